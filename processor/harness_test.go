package processor_test

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
	"github.com/kafkapg/kafkapg/internal/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// harness is one scenario: a fresh database with the ledger tables, a topic and a group.
type harness struct {
	t     *testing.T
	k     *testenv.Kafka
	pool  *pgxpool.Pool
	dbURL string
	topic string
	group string
}

func newHarness(t *testing.T, k *testenv.Kafka, partitions int32) *harness {
	t.Helper()
	pool, url := testenv.Postgres(t)
	ctx := context.Background()
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, ledger.Schema); err != nil {
		t.Fatal(err)
	}
	return &harness{t: t, k: k, pool: pool, dbURL: url, topic: k.CreateTopic(t, partitions), group: k.Group(t)}
}

// config returns a processor config tuned for fast tests.
func (h *harness) config(handler processor.Handler) *processor.Config {
	return &processor.Config{
		Brokers:          h.k.Brokers,
		Group:            h.group,
		Topics:           []string{h.topic},
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
		Logger:           testLogger(h.t),
		Registerer:       prometheus.NewRegistry(),
		KafkaOptions:     []kgo.Opt{kgo.FetchMaxWait(200 * time.Millisecond)},
	}
}

// running is a processor started by start.
type running struct {
	p      *processor.Processor
	cancel context.CancelFunc
	done   chan struct{}
	err    error
	reg    *prometheus.Registry
}

// start runs a processor in the background until stop (or the end of the test).
func (h *harness) start(cfg *processor.Config) *running {
	h.t.Helper()
	reg, ok := cfg.Registerer.(*prometheus.Registry)
	if !ok {
		reg = prometheus.NewRegistry()
		cfg.Registerer = reg
	}
	p, err := processor.New(h.pool, cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{p: p, cancel: cancel, done: make(chan struct{}), reg: reg}
	go func() {
		defer close(r.done)
		r.err = p.Run(ctx)
	}()
	h.t.Cleanup(func() { r.stop(h.t) })
	return r
}

// stop cancels the processor and waits for Run to return; Run must return nil.
func (r *running) stop(t *testing.T) {
	t.Helper()
	r.cancel()
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		t.Fatal("processor did not stop within 30s")
	}
	if r.err != nil {
		t.Errorf("Run returned %v", r.err)
	}
}

// counter returns the sum of a counter metric's series.
func (r *running) counter(name string) float64 { return r.sum(name) }

// gauge returns the sum of a gauge metric's series.
func (r *running) gauge(name string) float64 { return r.sum(name) }

// observations returns the number of observations of a histogram metric.
func (r *running) observations(name string) float64 { return r.sum(name) }

func (r *running) sum(name string) float64 { return r.sumWhere(name, "", "") }

// labeled returns the sum of the series of metric name whose label has the given value.
func (r *running) labeled(name, label, value string) float64 { return r.sumWhere(name, label, value) }

