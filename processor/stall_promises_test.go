package processor_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// The tests in this file hold the promises of docs/operations.md about a processor that makes no
// progress: kafkapg_stalled_partitions{cause} and kafkapg_stuck_keys{reason} say why, a worker
// that meets a bug makes Run return the error, and a burst of held records has its tables
// analyzed (docs/testing.md).

// wantOnly returns nil if the series of metric name with label = want is 1 and every other
// series of the metric is 0.
func wantOnly(r *running, name, label, want string) error {
	got := map[string]float64{}
	for _, v := range labelValues(r, name, label) {
		got[v] = r.Labeled(name, label, v)
	}
	if _, ok := got[want]; !ok {
		return fmt.Errorf("%s has no series with %s %q yet: %v", name, label, want, got)
	}
	for v, n := range got {
		if (v == want && n != 1) || (v != want && n != 0) {
			return fmt.Errorf("%s by %s: %v; want 1 %s and none other", name, label, got, want)
		}
	}
	return nil
}

// labelValues returns the values of label among the series of metric name.
func labelValues(r *running, name, label string) []string {
	mfs, err := r.Reg.Gather()
	if err != nil {
		panic(err)
	}
	var out []string
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label {
					out = append(out, lp.GetValue())
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

// documentedValues returns the label values that docs/operations.md's row for metric name lists:
// the words in lower case between backquotes.
func documentedValues(t *testing.T, name string) []string {
	t.Helper()
	ops, err := os.ReadFile("../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `" + name + "\\{[a-z]+\\}` \\|.*$").Find(ops)
	if row == nil {
		t.Fatalf("docs/operations.md has no row for %s", name)
	}
	var out []string
	for _, m := range regexp.MustCompile("`([a-z]+)`").FindAllSubmatch(row, -1) {
		out = append(out, string(m[1]))
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// documentedAsExported checks that docs/operations.md lists the label values that the metric has.
func documentedAsExported(t *testing.T, r *running, name, label string) {
	t.Helper()
	if doc, code := documentedValues(t, name), labelValues(r, name, label); !slices.Equal(doc, code) {
		t.Errorf("docs/operations.md lists %s's %s as %q; the processor exports %q", name, label, doc, code)
	}
}

// startOn runs a processor of cfg on pool, returning it as running (Err is Run's, once Done is
// closed). Unlike Harness.Start, it leaves what Run returns for the test to check.
func startOn(t *testing.T, pool *pgxpool.Pool, cfg *processor.Config) *running {
	t.Helper()
	p, err := processor.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{P: p, Cancel: cancel, Done: make(chan struct{}), Reg: cfg.Registerer.(*prometheus.Registry)}
	go func() {
		defer close(r.Done)
		r.Err = p.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-r.Done
	})
	return r
}

// TestStalledWhilePostgresIsDown: a partition whose Postgres is unreachable (the processor's
// connections go through a proxy that the test cuts: existing connections closed, new ones
// refused) for longer than StallTimeout counts in kafkapg_stalled_partitions with cause
// infrastructure and no other; once Postgres is back the record is applied and the partition is
// not stalled any more.
func TestStalledWhilePostgresIsDown(t *testing.T) {
	k := testenv.NewKfake(t)
	h := carelessHarness(t, k, 1)
	proxied, proxy, _ := proxiedPool(t, h.DBURL)
	cfg := h.Config(careless{})
	cfg.StallTimeout = time.Second
	r := startOn(t, proxied, cfg)
	h.K.Produce(t, &kgo.Record{Topic: h.Topic, Value: []byte("before")})
	h.waitEffects([]string{"before"}, 30*time.Second) // the partition is claimed

	proxy.Cut()
	h.K.Produce(t, &kgo.Record{Topic: h.Topic, Value: []byte("during")})
	testenv.Eventually(t, 30*time.Second, func() error {
		return wantOnly(r, "kafkapg_stalled_partitions", "cause", "infrastructure")
	})
	if n := r.Counter("kafkapg_infrastructure_retries_total"); n == 0 {
		t.Error("kafkapg_infrastructure_retries_total stayed at 0 while Postgres was down")
	}

	proxy.Restore()
	h.waitEffects([]string{"before", "during"}, 30*time.Second)
	testenv.Eventually(t, 30*time.Second, func() error {
		if n := r.Gauge("kafkapg_stalled_partitions"); n != 0 {
			return fmt.Errorf("%v partitions still reported stalled", n)
		}
		return nil
	})
	r.Cancel()
	<-r.Done
	if r.Err != nil {
		t.Errorf("Run returned %v", r.Err)
	}
}

// TestStalledByOpenBreaker: a partition whose failing record waits in place while the circuit
// breaker is open counts in kafkapg_stalled_partitions with cause breaker and no other.
func TestStalledByOpenBreaker(t *testing.T) {
	k := testenv.NewKfake(t)
	h := carelessHarness(t, k, 1)
	cfg := h.Config(careless{before: func(context.Context, pgx.Tx, *processor.Record) error {
		return errors.New("payments API: 503 Service Unavailable")
	}})
	cfg.StallTimeout = time.Second
	cfg.LocalAttempts = 1
	cfg.RetryTiers = []time.Duration{time.Hour} // the failures before the breaker opens wait there
	cfg.BreakerMinRecords = 3
	cfg.BreakerWindow = time.Minute
	cfg.BreakerProbeInterval = time.Hour // no probe: the record waits for the whole test
	cfg.BreakerProbeMax = time.Hour
	r := h.Start(cfg)
	var recs []*kgo.Record
	for i := range 10 {
		recs = append(recs, &kgo.Record{Topic: h.Topic, Key: fmt.Appendf(nil, "k%d", i), Value: fmt.Appendf(nil, "v%d", i)})
	}
	h.K.Produce(t, recs...)
	testenv.Eventually(t, 30*time.Second, func() error {
		if open := r.Gauge("kafkapg_circuit_breaker_open"); open != 1 {
			return fmt.Errorf("kafkapg_circuit_breaker_open = %v", open)
		}
		return wantOnly(r, "kafkapg_stalled_partitions", "cause", "breaker")
	})
	documentedAsExported(t, r, "kafkapg_stalled_partitions", "cause")
}

// TestStuckKeysOverdueThenUnapplied: a held key whose record in a retry tier is past its due time
// by StallTimeout and not applied (here the tier's consumer is held up by a handler that does not
// return) counts in kafkapg_stuck_keys as overdue; once that record is applied and the key's held
// records wait for longer than StallTimeout to be applied (the held record's handler does not
// return), it counts as unapplied; once they are applied, it is not stuck. A key whose record
// waits in a tier and is not yet due is held all along and never counts.
func TestStuckKeysOverdueThenUnapplied(t *testing.T) {
	k := testenv.NewKfake(t)
	h := carelessHarness(t, k, 1)
	tierGate, heldGate := make(chan struct{}), make(chan struct{})
	wait := func(ctx context.Context, gate chan struct{}) error {
		select {
		case <-gate:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	cfg := h.Config(careless{before: func(ctx context.Context, _ pgx.Tx, rec *processor.Record) error {
		switch v := string(rec.Value); {
		case v == "L-head" && rec.Attempt < 3:
			return errors.New("fails twice: waits in tier 2 for an hour")
		case v == "K-head" && rec.Attempt == 1:
			return errors.New("fails once: due in tier 1 at once")
		case v == "K-head":
			return wait(ctx, tierGate) // the tier's consumer makes no progress
		case v == "K-after":
			return wait(ctx, heldGate) // nor does the held record's
		}
		return nil
	}})
	cfg.StallTimeout = time.Second
	cfg.LocalAttempts = 1
	cfg.RetryTiers = []time.Duration{100 * time.Millisecond, time.Hour}
	cfg.BreakerDisabled = true
	cfg.TxIdleTimeout = 5 * time.Minute // the gates hold transactions open
	r := h.Start(cfg)
	t.Cleanup(func() { closeOnce(tierGate); closeOnce(heldGate) })
	rec := func(key, value string) *kgo.Record {
		return &kgo.Record{Topic: h.Topic, Key: []byte(key), Value: []byte(value)}
	}

	h.K.Produce(t, rec("L", "L-head"), rec("L", "L-after"))
	testenv.Eventually(t, 30*time.Second, func() error {
		var tier int
		if err := h.Pool.QueryRow(context.Background(), `SELECT tier FROM kafkapg.retries WHERE "offset" = 0`).Scan(&tier); err != nil || tier != 2 {
			return fmt.Errorf("L-head's retry state: tier %d, %v; want tier 2", tier, err)
		}
		return nil
	})
	h.K.Produce(t, rec("K", "K-head"), rec("K", "K-after"))

	stuck := func(reason string, head int64) {
		t.Helper()
		testenv.Eventually(t, 30*time.Second, func() error {
			return wantOnly(r, "kafkapg_stuck_keys", "reason", reason)
		})
		scope := retrytopics.StuckScope{Older: cfg.StallTimeout, Tiers: map[string]int{h.Topic: len(cfg.RetryTiers)}}
		keys, err := processor.StuckKeys(context.Background(), h.Pool, "kafkapg", h.Group, scope, 10)
		if err != nil || len(keys) != 1 || string(keys[0].Key.Key) != "K" || keys[0].Reason != reason || keys[0].Head != head {
			t.Fatalf("StuckKeys = %+v, %v; want key K alone, %s, waiting for offset %d", keys, err, reason, head)
		}
	}
	stuck(retrytopics.StuckOverdue, 2)
	documentedAsExported(t, r, "kafkapg_stuck_keys", "reason")

	closeOnce(tierGate)
	h.waitEffects([]string{"K-head"}, 30*time.Second)
	stuck(retrytopics.StuckUnapplied, -1)

	closeOnce(heldGate)
	h.waitEffects([]string{"K-head", "K-after"}, 30*time.Second)
	testenv.Eventually(t, 30*time.Second, func() error {
		if n := r.Gauge("kafkapg_stuck_keys"); n != 0 {
			return fmt.Errorf("%v keys still reported stuck", n)
		}
		return nil
	})
	rows, err := h.Pool.Query(context.Background(), `SELECT convert_from(key, 'UTF8') FROM kafkapg.held_keys`)
	if err != nil {
		t.Fatal(err)
	}
	held, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(held) != 1 || held[0] != "L" {
		t.Errorf("held keys %q, %v; want L alone, still waiting for its tier", held, err)
	}
}

// closeOnce closes gate unless it is closed.
func closeOnce(gate chan struct{}) {
	select {
	case <-gate:
	default:
		close(gate)
	}
}

// TestWorkerBugStopsRun: a worker that meets an error that cannot happen (a bug, injected here
// after a batch is applied) makes Run shut down and return that error, naming the partition,
// rather than leave the partition stuck or return nil; a restart resumes from Postgres, applying
// nothing twice.
func TestWorkerBugStopsRun(t *testing.T) {
	k := testenv.NewKfake(t)
	h := carelessHarness(t, k, 1)
	bug := errors.New("impossible state injected by the test")
	restore := processor.SetWorkerBug(h.Topic, bug)
	defer restore()
	r := startOn(t, h.Pool, h.Config(careless{}))
	h.K.Produce(t, &kgo.Record{Topic: h.Topic, Value: []byte("x")})
	select {
	case <-r.Done:
	case <-time.After(60 * time.Second):
		t.Fatal("Run did not return within 60s of the worker's bug")
	}
	partition := fmt.Sprintf("partition %s[0]", h.Topic)
	if !errors.Is(r.Err, bug) || !strings.Contains(fmt.Sprint(r.Err), partition) {
		t.Fatalf("Run returned %v; want the bug's error, naming %q", r.Err, partition)
	}
	h.waitEffects([]string{"x"}, time.Second) // committed before the bug

	restore()
	h.Start(h.Config(careless{}))
	h.K.Produce(t, &kgo.Record{Topic: h.Topic, Value: []byte("y")})
	h.waitEffects([]string{"x", "y"}, 30*time.Second)
}

// TestHeldRecordsAnalyzed: a processor that held 10,000 records or more since it last did runs
// ANALYZE on held_records and held_keys before applying held records, at most once a minute
// (docs/testing.md, BenchmarkHeldRecords). Three bursts, each held behind a key whose head waits
// in a retry tier until the test lets it through: 9,999 records (no ANALYZE), 1 more (10,000 since
// none ran: ANALYZE), 10,000 more within the minute (no second ANALYZE).
func TestHeldRecordsAnalyzed(t *testing.T) {
	k := testenv.NewKfake(t)
	h := carelessHarness(t, k, 1)
	gates := map[string]chan struct{}{"A": make(chan struct{}), "B": make(chan struct{}), "C": make(chan struct{})}
	t.Cleanup(func() {
		for _, g := range gates {
			closeOnce(g)
		}
	})
	cfg := h.Config(careless{before: func(ctx context.Context, _ pgx.Tx, rec *processor.Record) error {
		if string(rec.Value) != "head" {
			return nil
		}
		if rec.Attempt == 1 {
			return errors.New("the head fails: its key's next records are held")
		}
		select { // in the tier: wait until the test has seen the key's records held
		case <-gates[string(rec.Key)]:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}})
	cfg.LocalAttempts = 1
	cfg.RetryTiers = []time.Duration{10 * time.Millisecond}
	cfg.BreakerDisabled = true
	cfg.TxIdleTimeout = 5 * time.Minute
	r := h.Start(cfg)

	analyzed := func() (n int64) {
		t.Helper()
		if err := h.Pool.QueryRow(context.Background(), `SELECT analyze_count FROM pg_stat_user_tables
			WHERE schemaname = 'kafkapg' AND relname = 'held_records'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	heldTotal := 0
	burst := func(key string, n int) {
		t.Helper()
		recs := []*kgo.Record{{Topic: h.Topic, Key: []byte(key), Value: []byte("head")}}
		for i := range n {
			recs = append(recs, &kgo.Record{Topic: h.Topic, Key: []byte(key), Value: fmt.Appendf(nil, "%s%d", key, i)})
		}
		h.K.Produce(t, recs...)
		heldTotal += n
		testenv.Eventually(t, 60*time.Second, func() error {
			var held int
			if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.held_records`).Scan(&held); err != nil || held != n {
				return fmt.Errorf("%d records held, %v; want %d", held, err, n)
			}
			if got := r.Counter("kafkapg_records_held_total"); got != float64(heldTotal) {
				return fmt.Errorf("kafkapg_records_held_total = %v, want %d", got, heldTotal)
			}
			return nil
		})
		close(gates[key])
		testenv.Eventually(t, 60*time.Second, func() error {
			var held, keys int
			if err := h.Pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM kafkapg.held_records), (SELECT count(*) FROM kafkapg.held_keys)`).Scan(&held, &keys); err != nil || held+keys != 0 {
				return fmt.Errorf("%d records still held, %d keys, %v", held, keys, err)
			}
			return nil
		})
	}

	before := analyzed()
	burst("A", 9_999)
	if n := analyzed() - before; n != 0 {
		t.Fatalf("held_records analyzed %d times after 9,999 held records; want none below 10,000", n)
	}
	first := time.Now() // before the ANALYZE: the bound on the minute below is conservative
	burst("B", 1)
	if n := analyzed() - before; n != 1 {
		t.Fatalf("held_records analyzed %d times once 10,000 records were held; want once", n)
	}
	burst("C", 10_000)
	if n := analyzed() - before; n != 1 {
		t.Fatalf("held_records analyzed %d times after 10,000 more within the minute; want once", n)
	}
	if time.Since(first) >= time.Minute {
		t.Fatal("the last two bursts took over a minute: the check of 'at most once a minute' proves nothing; make them smaller")
	}
}
