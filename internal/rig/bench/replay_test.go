package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"
	"golang.org/x/sync/errgroup"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// BenchmarkReplay measures a bulk replay: every event of the topic failed its first delivery and
// was dead-lettered (no retry tiers); with the processor running, one task replays them all. It
// reports how fast the task queues them (the operator's command returns) and how fast they are
// then applied, against the fast path applying the same records straight from the topic, in the
// same run. BENCH_REPLAY_EVENTS (default 20000) sets the size.
func BenchmarkReplay(b *testing.B) {
	events := envInt("BENCH_REPLAY_EVENTS", 20_000)
	accounts := 64
	k := brokerFor(b)
	ctx := context.Background()

	dead := k.CreateTopic(b, partitions)
	plain := k.CreateTopic(b, partitions)
	var failing, same []*kgo.Record
	for _, it := range ledger.Generate(ledger.GenConfig{Events: events, Accounts: accounts, Seed: 3, Prefix: "r"}) {
		same = append(same, it.Record(plain))
		ev := it.Event
		ev.FailAttempts = 1 // fails at attempt 1: dead at once; the replay's attempt 2 succeeds
		v, _ := json.Marshal(ev)
		failing = append(failing, &kgo.Record{Topic: dead, Key: it.Key, Value: v})
	}
	k.Produce(b, failing...)
	k.Produce(b, same...)

	for b.Loop() {
		fast := measure(b, "fast path", plain, events, func(pool *pgxpool.Pool) func(context.Context) error {
			return drainProcessor(b, k, plain, pool, nil)
		})

		_, url := testenv.Postgres(b)
		pool := benchPool(b, url)
		group := "replay-" + dead
		p, err := processor.New(pool, &processor.Config{
			Brokers: k.Brokers, Group: group, Topics: []string{dead}, Handler: ledger.Handler{},
			BatchMaxRecords: batchSize, RetryTiers: []time.Duration{}, LocalAttempts: 1,
			BreakerDisabled: true, // every record fails at first: the breaker would rightly hold them in place
			Registerer:      prometheus.NewRegistry(), Logger: slog.New(slog.DiscardHandler),
		})
		if err != nil {
			b.Fatal(err)
		}
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- p.Run(runCtx) }()
		// Every record failing at once is the slow path's slowest case (about 1,000 records/s here):
		// a large BENCH_REPLAY_EVENTS needs longer than waitCount's 5 minutes to dead-letter them.
		waitCountFor(b, pool, `SELECT count(*) FROM kafkapg.dead_letters`, events, max(5*time.Minute, time.Duration(events)*2*time.Millisecond))

		o := ops.New(pool, "kafkapg", group)
		start := time.Now()
		task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, ops.Actor{Name: "bench", Reason: "bench"}, 0)
		if err != nil {
			b.Fatal(err)
		}
		if task, err = o.RunTask(ctx, task.ID, "bench", nil); err != nil || task.Done != int64(events) {
			b.Fatalf("replay task: %+v, %v", task, err)
		}
		queued := float64(events) / time.Since(start).Seconds()
		waitCount(b, pool, `SELECT count(*) FROM ledger_entries`, events)
		applied := float64(events) / time.Since(start).Seconds()
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		floor := replayFloor(b, pool, group)
		pool.Close()

		b.ReportMetric(queued, "queued_rec/s")
		b.ReportMetric(applied, "replayed_rec/s")
		b.ReportMetric(fast, "fast_rec/s")
		b.ReportMetric(applied/fast, "x_fast")
		fmt.Printf("\nbulk replay, %s broker, %d dead letters over %d accounts (%d partitions), processor running:\n", k.Name, events, accounts, partitions)
		fmt.Printf("  queued by the task (dlq replay returns)  %9.0f records/s\n", queued)
		fmt.Printf("  replayed and applied                     %9.0f records/s\n", applied)
		fmt.Printf("  same records from the topic              %9.0f records/s\n", fast)
		fmt.Printf("  replay / fast path = %.2f\n", applied/fast)
		fmt.Printf("  the audit's writes alone (no handler)    %9.0f records/s: a replay that kept the status and events could reach %.2f of the fast path at best\n\n", floor, floor/fast)
		b.ReportMetric(floor, "floor_rec/s")
		summarize(replayPath, applied/fast, "%.0f vs %.0f records/s, %d dead letters (queued at %.0f/s); its status and event writes alone: %.0f/s, %.2fx", applied, fast, events, queued, floor, floor/fast)
	}
}

// replayFloor measures the least a replay that keeps its audit must write, with nothing else
// running: copies of the group's dead letters (as dead letters of a group of their own) are
// replayed in chunks of 200 by four connections with only the statements that set each row
// replaying and then replayed and add its two events (both in one transaction), no held records,
// no handler, no Kafka.
// Whatever else a replay does comes on top, so the rate it returns (records/s) bounds the replay's.
func replayFloor(b *testing.B, pool *pgxpool.Pool, group string) float64 {
	ctx := context.Background()
	const chunk = 200
	floorGroup := "floor-" + group
	var lo, hi int64
	if err := pool.QueryRow(ctx, `WITH c AS (INSERT INTO kafkapg.dead_letters (consumer_group, topic, partition, "offset", key, value,
			header_keys, header_values, "timestamp", error_class, error_message, attempts, first_failed_at)
		SELECT $2, topic, partition, "offset", key, value, header_keys, header_values, "timestamp", error_class, error_message,
			attempts, first_failed_at FROM kafkapg.dead_letters WHERE consumer_group = $1 ORDER BY id RETURNING id)
		SELECT min(id), max(id) FROM c`, group, floorGroup).Scan(&lo, &hi); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.dead_letter_events (dead_letter_id, event)
		SELECT id, 'dead_lettered' FROM kafkapg.dead_letters WHERE consumer_group = $1`, floorGroup); err != nil {
		b.Fatal(err)
	}
	for _, q := range []string{`ANALYZE kafkapg.dead_letters, kafkapg.dead_letter_events`, `CHECKPOINT`} {
		if _, err := pool.Exec(ctx, q); err != nil {
			b.Fatal(err)
		}
	}
	step := func(tx pgx.Tx, from, to, event string, first int64) error {
		_, err := tx.Exec(ctx, `WITH q AS (UPDATE kafkapg.dead_letters SET status = $2, status_changed_at = now(), replays = replays + 1
				WHERE consumer_group = $1 AND id >= $4 AND id < $4 + $5 AND status || '' = $3 RETURNING id, attempts)
			INSERT INTO kafkapg.dead_letter_events (dead_letter_id, event, attempt) SELECT id, $6, attempts + 1 FROM q`,
			floorGroup, to, from, first, chunk, event)
		return err
	}
	var next atomic.Int64
	next.Store(lo)
	start := time.Now()
	var g errgroup.Group
	for range 4 {
		g.Go(func() error {
			for {
				first := next.Add(chunk) - chunk
				if first > hi {
					return nil
				}
				// Both steps in one transaction: a replay commits the queueing and the applying
				// apart, so this spares the floor a commit a replay pays.
				if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if err := step(tx, "new", "replaying", "replay_queued", first); err != nil {
						return err
					}
					return step(tx, "replaying", "replayed", "replayed", first)
				}); err != nil {
					return err
				}
			}
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	rate := float64(hi-lo+1) / time.Since(start).Seconds()
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.dead_letters WHERE consumer_group = $1 AND status <> 'replayed'`, floorGroup).Scan(&left); err != nil || left != 0 {
		b.Fatalf("the floor's dead letters: %d not replayed (%v)", left, err)
	}
	return rate
}
