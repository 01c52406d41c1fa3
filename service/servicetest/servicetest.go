package servicetest

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/servicehook"
	"github.com/kafkapg/kafkapg/internal/topicread"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/processortest"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/service"
)

// Options configure Start. The zero value is valid, but for Env's KAFKA_TOPICS.
type Options struct {
	// Env is the service's environment, as its Deployment would give it (docs/configuration.md):
	// KAFKA_TOPICS (required), CONCURRENCY, RETRY_TIERS, TOPIC_<topic>_*, ON_DEAD_LETTER, ... It
	// is the whole environment the service reads: the test process's own variables of the
	// service are not. Start fills in what it runs: DATABASE_URL (the test's database),
	// KAFKA_BROKERS (the in-process broker) and HTTP_ADDR (a free port of 127.0.0.1), and, unless
	// Env sets them, KAFKA_GROUP_ID=test, LOG_FORMAT=text and a short local backoff
	// (RETRY_BACKOFF_BASE=10ms, RETRY_BACKOFF_MAX=100ms). Setting DATABASE_URL or KAFKA_BROKERS
	// here runs the service against them instead.
	Env map[string]string
	// Topics are the other topics to create: those the service emits events to (sink.Event's
	// Topic), as on a real broker, where the outbox relay waits for a missing topic.
	Topics []string
	// Partitions is how many partitions each topic created has (the topics of KAFKA_TOPICS and
	// Topics). Defaults to 1.
	Partitions int32
	// Timeout bounds each wait (Eventually, WaitQuery, WaitRecords, WaitDeadLetters) and the
	// start. Defaults to 30s.
	Timeout time.Duration
}

// Service is a service started by Start, with its broker and database.
type Service struct {
	// DB is a pool on the service's database.
	DB *pgxpool.Pool
	// Brokers are the broker's addresses.
	Brokers []string
	// Group is the service's consumer group (KAFKA_GROUP_ID).
	Group string

	t        testing.TB
	env      map[string]string
	handlers []service.Handler
	timeout  time.Duration
	client   *kgo.Client
	logs     *logBuffer
	offset   atomic.Int64 // the retry path's clock, ahead of the real one by this many nanoseconds
	cancel   context.CancelFunc
	exited   chan struct{} // closed when the service has exited, with status
	status   int
	reported atomic.Bool // a failure of the test said that the service exited
	stopOnce sync.Once
}

// Start starts an in-process Kafka broker (franz-go's kfake) and a database of the test's own
// (processortest.DB), creates the topics of KAFKA_TOPICS and opts.Topics, and runs handlers as service.Main
// runs them with opts.Env for environment: the same configuration, the same startup (kafkapg's
// tables, each handler's Setup), in the consumer group. It returns once the service is ready
// (its /readyz: in the group, Postgres answering). The service stops, the broker with it, when
// the test ends; its log is printed if the test failed.
//
// The environment's KAFKA_BROKERS is not used: a test's topics are named as the service's, and
// on a broker that outlives the test they would hold the records of the runs before.
func Start(t testing.TB, opts Options, handlers ...service.Handler) *Service {
	t.Helper()
	s := &Service{t: t, handlers: handlers, timeout: opts.Timeout, logs: &logBuffer{}, exited: make(chan struct{})}
	if s.timeout <= 0 {
		s.timeout = 30 * time.Second
	}
	partitions := max(opts.Partitions, 1)
	env := map[string]string{
		"KAFKA_GROUP_ID":     "test",
		"LOG_FORMAT":         "text",
		"RETRY_BACKOFF_BASE": "10ms",
		"RETRY_BACKOFF_MAX":  "100ms",
	}
	maps.Copy(env, opts.Env)
	topics := strings.FieldsFunc(env["KAFKA_TOPICS"], func(r rune) bool { return r == ',' || r == ' ' })
	if len(topics) == 0 {
		t.Fatal("servicetest: Options.Env must set KAFKA_TOPICS, the topics the service consumes")
	}
	var err error
	if env["KAFKA_BROKERS"] == "" {
		c, err := kfake.NewCluster(
			kfake.NumBrokers(1),
			kfake.SeedTopics(partitions, slices.Concat(topics, opts.Topics)...),
			kfake.GroupMinSessionTimeout(100*time.Millisecond),
			// kfake tells consumer-protocol members the broker's heartbeat interval: keep it short,
			// for a quick start.
			kfake.BrokerConfigs(map[string]string{"group.consumer.heartbeat.interval.ms": "500"}),
		)
		if err != nil {
			t.Fatalf("servicetest: start the broker: %v", err)
		}
		t.Cleanup(c.Close)
		env["KAFKA_BROKERS"] = strings.Join(c.ListenAddrs(), ",")
	}
	s.Brokers = strings.Split(env["KAFKA_BROKERS"], ",")
	if s.client, err = kgo.NewClient(kgo.SeedBrokers(s.Brokers...)); err != nil {
		t.Fatalf("servicetest: %v", err)
	}
	t.Cleanup(s.client.Close)
	if opts.Env["KAFKA_BROKERS"] != "" {
		ctx, cancel := context.WithTimeout(t.Context(), s.timeout)
		defer cancel()
		created, err := kadm.NewClient(s.client).CreateTopics(ctx, partitions, -1, nil, slices.Concat(topics, opts.Topics)...)
		if err == nil {
			err = created.Error()
		}
		if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			t.Fatalf("servicetest: create the topics: %v", err)
		}
	}
	if env["DATABASE_URL"] == "" {
		s.DB = processortest.DB(t)
		env["DATABASE_URL"] = s.DB.Config().ConnString()
	} else {
		pool, err := pgxpool.New(t.Context(), env["DATABASE_URL"])
		if err != nil {
			t.Fatalf("servicetest: DATABASE_URL: %v", err)
		}
		t.Cleanup(pool.Close)
		s.DB = pool
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	env["HTTP_ADDR"] = addr
	s.env, s.Group = env, env["KAFKA_GROUP_ID"]

	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	s.cancel = cancel
	test := processor.TestConfig{Now: s.Now}
	go func() {
		s.status = servicehook.Run(ctx, nil, env, handlers, test, s.logs, s.logs)
		close(s.exited)
	}()
	t.Cleanup(func() {
		s.Stop()
		if t.Failed() {
			t.Logf("servicetest: the service's log:\n%s", s.logs.String())
		}
	})
	s.wait("the service to be ready", func() error { return localrun.Ready(addr) })
	return s
}

