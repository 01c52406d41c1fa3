package bench

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// BenchmarkScaleOut drains the same backlog of ledger events on a 12-partition topic with 1, 2
// and 3 processors in one group against one Postgres, each with its own pool of poolConns
// connections (the connections Postgres serves: replicas × pool). The processors run in this
// process, so they share its two cores with Postgres and the broker: the curve shows where the
// machine, not kafkapg, flattens it. BENCH_SCALE_EVENTS (default 300000) sets the size.
func BenchmarkScaleOut(b *testing.B) {
	events := envInt("BENCH_SCALE_EVENTS", 300_000)
	const parts = 12
	k := brokerFor(b)
	topic := k.CreateTopic(b, parts)
	items := ledger.Generate(ledger.GenConfig{Events: events, Accounts: 1000, Seed: 9, Prefix: "s"})
	recs := make([]*kgo.Record, len(items))
	for i, it := range items {
		recs[i] = it.Record(topic)
	}
	k.Produce(b, recs...)

	for b.Loop() {
		rates := map[int]float64{}
		for _, n := range []int{1, 2, 3} {
			rates[n] = measure(b, fmt.Sprintf("%d processors", n), topic, events, func(pool *pgxpool.Pool) func(context.Context) error {
				return processors(b, k, topic, pool, n)
			})
		}
		fmt.Printf("\nscale-out, %s broker, %d events over %d partitions, one Postgres, %d connections per processor:\n", k.Name, events, parts, poolConns)
		for _, n := range []int{1, 2, 3} {
			fmt.Printf("  %d processor(s)  %9.0f records/s  %.2fx one  (%d connections)\n", n, rates[n], rates[n]/rates[1], n*poolConns)
			b.ReportMetric(rates[n], fmt.Sprintf("rec/s_%dproc", n))
		}
		fmt.Println()
	}
}

// processors runs n processors in one group, each with its own pool on pool's database.
func processors(b *testing.B, k *testenv.Kafka, topic string, pool *pgxpool.Pool, n int) func(context.Context) error {
	group := fmt.Sprintf("scale-%s-%d", topic, n)
	return func(ctx context.Context) error {
		errs := make(chan error, n)
		for i := range n {
			p := pool
			if i > 0 {
				var err error
				if p, err = pgxpool.NewWithConfig(ctx, pool.Config()); err != nil {
					return err
				}
				defer p.Close()
			}
			proc, err := processor.New(p, &processor.Config{
				Brokers:         k.Brokers,
				Group:           group,
				Topics:          []string{topic},
				Handler:         ledger.Handler{},
				BatchMaxRecords: batchSize,
				InstanceName:    fmt.Sprintf("p%d", i),
				SessionTimeout:  10 * time.Second,
				Registerer:      prometheus.NewRegistry(),
				Logger:          slog.New(slog.DiscardHandler),
			})
			if err != nil {
				return err
			}
			go func() { errs <- proc.Run(ctx) }()
		}
		var first error
		for range n {
			if err := <-errs; err != nil && first == nil {
				first = err
			}
		}
		return first
	}
}
