package bench

import (
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"sync"
	"sync/atomic"
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

// waiting is a batch handler (apply) behind a Prepare that waits as a call to another system
// does: wait(rec) long. first is when the first Prepare started (the first record in hand).
type waiting struct {
	apply func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error
	wait  func(*processor.Record) time.Duration
	first atomic.Int64 // unix nanoseconds
	busy  atomic.Int64 // nanoseconds spent in Prepare, all calls
}

func (h *waiting) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	return h.apply(ctx, tx, []*processor.Record{rec})
}

func (h *waiting) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	return h.apply(ctx, tx, recs)
}

// copyResults writes a row per record into results with COPY: the enrichment's result.
func copyResults(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	rows := make([][]any, len(recs))
	for i, r := range recs {
		rows[i] = []any{string(r.Key), r.Offset, r.Prepared}
	}
	_, err := tx.CopyFrom(ctx, pgx.Identifier{"results"}, []string{"key", "offset", "waited_us"}, pgx.CopyFromRows(rows))
	return processor.CopyFailed(err)
}

const createResults = `CREATE TABLE results (key text NOT NULL, "offset" bigint NOT NULL, waited_us bigint NOT NULL)`

func (h *waiting) Prepare(ctx context.Context, rec *processor.Record) error {
	start := time.Now()
	h.first.CompareAndSwap(0, start.UnixNano())
	defer func() { h.busy.Add(int64(time.Since(start))) }()
	d := h.wait(rec)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		rec.Prepared = d.Microseconds()
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// uniformWait is a record's wait in Parallel Consumer's example shape: uniform in [0, 5 ms),
// drawn from its offset, so that every variant waits the same, and the total is known.
func uniformWait(offset int64) time.Duration {
	h := fnv.New64a()
	fmt.Fprint(h, offset)
	return time.Duration(h.Sum64() % uint64(5*time.Millisecond))
}

// BenchmarkKeyOrderedConcurrency measures Config.Concurrency on two shapes.
//
// Parallel Consumer's published example: 10,000 records on one partition, 1,000 keys, each
// record waiting 0-5 ms (uniform), concurrency 100. Its README gives 22.2 s in partition order
// and 2.06 s in key order. Here: the time from the first record in hand (the processor has joined
// the group, claimed the partition and fetched) to the last record's effects committed to
// Postgres, in partition order (Concurrency 1: each record prepared just before its Handle) and
// in key order (Concurrency 100), against the ideal, the total waiting divided by 100. The
// effect is a row per record (its key, offset and wait) written with COPY; the records are
// ledger events of 1,000 accounts, whose account is the key.
//
// An enrichment call of 20 ms per record, 8 partitions, 10,000 keys: records/s with Concurrency
// 100 against partition order, and against a hand-written loop with a pool of 800 workers (the
// same number of calls at once) that makes the call and writes each record in a transaction of
// its own, with no order and no guarantee.
//
// BENCH_CONC_EVENTS (default 40000) sets the enrichment run's size.
func BenchmarkKeyOrderedConcurrency(b *testing.B) {
	k := brokerFor(b)
	const pcEvents, pcKeys, pcConc = 10_000, 1_000, 100
	pcTopic := k.CreateTopic(b, 1)
	var pcRecs []*kgo.Record
	var totalWait time.Duration
	for i, it := range ledger.Generate(ledger.GenConfig{Events: pcEvents, Accounts: pcKeys, Seed: 3, Prefix: "pc"}) {
		pcRecs = append(pcRecs, it.Record(pcTopic))
		totalWait += uniformWait(int64(i))
	}
	k.Produce(b, pcRecs...)

	events := envInt("BENCH_CONC_EVENTS", 40_000)
	enrichTopic := k.CreateTopic(b, partitions)
	items := ledger.Generate(ledger.GenConfig{Events: events, Accounts: 10_000, Seed: 4, Prefix: "en"})
	recs := make([]*kgo.Record, len(items))
	for i, it := range items {
		recs[i] = it.Record(enrichTopic)
	}
	k.Produce(b, recs...)
	const call = 20 * time.Millisecond
	const conc = 100
	partitionOrderEvents := min(events, 4_000) // 400 records/s: 10 s

	for b.Loop() {
		ideal := totalWait / pcConc
		floor := sleepPool(pcEvents, pcConc)
		keyOrder := timeToApply(b, k, pcTopic, pcEvents, pcConc, func(r *processor.Record) time.Duration { return uniformWait(r.Offset) })
		partOrder := timeToApply(b, k, pcTopic, pcEvents, 1, func(r *processor.Record) time.Duration { return uniformWait(r.Offset) })
		fmt.Printf("\nParallel Consumer's example shape, %s broker: %d records on 1 partition, %d keys, 0-5 ms of waiting each (%v in all), concurrency %d;\n"+
			"first record in hand to last effect committed to Postgres:\n", k.Name, pcEvents, pcKeys, totalWait.Round(time.Millisecond), pcConc)
		fmt.Printf("  partition order (Concurrency 1)     %7.2f s   (Parallel Consumer: 22.2 s)\n", partOrder.Seconds())
		fmt.Printf("  key order (Concurrency %d)         %7.3f s   (Parallel Consumer: 2.06 s)\n", pcConc, keyOrder.Seconds())
		fmt.Printf("  ideal (waiting / %d)               %7.3f s\n", pcConc, ideal.Seconds())
		fmt.Printf("  floor here: %d goroutines sleeping the same waits, no Kafka, no Postgres  %.3f s (%.2f of the ideal: timers on this machine)\n",
			pcConc, floor.Seconds(), floor.Seconds()/ideal.Seconds())
		fmt.Printf("  key order / ideal = %.2f   (target <= 1.3, and under 2.06 s)\n", keyOrder.Seconds()/ideal.Seconds())
		b.ReportMetric(keyOrder.Seconds(), "pc_key_order_s")
		b.ReportMetric(partOrder.Seconds(), "pc_partition_order_s")
		b.ReportMetric(keyOrder.Seconds()/ideal.Seconds(), "x_ideal")

		fixed := func(*processor.Record) time.Duration { return call }
		concurrent := measure(b, "kafkapg concurrency", enrichTopic, events, func(pool *pgxpool.Pool) func(context.Context) error {
			return waitingProcessor(b, k, enrichTopic, pool, conc, fixed)
		})
		ordered := measure(b, "kafkapg partition order", enrichTopic, partitionOrderEvents, func(pool *pgxpool.Pool) func(context.Context) error {
			return waitingProcessor(b, k, enrichTopic, pool, 1, fixed)
		})
		pooled := measure(b, "worker pool", enrichTopic, events, func(pool *pgxpool.Pool) func(context.Context) error {
			return workerPool(k, enrichTopic, pool, events, partitions*conc, call)
		})
		fmt.Printf("\n%d ms enrichment call per record, %s broker, %d partitions, 10,000 keys:\n", call.Milliseconds(), k.Name, partitions)
		fmt.Printf("  kafkapg, Concurrency %d             %8.0f records/s   (%d events)\n", conc, concurrent, events)
		fmt.Printf("  kafkapg, partition order            %8.0f records/s   (%d events)\n", ordered, partitionOrderEvents)
		fmt.Printf("  hand-written pool of %d workers    %8.0f records/s   (no order, no guarantee; %d events)\n", partitions*conc, pooled, events)
		fmt.Printf("  concurrency / partition order = %.0f;   concurrency / worker pool = %.2f\n\n", concurrent/ordered, concurrent/pooled)
		b.ReportMetric(concurrent, "enrich_rec/s")
		b.ReportMetric(concurrent/ordered, "x_partition_order")
		b.ReportMetric(concurrent/pooled, "x_worker_pool")
	}
}

// sleepPool is the floor of the example shape on this machine: conc goroutines sleeping the
// waits of events records, nothing else.
func sleepPool(events, conc int) time.Duration {
	work := make(chan time.Duration, events)
	for i := range events {
		work <- uniformWait(int64(i))
	}
	close(work)
	start := time.Now()
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for d := range work {
				time.Sleep(d)
			}
		})
	}
	wg.Wait()
	return time.Since(start)
}