// Stop stops the service, as SIGTERM does, and waits for it to exit; the test ends it anyway.
// It fails the test if the service exited with an error.
func (s *Service) Stop() {
	s.t.Helper()
	s.stopOnce.Do(func() {
		s.cancel()
		select {
		case <-s.exited:
		case <-time.After(s.timeout):
			s.t.Errorf("servicetest: the service did not stop within %v", s.timeout)
			return
		}
		if s.status != 0 && !s.reported.Load() {
			s.t.Errorf("servicetest: the service exited with status %d:\n%s", s.status, s.logs.tail(30))
		}
	})
}

// Env returns the environment the service runs with: Options.Env and what Start filled in. A
// second replica started with it (Options.Env) joins the first's group on its broker and
// database.
func (s *Service) Env() map[string]string { return maps.Clone(s.env) }

// Logs returns what the service has logged so far.
func (s *Service) Logs() string { return s.logs.String() }

// Now is the retry path's clock: the time the service reads when a record that fails is due in
// its next retry tier, and whether it is due. It is the real time, moved on by Advance.
func (s *Service) Now() time.Time { return time.Now().Add(time.Duration(s.offset.Load())) }

// Advance moves the retry path's clock d forward: a record waiting in a retry tier (RETRY_TIERS:
// 1s, 30s, 5m...) until a time d has reached is tried again within milliseconds, instead of after
// its delay. The rest of the service (batches, local backoff between attempts, timeouts) keeps
// the real clock.
func (s *Service) Advance(d time.Duration) {
	if d < 0 {
		s.t.Fatalf("servicetest: Advance(%v): the clock does not go back", d)
	}
	s.offset.Add(int64(d))
}

// Produce produces a record of topic with key (none if empty) and value, and waits until the
// broker has it.
func (s *Service) Produce(topic, key, value string) {
	s.t.Helper()
	r := &kgo.Record{Topic: topic, Value: []byte(value)}
	if key != "" {
		r.Key = []byte(key)
	}
	s.ProduceRecords(r)
}

// ProduceRecords produces recs (with their headers, timestamps and partitions if set: a zero
// Partition is left to the default partitioner, the murmur2 hash of the key that Java's producer
// uses), in order, and waits until the broker has them.
func (s *Service) ProduceRecords(recs ...*kgo.Record) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(s.t.Context(), s.timeout)
	defer cancel()
	if err := s.client.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		s.t.Fatalf("servicetest: produce: %v", err)
	}
}

