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
	"log"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:9092", "address to listen on (host:port; port 0 picks a free one)")
	partitions := flag.Int("partitions", 10, "partitions of topics created with the broker default (-1)")
	autoCreate := flag.Bool("auto-create-topics", false, "create unknown topics on first use, as auto.create.topics.enable does")
	flag.Parse()

	host, portStr, err := net.SplitHostPort(*listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "devbroker: -listen %q: %v\n", *listen, err)
		os.Exit(2)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		fmt.Fprintf(os.Stderr, "devbroker: -listen %q: invalid port\n", *listen)
		os.Exit(2)
	}
	if port == 0 {
		// kfake picks free ports itself only per broker; reserve one here so we can print it.
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			fmt.Fprintf(os.Stderr, "devbroker: %v\n", err)
			os.Exit(1)
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
		fmt.Fprintf(os.Stderr, "devbroker: start: %v\n", err)
		os.Exit(1)
	}
	defer c.Close()

	log.SetFlags(0)
	log.Printf("devbroker: WARNING: in-memory Kafka-protocol broker (kfake) for development and tests only;")
	log.Printf("devbroker: WARNING: all data is lost when it stops. Do not use it in production.")
	log.Printf("devbroker: listening on %s", c.ListenAddrs()[0])

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	<-ctx.Done()
	log.Printf("devbroker: stopping")
}
