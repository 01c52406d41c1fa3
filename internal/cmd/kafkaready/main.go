// Command kafkaready waits until a Kafka broker really serves requests.
//
// scripts/kafka.sh starts a real broker in the background and then runs
//
//	go run ./internal/cmd/kafkaready -brokers 127.0.0.1:9092 -timeout 120s
//
// Waiting for the TCP port is not enough: a KRaft broker opens its listener
// before it has caught up with the metadata log, and for a while it answers
// requests with errors (or not at all), and the group coordinator (the
// __consumer_offsets partitions) becomes available later still. Tests that
// start right after the port opens then fail or hang in their first
// JoinGroup. So this program polls, until the deadline, for:
//
//  1. a Metadata response that lists at least one broker;
//  2. a FindCoordinator for a probe group that returns a coordinator without
//     error (this also makes the broker create __consumer_offsets now rather
//     than in the first test);
//  3. a DescribeGroups for that probe group, answered by its coordinator
//     without error, or with GROUP_ID_NOT_FOUND, which Kafka 4.x returns for a
//     group that does not exist once the coordinator has loaded its partition
//     (while loading it says COORDINATOR_LOAD_IN_PROGRESS).
//
// It exits 0 once all three succeed in one round, and 1 with the last error on
// timeout. It uses only franz-go and the standard library.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

func main() {
	brokers := flag.String("brokers", "127.0.0.1:9092", "comma-separated seed brokers")
	timeout := flag.Duration("timeout", 120*time.Second, "give up after this long")
	interval := flag.Duration("interval", 250*time.Millisecond, "pause between attempts")
	group := flag.String("group", "kafkapg-ready-probe", "consumer group used to probe the group coordinator")
	quiet := flag.Bool("quiet", false, "print nothing on success")
	flag.Parse()

	seeds := splitBrokers(*brokers)
	if len(seeds) == 0 {
		fmt.Fprintln(os.Stderr, "kafkaready: -brokers is empty")
		os.Exit(2)
	}

	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()

	cl, err := kgo.NewClient(
		kgo.SeedBrokers(seeds...),
		kgo.ClientID("kafkapg-kafkaready"),
		kgo.DialTimeout(2*time.Second),
		kgo.RequestRetries(0),
		kgo.RetryTimeout(2*time.Second),
		kgo.MetadataMinAge(100*time.Millisecond),
	)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kafkaready: creating client: %v\n", err)
		os.Exit(2)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)

	attempts := 0
	var lastErr error
	for {
		attempts++
		lastErr = probe(ctx, adm, *group)
		if lastErr == nil {
			if !*quiet {
				fmt.Printf("kafkaready: %s serves requests and has a group coordinator (after %s, %d attempts)\n",
					strings.Join(seeds, ","), time.Since(start).Round(10*time.Millisecond), attempts)
			}
			return
		}
		select {
		case <-ctx.Done():
			fmt.Fprintf(os.Stderr, "kafkaready: broker %s not ready after %s (%d attempts); last error: %v\n",
				strings.Join(seeds, ","), *timeout, attempts, lastErr)
			os.Exit(1)
		case <-time.After(*interval):
		}
	}
}

// probe does one round of checks, each bounded by a short per-attempt timeout
// so that a broker that accepts connections but does not answer cannot eat the
// whole deadline in one request.
func probe(parent context.Context, adm *kadm.Client, group string) error {
	ctx, cancel := context.WithTimeout(parent, 5*time.Second)
	defer cancel()

	brokers, err := adm.ListBrokers(ctx)
	if err != nil {
		return fmt.Errorf("metadata: %w", err)
	}
	if len(brokers) == 0 {
		return errors.New("metadata: response lists no brokers")
	}

	coords := adm.FindGroupCoordinators(ctx, group)
	if err := coords.Error(); err != nil {
		return fmt.Errorf("find coordinator for group %q: %w", group, err)
	}
	if c, ok := coords[group]; !ok || c.NodeID < 0 {
		return fmt.Errorf("find coordinator for group %q: no coordinator in response", group)
	}

	described, err := adm.DescribeGroups(ctx, group)
	if err != nil {
		return fmt.Errorf("describe group %q: %w", group, err)
	}
	if err := described.Error(); err != nil && !errors.Is(err, kerr.GroupIDNotFound) {
		return fmt.Errorf("describe group %q: %w", group, err)
	}
	if _, ok := described[group]; !ok {
		return fmt.Errorf("describe group %q: group missing from response", group)
	}
	return nil
}

func splitBrokers(s string) []string {
	var out []string
	for b := range strings.SplitSeq(s, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}