// Eventually calls cond until it returns nil, and fails the test with its last error if it has
// not within the timeout (Options.Timeout), or at once if the service exits.
func (s *Service) Eventually(cond func(ctx context.Context, db *pgxpool.Pool) error) {
	s.t.Helper()
	s.wait("the condition", func() error {
		ctx, cancel := context.WithTimeout(s.t.Context(), s.timeout)
		defer cancel()
		return cond(ctx, s.DB)
	})
}

// WaitQuery waits until query (with args) returns one row whose first column is want: compared
// as text (fmt's %v), so that 8 matches an int, a bigint or a numeric 8.
func (s *Service) WaitQuery(want any, query string, args ...any) {
	s.t.Helper()
	s.Eventually(func(ctx context.Context, db *pgxpool.Pool) error {
		var got any
		if err := db.QueryRow(ctx, query, args...).Scan(&got); err != nil {
			return fmt.Errorf("%s: %w", query, err)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) && !reflect.DeepEqual(got, want) {
			return fmt.Errorf("%s = %v, want %v", query, got, want)
		}
		return nil
	})
}

// Records returns the records of topic now, partition after partition, each in offset order
// (a topic not created yet has none).
func (s *Service) Records(topic string) []*kgo.Record {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(s.t.Context(), s.timeout)
	defer cancel()
	recs, err := topicread.All(ctx, s.Brokers, topic)
	if err != nil && !errors.Is(err, kerr.UnknownTopicOrPartition) {
		s.t.Fatalf("servicetest: read %s: %v", topic, err)
	}
	return byPartition(recs)
}

// WaitRecords waits until topic has at least n records, and returns them all (see Records):
// the events the service emitted (published by its outbox relay), the copies of records it put
// in a retry tier (RetryTopic) or dead-lettered (DeadLetterTopic).
func (s *Service) WaitRecords(topic string, n int) []*kgo.Record {
	s.t.Helper()
	var recs []*kgo.Record
	s.wait(fmt.Sprintf("%d records on %s", n, topic), func() error {
		ctx, cancel := context.WithTimeout(s.t.Context(), s.timeout)
		defer cancel()
		var err error
		if recs, err = topicread.All(ctx, s.Brokers, topic); err != nil {
			return err
		}
		if len(recs) < n {
			return fmt.Errorf("%s has %d records, want %d", topic, len(recs), n)
		}
		return nil
	})
	return byPartition(recs)
}

// byPartition sorts recs by partition, then offset.
func byPartition(recs []*kgo.Record) []*kgo.Record {
	slices.SortStableFunc(recs, func(a, b *kgo.Record) int {
		return cmp.Or(cmp.Compare(a.Partition, b.Partition), cmp.Compare(a.Offset, b.Offset))
	})
	return recs
}

// RetryTopic is the name of the retry tier (1 for the first) of the service's source topic.
func (s *Service) RetryTopic(topic string, tier int) string {
	return retrytopics.TierTopic(topic, s.Group, tier)
}

// DeadLetterTopic is the name of the dead-letter topic of the service's source topic.
func (s *Service) DeadLetterTopic(topic string) string { return retrytopics.DLQTopic(topic, s.Group) }

// DeadLetter is a dead letter of the service: a record of a source topic that failed for good,
// as `dlq list` shows it.
type DeadLetter struct {
	// ID names it to ReplayDeadLetters.
	ID int64
	// Topic, Partition and Offset are the record's in its source topic.
	Topic     string
	Partition int32
	Offset    int64
	// Key is the record's key: its first 1024 bytes, as `dlq list` shows them.
	Key []byte
	// Class is the class of the last error (permanent, retryable, ...), and Error its message.
	Class, Error string
	Attempts     int
	// Status is new (waiting for an operator), replaying, replayed or discarded.
	Status string
}

