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
		pool.Close()

		b.ReportMetric(queued, "queued_rec/s")
		b.ReportMetric(applied, "replayed_rec/s")
		b.ReportMetric(fast, "fast_rec/s")
		b.ReportMetric(applied/fast, "x_fast")
		fmt.Printf("\nbulk replay, %s broker, %d dead letters over %d accounts (%d partitions), processor running:\n", k.Name, events, accounts, partitions)
		fmt.Printf("  queued by the task (dlq replay returns)  %9.0f records/s\n", queued)
		fmt.Printf("  replayed and applied                     %9.0f records/s\n", applied)
		fmt.Printf("  same records from the topic              %9.0f records/s\n", fast)
		fmt.Printf("  replay / fast path = %.2f\n\n", applied/fast)
		summarize(replayPath, applied/fast, "%.0f vs %.0f records/s, %d dead letters (queued at %.0f/s)", applied, fast, events, queued)
	}
}
