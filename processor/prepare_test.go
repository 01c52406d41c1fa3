package processor_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// TestConcurrentPrepareKeepsKeyOrder runs a handler whose Prepare waits up to 3 ms with
// Concurrency 64, over a stream a tenth of whose events fail transiently (through two short
// tiers, their keys held meanwhile) or are poison, with a second processor joining and leaving
// halfway (revokes in the middle of concurrent work). Every event must be applied exactly once,
// in per-account order, at the attempt its failures allow; no two Prepare calls of a key may
// overlap, Handle must get every record with its own Prepare, and the prepares must really have
// run side by side.
func TestConcurrentPrepareKeepsKeyOrder(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 3)
		if _, err := h.Pool.Exec(context.Background(), ledger.PreparedSchema); err != nil {
			t.Fatal(err)
		}
		items := flakyMix(6000, 28, "conc")
		handler := ledger.NewPrepared(ledger.Handler{}, 3*time.Millisecond)
		cfg := func() *processor.Config {
			c := h.Config(handler)
			c.Concurrency = 64
			c.RetryTiers = []time.Duration{100 * time.Millisecond, 300 * time.Millisecond}
			return c
		}
		go h.Produce(items)
		a := h.Start(cfg())
		h.WaitApplied(1500, 60*time.Second)
		b := h.Start(cfg())
		h.WaitApplied(3500, 60*time.Second)
		b.Stop(t)
		h.WaitSettled(items, 3, 90*time.Second)
		h.Verify(items, 3, false)
		st := ledger.PrepareStatsOf(handler)
		for _, p := range st.Problems {
			t.Error(p)
		}
		bad, err := ledger.PrepareViolations(context.Background(), h.Pool)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range bad {
			t.Error(p)
		}
		t.Logf("%d prepares, at most %d at once", st.Prepares, st.MaxAtOnce)
		if st.MaxAtOnce < 16 {
			t.Errorf("at most %d prepares ran at once with Concurrency 64: the records were not prepared side by side", st.MaxAtOnce)
		}
		if got := a.Observations("kafkapg_prepare_duration_seconds"); got == 0 {
			t.Error("kafkapg_prepare_duration_seconds has no observations")
		}
	})
}

// TestConcurrencyNeedsAPreparer: Concurrency above 1 with a handler that has no Prepare step is
// a configuration error that says why, not a setting silently ignored.
func TestConcurrencyNeedsAPreparer(t *testing.T) {
	cfg := &processor.Config{Brokers: []string{"k:9092"}, Group: "g", Topics: []string{"orders"}, Handler: ledger.Handler{}, Concurrency: 8}
	err := cfg.Validate()
	var ce *processor.ConfigError
	if !errors.As(err, &ce) || ce.Field != "Concurrency" || !strings.Contains(err.Error(), "Preparer") {
		t.Fatalf("Validate() = %v; want a ConfigError on Concurrency naming Preparer", err)
	}
	cfg.Handler = ledger.NewPrepared(ledger.Handler{}, 0)
	if err := cfg.Validate(); err != nil {
		t.Fatalf("with a Preparer: Validate() = %v", err)
	}
	cfg.Concurrency = -1
	if err := cfg.Validate(); err == nil {
		t.Fatal("Concurrency -1: no error")
	}
}

// pricingDown is a handler whose Prepare fails, retryably, while down is set, counting the calls
// of partition 1's records and how many run at once meanwhile.
type pricingDown struct {
	down, calls, inFlight, most *atomic.Int64
}

func (h pricingDown) Prepare(ctx context.Context, rec *processor.Record) error {
	if h.down.Load() == 0 {
		return nil
	}
	if rec.Partition == 1 {
		h.calls.Add(1)
		n := h.inFlight.Add(1)
		defer h.inFlight.Add(-1)
		for m := h.most.Load(); n > m && !h.most.CompareAndSwap(m, n); m = h.most.Load() {
		}
	}
	time.Sleep(2 * time.Millisecond)
	return errors.New("pricing service unavailable")
}

func (pricingDown) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error { return nil }

// TestOpenBreakerPreparesOneAtATime: the circuit breaker is per process. Partition 0's records
// open it (a downstream outage); partition 1's records arrive after that. With Concurrency 32,
// partition 1 then prepares only its first record, alone, instead of
// sending the service that is down 32 calls at once and a window's worth in all: its head
// fails, and waits in place as a probe. When the
// service comes back, every record is applied.
func TestOpenBreakerPreparesOneAtATime(t *testing.T) {
	h := newHarness(t, testenv.NewKfake(t), 2)
	var down, calls, inFlight, most atomic.Int64
	down.Store(1)
	produce := func(partition int32, n int) {
		var recs []*kgo.Record
		for i := range n {
			recs = append(recs, &kgo.Record{Topic: h.Topic, Partition: partition, Key: fmt.Appendf(nil, "p%d-k%d", partition, i%100), Value: []byte("v")})
		}
		cl := h.K.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
		if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	produce(0, 400)
	cfg := h.Config(pricingDown{&down, &calls, &inFlight, &most})
	cfg.Concurrency = 32
	cfg.LocalAttempts = 2
	cfg.BreakerMinRecords = 5
	cfg.BreakerProbeInterval = 50 * time.Millisecond
	cfg.BreakerProbeMax = 100 * time.Millisecond
	r := h.Start(cfg)
	testenv.Eventually(t, 30*time.Second, func() error {
		if r.Gauge("kafkapg_circuit_breaker_open") != 1 {
			return errors.New("the breaker is not open")
		}
		return nil
	})
	produce(1, 400)
	time.Sleep(time.Second)
	if m, c := most.Load(), calls.Load(); m > 2 || c > 30 {
		t.Errorf("partition 1 made %d calls, %d at once, while the breaker was open; want at most 2 at once, and only its head's probes after its first failure (30 at most)", c, m)
	}
	down.Store(0)
	testenv.Eventually(t, 30*time.Second, func() error {
		applied, dead := r.Counter("kafkapg_records_applied_total"), r.Counter("kafkapg_records_dead_lettered_total")
		if applied+dead != 800 {
			return fmt.Errorf("%v applied and %v dead-lettered of 800", applied, dead)
		}
		return nil
	})
	if dead := r.Counter("kafkapg_records_dead_lettered_total"); dead > 40 {
		t.Errorf("%v records dead-lettered: the breaker should have kept them waiting in place", dead)
	}
}
