// Package testkit is the harness of kafkapg's integration tests: a fresh database with the ledger
// tables, a topic and a group on a broker (see testenv), processors run in the test or as child
// processes, ledger workloads, and the one check that a run is over (ledger.Settled).
package testkit

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// Harness is one scenario: a fresh database with the ledger tables, a topic and a group.
type Harness struct {
	T     *testing.T
	K     *testenv.Kafka
	Pool  *pgxpool.Pool
	DBURL string
	Topic string
	Group string
}

// New returns a harness with a fresh database (kafkapg's and the ledger's tables), a topic of
// partitions partitions and a group name.
func New(t *testing.T, k *testenv.Kafka, partitions int32) *Harness {
	t.Helper()
	pool, url := testenv.Postgres(t)
	ctx := context.Background()
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, ledger.Schema); err != nil {
		t.Fatal(err)
	}
	return &Harness{T: t, K: k, Pool: pool, DBURL: url, Topic: k.CreateTopic(t, partitions), Group: k.Group(t)}
}

// Config returns a processor config tuned for fast tests.
func (h *Harness) Config(handler processor.Handler) *processor.Config {
	return &processor.Config{
		Brokers:          h.K.Brokers,
		Group:            h.Group,
		Topics:           []string{h.Topic},
		Handler:          handler,
		LocalAttempts:    3,
		RetryTiers:       []time.Duration{}, // tests of the retry tiers set their own
		BackoffBase:      5 * time.Millisecond,
		BackoffMax:       50 * time.Millisecond,
		SessionTimeout:   3 * time.Second,
		RebalanceTimeout: 8 * time.Second,
		HandoffTimeout:   2 * time.Second,
		ShutdownTimeout:  10 * time.Second,
		BatchMaxWait:     5 * time.Millisecond,
		Logger:           TestLogger(h.T),
		Registerer:       prometheus.NewRegistry(),
		KafkaOptions:     []kgo.Opt{kgo.FetchMaxWait(200 * time.Millisecond)},
	}
}

// Running is a processor started by Start.
type Running struct {
	P      *processor.Processor
	Cancel context.CancelFunc // stops it
	Done   chan struct{}      // closed when Run has returned
	Err    error              // what Run returned, once Done is closed
	Reg    *prometheus.Registry
}