// sumWhere sums the series of metric name (a histogram's sample counts), those whose label has
// the given value if label is not empty.
func (r *running) sumWhere(name, label, value string) float64 {
	mfs, err := r.reg.Gather()
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

func (h *harness) produce(items []ledger.Item) {
	h.t.Helper()
	recs := make([]*kgo.Record, len(items))
	for i, it := range items {
		recs[i] = it.Record(h.topic)
	}
	h.k.Produce(h.t, recs...)
}

// applied returns the number of rows in ledger_entries.
func (h *harness) applied() int {
	var n int
	if err := h.pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger_entries`).Scan(&n); err != nil {
		h.t.Fatal(err)
	}
	return n
}

// waitApplied waits until at least n events are applied.
func (h *harness) waitApplied(n int, timeout time.Duration) {
	h.t.Helper()
	testenv.Eventually(h.t, timeout, func() error {
		if got := h.applied(); got < n {
			return fmt.Errorf("%d of %d events applied", got, n)
		}
		return nil
	})
}

// waitSettled waits until every item is accounted for: the expected events applied, the outbox
// and the retry path (tiers, held keys, parked records) empty, and the dead-letter topic holding
// at least the expected dead letters.
func (h *harness) waitSettled(items []ledger.Item, maxAttempt int, timeout time.Duration) {
	h.t.Helper()
	wantApplied, wantDead := 0, 0
	for _, it := range items {
		if it.Dead(maxAttempt) {
			wantDead++
		} else {
			wantApplied++
		}
	}
	testenv.Eventually(h.t, timeout, func() error {
		if got := h.applied(); got < wantApplied {
			if err := h.inFlight(); err != nil {
				return fmt.Errorf("%d of %d events applied; %v; positions: %s", got, wantApplied, err, h.positions())
			}
			return fmt.Errorf("%d of %d events applied; positions: %s", got, wantApplied, h.positions())
		}
		if err := h.inFlight(); err != nil {
			return err
		}
		if got := len(h.k.ReadAll(h.t, h.dlq())); got < wantDead {
			return fmt.Errorf("%d of %d dead letters published", got, wantDead)
		}
		return nil
	})
}

// positions describes the group's stored positions and owners, to tell where a test got stuck.
func (h *harness) positions() string {
	rows, err := h.pool.Query(context.Background(), `SELECT topic, partition, coalesce(next_offset, -1), owner FROM kafkapg.offsets
		WHERE consumer_group = $1 ORDER BY topic, partition`, h.group)
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

// inFlight returns an error describing what is left in the outbox and the retry path, nil if
// nothing is.
func (h *harness) inFlight() error {
	var outbox int
	if err := h.pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.outbox`).Scan(&outbox); err != nil {
		return err
	}
	if outbox > 0 {
		return fmt.Errorf("%d outbox rows not yet published", outbox)
	}
	if n := h.retryPathRows(); n != "" {
		return fmt.Errorf("retry path not empty: %s", n)
	}
	return nil
}

// retryPathRows describes what is left in the retry path's tables ("" if nothing).
func (h *harness) retryPathRows() string {
	var retries, keys, parked int
	err := h.pool.QueryRow(context.Background(), `SELECT
		(SELECT count(*) FROM kafkapg.retries), (SELECT count(*) FROM kafkapg.held_keys), (SELECT count(*) FROM kafkapg.held_records)`).
		Scan(&retries, &keys, &parked)
	if err != nil {
		return err.Error()
	}
	if retries+keys+parked == 0 {
		return ""
	}
	return fmt.Sprintf("%d records in tiers, %d held keys, %d parked records", retries, keys, parked)
}

// checkDeadLetterRows checks that the dead_letters table has exactly one row per item that must
// be dead-lettered, and no other.
func (h *harness) checkDeadLetterRows(items []ledger.Item, maxAttempt int) {
	h.t.Helper()
	n, err := ledger.CheckDeadLetterRows(context.Background(), h.pool, "kafkapg", h.group, items, maxAttempt)
	if err != nil {
		h.t.Fatalf("dead_letters verification failed:\n%v", err)
	}
	h.t.Logf("dead_letters: exactly one row for each of the %d dead records", n)
}

func (h *harness) dlq() string { return retrytopics.DLQTopic(h.topic, h.group) }

// verify checks the ledger tables and the dead-letter topic against items.
func (h *harness) verify(items []ledger.Item, maxAttempt int, allowDupDeadLetters bool) {
	h.t.Helper()
	h.verifyWith(items, maxAttempt, allowDupDeadLetters, ledger.VerifyOptions{})
}

// verifyWith is verify with ledger verification options.
func (h *harness) verifyWith(items []ledger.Item, maxAttempt int, allowDupDeadLetters bool, opts ledger.VerifyOptions) {
	h.t.Helper()
	rep, err := ledger.VerifyWith(context.Background(), h.pool, items, maxAttempt, opts)
	if err != nil {
		h.t.Fatalf("ledger verification failed:\n%v", err)
	}
	dups, err := ledger.CheckDeadLetters(items, h.k.ReadAll(h.t, h.dlq()), maxAttempt, allowDupDeadLetters)
	if err != nil {
		h.t.Fatalf("dead-letter verification failed:\n%v", err)
	}
	h.checkDeadLetterRows(items, maxAttempt)
	h.t.Logf("verified: %d events applied exactly once in per-account order across %d accounts; %d expected dead letters present (%d published twice)",
		rep.Applied, rep.Accounts, len(items)-rep.Expected, dups)
}

// testLogger logs to the test at warn level (debug with KAFKAPG_TEST_DEBUG=1).
func testLogger(t testing.TB) *slog.Logger {
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
