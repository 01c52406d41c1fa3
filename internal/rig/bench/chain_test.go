package bench

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/sink"
)

// BenchmarkChainDedupe is stage 2 of a chain of two kafkapg services: the postings stage 1
// (ledger.Forward, not measured) emitted through its outbox, numbered in streams, posted by
// ledger.Post into a table without a unique constraint. In interleaved rounds, it measures stage
// 2 deduplicating on the message id (the streams: a few numbers per stream), deduplicating by a
// key per record (KeyFromJSON("event_id"): what the postings of another producer would cost), and
// not deduplicating; then it runs the streams once more, half the postings and then the rest, and
// reports the deduplication state's size after each half: flat if it does not grow with the
// records. BENCH_CHAIN_EVENTS (default 300000) sets the postings, BENCH_ROUNDS (default 3) the
// rounds.
func BenchmarkChainDedupe(b *testing.B) {
	events := envInt("BENCH_CHAIN_EVENTS", 300_000)
	rounds := envInt("BENCH_ROUNDS", 3)
	k := brokerFor(b)
	src := "c_" + testenv.Name(b, 16)
	postings := src + ".postings"
	k.CreateTopicNamed(b, src, partitions)
	k.CreateTopicNamed(b, postings, partitions)
	items := ledger.Generate(ledger.GenConfig{Events: events, Accounts: 1000, Seed: 5, Prefix: "c"})
	recs := make([]*kgo.Record, len(items))
	for i, it := range items {
		recs[i] = it.Record(src)
	}
	k.Produce(b, recs...)
	stageOne(b, k, src, postings, events)

	for b.Loop() {
		var streams, perKey, off []float64
		for r := range rounds {
			order := []string{"streams", "key per record", "off"}
			if r%2 == 1 {
				order = []string{"off", "key per record", "streams"}
			}
			for _, v := range order {
				rate := measureTable(b, v, postings, events, "ledger_postings", func(pool *pgxpool.Pool) func(context.Context) error {
					return stageTwo(b, k, postings, pool, fmt.Sprintf("%s-%d-%s", postings, r, v[:3]), v)
				})
				switch v {
				case "streams":
					streams = append(streams, rate)
				case "off":
					off = append(off, rate)
				default:
					perKey = append(perKey, rate)
				}
			}
		}
		half, whole, keyState, halfAt := chainState(b, k, postings, events)
		mS, mK, mO := median(streams), median(perKey), median(off)
		b.ReportMetric(mS/mO, "x_streams_off")
		b.ReportMetric(mK/mO, "x_perkey_off")
		b.ReportMetric(float64(whole), "state_B_2x")
		b.Logf("chain stage 2 (ledger.Post), %s broker, %d postings over %d partitions from %d, median of %d rounds:", k.Name, events, partitions, partitions, rounds)
		b.Logf("  message ids, numbered (streams) %9.0f records/s   rounds %v", mS, rounded(streams))
		b.Logf("  a key per record                %9.0f records/s   rounds %v", mK, rounded(perKey))
		b.Logf("  off                             %9.0f records/s   rounds %v", mO, rounded(off))
		b.Logf("  streams / off = %.2f, key per record / off = %.2f   (target >= 0.85)", mS/mO, mK/mO)
		b.Logf("  deduplication state (streams): %d bytes after %d postings, %d bytes after %d (a key per record: %d bytes after %d)",
			half, halfAt, whole, events, keyState, events)
		summarize(chainKeysPath, mS/mO, "%.0f vs %.0f records/s; state %d bytes after %d postings, %d after %d (a key per record: %.2fx, %d bytes)",
			mS, mO, half, halfAt, whole, events, mK/mO, keyState)
	}
}

