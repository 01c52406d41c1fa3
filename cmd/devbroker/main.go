// Command devbroker runs a Kafka-protocol broker for local development and tests, built on
// franz-go's kfake. It keeps all data in memory and is NOT for production: no replication, no
// durability, no quotas.
//
//	devbroker [-listen 127.0.0.1:9092] [-partitions 10]
//
// Topics are created through the normal admin API (CreateTopics), as with a real broker.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stderr, nil))
}

// run runs the broker until ctx is done and returns the exit status. ready, if not nil, receives
// the listening address once the broker serves.
func run(ctx context.Context, args []string, stderr io.Writer, ready chan<- string) int {
	fs := flag.NewFlagSet("devbroker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "127.0.0.1:9092", "address to listen on (host:port; port 0 picks a free one)")
	partitions := fs.Int("partitions", 10, "partitions of topics created with the broker default (-1)")
	autoCreate := fs.Bool("auto-create-topics", false, "create unknown topics on first use, as auto.create.topics.enable does")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	host, portStr, err := net.SplitHostPort(*listen)
	if err != nil {
		fmt.Fprintf(stderr, "devbroker: -listen %q: %v\n", *listen, err)
		return 2
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		fmt.Fprintf(stderr, "devbroker: -listen %q: invalid port\n", *listen)
		return 2
	}
	if port == 0 {
		// Reserve a free port here so that the address can be printed.
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			fmt.Fprintf(stderr, "devbroker: %v\n", err)
			return 1
		}
		port = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}

	opts := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.Ports(port),
		kfake.DefaultNumPartitions(*partitions),
		kfake.ListenFn(func(network, _ string) (net.Listener, error) {
			return net.Listen(network, net.JoinHostPort(host, strconv.Itoa(port)))
		}),
		kfake.GroupMinSessionTimeout(100 * time.Millisecond), // lets tests use short sessions
	}
	if *autoCreate {
		opts = append(opts, kfake.AllowAutoTopicCreation())
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		fmt.Fprintf(stderr, "devbroker: start: %v\n", err)
		return 1
	}
	defer c.Close()

	fmt.Fprintln(stderr, "devbroker: WARNING: in-memory Kafka-protocol broker (kfake) for development and tests only;")
	fmt.Fprintln(stderr, "devbroker: WARNING: all data is lost when it stops. Do not use it in production.")
	fmt.Fprintf(stderr, "devbroker: listening on %s\n", c.ListenAddrs()[0])
	if ready != nil {
		ready <- c.ListenAddrs()[0]
	}
	<-ctx.Done()
	fmt.Fprintln(stderr, "devbroker: stopping")
	return 0
}
