package bench

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

const (
	partitions = 8
	poolConns  = 8
	batchSize  = 500
)

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// BenchmarkLedgerEndToEnd applies the same ledger events three ways and reports records/s:
//
//   - kafkapg: the processor with the ledger handler (consumer group, fenced offsets, failure
//     isolation, metrics);
//   - batched: a hand-written loop a careful engineer would write — poll, then per partition
//     one transaction per 500 records, the ledger statements and an offset upsert pipelined
//     in one pgx.Batch;
//   - per-record: the same loop with one transaction per record (on a smaller slice of the
//     data, since it is slow).
//
// BENCH_EVENTS (default 300000) sets the data size, BENCH_ROUNDS (default 3) how many interleaved
// rounds to run; medians are reported.
func BenchmarkLedgerEndToEnd(b *testing.B) {
	events := envInt("BENCH_EVENTS", 300_000)
	rounds := envInt("BENCH_ROUNDS", 3)
	perRecordEvents := min(events, envInt("BENCH_PER_RECORD_EVENTS", 5_000))
	k := brokerFor(b)
	topic := ledgerTopic(b, k, events)

	for b.Loop() {
		var fw, batched, perRecord []float64
		for r := range rounds {
			perRecord = append(perRecord, measure(b, "per-record", topic, perRecordEvents, func(pool *pgxpool.Pool) func(context.Context) error {
				return handWritten(k, topic, pool, perRecordEvents, 1, applyChunk)
			}))
			batched = append(batched, measure(b, "batched", topic, events, func(pool *pgxpool.Pool) func(context.Context) error {
				return handWritten(k, topic, pool, events, batchSize, applyChunk)
			}))
			fw = append(fw, measure(b, "kafkapg", topic, events, func(pool *pgxpool.Pool) func(context.Context) error {
				return kafkapg(b, k, topic, pool, r)
			}))
		}
		f, bt, pr := median(fw), median(batched), median(perRecord)
		b.ReportMetric(f, "kafkapg_rec/s")
		b.ReportMetric(bt, "batched_rec/s")
		b.ReportMetric(pr, "per_record_rec/s")
		b.ReportMetric(f/bt, "x_batched")
		b.ReportMetric(f/pr, "x_per_record")
		fmt.Printf("\nledger end to end, %s broker, %d events over %d partitions, pool of %d connections, median of %d rounds:\n",
			k.Name, events, partitions, poolConns, rounds)
		fmt.Printf("  kafkapg (ledger handler)        %9.0f records/s   rounds %v\n", f, rounded(fw))
		fmt.Printf("  hand-written batched loop       %9.0f records/s   rounds %v\n", bt, rounded(batched))
		fmt.Printf("  hand-written per-record loop    %9.0f records/s   rounds %v (%d events)\n", pr, rounded(perRecord), perRecordEvents)
		fmt.Printf("  kafkapg / batched = %.2f   (target >= 1.0)\n", f/bt)
		summarize(ledgerPath, f/bt, "%.0f vs %.0f records/s, median of %d rounds", f, bt, rounds)
		fmt.Printf("  kafkapg / per-record = %.1f  (target >= 20)\n\n", f/pr)
	}
}

// ledgerTopic creates a topic of partitions partitions and produces events ledger events of 1,000
// accounts to it.
func ledgerTopic(b *testing.B, k *testenv.Kafka, events int) string {
	items := ledger.Generate(ledger.GenConfig{Events: events, Accounts: 1000, Seed: 1, Prefix: "b"})
	topic := k.CreateTopic(b, partitions)
	recs := make([]*kgo.Record, len(items))
	for i, it := range items {
		recs[i] = it.Record(topic)
	}
	k.Produce(b, recs...)
	return topic
}

func brokerFor(b *testing.B) *testenv.Kafka {
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		return &testenv.Kafka{Name: "kafka", Brokers: []string{env}}
	}
	return testenv.NewKfake(b)
}

// measure runs one variant against a fresh database until want events of topic are applied, and
// returns records per second.
func measure(b *testing.B, name, topic string, want int, variant func(*pgxpool.Pool) func(context.Context) error) float64 {
	b.Helper()
	return measureTable(b, name, topic, want, "ledger_entries", variant)
}

// measureTable is measure for records that each add a row to table.
//
// Progress is read from the offsets each variant stores with its effects (kafkapg's or the
// hand-written loops' bench_offsets: topic's offsets start at 0, so their sum is the records
// applied), every 20 ms; once it reaches want, the rows of table are counted once to check it.
// Counting a table of a million rows every 20 ms would keep a core of this machine busy and
// skew the ratios.
func measureTable(b *testing.B, name, topic string, want int, table string, variant func(*pgxpool.Pool) func(context.Context) error) float64 {
	b.Helper()
	return measureVia(b, name, topic, want, table, nil, variant)
}

