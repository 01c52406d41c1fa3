package retrytopics_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// newAdmin returns an admin client of its own. kadm answers ListTopics from the kgo client's
// metadata cache (for MetadataMinAge, 5s by default), so each step of a test that must see the
// broker's current state uses a fresh client.
func newAdmin(t *testing.T, k *testenv.Kafka) *kadm.Client {
	t.Helper()
	return kadm.NewClient(k.Client(t))
}

// partitions returns the partition count of topic, or -1 if it does not exist.
func partitions(t *testing.T, k *testenv.Kafka, topic string) int {
	t.Helper()
	d, err := newAdmin(t, k).ListTopics(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	td, ok := d[topic]
	if !ok || td.Err != nil {
		return -1
	}
	return len(td.Partitions)
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

func TestEnsureTopics(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k := testenv.NewKfake(t)
	k.CreateTopicNamed(t, "orders", 3)
	k.CreateTopicNamed(t, "refunds", 1)
	sources := []string{"orders", "ghost", "refunds"}

	created, missing, err := retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf(sources, 0), retrytopics.EnsureOptions{Create: true})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"orders.billing.dlq", "refunds.billing.dlq"}; !slices.Equal(sorted(created), want) {
		t.Errorf("created = %q, want %q", created, want)
	}
	if want := []string{"ghost"}; !slices.Equal(missing, want) {
		t.Errorf("missing = %q, want %q", missing, want)
	}
	for topic, want := range map[string]int{
		"orders.billing.dlq":  3,
		"refunds.billing.dlq": 1,
		"ghost.billing.dlq":   -1, // a missing source gets no DLQ
	} {
		if got := partitions(t, k, topic); got != want {
			t.Errorf("%s has %d partitions, want %d (-1: does not exist)", topic, got, want)
		}
	}

	// Idempotent: the second call finds everything in place.
	created, missing, err = retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf(sources, 0), retrytopics.EnsureOptions{Create: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(created) != 0 {
		t.Errorf("second call created %q, want nothing", created)
	}
	if want := []string{"ghost"}; !slices.Equal(missing, want) {
		t.Errorf("second call: missing = %q, want %q", missing, want)
	}

	// Once the source appears, its DLQ is created.
	k.CreateTopicNamed(t, "ghost", 2)
	created, missing, err = retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf(sources, 0), retrytopics.EnsureOptions{Create: true})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"ghost.billing.dlq"}; !slices.Equal(created, want) || len(missing) != 0 {
		t.Errorf("after creating ghost: created = %q, missing = %q; want %q, none missing", created, missing, want)
	}
	if got := partitions(t, k, "ghost.billing.dlq"); got != 2 {
		t.Errorf("ghost.billing.dlq has %d partitions, want 2", got)
	}

	// Another group gets DLQs of its own.
	created, _, err = retrytopics.EnsureTopics(ctx, newAdmin(t, k), "audit", tiersOf([]string{"orders"}, 0), retrytopics.EnsureOptions{Create: true})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"orders.audit.dlq"}; !slices.Equal(created, want) {
		t.Errorf("group audit: created = %q, want %q", created, want)
	}
}

// TestEnsureTopicsLostRace: another instance creates the DLQ between this one's ListTopics and
// CreateTopic. TopicAlreadyExists is success, but the topic is not reported as created by us.
// A stale metadata cache produces exactly that sequence.
func TestEnsureTopicsLostRace(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k := testenv.NewKfake(t)
	k.CreateTopicNamed(t, "orders", 3)
	stale := newAdmin(t, k)
	if _, err := stale.ListTopics(ctx, "orders", "orders.billing.dlq"); err != nil {
		t.Fatal(err)
	}
	k.CreateTopicNamed(t, "orders.billing.dlq", 3) // the other instance
	if d, err := stale.ListTopics(ctx, "orders.billing.dlq"); err != nil || d["orders.billing.dlq"].Err == nil {
		t.Fatalf("the admin client's metadata is not stale (err %v): the race is not staged, the test would prove nothing", err)
	}

	created, missing, err := retrytopics.EnsureTopics(ctx, stale, "billing", tiersOf([]string{"orders"}, 0), retrytopics.EnsureOptions{Create: true})
	if err != nil {
		t.Fatalf("err = %v, want TopicAlreadyExists treated as success", err)
	}
	if len(created) != 0 || len(missing) != 0 {
		t.Errorf("created = %q, missing = %q; want neither", created, missing)
	}
}

