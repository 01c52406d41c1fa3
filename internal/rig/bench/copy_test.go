package bench

import (
	"context"
	"fmt"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// BenchmarkCopy applies the same records with COPY two ways, in the same run: kafkapg with a
// processor.BatchHandlerFunc that copies each batch into a table (and processor.CopyFailed to
// name a failing row), and a hand-written loop — poll, then per partition one transaction per 500
// records: the COPY and an offset upsert. BENCH_COPY_EVENTS (default 1000000) sets the size,
// BENCH_ROUNDS (default 3) the interleaved rounds; medians are reported.
func BenchmarkCopy(b *testing.B) {
	events := envInt("BENCH_COPY_EVENTS", 1_000_000)
	rounds := envInt("BENCH_ROUNDS", 3)
	k := brokerFor(b)
	topic := k.CreateTopic(b, partitions)
	recs := make([]*kgo.Record, events)
	for i := range recs {
		recs[i] = &kgo.Record{Topic: topic, Key: fmt.Appendf(nil, "user-%d", i%5000), Value: fmt.Appendf(nil, "/page/%d?ref=bench", i)}
	}
	k.Produce(b, recs...)

	for b.Loop() {
		var fw, loop []float64
		for r := range rounds {
			loop = append(loop, measureCopy(b, "copy loop", topic, events, func(pool *pgxpool.Pool) func(context.Context) error {
				return handWritten(k, topic, pool, events, batchSize, copyChunk)
			}))
			fw = append(fw, measureCopy(b, "kafkapg copy", topic, events, func(pool *pgxpool.Pool) func(context.Context) error {
				return copyProcessor(b, k, topic, pool, r)
			}))
		}
		f, l := median(fw), median(loop)
		b.ReportMetric(f, "kafkapg_copy_rec/s")
		b.ReportMetric(l, "loop_copy_rec/s")
		b.ReportMetric(f/l, "x_copy_loop")
		fmt.Printf("\nCOPY end to end, %s broker, %d records over %d partitions, median of %d rounds:\n", k.Name, events, partitions, rounds)
		fmt.Printf("  kafkapg, BatchHandlerFunc with COPY   %9.0f records/s   rounds %v\n", f, rounded(fw))
		fmt.Printf("  hand-written COPY loop                %9.0f records/s   rounds %v\n", l, rounded(loop))
		fmt.Printf("  kafkapg / loop = %.2f   (target >= 0.95)\n\n", f/l)
		summarize(copyPath, f/l, "%.0f vs %.0f records/s, median of %d rounds", f, l, rounds)
	}
}

const createViews = `CREATE TABLE views (topic text NOT NULL, partition int NOT NULL, "offset" bigint NOT NULL, user_id text NOT NULL, url text NOT NULL)`

// measureCopy is measure for the views table.
func measureCopy(b *testing.B, name, topic string, want int, variant func(*pgxpool.Pool) func(context.Context) error) float64 {
	b.Helper()
	return measureTable(b, name, topic, want, "views", func(pool *pgxpool.Pool) func(context.Context) error {
		if _, err := pool.Exec(context.Background(), createViews); err != nil {
			b.Fatal(err)
		}
		return variant(pool)
	})
}

func viewRow(r *kgo.Record) []any {
	return []any{r.Topic, r.Partition, r.Offset, string(r.Key), string(r.Value)}
}

var viewColumns = []string{"topic", "partition", "offset", "user_id", "url"}

// copyProcessor runs the processor with a COPY batch handler.
func copyProcessor(b *testing.B, k *testenv.Kafka, topic string, pool *pgxpool.Pool, round int) func(context.Context) error {
	h := processor.BatchHandlerFunc(func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
		rows := make([][]any, len(recs))
		for i, r := range recs {
			rows[i] = []any{r.Topic, r.Partition, r.Offset, string(r.Key), string(r.Value)} // viewRow's columns
		}
		_, err := tx.CopyFrom(ctx, pgx.Identifier{"views"}, viewColumns, pgx.CopyFromRows(rows))
		return processor.CopyFailed(err)
	})
	p, err := processor.New(pool, &processor.Config{
		Brokers:         k.Brokers,
		Group:           fmt.Sprintf("copy-%s-%d", topic, round),
		Topics:          []string{topic},
		Handler:         h,
		BatchMaxRecords: batchSize,
		Registerer:      prometheus.NewRegistry(),
		Logger:          slog.New(slog.DiscardHandler),
	})
	if err != nil {
		b.Fatal(err)
	}
	return p.Run
}

// copyChunk applies recs in one transaction: a COPY and an offset upsert.
func copyChunk(ctx context.Context, pool *pgxpool.Pool, recs []*kgo.Record) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		rows := make([][]any, len(recs))
		for i, r := range recs {
			rows[i] = viewRow(r)
		}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"views"}, viewColumns, pgx.CopyFromRows(rows)); err != nil {
			return err
		}
		last := recs[len(recs)-1]
		_, err := tx.Exec(ctx, `INSERT INTO bench_offsets VALUES ($1, $2, $3)
			ON CONFLICT (topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset`, last.Topic, last.Partition, last.Offset+1)
		return err
	})
}