// WaitDeadLetters waits until topic, a source topic, has at least n dead letters, and returns
// them all, oldest first.
func (s *Service) WaitDeadLetters(topic string, n int) []DeadLetter {
	s.t.Helper()
	var dls []DeadLetter
	s.wait(fmt.Sprintf("%d dead letters of %s", n, topic), func() error {
		out, err := s.Command("dlq", "list", "--topic", topic, "--json", "--limit", "1000")
		if err != nil {
			return err
		}
		var rows []struct {
			ID        int64  `json:"id"`
			Topic     string `json:"topic"`
			Partition int32  `json:"partition"`
			Offset    int64  `json:"offset"`
			Key       []byte `json:"key"`
			Class     string `json:"error_class"`
			Message   string `json:"error_message"`
			Attempts  int    `json:"attempts"`
			Status    string `json:"status"`
		}
		if err := json.Unmarshal([]byte(out), &rows); err != nil {
			return fmt.Errorf("dlq list --json: %w: %s", err, out)
		}
		dls = dls[:0]
		for i := len(rows) - 1; i >= 0; i-- { // the list is newest first
			r := rows[i]
			dls = append(dls, DeadLetter{ID: r.ID, Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key,
				Class: r.Class, Error: r.Message, Attempts: r.Attempts, Status: r.Status})
		}
		if len(dls) < n {
			return fmt.Errorf("%s has %d dead letters, want %d", topic, len(dls), n)
		}
		return nil
	})
	return dls
}

// ReplayDeadLetters replays the new dead letters of topic (those of ids only, if any are given)
// as an operator does (`dlq replay --execute`): they go back to the service, which applies them
// again. It returns the command's output, and fails the test if it fails. Wait for their effects
// as for any record's.
func (s *Service) ReplayDeadLetters(topic string, ids ...int64) string {
	s.t.Helper()
	args := []string{"dlq", "replay", "--topic", topic, "--execute", "--reason", "servicetest", "--wait", "0"}
	for _, id := range ids {
		args = append(args, "--id", strconv.FormatInt(id, 10))
	}
	out, err := s.Command(args...)
	if err != nil {
		s.t.Fatalf("servicetest: %v", err)
	}
	return out
}

// ReleaseKey releases key of topic, a source topic, as an operator does (`keys release
// --execute`): a key blocked behind a dead letter (ON_DEAD_LETTER=block) goes on with its next
// record. It returns the command's output, and fails the test if the key is not held or the
// command fails.
func (s *Service) ReleaseKey(topic, key string) string {
	s.t.Helper()
	out, err := s.Command("keys", "list", "--json")
	if err != nil {
		s.t.Fatalf("servicetest: %v", err)
	}
	var held []struct {
		Topic     string `json:"topic"`
		Partition int32  `json:"partition"`
		Key       []byte `json:"key"`
	}
	if err := json.Unmarshal([]byte(out), &held); err != nil {
		s.t.Fatalf("servicetest: keys list --json: %v: %s", err, out)
	}
	for _, h := range held {
		if h.Topic == topic && bytes.Equal(h.Key, []byte(key)) {
			out, err := s.Command("keys", "release", "--topic", topic, "--partition", strconv.Itoa(int(h.Partition)),
				"--key-hex", fmt.Sprintf("%x", key), "--execute", "--reason", "servicetest")
			if err != nil {
				s.t.Fatalf("servicetest: %v", err)
			}
			return out
		}
	}
	s.t.Fatalf("servicetest: key %q of %s is not held; held keys:\n%s", key, topic, out)
	return ""
}

// Command runs one of the service's operator commands (dlq, keys, trace, config) with the
// service's environment, as `<binary> dlq list` would, and returns what it printed; err (with
// what it wrote to stderr) if it exited with a status other than 0.
func (s *Service) Command(args ...string) (stdout string, err error) {
	var out, errOut bytes.Buffer
	status := servicehook.Run(s.t.Context(), args, s.env, s.handlers, processor.TestConfig{}, &out, &errOut)
	if status != 0 {
		return out.String(), fmt.Errorf("%s: exit status %d: %s", strings.Join(args, " "), status, strings.TrimSpace(errOut.String()))
	}
	return out.String(), nil
}

// wait calls cond until it returns nil, failing the test with its last error after the timeout,
// or at once if the service has exited.
func (s *Service) wait(what string, cond func() error) {
	s.t.Helper()
	deadline := time.Now().Add(s.timeout)
	for delay := 5 * time.Millisecond; ; delay = min(2*delay, 100*time.Millisecond) {
		err := cond()
		if err == nil {
			return
		}
		select {
		case <-s.exited:
			s.reported.Store(true)
			s.t.Fatalf("servicetest: waiting for %s: the service exited with status %d:\n%s", what, s.status, s.logs.tail(30))
		default:
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("servicetest: waited %v for %s: %v", s.timeout, what, err)
		}
		time.Sleep(delay)
	}
}

// logBuffer keeps what the service logs.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// tail returns the last n lines.
func (b *logBuffer) tail(n int) string {
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	return strings.Join(lines[max(len(lines)-n, 0):], "\n")
}