// stageOne runs stage 1 (ledger.Forward, keys on the event id) over the events of src until it
// has published a posting for each to postings, in a database of its own.
func stageOne(b *testing.B, k *testenv.Kafka, src, postings string, events int) {
	_, url := testenv.Postgres(b)
	pool := benchPool(b, url)
	defer pool.Close()
	p, err := processor.New(pool, &processor.Config{
		Brokers:            k.Brokers,
		Group:              "stage-one-" + src,
		Topics:             []string{src},
		Handler:            ledger.Forward{Topic: postings},
		TopicPolicies:      map[string]processor.TopicPolicy{src: {IdempotencyKey: ledger.StageOneKey}},
		BatchMaxRecords:    batchSize,
		OutboxPollInterval: 50 * time.Millisecond,
		Registerer:         prometheus.NewRegistry(),
		Logger:             slog.New(slog.DiscardHandler),
	})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	cl := k.Client(b)
	defer cl.Close()
	deadline := time.Now().Add(10 * time.Minute)
	for {
		ends, err := kadm.NewClient(cl).ListEndOffsets(ctx, postings)
		if err == nil {
			err = ends.Error()
		}
		if err != nil {
			b.Fatal(err)
		}
		n := int64(0)
		ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
		if n >= int64(events) {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("stage 1 published %d of %d postings", n, events)
		}
		time.Sleep(100 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
}

// stageTwo runs stage 2 (ledger.Post) on postings, deduplicating as variant says.
func stageTwo(b *testing.B, k *testenv.Kafka, postings string, pool *pgxpool.Pool, group, variant string) func(context.Context) error {
	if _, err := pool.Exec(context.Background(), ledger.ChainSchema); err != nil {
		b.Fatal(err)
	}
	cfg := &processor.Config{
		Brokers:         k.Brokers,
		Group:           group,
		Topics:          []string{postings},
		Handler:         ledger.Post{},
		BatchMaxRecords: batchSize,
		Registerer:      prometheus.NewRegistry(),
		Logger:          slog.New(slog.DiscardHandler),
	}
	switch variant {
	case "streams":
		cfg.TopicPolicies = map[string]processor.TopicPolicy{postings: {IdempotencyKey: processor.KeyFromHeader(sink.HeaderMessageID)}}
	case "key per record":
		cfg.TopicPolicies = map[string]processor.TopicPolicy{postings: {IdempotencyKey: processor.KeyFromJSON("event_id")}}
	}
	p, err := processor.New(pool, cfg)
	if err != nil {
		b.Fatal(err)
	}
	return p.Run
}

// chainState runs stage 2 with streams over the first half of postings, reads the size of its
// deduplication state (its streams and keys, indexes included), goes on over the rest,
// and reads it again. Then a key per record over all of them, for comparison.
func chainState(b *testing.B, k *testenv.Kafka, postings string, events int) (half, whole, perKey int64, halfAt int) {
	ctx := context.Background()
	size := func(pool *pgxpool.Pool) int64 {
		var n int64
		if err := pool.QueryRow(ctx, `SELECT pg_total_relation_size('kafkapg.idempotency_lineages') + `+
			overRing("pg_total_relation_size('kafkapg.%[1]s')")).Scan(&n); err != nil {
			b.Fatal(err)
		}
		return n
	}
	run := func(pool *pgxpool.Pool, group, variant string, want int) (consumed int) {
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- stageTwo(b, k, postings, pool, group, variant)(runCtx) }()
		waitCountFor(b, pool, `SELECT coalesce(sum(next_offset), 0) FROM kafkapg.offsets WHERE consumer_group = '`+group+`'`, want, 10*time.Minute)
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		if err := pool.QueryRow(ctx, `SELECT coalesce(sum(next_offset), 0) FROM kafkapg.offsets WHERE consumer_group = $1`, group).Scan(&consumed); err != nil {
			b.Fatal(err)
		}
		return consumed
	}
	_, url := testenv.Postgres(b)
	pool := benchPool(b, url)
	defer pool.Close()
	group := postings + "-state"
	halfAt = run(pool, group, "streams", events/2)
	half = size(pool)
	run(pool, group, "streams", events)
	whole = size(pool)

	_, url = testenv.Postgres(b)
	keyPool := benchPool(b, url)
	defer keyPool.Close()
	run(keyPool, postings+"-state-keys", "key per record", events)
	return half, whole, size(keyPool), halfAt
}
