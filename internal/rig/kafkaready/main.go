// Command kafkaready waits until a Kafka broker really serves requests.
//
// scripts/kafka.sh starts a real broker in the background and then runs
//
//	go run ./internal/rig/kafkaready -brokers 127.0.0.1:9092 -timeout 120s
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
// timeout.
//
// For a cluster (scripts/kafka.sh cluster ...) three flags add checks to each round:
//
//   - -brokers-count N: the metadata lists at least N brokers (registered and
//     unfenced); by default at least one.
//   - -each-seed: every broker named in -brokers answers a Metadata request
//     itself (the default asks any one broker) and lists itself among the
//     brokers, i.e. it is back in the cluster's metadata, not just listening;
//     -brokers-count then applies to each one's view. So
//     `-brokers 127.0.0.1:9193 -each-seed` waits for that one broker.
//   - -in-sync: every partition of every topic, internal ones included, has a
//     leader and an ISR equal to its replica set (with -each-seed, in every
//     seed's view), as a rolling restart needs before it stops the next node.
//
// It uses only franz-go, the standard library and internal/rig/kafkacluster (for
// the in-sync check).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/internal/rig/kafkacluster"
)

func main() {
	brokers := flag.String("brokers", "127.0.0.1:9092", "comma-separated seed brokers")
	timeout := flag.Duration("timeout", 120*time.Second, "give up after this long")
	interval := flag.Duration("interval", 250*time.Millisecond, "pause between attempts")
	group := flag.String("group", "kafkapg-ready-probe", "consumer group used to probe the group coordinator")
	quiet := flag.Bool("quiet", false, "print nothing on success")
	brokersCount := flag.Int("brokers-count", 1, "wait until the metadata lists at least this many brokers")
	eachSeed := flag.Bool("each-seed", false, "ask every broker of -brokers itself: each must answer, list itself and pass -brokers-count and -in-sync")
	inSync := flag.Bool("in-sync", false, "wait until every partition of every topic has a leader and its ISR equals its replicas")
	flag.Parse()

	seeds := splitBrokers(*brokers)
	if len(seeds) == 0 {
		fmt.Fprintln(os.Stderr, "kafkaready: -brokers is empty")
		os.Exit(2)
	}
	if *brokersCount < 1 {
		fmt.Fprintln(os.Stderr, "kafkaready: -brokers-count must be at least 1")
		os.Exit(2)
	}

	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()

	cl, err := newClient(seeds...)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kafkaready: creating client: %v\n", err)
		os.Exit(2)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)

	c := cluster{brokers: *brokersCount, inSync: *inSync}
	if *eachSeed {
		for _, s := range seeds {
			scl, err := newClient(s)
			if err != nil {
				fmt.Fprintf(os.Stderr, "kafkaready: creating client: %v\n", err)
				os.Exit(2)
			}
			defer scl.Close()
			c.seeds = append(c.seeds, seed{addr: s, cl: scl})
		}
	}

	attempts := 0
	var lastErr error
	for {
		attempts++
		lastErr = probe(ctx, adm, *group)
		if lastErr == nil {
			lastErr = c.probe(ctx, cl)
		}
		if lastErr == nil {
			if !*quiet {
				fmt.Printf("kafkaready: %s serves requests and has a group coordinator%s (after %s, %d attempts)\n",
					strings.Join(seeds, ","), c.describe(), time.Since(start).Round(10*time.Millisecond), attempts)
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

func newClient(seeds ...string) (*kgo.Client, error) {
	return kgo.NewClient(
		kgo.SeedBrokers(seeds...),
		kgo.ClientID("kafkapg-kafkaready"),
		kgo.DialTimeout(2*time.Second),
		kgo.RequestRetries(0),
		kgo.RetryTimeout(2*time.Second),
		kgo.MetadataMinAge(100*time.Millisecond),
	)
}

// cluster holds the checks for a cluster; its zero value adds none.
type cluster struct {
	brokers int    // the metadata must list at least this many brokers
	inSync  bool   // every partition must be in sync
	seeds   []seed // with -each-seed: ask each of these itself
}

// seed is one broker of -brokers, with a client seeded with it alone.
type seed struct {
	addr string
	cl   *kgo.Client
}

func (c cluster) describe() string {
	var s []string
	if c.brokers > 1 {
		s = append(s, fmt.Sprintf("lists %d+ brokers", c.brokers))
	}
	if c.inSync {
		s = append(s, "every partition in sync")
	}
	if len(c.seeds) > 0 {
		s = append(s, "in each broker's own view")
	}
	if len(s) == 0 {
		return ""
	}
	return ", " + strings.Join(s, ", ")
}

// probe does the cluster checks of one round: on any broker's metadata, or on each seed's own.
func (c cluster) probe(parent context.Context, cl *kgo.Client) error {
	if c.brokers <= 1 && !c.inSync && len(c.seeds) == 0 {
		return nil // probe's ListBrokers has checked the one broker already
	}
	if len(c.seeds) == 0 {
		ctx, cancel := context.WithTimeout(parent, 5*time.Second)
		defer cancel()
		resp, err := kmsg.NewPtrMetadataRequest().RequestWith(ctx, cl)
		if err != nil {
			return fmt.Errorf("metadata: %w", err)
		}
		return c.check(resp, "")
	}
	for _, s := range c.seeds {
		ctx, cancel := context.WithTimeout(parent, 5*time.Second)
		m, err := kafkacluster.SeedMetadata(ctx, s.cl)
		cancel()
		if err != nil {
			return fmt.Errorf("broker %s: metadata: %w", s.addr, err)
		}
		if err := c.check(m, s.addr); err != nil {
			return fmt.Errorf("broker %s: %w", s.addr, err)
		}
	}
	return nil
}

// check checks one broker's metadata; self, if not empty, is that broker's address, which its
// own metadata must list (a broker serves requests a moment before the controller unfences it).
func (c cluster) check(m *kmsg.MetadataResponse, self string) error {
	var listed []string
	for _, b := range m.Brokers {
		listed = append(listed, fmt.Sprintf("%d@%s", b.NodeID, net.JoinHostPort(b.Host, strconv.Itoa(int(b.Port)))))
	}
	if len(m.Brokers) < c.brokers {
		return fmt.Errorf("metadata lists %d brokers %v, want %d", len(m.Brokers), listed, c.brokers)
	}
	if self != "" && !slices.ContainsFunc(m.Brokers, func(b kmsg.MetadataResponseBroker) bool {
		return strings.EqualFold(net.JoinHostPort(b.Host, strconv.Itoa(int(b.Port))), self)
	}) {
		return fmt.Errorf("metadata lists brokers %v but not this one: not registered (or still fenced) yet", listed)
	}
	if c.inSync {
		return kafkacluster.InSync(m)
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