// Start runs a processor in the background until Stop (or the end of the test).
func (h *Harness) Start(cfg *processor.Config) *Running {
	h.T.Helper()
	reg, ok := cfg.Registerer.(*prometheus.Registry)
	if !ok {
		reg = prometheus.NewRegistry()
		cfg.Registerer = reg
	}
	p, err := processor.New(h.Pool, cfg)
	if err != nil {
		h.T.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &Running{P: p, Cancel: cancel, Done: make(chan struct{}), Reg: reg}
	go func() {
		defer close(r.Done)
		r.Err = p.Run(ctx)
	}()
	h.T.Cleanup(func() { r.Stop(h.T) })
	return r
}

// Stop cancels the processor and waits for Run to return; Run must return nil.
func (r *Running) Stop(t *testing.T) {
	t.Helper()
	r.Cancel()
	select {
	case <-r.Done:
	case <-time.After(30 * time.Second):
		t.Fatal("processor did not stop within 30s")
	}
	if r.Err != nil {
		t.Errorf("Run returned %v", r.Err)
	}
}

// Counter returns the sum of a counter metric's series.
func (r *Running) Counter(name string) float64 { return r.sum(name) }

// Gauge returns the sum of a gauge metric's series.
func (r *Running) Gauge(name string) float64 { return r.sum(name) }

// Observations returns the number of observations of a histogram metric.
func (r *Running) Observations(name string) float64 { return r.sum(name) }

func (r *Running) sum(name string) float64 { return r.sumWhere(name, "", "") }

// Labeled returns the sum of the series of metric name whose label has the given value.
func (r *Running) Labeled(name, label, value string) float64 { return r.sumWhere(name, label, value) }

// sumWhere sums the series of metric name (a histogram's sample counts), those whose label has
// the given value if label is not empty.
func (r *Running) sumWhere(name, label, value string) float64 {
	mfs, err := r.Reg.Gather()
	if err != nil {
		panic(err)
	}
	total := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			match := label == ""
			for _, lp := range m.GetLabel() {
				match = match || (lp.GetName() == label && lp.GetValue() == value)
			}
			if match {
				total += m.GetCounter().GetValue() + m.GetGauge().GetValue() + float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return total
}

// Produce produces items to the harness's topic.
func (h *Harness) Produce(items []ledger.Item) {
	h.T.Helper()
	recs := make([]*kgo.Record, len(items))
	for i, it := range items {
		recs[i] = it.Record(h.Topic)
	}
	h.K.Produce(h.T, recs...)
}

// Applied returns the number of rows in ledger_entries.
func (h *Harness) Applied() int {
	var n int
	if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger_entries`).Scan(&n); err != nil {
		h.T.Fatal(err)
	}
	return n
}

// WaitApplied waits until at least n events are applied.
func (h *Harness) WaitApplied(n int, timeout time.Duration) {
	h.T.Helper()
	testenv.Eventually(h.T, timeout, func() error {
		if got := h.Applied(); got < n {
			return fmt.Errorf("%d of %d events applied", got, n)
		}
		return nil
	})
}

// WaitSettled waits until the run is over for items (ledger.Settled): the events that must be
// applied are, the dead letters are published and in dead_letters, nothing is in flight.
func (h *Harness) WaitSettled(items []ledger.Item, maxAttempt int, timeout time.Duration) {
	h.T.Helper()
	testenv.Eventually(h.T, timeout, func() error {
		p := h.Progress()
		// The dead-letter topic is read last: it may not exist before the first dead letter.
		if err := ledger.Settled(p, items, maxAttempt, -1); err != nil {
			return fmt.Errorf("%w; positions: %s", err, h.Positions())
		}
		return ledger.Settled(p, items, maxAttempt, len(h.K.ReadAll(h.T, h.DLQ())))
	})
}

// Progress reads the group's ledger.Progress.
func (h *Harness) Progress() ledger.Progress {
	h.T.Helper()
	p, err := ledger.ReadProgress(context.Background(), h.Pool, "kafkapg", h.Group)
	if err != nil {
		h.T.Fatal(err)
	}
	return p
}

// Positions describes the group's stored positions and owners, to tell where a test got stuck.
func (h *Harness) Positions() string {
	rows, err := h.Pool.Query(context.Background(), `SELECT topic, partition, coalesce(next_offset, -1), owner FROM kafkapg.offsets
		WHERE consumer_group = $1 ORDER BY topic, partition`, h.Group)
	if err != nil {
		return err.Error()
	}
	var out []string
	var topic, owner string
	var part int32
	var next int64
	_, err = pgx.ForEachRow(rows, []any{&topic, &part, &next, &owner}, func() error {
		out = append(out, fmt.Sprintf("%s[%d]@%d (%s)", topic, part, next, owner))
		return nil
	})
	if err != nil {
		return err.Error()
	}
	return strings.Join(out, ", ")
}

// CheckDeadLetterRows checks that the dead_letters table has exactly one row per item that must
// be dead-lettered, and no other.
func (h *Harness) CheckDeadLetterRows(items []ledger.Item, maxAttempt int) {
	h.T.Helper()
	n, err := ledger.CheckDeadLetterRows(context.Background(), h.Pool, "kafkapg", h.Group, items, maxAttempt)
	if err != nil {
		h.T.Fatalf("dead_letters verification failed:\n%v", err)
	}
	h.T.Logf("dead_letters: exactly one row for each of the %d dead records", n)
}

// DLQ is the dead-letter topic of the harness's topic and group.
func (h *Harness) DLQ() string { return retrytopics.DLQTopic(h.Topic, h.Group) }

// Verify checks the ledger tables, the dead-letter topic and the dead_letters rows against items.
func (h *Harness) Verify(items []ledger.Item, maxAttempt int, allowDupDeadLetters bool) {
	h.T.Helper()
	h.VerifyWith(items, maxAttempt, allowDupDeadLetters, ledger.VerifyOptions{})
}

// VerifyWith is Verify with ledger verification options.
func (h *Harness) VerifyWith(items []ledger.Item, maxAttempt int, allowDupDeadLetters bool, opts ledger.VerifyOptions) {
	h.T.Helper()
	rep, err := ledger.VerifyWith(context.Background(), h.Pool, items, maxAttempt, opts)
	if err != nil {
		h.T.Fatalf("ledger verification failed:\n%v", err)
	}
	dups, err := ledger.CheckDeadLetters(items, h.K.ReadAll(h.T, h.DLQ()), maxAttempt, allowDupDeadLetters)
	if err != nil {
		h.T.Fatalf("dead-letter verification failed:\n%v", err)
	}
	h.CheckDeadLetterRows(items, maxAttempt)
	h.T.Logf("verified: %d events applied exactly once in per-account order across %d accounts; %d expected dead letters present (%d published twice)",
		rep.Applied, rep.Accounts, len(items)-rep.Expected, dups)
}

// TestLogger logs to the test at warn level (debug with KAFKAPG_TEST_DEBUG=1).
func TestLogger(t testing.TB) *slog.Logger {
	level := slog.LevelWarn
	if os.Getenv("KAFKAPG_TEST_DEBUG") != "" {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(testWriter{t: t}, &slog.HandlerOptions{Level: level}))
}

type testWriter struct {
	t testing.TB
}

func (w testWriter) Write(p []byte) (int, error) {
	defer func() { recover() }() // a log line after the test ended
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