// TestEnsureTopicsKeepsExisting checks that an existing DLQ is left alone, even if its
// partition count differs from the source's or its source is gone.
func TestEnsureTopicsKeepsExisting(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k := testenv.NewKfake(t)
	k.CreateTopicNamed(t, "orders", 3)
	k.CreateTopicNamed(t, "orders.billing.dlq", 1)
	k.CreateTopicNamed(t, "gone.billing.dlq", 1)

	created, missing, err := retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf([]string{"orders", "gone"}, 0), retrytopics.EnsureOptions{Create: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(created) != 0 || !slices.Equal(missing, []string{"gone"}) {
		t.Errorf("created = %q, missing = %q; want nothing created, the missing source gone reported", created, missing)
	}
	if got := partitions(t, k, "orders.billing.dlq"); got != 1 {
		t.Errorf("existing DLQ now has %d partitions, want it untouched (1)", got)
	}
}

func TestEnsureTopicsNoSources(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k := testenv.NewKfake(t)
	k.CreateTopicNamed(t, "orders", 3)
	created, missing, err := retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf(nil, 0), retrytopics.EnsureOptions{Create: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(created) != 0 || len(missing) != 0 {
		t.Errorf("created = %q, missing = %q; want neither for no sources", created, missing)
	}
	if got := partitions(t, k, "orders.billing.dlq"); got != -1 {
		t.Errorf("orders.billing.dlq was created although orders was not asked for")
	}
}

func TestEnsureTopicsContextDone(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, _, err := retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf([]string{"orders"}, 0), retrytopics.EnsureOptions{Create: true})
	if err == nil {
		t.Fatal("EnsureTopics with a cancelled context returned no error")
	}
	if !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want it to wrap context.Canceled", err)
	}
}

func TestEnsureTopicsTiers(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k := testenv.NewKfake(t)
	k.CreateTopicNamed(t, "orders", 3)

	// Creation disabled: every missing retry and dead-letter topic is named in the error.
	_, _, err := retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf([]string{"orders"}, 2), retrytopics.EnsureOptions{})
	if !errors.Is(err, retrytopics.ErrTopicMissing) {
		t.Fatalf("err = %v, want ErrTopicMissing", err)
	}
	for _, name := range []string{"orders.billing.retry.1", "orders.billing.retry.2", "orders.billing.dlq"} {
		if !strings.Contains(err.Error(), name) {
			t.Errorf("error %q does not name %s", err, name)
		}
	}
	if got := partitions(t, k, "orders.billing.retry.1"); got != -1 {
		t.Errorf("a topic was created although creation is disabled")
	}

	created, missing, err := retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf([]string{"orders"}, 2), retrytopics.EnsureOptions{Create: true})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"orders.billing.dlq", "orders.billing.retry.1", "orders.billing.retry.2"}
	if !slices.Equal(sorted(created), want) || len(missing) != 0 {
		t.Errorf("created = %q, missing = %q; want %q, none missing", created, missing, want)
	}
	for _, name := range want {
		if got := partitions(t, k, name); got != 3 {
			t.Errorf("%s has %d partitions, want 3 (the source's)", name, got)
		}
	}
	// Now everything exists: creation disabled is fine.
	if _, _, err := retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf([]string{"orders"}, 2), retrytopics.EnsureOptions{}); err != nil {
		t.Errorf("with all topics present and creation disabled: %v", err)
	}
}