// waitingProcessor runs the processor with the ledger handler behind a Prepare that waits.
func waitingProcessor(b *testing.B, k *testenv.Kafka, topic string, pool *pgxpool.Pool, concurrency int, wait func(*processor.Record) time.Duration) func(context.Context) error {
	return waitingProcessorWith(b, k, topic, pool, &waiting{apply: ledger.Handler{}.HandleBatch, wait: wait}, concurrency)
}

func waitingProcessorWith(b *testing.B, k *testenv.Kafka, topic string, pool *pgxpool.Pool, h *waiting, concurrency int) func(context.Context) error {
	p, err := processor.New(pool, &processor.Config{
		Brokers:         k.Brokers,
		Group:           fmt.Sprintf("bench-%s-%d-%d", topic, concurrency, time.Now().UnixNano()),
		Topics:          []string{topic},
		Handler:         h,
		Concurrency:     concurrency,
		BatchMaxRecords: batchSize,
		Registerer:      prometheus.NewRegistry(),
		Logger:          slog.New(slog.DiscardHandler),
	})
	if err != nil {
		b.Fatal(err)
	}
	return p.Run
}

// timeToApply runs the processor over the first want records of topic (one partition) against
// a fresh database, and returns the time from its first Prepare to the stored position reaching
// want (read every millisecond).
func timeToApply(b *testing.B, k *testenv.Kafka, topic string, want, concurrency int, wait func(*processor.Record) time.Duration) time.Duration {
	b.Helper()
	_, url := testenv.Postgres(b)
	ctx := context.Background()
	pool := benchPool(b, url)
	defer pool.Close()
	if _, err := pool.Exec(ctx, createResults); err != nil {
		b.Fatal(err)
	}
	h := &waiting{apply: copyResults, wait: wait}
	run := waitingProcessorWith(b, k, topic, pool, h, concurrency)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- run(runCtx) }()
	var end time.Time
	for {
		var next int
		if err := pool.QueryRow(ctx, `SELECT coalesce(max(next_offset), 0) FROM kafkapg.offsets WHERE topic = $1`, topic).Scan(&next); err != nil {
			b.Fatal(err)
		}
		if next >= want {
			end = time.Now()
			break
		}
		select {
		case err := <-done:
			b.Fatalf("the processor stopped after %d of %d records: %v", next, want, err)
		case <-time.After(time.Millisecond):
		}
	}
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(DISTINCT "offset") FROM results`).Scan(&rows); err != nil || rows != want {
		b.Fatalf("results has %d offsets (%v), want %d", rows, err, want)
	}
	took := end.Sub(time.Unix(0, h.first.Load()))
	if concurrency > 1 {
		fmt.Printf("  (Concurrency %d: %.1f prepares at once on average)\n", concurrency, float64(h.busy.Load())/float64(took))
	}
	return took
}

// workerPool consumes topic from the start and hands each record to one of workers goroutines,
// which waits call (the enrichment) and applies it in a transaction of its own, counting it in
// its own bench_offsets row (so that the sum over rows is the records applied): no order, no
// offsets, no guarantee — the loop a team writes first.
func workerPool(k *testenv.Kafka, topic string, pool *pgxpool.Pool, want, workers int, call time.Duration) func(context.Context) error {
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
		work := make(chan *kgo.Record, workers)
		var wg sync.WaitGroup
		var mu sync.Mutex
		var firstErr error
		for w := range workers {
			wg.Go(func() {
				for r := range work {
					time.Sleep(call)
					ev, err := ledger.Parse(r.Value)
					if err == nil {
						err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
							b := &pgx.Batch{}
							b.Queue(ledger.InsertEntrySQL, ev.EventID, ev.Account, ev.Amount, ev.Seq, 1)
							b.Queue(ledger.AddBalanceSQL, ev.Account, ev.Amount, ev.Seq)
							b.Queue(`INSERT INTO bench_offsets VALUES ($1, $2, 1)
								ON CONFLICT (topic, partition) DO UPDATE SET next_offset = bench_offsets.next_offset + 1`, topic, w)
							return tx.SendBatch(ctx, b).Close()
						})
					}
					if err != nil && ctx.Err() == nil {
						mu.Lock()
						firstErr = err
						mu.Unlock()
					}
				}
			})
		}
		defer wg.Wait()
		defer close(work)
		handed := 0
		for handed < want {
			fetches := cl.PollFetches(ctx)
			if ctx.Err() != nil {
				return nil
			}
			if errs := fetches.Errors(); len(errs) > 0 {
				return errs[0].Err
			}
			for it := fetches.RecordIter(); !it.Done() && handed < want; handed++ {
				select {
				case work <- it.Next():
				case <-ctx.Done():
					return nil
				}
			}
			mu.Lock()
			err := firstErr
			mu.Unlock()
			if err != nil {
				return err
			}
		}
		<-ctx.Done()
		return nil
	}
}
