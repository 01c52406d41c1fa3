// Command devbroker runs a Kafka-protocol broker for local development and tests, built on
// franz-go's kfake. It keeps all data in memory (or, with -data-dir, in a directory it reloads on
// restart) and is NOT for production: no replication, no quotas.
//
//	devbroker [-listen 127.0.0.1:9092] [-partitions 10] [-advertise host:port] [-data-dir DIR]
//
// -advertise makes the broker tell clients to connect to another address than the one it
// listens on, such as a fault-injecting proxy in front of it (make chaos).
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
	advertise := fs.String("advertise", "", "address clients are told to connect to (default: the listening address)")
	dataDir := fs.String("data-dir", "", "keep topics, offsets and groups in this directory and reload them on restart (default: memory only)")
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

	if *advertise != "" {
		if _, _, err := net.SplitHostPort(*advertise); err != nil {
			fmt.Fprintf(stderr, "devbroker: -advertise %q: %v\n", *advertise, err)
			return 2
		}
	}
	opts := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.Ports(port),
		kfake.DefaultNumPartitions(*partitions),
		kfake.ListenFn(func(network, _ string) (net.Listener, error) {
			ln, err := net.Listen(network, net.JoinHostPort(host, strconv.Itoa(port)))
			if err != nil || *advertise == "" {
				return ln, err
			}
			return advertised{ln, *advertise}, nil
		}),
		kfake.GroupMinSessionTimeout(100 * time.Millisecond), // lets tests use short sessions
		// Consumer-protocol members get the broker's heartbeat interval even when their group sets
		// its own (a kfake gap; Kafka uses the group's): kafkapg's own interval, 500ms.
		kfake.BrokerConfigs(map[string]string{"group.consumer.heartbeat.interval.ms": "500"}),
	}
	if *autoCreate {
		opts = append(opts, kfake.AllowAutoTopicCreation())
	}
	if *dataDir != "" {
		opts = append(opts, kfake.DataDir(*dataDir))
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		fmt.Fprintf(stderr, "devbroker: start: %v\n", err)
		return 1
	}
	defer c.Close()

	fmt.Fprintln(stderr, "devbroker: WARNING: Kafka-protocol broker (kfake) for development and tests only. Do not use it in production.")
	if *dataDir == "" {
		fmt.Fprintln(stderr, "devbroker: WARNING: all data is kept in memory and lost when it stops (see -data-dir).")
	} else {
		fmt.Fprintf(stderr, "devbroker: data kept in %s\n", *dataDir)
	}
	fmt.Fprintf(stderr, "devbroker: listening on %s\n", net.JoinHostPort(host, strconv.Itoa(port)))
	if *advertise != "" {
		fmt.Fprintf(stderr, "devbroker: clients are told to connect to %s\n", *advertise)
	}
	if ready != nil {
		ready <- c.ListenAddrs()[0]
	}
	<-ctx.Done()
	fmt.Fprintln(stderr, "devbroker: stopping")
	return 0
}

// advertised is a listener that reports another address than its own, which kfake tells
// clients to connect to.
type advertised struct {
	net.Listener
	addr string
}

func (a advertised) Addr() net.Addr { return advertisedAddr(a.addr) }

type advertisedAddr string

func (a advertisedAddr) Network() string { return "tcp" }
func (a advertisedAddr) String() string  { return string(a) }
