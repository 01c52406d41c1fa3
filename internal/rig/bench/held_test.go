package bench

import (
	"context"
	"encoding/json"
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

// BenchmarkHeldRecords measures how fast held records are applied once
// their keys are released, against the fast path applying the same records straight from the
// topic, in the same run.
//
// Every account's first event is poison and ON_DEAD_LETTER=block, so all its later events are
// held in Postgres; the drain is timed from releasing every key to the last event applied.
// BENCH_DRAIN_EVENTS (default 100000) and BENCH_DRAIN_ACCOUNTS (default 64) set the size.
func BenchmarkHeldRecords(b *testing.B) {
	events := envInt("BENCH_DRAIN_EVENTS", 100_000)
	accounts := envInt("BENCH_DRAIN_ACCOUNTS", 64)
	k := brokerFor(b)
	ctx := context.Background()

	// Produce order: one poison head per account, then the events.
	var heads, body, same []*kgo.Record
	blocked := k.CreateTopic(b, partitions)
	plain := k.CreateTopic(b, partitions)
	for a := range accounts {
		ev := ledger.Event{EventID: fmt.Sprintf("h-%d", a), Account: fmt.Sprintf("acct-%d", a), Seq: 0, Poison: true}
		v, _ := json.Marshal(ev)
		heads = append(heads, &kgo.Record{Topic: blocked, Key: []byte(ev.Account), Value: v})
	}
	for _, it := range ledger.Generate(ledger.GenConfig{Events: events, Accounts: accounts, Seed: 2, Prefix: "d"}) {
		body = append(body, it.Record(blocked))
		same = append(same, it.Record(plain))
	}
	k.Produce(b, heads...)
	k.Produce(b, body...)
	k.Produce(b, same...)

	for b.Loop() {
		fast := measure(b, "fast path", plain, events, func(pool *pgxpool.Pool) func(context.Context) error {
			return drainProcessor(b, k, plain, pool, nil)
		})

		_, url := testenv.Postgres(b)
		pool := benchPool(b, url)
		released := make(chan struct{})
		run := drainProcessor(b, k, blocked, pool, released)
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- run(runCtx) }()
		waitCount(b, pool, `SELECT count(*) FROM kafkapg.held_records`, events)
		start := time.Now()
		close(released)
		// Done when nothing is held any more (a probe that stops at the first held record;
		// counting the ledger every 20 ms would cost Postgres more than the fast path's
		// measurement pays), then checked once.
		waitCount(b, pool, `SELECT (NOT EXISTS (SELECT 1 FROM kafkapg.held_records))::int`, 1)
		drain := float64(events) / time.Since(start).Seconds()
		waitCount(b, pool, `SELECT count(*) FROM ledger_entries`, events)
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		pool.Close()

		b.ReportMetric(drain, "held_rec/s")
		b.ReportMetric(fast, "fast_rec/s")
		b.ReportMetric(drain/fast, "x_fast")
		fmt.Printf("\nheld records drain, %s broker, %d events over %d accounts (%d partitions):\n", k.Name, events, accounts, partitions)
		fmt.Printf("  held records applied after release  %9.0f records/s\n", drain)
		fmt.Printf("  same records from the topic           %9.0f records/s\n", fast)
		fmt.Printf("  held / fast path = %.2f\n\n", drain/fast)
		summarize(heldPath, drain/fast, "%.0f vs %.0f records/s, %d records of %d keys", drain, fast, events, accounts)
	}
}

// drainProcessor runs the processor with ON_DEAD_LETTER=block; once released is closed, it
// releases every blocked key.
func drainProcessor(b *testing.B, k *testenv.Kafka, topic string, pool *pgxpool.Pool, released <-chan struct{}) func(context.Context) error {
	group := "held-" + topic
	p, err := processor.New(pool, &processor.Config{
		Brokers:         k.Brokers,
		Group:           group,
		Topics:          []string{topic},
		Handler:         ledger.Handler{},
		BatchMaxRecords: batchSize,
		RetryTiers:      []time.Duration{},
		OnDeadLetter:    processor.OnDeadLetterBlock,
		Registerer:      prometheus.NewRegistry(),
		Logger:          slog.New(slog.DiscardHandler),
	})
	if err != nil {
		b.Fatal(err)
	}
	return func(ctx context.Context) error {
		if released != nil {
			go func() {
				select {
				case <-released:
				case <-ctx.Done():
					return
				}
				for part := range int32(partitions) {
					if _, err := processor.ReleaseBlockedKeys(ctx, pool, "kafkapg", group, topic, part, nil); err != nil {
						b.Error(err)
					}
				}
			}()
		}
		return p.Run(ctx)
	}
}

// benchPool connects to a fresh database with poolConns connections and creates kafkapg's
// tables, the ledger's and the hand-written loops' bench_offsets.
func benchPool(b *testing.B, url string, opts ...func(*pgxpool.Config)) *pgxpool.Pool {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = poolConns
	for _, o := range opts {
		o(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, ledger.Schema+`;
		CREATE TABLE bench_offsets (topic text, partition int, next_offset bigint, PRIMARY KEY (topic, partition))`); err != nil {
		b.Fatal(err)
	}
	return pool
}

func waitCount(b *testing.B, pool *pgxpool.Pool, query string, want int) {
	waitCountFor(b, pool, query, want, 5*time.Minute)
}

// waitCountFor is waitCount with a deadline of its own.
func waitCountFor(b *testing.B, pool *pgxpool.Pool, query string, want int, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for {
		var n int
		if err := pool.QueryRow(context.Background(), query).Scan(&n); err != nil {
			b.Fatal(err)
		}
		if n >= want {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%s: %d, want %d, after %v", query, n, want, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
