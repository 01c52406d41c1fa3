package testenv

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/topicread"
)

// Kafka is a broker (or cluster) a test runs against.
type Kafka struct {
	// Name is "kfake" or "kafka" (the real broker at KAFKA_BROKERS).
	Name    string
	Brokers []string
	// Cluster is the in-process kfake cluster, nil for real Kafka.
	Cluster *kfake.Cluster
	// ClientOpts are options every client of the test needs (SASL, TLS).
	ClientOpts []kgo.Opt
}

// Real reports whether this is a real Apache Kafka broker.
func (k *Kafka) Real() bool { return k.Cluster == nil }

// EachBroker runs fn as a subtest against a fresh kfake cluster and, when KAFKA_BROKERS is set,
// against that broker too.
func EachBroker(t *testing.T, fn func(t *testing.T, k *Kafka)) {
	t.Run("kfake", func(t *testing.T) {
		fn(t, NewKfake(t))
	})
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		t.Run("kafka", func(t *testing.T) {
			fn(t, &Kafka{Name: "kafka", Brokers: strings.Split(env, ",")})
		})
	}
}

// NewKfake starts an in-process kfake cluster for the test, closed when the test ends.
func NewKfake(t testing.TB, opts ...kfake.Opt) *Kafka {
	t.Helper()
	base := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.GroupMinSessionTimeout(100 * time.Millisecond),
		// kfake (2026-09) tells consumer-protocol members the broker's heartbeat interval even
		// when the group sets its own (real Kafka uses the group's): keep it below the tests'
		// session timeouts.
		kfake.BrokerConfigs(map[string]string{"group.consumer.heartbeat.interval.ms": "500"}),
	}

	c, err := kfake.NewCluster(append(base, opts...)...)
	if err != nil {
		t.Fatalf("start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return &Kafka{Name: "kfake", Brokers: c.ListenAddrs(), Cluster: c}
}

// Client returns a plain client (producer, admin) closed when the test ends.
func (k *Kafka) Client(t testing.TB, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(slices.Concat([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts, opts)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// CreateTopic creates a topic with a name unique to this test and returns the name.
func (k *Kafka) CreateTopic(t testing.TB, partitions int32) string {
	t.Helper()
	name := k.TopicName(t)
	k.CreateTopicNamed(t, name, partitions)
	return name
}

// TopicName returns a topic name unique to this test, without creating the topic.
func (k *Kafka) TopicName(t testing.TB) string { return "t_" + Name(t, 40) }

// CreateTopicNamed creates the topic name.
func (k *Kafka) CreateTopicNamed(t testing.TB, name string, partitions int32) {
	t.Helper()
	adm := kadm.NewClient(k.Client(t))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := adm.CreateTopic(ctx, partitions, 1, nil, name)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatalf("create topic %s: %v", name, err)
	}
}

// Group returns a consumer group id unique to this test.
func (k *Kafka) Group(t testing.TB) string { return "g_" + Name(t, 40) }

// Produce produces recs synchronously and fails the test on error.
func (k *Kafka) Produce(t testing.TB, recs ...*kgo.Record) {
	t.Helper()
	cl := k.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// ReadAll returns every record of topic, reading until the end offsets as of the call.
func (k *Kafka) ReadAll(t testing.TB, topic string) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	recs, err := topicread.All(ctx, k.Brokers, topic)
	if err != nil {
		t.Fatalf("read %s: %v", topic, err)
	}
	return recs
}
