package processor_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// downstream is a ledger handler whose (simulated) downstream service can go down: every call
// then fails with a plain, retryable error, as a handler calling an unavailable API would.
type downstream struct {
	down  atomic.Bool
	calls atomic.Int64
}

func (d *downstream) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	d.calls.Add(1)
	if d.down.Load() {
		return errors.New("payments API: 503 Service Unavailable")
	}
	return ledger.Handler{}.Handle(ctx, tx, rec)
}

// TestBreakerHoldsRecordsDuringOutage takes the handler's downstream down while 400 events
// arrive. The circuit breaker must open after a handful of failures and hold the failing records
// in place (one per partition, probing) instead of pushing the whole stream into the retry
// tiers, where it would be dead-lettered after the last tier. When the downstream comes back,
// a probe closes the breaker and every event is applied exactly once, in order, with no dead
// letters. Without the breaker (BreakerDisabled) nearly every event would go to the tiers
// and most would be dead-lettered.
func TestBreakerHoldsRecordsDuringOutage(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 4)
		items := ledger.Generate(ledger.GenConfig{Events: 400, Accounts: 400, Seed: 51, Prefix: "cb"})
		d := &downstream{}
		cfg := h.Config(d)
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond, 200 * time.Millisecond}
		cfg.LocalAttempts = 2
		cfg.BreakerMinRecords = 10
		cfg.BreakerWindow = 10 * time.Second
		cfg.BreakerProbeInterval = 100 * time.Millisecond
		cfg.BreakerProbeMax = 400 * time.Millisecond
		r := h.Start(cfg)

		d.down.Store(true)
		h.Produce(items)
		testenv.Eventually(t, 30*time.Second, func() error {
			open, waiting := r.Gauge("kafkapg_circuit_breaker_open"), r.Gauge("kafkapg_circuit_breaker_waiting_records")
			if open != 1 || waiting < 4 {
				return fmt.Errorf("circuit_breaker_open = %v, waiting records = %v; want open, keeping at least one record per source partition waiting", open, waiting)
			}
			return nil
		})
		// Let the outage last: probes fail, the breaker stays open, nothing more moves.
		time.Sleep(2 * time.Second)
		retried := r.Counter("kafkapg_records_retried_total")
		dead := r.Counter("kafkapg_records_dead_lettered_total")
		t.Logf("during the outage: %v records sent to a retry tier, %v dead-lettered, %v handler calls, breaker opened %v times",
			retried, dead, d.calls.Load(), r.Counter("kafkapg_circuit_breaker_opened_total"))
		if r.Gauge("kafkapg_circuit_breaker_open") != 1 {
			t.Errorf("the breaker closed while the downstream was still down")
		}
		if retried > 2*float64(cfg.BreakerMinRecords) {
			t.Errorf("%v records went to the retry tiers during the outage; the breaker should have kept all but the first few waiting", retried)
		}
		if dead > 0 {
			t.Errorf("%v records were dead-lettered during the outage", dead)
		}
		if got := h.Applied(); got != 0 {
			t.Errorf("%d events applied while the downstream was down", got)
		}

		d.down.Store(false)
		h.WaitSettled(items, 1, 60*time.Second)
		if got := r.Gauge("kafkapg_circuit_breaker_open"); got != 0 {
			t.Errorf("circuit_breaker_open = %v after the outage", got)
		}
		if got := r.Gauge("kafkapg_circuit_breaker_waiting_records"); got != 0 {
			t.Errorf("circuit_breaker_held_records = %v after the outage", got)
		}
		r.Stop(t)
		// The records that reached a tier before the breaker opened are applied at attempt 2.
		h.VerifyWith(items, 1, false, ledger.VerifyOptions{ExternalFailures: true})
	})
}
