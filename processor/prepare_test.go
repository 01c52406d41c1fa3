package processor_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

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
