package bench

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/processor"
)

// countingExporter is an exporter that counts the spans it is given and sends them nowhere: what
// a collector does with them is not kafkapg's cost.
type countingExporter struct{ spans atomic.Int64 }

func (e *countingExporter) ExportSpans(_ context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.spans.Add(int64(len(spans)))
	return nil
}

func (e *countingExporter) Shutdown(context.Context) error { return nil }

// BenchmarkTracing applies the ledger events with tracing off (no TracerProvider: what every
// user without OTEL_* gets) and on at full sampling, as the service sets it up (a batch span
// processor, the OTLP exporter's place taken by one that discards, Postgres statements traced by
// the statement tracer of the service, tracing.PostgresTracer), and reports the ratio, median of BENCH_ROUNDS (3) interleaved rounds of
// BENCH_TRACING_EVENTS (100,000) events.
func BenchmarkTracing(b *testing.B) {
	events := envInt("BENCH_TRACING_EVENTS", 100_000)
	rounds := envInt("BENCH_ROUNDS", 3)
	k := brokerFor(b)
	topic := ledgerTopic(b, k, events)
	run := func(pool *pgxpool.Pool, round int, tp *sdktrace.TracerProvider) func(context.Context) error {
		cfg := &processor.Config{
			Brokers: k.Brokers, Group: fmt.Sprintf("bench-tracing-%s-%d-%t", topic, round, tp != nil), Topics: []string{topic},
			Handler: ledger.Handler{}, BatchMaxRecords: batchSize, Registerer: prometheus.NewRegistry(), Logger: slog.New(slog.DiscardHandler),
		}
		if tp != nil {
			cfg.TracerProvider = tp
		}
		p, err := processor.New(pool, cfg)
		if err != nil {
			b.Fatal(err)
		}
		return p.Run
	}
	for b.Loop() {
		var off, on []float64
		var spans int64
		for r := range rounds {
			off = append(off, measure(b, "tracing-off", topic, events, func(pool *pgxpool.Pool) func(context.Context) error {
				return run(pool, r, nil)
			}))
			exp := &countingExporter{}
			tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
			on = append(on, measureVia(b, "tracing-on", topic, events, "ledger_entries", nil, func(pool *pgxpool.Pool) func(context.Context) error {
				return run(pool, r, tp)
			}, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracing.PostgresTracer(tp) }))
			tp.Shutdown(context.Background())
			spans += exp.spans.Load()
		}
		f, t := median(off), median(on)
		b.ReportMetric(f, "off_rec/s")
		b.ReportMetric(t, "on_rec/s")
		b.ReportMetric(t/f, "x_off")
		fmt.Printf("\ntracing, %s broker, %d ledger events over %d partitions, median of %d rounds:\n", k.Name, events, partitions, rounds)
		fmt.Printf("  tracing off                     %9.0f records/s   rounds %v\n", f, rounded(off))
		fmt.Printf("  tracing on, every trace sampled %9.0f records/s   rounds %v (%.3f spans per record exported)\n", t, rounded(on), float64(spans)/float64(rounds*events))
		fmt.Printf("  on / off = %.2f   (target >= 0.90)\n\n", t/f)
	}
}