// measureVia is measureTable on a pool whose URL via rewrites (to go through PgBouncer, say) if
// it is not nil, configured further by opts.
func measureVia(b *testing.B, name, topic string, want int, table string, via func(url string) string, variant func(*pgxpool.Pool) func(context.Context) error,
	opts ...func(*pgxpool.Config)) float64 {
	b.Helper()
	_, url := testenv.Postgres(b)
	if via != nil {
		url = via(url)
	}
	ctx := context.Background()
	pool := benchPool(b, url, opts...)
	defer pool.Close()
	run := variant(pool)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	start := time.Now()
	// The label lets a CPU profile (go test -cpuprofile) tell the variants apart:
	// go tool pprof -tagfocus variant=kafkapg ...
	go pprof.Do(runCtx, pprof.Labels("variant", name), func(ctx context.Context) { done <- run(ctx) })
	var applied int
	for {
		if err := pool.QueryRow(ctx, `SELECT (SELECT coalesce(sum(next_offset), 0) FROM kafkapg.offsets WHERE topic = $1)
			+ (SELECT coalesce(sum(next_offset), 0) FROM bench_offsets WHERE topic = $1)`, topic).Scan(&applied); err != nil {
			b.Fatal(err)
		}
		if applied >= want {
			break
		}
		select {
		case err := <-done:
			b.Fatalf("%s stopped after %d of %d events: %v", name, applied, want, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
	elapsed := time.Since(start)
	cancel()
	if err := <-done; err != nil {
		b.Fatalf("%s: %v", name, err)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{table}.Sanitize()).Scan(&rows); err != nil {
		b.Fatal(err)
	}
	if rows < want {
		b.Fatalf("%s: offsets say %d records of %s applied, but %s has %d rows", name, applied, topic, table, rows)
	}
	return float64(want) / elapsed.Seconds()
}

// kafkapg runs the processor with the ledger handler.
func kafkapg(b *testing.B, k *testenv.Kafka, topic string, pool *pgxpool.Pool, round int) func(context.Context) error {
	p, err := processor.New(pool, &processor.Config{
		Brokers:         k.Brokers,
		Group:           fmt.Sprintf("bench-%s-%d", topic, round),
		Topics:          []string{topic},
		Handler:         ledger.Handler{},
		BatchMaxRecords: batchSize,
		Registerer:      prometheus.NewRegistry(),
		Logger:          slog.New(slog.DiscardHandler),
	})
	if err != nil {
		b.Fatal(err)
	}
	return p.Run
}

// handWritten consumes topic from the start with direct partition assignment and applies up to
// perTx records per transaction with apply, partitions in parallel, until want records are applied
// or ctx ends.
func handWritten(k *testenv.Kafka, topic string, pool *pgxpool.Pool, want, perTx int, apply func(context.Context, *pgxpool.Pool, []*kgo.Record) error) func(context.Context) error {
	return func(ctx context.Context) error {
		parts := map[int32]kgo.Offset{}
		for p := range int32(partitions) {
			parts[p] = kgo.NewOffset().AtStart()
		}
		cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers...), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: parts}))
		if err != nil {
			return err
		}
		defer cl.Close()
		applied := 0
		for applied < want {
			fetches := cl.PollFetches(ctx)
			if ctx.Err() != nil {
				return nil
			}
			if errs := fetches.Errors(); len(errs) > 0 {
				return errs[0].Err
			}
			var wg sync.WaitGroup
			var mu sync.Mutex
			var firstErr error
			fetches.EachPartition(func(p kgo.FetchTopicPartition) {
				recs := p.Records
				if n := want - applied; len(recs) > n {
					recs = recs[:n]
				}
				applied += len(recs)
				wg.Go(func() {
					for chunk := range slices.Chunk(recs, perTx) {
						if err := apply(ctx, pool, chunk); err != nil {
							mu.Lock()
							firstErr = err
							mu.Unlock()
							return
						}
					}
				})
			})
			wg.Wait()
			if firstErr != nil {
				return firstErr
			}
		}
		<-ctx.Done()
		return nil
	}
}

// applyChunk applies recs in one transaction that pipelines the ledger statements and an offset
// upsert in one pgx.Batch.
func applyChunk(ctx context.Context, pool *pgxpool.Pool, recs []*kgo.Record) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		for _, r := range recs {
			ev, err := ledger.Parse(r.Value)
			if err != nil {
				return err
			}
			b.Queue(ledger.InsertEntrySQL, ev.EventID, ev.Account, ev.Amount, ev.Seq, 1)
			b.Queue(ledger.AddBalanceSQL, ev.Account, ev.Amount, ev.Seq)
		}
		last := recs[len(recs)-1]
		b.Queue(`INSERT INTO bench_offsets VALUES ($1, $2, $3)
			ON CONFLICT (topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset`, last.Topic, last.Partition, last.Offset+1)
		return tx.SendBatch(ctx, b).Close()
	})
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func rounded(xs []float64) []int {
	out := make([]int, len(xs))
	for i, x := range xs {
		out[i] = int(x)
	}
	return out
}
