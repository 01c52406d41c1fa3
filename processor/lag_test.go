package processor_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// TestConsumerLagFollowsPostgres stalls the handler on both partitions, so nothing commits while
// 40 events wait: kafkapg_consumer_lag_records must show all 40. Once the handler runs again and
// everything is applied, the lag must fall to 0, and the consumed and handler-duration metrics
// must have counted the work.
func TestConsumerLagFollowsPostgres(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 2)
		items := ledger.Generate(ledger.GenConfig{Events: 40, Accounts: 8, Seed: 41, Prefix: "lag"})
		g := newGate(t, 2)
		r := h.Start(h.Config(g))
		h.Produce(items)
		g.waitStalled(t, 2)

		waitGauge := func(want float64) {
			t.Helper()
			testenv.Eventually(t, 30*time.Second, func() error {
				if got := r.Gauge("kafkapg_consumer_lag_records"); got != want {
					return fmt.Errorf("kafkapg_consumer_lag_records = %v, want %v", got, want)
				}
				return nil
			})
		}
		waitGauge(float64(len(items)))
		g.open()
		h.WaitApplied(len(items), 30*time.Second)
		waitGauge(0)
		if got := r.Counter("kafkapg_records_consumed_total"); got != float64(len(items)) {
			t.Errorf("kafkapg_records_consumed_total = %v, want %d", got, len(items))
		}
		if got := r.Observations("kafkapg_handler_duration_seconds"); got < 2 {
			t.Errorf("kafkapg_handler_duration_seconds has %v observations, want at least one per partition", got)
		}
		r.Stop(t)
		h.Verify(items, 1, false)
	})
}
