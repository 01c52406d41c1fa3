package validate

import (
	"strings"
	"testing"

	"github.com/prometheus/prometheus/promql/promqltest"
)

// TestLagAlertsLeavePausedPartitionsOut: an operator's pause (positions pause) makes a
// partition's lag grow on purpose, which KafkapgPausedTooLong watches; the lag alerts must not
// fire for it, whether the partition is paused or its whole topic ("all"), and must still fire
// for the partitions beside it. The rules' own expressions, evaluated by Prometheus's engine on
// series as the processors export them: orders[0] paused, orders[1] stuck and growing, refunds
// paused whole and growing; payments[0] paused and growing beside payments[1], whose 5,000
// records do not grow (its topic's lag grows, but not that of what is not paused).
func TestLagAlertsLeavePausedPartitionsOut(t *testing.T) {
	m := build(t)
	exprs := map[string]string{}
	for _, g := range m.rules.Spec.Groups {
		for _, r := range g.Rules {
			exprs[r.Alert] = strings.TrimSpace(r.Expr.String())
		}
	}
	const series = `
load 1m
	kafkapg_consumer_lag_records{topic="orders", partition="0"} 0+100x60
	kafkapg_consumer_lag_records{topic="orders", partition="1"} 0+100x60
	kafkapg_consumer_lag_records{topic="payments", partition="0"} 0+100x60
	kafkapg_consumer_lag_records{topic="payments", partition="1"} 5000x60
	kafkapg_consumer_lag_records{topic="refunds", partition="0"} 0+100x60
	kafkapg_consumer_lag_records{topic="refunds", partition="1"} 0+100x60
	kafkapg_partition_paused_seconds{topic="orders", partition="0"} 0+60x60
	kafkapg_partition_paused_seconds{topic="refunds", partition="all"} 0+60x60
	kafkapg_partition_paused_seconds{topic="payments", partition="0"} 0+60x60
	kafkapg_records_applied_total{topic="orders"} 0x60
	kafkapg_records_applied_total{topic="refunds"} 0x60
	kafkapg_records_applied_total{topic="payments"} 0+10x60
`
	for _, tc := range []struct{ alert, want string }{
		// orders: partition 1's 5,900 records; partition 0's do not count. refunds: nothing.
		{"KafkapgLagGrowing", `{topic="orders"} 5900`},
		{"KafkapgPartitionStuck", `{topic="orders", partition="1"} 5900`},
	} {
		expr, ok := exprs[tc.alert]
		if !ok {
			t.Fatalf("the rules have no %s", tc.alert)
		}
		script := series + "\neval instant at 59m " + strings.Join(strings.Fields(expr), " ") + "\n\t" + tc.want + "\n"
		t.Run(tc.alert, func(t *testing.T) {
			promqltest.RunTest(t, script, promqltest.NewTestEngine(t, false, 0, promqltest.DefaultMaxSamplesPerQuery))
		})
	}
}