// tiersOf gives every one of sources n retry tiers.
func tiersOf(sources []string, n int) map[string]int {
	out := map[string]int{}
	for _, s := range sources {
		out[s] = n
	}
	return out
}

// TestEnsureTopicsReplicateLikeTheirSource: on a cluster of three brokers whose defaults are
// Apache Kafka's own (default.replication.factor=1), the tiers and the dead-letter topic of a
// source topic with three replicas and min.insync.replicas=2 get the same, not the broker's one
// replica; settings override both; an existing tier with fewer replicas than its source is named.
func TestEnsureTopicsReplicateLikeTheirSource(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k := testenv.NewKfake(t, kfake.NumBrokers(3))
	adm := newAdmin(t, k)
	two := "2"
	for _, src := range []struct {
		name string
		rf   int16
		cfg  map[string]*string
	}{{"orders", 3, map[string]*string{"min.insync.replicas": &two}}, {"refunds", 3, nil}, {"audit", 1, nil}} {
		if resp, err := adm.CreateTopic(ctx, 2, src.rf, src.cfg, src.name); err != nil || resp.Err != nil {
			t.Fatalf("create %s: %v %v", src.name, err, resp.Err)
		}
	}
	// A tier created by hand, with one replica, before kafkapg ran.
	if resp, err := adm.CreateTopic(ctx, 2, 1, nil, "refunds.billing.retry.1"); err != nil || resp.Err != nil {
		t.Fatalf("create refunds.billing.retry.1: %v %v", err, resp.Err)
	}
	var weak []string
	_, _, err := retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf([]string{"orders", "refunds", "audit"}, 1), retrytopics.EnsureOptions{
		Create: true,
		UnderReplicated: func(topic string, replicas int, source string, sourceReplicas int) {
			weak = append(weak, fmt.Sprintf("%s %d<%d", topic, replicas, sourceReplicas))
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"refunds.billing.retry.1 1<3"}; !slices.Equal(weak, want) {
		t.Errorf("under-replicated topics reported: %q, want %q", weak, want)
	}
	check := func(topic string, wantRF int, wantMinInsync string) {
		t.Helper()
		adm := newAdmin(t, k)
		d, err := adm.ListTopics(ctx, topic)
		if err != nil {
			t.Fatal(err)
		}
		rf := 0
		for _, p := range d[topic].Partitions {
			rf = max(rf, len(p.Replicas))
		}
		rcs, err := adm.DescribeTopicConfigs(ctx, topic)
		if err != nil {
			t.Fatal(err)
		}
		rc, err := rcs.On(topic, nil)
		if err != nil {
			t.Fatal(err)
		}
		minInsync := ""
		for _, c := range rc.Configs {
			if c.Key == "min.insync.replicas" && c.Source == kmsg.ConfigSourceDynamicTopicConfig {
				minInsync = c.MaybeValue()
			}
		}
		if rf != wantRF || minInsync != wantMinInsync {
			t.Errorf("%s: replication factor %d, min.insync.replicas %q set on the topic; want %d, %q", topic, rf, minInsync, wantRF, wantMinInsync)
		}
	}
	check("orders.billing.retry.1", 3, "2")
	check("orders.billing.dlq", 3, "2")
	check("refunds.billing.dlq", 3, "")
	check("audit.billing.dlq", 1, "")

	// Settings win over the source.
	if resp, err := adm.CreateTopic(ctx, 1, 1, nil, "payments"); err != nil || resp.Err != nil {
		t.Fatalf("create payments: %v %v", err, resp.Err)
	}
	if _, _, err := retrytopics.EnsureTopics(ctx, newAdmin(t, k), "billing", tiersOf([]string{"payments"}, 0), retrytopics.EnsureOptions{
		Create: true, ReplicationFactor: 3, MinInsyncReplicas: 2,
	}); err != nil {
		t.Fatal(err)
	}
	check("payments.billing.dlq", 3, "2")
}
