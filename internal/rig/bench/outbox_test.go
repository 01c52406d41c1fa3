package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/sink"
)

// BenchmarkOutbox measures the outbox's commit-to-ack latency and throughput against the loop
// people write without one — commit, then produce — on the same orders, in the same run.
//
// Writers (BENCH_OUTBOX_WRITERS, default 8) run transactions that each insert an order and
// publish one ~100-byte event keyed by customer:
//
//   - outbox: sink.Outbox.Emit in the transaction (without NOTIFY), the writer waking the relay
//     in its process after the commit: what a processor does for Record.Emit;
//   - outbox+NOTIFY: sink.Outbox.Emit with NOTIFY, the relay LISTENing: an application's outbox
//     published by a relay in another process (RELAY_ONLY). Postgres serializes the commits of
//     notifying transactions, which this variant shows;
//   - loop: commit, then an asynchronous Produce on a franz-go client (idempotent, the default)
//     with no linger: the relay's ProduceSync does not linger either, and franz-go's default 10ms
//     linger would add about 5ms to the loop's p50 — a setting, not a difference of design.
//
// A record's latency runs from the moment its writer's Commit returned to the moment the writer
// could know Kafka has it: the Produce callback for the loop, the relay's Published callback for
// the outbox (after the relay's own commit, which is part of its cost). Each variant runs twice,
// each time on a fresh database and topic: at a steady BENCH_OUTBOX_RATE (default 5000) records/s
// for BENCH_OUTBOX_SECONDS (default 10) for p50 and p99, and unthrottled for half as long for the
// records Kafka acknowledged per second.
func BenchmarkOutbox(b *testing.B) {
	seconds := envInt("BENCH_OUTBOX_SECONDS", 10)
	rate := envInt("BENCH_OUTBOX_RATE", 5_000)
	writers := envInt("BENCH_OUTBOX_WRITERS", 8)
	steady := time.Duration(seconds) * time.Second
	unthrottled := max(steady/2, time.Second)
	k := brokerFor(b)

	for b.Loop() {
		// Phases alternate between the variants, so that a slow spell of the shared machine
		// does not fall on one variant's phase only.
		var res [3][2]phaseResult // [variant][steady, unthrottled]
		for ph, spec := range []phaseSpec{{rate: rate, d: steady}, {d: unthrottled}} {
			for v := range variants {
				res[v][ph] = runPhase(b, k, variant(v), writers, spec)
			}
		}
		n, w, l := res[outboxNotify], res[outboxWake], res[loop]
		b.ReportMetric(ms(w[0].p50), "outbox_p50_ms")
		b.ReportMetric(ms(w[0].p99), "outbox_p99_ms")
		b.ReportMetric(ms(n[0].p50), "notify_p50_ms")
		b.ReportMetric(ms(n[0].p99), "notify_p99_ms")
		b.ReportMetric(ms(l[0].p50), "loop_p50_ms")
		b.ReportMetric(ms(l[0].p99), "loop_p99_ms")
		b.ReportMetric(w[1].acksPerSec, "outbox_max_rec/s")
		b.ReportMetric(n[1].acksPerSec, "notify_max_rec/s")
		b.ReportMetric(l[1].acksPerSec, "loop_max_rec/s")
		b.ReportMetric(w[1].acksPerSec/l[1].acksPerSec, "x_loop_max_rate")

		b.Logf("outbox vs produce-after-commit (loop), %s broker, %d partitions, %d writers, one order row and one event per transaction:",
			k.Name, partitions, writers)
		for v := range variants {
			s, u := res[v][0], res[v][1]
			name := variants[v]
			b.Logf("  %s at %d/s for %v: commit-to-ack p50 %6.2f ms  p99 %6.2f ms  (%d records, committed at %.0f/s%s)",
				name, rate, steady, ms(s.p50), ms(s.p99), s.records, s.commitsPerSec, s.keptUp(rate))
			b.Logf("  %s where it goes (median of each step): commit→produce %.2f ms, produce→Kafka ack %.2f ms, Kafka ack→acknowledged %.2f ms",
				name, ms(s.toProduce), ms(s.toKafka), ms(s.toAck))
			b.Logf("  %s unthrottled for %v: %6.0f acks/s (%.0f commits/s; the last ack %v after the last commit; WAL %.0f bytes/record)",
				name, unthrottled, u.acksPerSec, u.commitsPerSec, u.drain.Round(time.Millisecond), u.walPerRecord)
		}
		b.Logf("  highest rate: outbox / loop = %.2f, outbox with NOTIFY / loop = %.2f", w[1].acksPerSec/l[1].acksPerSec, n[1].acksPerSec/l[1].acksPerSec)
		summarize(outboxPath, w[1].acksPerSec/l[1].acksPerSec, "%.0f vs %.0f acks/s unthrottled, WAL %.0f vs %.0f bytes/record; p99 at %d/s %.1f vs %.1f ms",
			w[1].acksPerSec, l[1].acksPerSec, w[1].walPerRecord, l[1].walPerRecord, rate, ms(w[0].p99), ms(l[0].p99))
	}
}

// variant is a way to get an order's event to Kafka.
type variant int

const (
	outboxWake   variant = iota // Outbox.Emit without NOTIFY; the writer wakes the relay after its commit (Record.Emit's way)
	outboxNotify                // Outbox.Emit with NOTIFY; the relay LISTENs (an application's outbox)
	loop                        // commit, then produce
)

var variants = [...]string{"outbox       ", "outbox+NOTIFY", "loop         "}

// phaseSpec is one phase: writers run for d, at rate records/s in total, or as fast as they can
// when rate is 0.
type phaseSpec struct {
	rate int
	d    time.Duration
}

type phaseResult struct {
	records                   int
	p50, p99                  time.Duration
	toProduce, toKafka        time.Duration
	toAck                     time.Duration
	commitsPerSec, acksPerSec float64
	drain                     time.Duration
	walPerRecord              float64 // bytes of WAL the cluster wrote per record (the other databases are idle)
}

// walLSN returns the cluster's current WAL position, in bytes.
func walLSN(b *testing.B, pool *pgxpool.Pool) int64 {
	var lsn int64
	if err := pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn() - '0/0'::pg_lsn`).Scan(&lsn); err != nil {
		b.Fatal(err)
	}
	return lsn
}

// keptUp says whether the writers kept to the rate they were given.
func (r phaseResult) keptUp(rate int) string {
	if r.commitsPerSec < 0.95*float64(rate) {
		return fmt.Sprintf(": the writers could NOT keep up with %d/s", rate)
	}
	return ""
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// runPhase runs one phase of one variant on a fresh database and topic, and tears everything down
// before it returns.
func runPhase(b *testing.B, k *testenv.Kafka, v variant, writers int, spec phaseSpec) phaseResult {
	b.Helper()
	ctx := context.Background()
	_, url := testenv.Postgres(b)
	pool := ordersPool(b, url, writers+2)
	defer pool.Close()
	topic := k.CreateTopic(b, partitions)
	tr := &tracker{base: time.Now()}

	var write func(ctx context.Context, i int) error
	if v != loop {
		cl := newProducer(b, k, kgo.WithHooks(tr), kgo.RecordPartitioner(sink.Partitioner()))
		defer cl.Close()
		o, err := sink.NewOutbox(sink.OutboxConfig{Schema: "kafkapg", Group: "bench", NoNotify: v == outboxWake})
		if err != nil {
			b.Fatal(err)
		}
		relay := sink.NewRelay(pool, cl, sink.RelayConfig{
			Schema: "kafkapg", Group: "bench", Listen: pool.Config().ConnConfig.Copy(),
			Logger:    slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
			Published: func(m sink.Message, _ time.Duration) { tr.stamp(messageID(m.Headers), acked) },
		})
		relayCtx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- relay.Run(relayCtx) }()
		defer func() {
			stop()
			if err := <-done; err != nil {
				b.Errorf("relay: %v", err)
			}
		}()
		waitListening(b, pool)
		write = func(ctx context.Context, i int) error {
			id, key, value := order(i)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, insertOrderSQL, id, int64(i%10_000)); err != nil {
					return err
				}
				return o.Emit(ctx, tx, sink.Event{Topic: topic, Key: key, Value: value, ID: id})
			})
			if err == nil {
				tr.stamp(id, committed)
				if v == outboxWake {
					relay.Notify()
				}
			}
			return err
		}
	} else {
		cl := newProducer(b, k, kgo.WithHooks(tr), kgo.ProducerLinger(0))
		defer cl.Close()
		write = func(ctx context.Context, i int) error {
			id, key, value := order(i)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, insertOrderSQL, id, int64(i%10_000))
				return err
			})
			if err != nil {
				return err
			}
			tr.stamp(id, committed)
			rec := &kgo.Record{Topic: topic, Key: key, Value: value, Headers: []kgo.RecordHeader{{Key: sink.HeaderMessageID, Value: []byte(id)}}}
			cl.Produce(ctx, rec, func(_ *kgo.Record, err error) {
				if err != nil {
					tr.fail(fmt.Errorf("produce %s: %w", id, err))
					return
				}
				tr.stamp(id, acked)
			})
			return nil
		}
	}

	// Warm up (metadata, producer id, connections), then start from zero.
	const warmup = 200
	for i := range warmup {
		if err := write(ctx, -1-i); err != nil {
			b.Fatalf("warm up: %v", err)
		}
	}
	tr.waitAcks(b, warmup)
	tr.reset()

	walStart := walLSN(b, pool)
	start := time.Now()
	var next atomic.Int64
	total := int64(spec.rate) * int64(spec.d/time.Second)
	deadline := start.Add(spec.d)
	var interval time.Duration
	if spec.rate > 0 {
		interval = time.Second / time.Duration(spec.rate)
	}
	var wg sync.WaitGroup
	for range writers {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if spec.rate > 0 {
					if i >= total {
						return
					}
					// A shared schedule: record i is due at start + i·interval. A writer that is
					// late does not sleep, so the writers catch up if they can.
					time.Sleep(time.Until(start.Add(time.Duration(i) * interval)))
				} else if time.Now().After(deadline) {
					return
				}
				if err := write(ctx, int(i)); err != nil {
					tr.fail(fmt.Errorf("write order %d: %w", i, err))
					return
				}
			}
		})
	}
	var atDeadline, committedAtDeadline int64
	if spec.rate == 0 {
		time.Sleep(time.Until(deadline))
		atDeadline, committedAtDeadline = tr.acks.Load(), tr.commits.Load()
	}
	wg.Wait()
	written := time.Since(start)
	n := int(tr.commits.Load())
	lastCommit := time.Now()
	tr.waitAcks(b, n)
	drain := time.Since(lastCommit)

	r := tr.result()
	r.drain = drain
	r.walPerRecord = float64(walLSN(b, pool)-walStart) / float64(max(n, 1))
	if spec.rate > 0 {
		r.commitsPerSec = float64(n) / written.Seconds()
	} else {
		r.commitsPerSec = float64(committedAtDeadline) / spec.d.Seconds()
		r.acksPerSec = float64(atDeadline) / spec.d.Seconds()
	}
	return r
}

const insertOrderSQL = `INSERT INTO orders (id, amount) VALUES ($1, $2)`

// order returns order i's id, its event's key (the customer) and value (about 100 bytes of JSON).
// Negative orders are the warm-up's.
func order(i int) (id string, key, value []byte) {
	id = fmt.Sprintf("order-%07d", i)
	if i < 0 {
		id = fmt.Sprintf("warmup-%d", -i)
	}
	c := (i%1000 + 1000) % 1000
	key = fmt.Appendf(nil, "customer-%03d", c)
	value = fmt.Appendf(nil, `{"event_id":%q,"type":"order_placed","customer":"customer-%03d","amount":%d,"currency":"EUR"}`, id, c, i%10_000)
	return id, key, value
}

// ordersPool connects to a fresh database with conns connections, creates kafkapg's tables and
// the orders table.
func ordersPool(b *testing.B, url string, conns int) *pgxpool.Pool {
	b.Helper()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = int32(conns)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		pool.Close()
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		pool.Close()
		b.Fatal(err)
	}
	return pool
}

// newProducer returns a producer with franz-go's defaults, closed by the caller.
func newProducer(b *testing.B, k *testenv.Kafka, opts ...kgo.Opt) *kgo.Client {
	b.Helper()
	cl, err := kgo.NewClient(slices.Concat([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, k.ClientOpts, opts)...)
	if err != nil {
		b.Fatal(err)
	}
	return cl
}

// waitListening waits until the relay's LISTEN connection is up, so that the first commits wake
// it rather than its poll.
func waitListening(b *testing.B, pool *pgxpool.Pool) {
	b.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND query LIKE 'LISTEN %'`).Scan(&n); err != nil {
			b.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			b.Fatal("the relay is not LISTENing after 30s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func messageID(hs []kgo.RecordHeader) string {
	for _, h := range hs {
		if h.Key == sink.HeaderMessageID {
			return string(h.Value)
		}
	}
	return ""
}

// step is a point a record passes on its way from its writer's commit to the writer knowing
// Kafka has it.
type step int

const (
	committed  step = iota // its writer's Commit returned
	produced               // Produce was called with it (by the relay, or the loop)
	kafkaAcked             // Kafka acknowledged it to the producing client
	acked                  // the writer's side learnt it: the Produce callback, or Published
)

// trace holds when a record passed each step, in nanoseconds since the tracker's base.
type trace [acked + 1]atomic.Int64

// tracker follows every record of a phase by its message id. It is the producing clients' hook.
type tracker struct {
	base    time.Time
	traces  sync.Map // message id → *trace
	commits atomic.Int64
	acks    atomic.Int64
	mu      sync.Mutex
	err     error
}

var (
	_ kgo.HookProduceRecordBuffered   = (*tracker)(nil)
	_ kgo.HookProduceRecordUnbuffered = (*tracker)(nil)
)

// stamp records that id passed s now.
func (t *tracker) stamp(id string, s step) {
	now := int64(time.Since(t.base))
	v, ok := t.traces.Load(id)
	if !ok {
		v, _ = t.traces.LoadOrStore(id, new(trace))
	}
	v.(*trace)[s].Store(now)
	switch s {
	case committed:
		t.commits.Add(1)
	case acked:
		t.acks.Add(1)
	}
}

func (t *tracker) OnProduceRecordBuffered(r *kgo.Record) {
	t.stamp(messageID(r.Headers), produced)
}

func (t *tracker) OnProduceRecordUnbuffered(r *kgo.Record, err error) {
	if err == nil {
		t.stamp(messageID(r.Headers), kafkaAcked)
	}
}

func (t *tracker) fail(err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.err = errors.Join(t.err, err)
}

func (t *tracker) failed() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.err
}

// waitAcks waits until n records are acknowledged.
func (t *tracker) waitAcks(b *testing.B, n int) {
	b.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for t.acks.Load() < int64(n) {
		if err := t.failed(); err != nil {
			b.Fatal(err)
		}
		if time.Now().After(deadline) {
			b.Fatalf("%d of %d records acknowledged after 2 minutes", t.acks.Load(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := t.failed(); err != nil {
		b.Fatal(err)
	}
}

// reset forgets every record; nothing may be in flight.
func (t *tracker) reset() {
	t.traces.Clear()
	t.commits.Store(0)
	t.acks.Store(0)
}

// result computes the latencies of the records traced: commit to ack, and the median of each
// step in between.
func (t *tracker) result() phaseResult {
	var total, toProduce, toKafka, toAck []time.Duration
	t.traces.Range(func(_, v any) bool {
		tr := v.(*trace)
		c, p, k, a := tr[committed].Load(), tr[produced].Load(), tr[kafkaAcked].Load(), tr[acked].Load()
		total = append(total, time.Duration(a-c))
		toProduce = append(toProduce, time.Duration(p-c))
		toKafka = append(toKafka, time.Duration(k-p))
		toAck = append(toAck, time.Duration(a-k))
		return true
	})
	return phaseResult{
		records:   len(total),
		p50:       percentile(total, 50),
		p99:       percentile(total, 99),
		toProduce: percentile(toProduce, 50),
		toKafka:   percentile(toKafka, 50),
		toAck:     percentile(toAck, 50),
	}
}

func percentile(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[min(len(ds)*p/100, len(ds)-1)]
}

// BenchmarkIdempotencyKeys applies the same ledger events through the processor with the ledger
// handler, with idempotency keys (TopicPolicy.IdempotencyKey = KeyFromJSON("event_id")) and
// without, in interleaved rounds, and reports the medians. Every event is distinct: the figure is
// the cost of recording and checking the keys, not of skipping copies. BENCH_DEDUP_EVENTS
// (default 200000) sets the size, BENCH_ROUNDS (default 3) the rounds.
func BenchmarkIdempotencyKeys(b *testing.B) {
	events := envInt("BENCH_DEDUP_EVENTS", 200_000)
	rounds := envInt("BENCH_ROUNDS", 3)
	k := brokerFor(b)
	// Every key row holds the group and topic names: names of a production length (not the long
	// ones CreateTopic makes) keep the figure representative.
	topic := "t_" + testenv.Name(b, 16)
	k.CreateTopicNamed(b, topic, partitions)
	items := ledger.Generate(ledger.GenConfig{Events: events, Accounts: 1000, Seed: 4, Prefix: "k"})
	recs := make([]*kgo.Record, len(items))
	for i, it := range items {
		recs[i] = it.Record(topic)
	}
	k.Produce(b, recs...)

	for b.Loop() {
		var on, off, onWAL, offWAL, state, compacted []float64
		for r := range rounds {
			run := func(keys bool) {
				name := map[bool]string{true: "keys on", false: "keys off"}[keys]
				var wal int64
				var stateBytes [2]int64
				rate := measure(b, name, topic, events, func(pool *pgxpool.Pool) func(context.Context) error {
					return keyedProcessor(b, k, topic, pool, fmt.Sprintf("%s-%d-%t", topic, r, keys), keys, events, &wal, &stateBytes)
				})
				perEvent := float64(wal) / float64(events)
				if keys {
					on, onWAL = append(on, rate), append(onWAL, perEvent)
					state = append(state, float64(stateBytes[0])/float64(events))
					compacted = append(compacted, float64(stateBytes[1])/float64(events))
				} else {
					off, offWAL = append(off, rate), append(offWAL, perEvent)
				}
			}
			// Alternate which goes first, so that neither always runs on a warmer machine.
			if r%2 == 0 {
				run(false)
				run(true)
			} else {
				run(true)
				run(false)
			}
		}
		mOn, mOff := median(on), median(off)
		b.ReportMetric(mOn, "keys_on_rec/s")
		b.ReportMetric(mOff, "keys_off_rec/s")
		b.ReportMetric(mOn/mOff, "x_keys_off")
		b.Logf("idempotency keys, ledger handler, %s broker, %d events over %d partitions, median of %d rounds:", k.Name, events, partitions, rounds)
		b.Logf("  keys on  (KeyFromJSON(\"event_id\"))  %9.0f records/s   rounds %v   WAL %4.0f bytes/event", mOn, rounded(on), median(onWAL))
		b.Logf("  keys off                            %9.0f records/s   rounds %v   WAL %4.0f bytes/event", mOff, rounded(off), median(offWAL))
		b.Logf("  on / off = %.2f   (target >= 0.85)", mOn/mOff)
		before := legacyKeyBytes(b, topic, events)
		// Over a retention, the ring holds a current generation (up to a third of the retention's
		// keys, filling) and three compacted ones: at its fullest, per key kept for the retention,
		// (current + 3 x compacted) / 3.
		cur, comp := median(state), median(compacted)
		peak := (cur + 3*comp) / 3
		b.Logf("  deduplication state, per key: %.0f bytes in the current generation, %.1f compacted; at the ring's fullest %.0f per key of a retention; the layout before migration 8: %.0f (%.2fx)",
			cur, comp, peak, before, peak/before)
		b.Logf("  the tables after %d records: %.1f MB (current generation), %.1f MB compacted; the layout before: %.1f MB",
			events, cur*float64(events)/1e6, comp*float64(events)/1e6, before*float64(events)/1e6)
		b.ReportMetric(cur, "state_B/rec")
		b.ReportMetric(comp, "compacted_B/rec")
		b.ReportMetric(before, "state_before_B/rec")
		summarize(keysPath, mOn/mOff, "%.0f vs %.0f records/s, WAL %.0f vs %.0f bytes/event; state %.0f bytes/key (%.0f current, %.1f compacted; %.0f before migration 8: %.2fx)",
			mOn, mOff, median(onWAL), median(offWAL), peak, cur, comp, before, peak/before)
	}
}

// keyedProcessor runs the processor with the ledger handler, as kafkapg does, with or without
// idempotency keys on topic, and sets wal to the WAL the cluster wrote while it ran (the other
// databases of the run are idle). With keys, once stopped, it checks that every event's key was
// recorded: the figure is for the work it claims, and sets state to the size of the deduplication
// state it left (the database is the run's own).
func keyedProcessor(b *testing.B, k *testenv.Kafka, topic string, pool *pgxpool.Pool, group string, keys bool, events int, wal *int64, state *[2]int64) func(context.Context) error {
	cfg := &processor.Config{
		Brokers:         k.Brokers,
		Group:           group,
		Topics:          []string{topic},
		Handler:         ledger.Handler{},
		BatchMaxRecords: batchSize,
		Registerer:      prometheus.NewRegistry(),
		Logger:          slog.New(slog.DiscardHandler),
	}
	if keys {
		cfg.TopicPolicies = map[string]processor.TopicPolicy{topic: {IdempotencyKey: processor.KeyFromJSON("event_id")}}
	}
	p, err := processor.New(pool, cfg)
	if err != nil {
		b.Fatal(err)
	}
	return func(ctx context.Context) error {
		var start string
		if err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&start); err != nil {
			return err
		}
		if err := p.Run(ctx); err != nil {
			return err
		}
		if err := pool.QueryRow(context.Background(), `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::int8`, start).Scan(wal); err != nil {
			return err
		}
		if !keys {
			return nil
		}
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT `+overRing("(SELECT count(*) FROM kafkapg.%[1]s)")).Scan(&n); err != nil {
			return err
		}
		if n < events {
			return fmt.Errorf("%d idempotency keys recorded for %d events applied", n, events)
		}
		bg := context.Background() // ctx ended: it stopped the processor
		if err := pool.QueryRow(bg, `SELECT `+overRing("pg_total_relation_size('kafkapg.%[1]s')")).Scan(&state[0]); err != nil {
			return err
		}
		// Then the generation is made old (the ring turned) and compacted, as it would be after
		// a third of the retention.
		ring := keyring.New("kafkapg")
		if _, err := pool.Exec(bg, `UPDATE kafkapg.idempotency_ring SET rotated_at = now() - interval '1000 days'`); err != nil {
			return err
		}
		if t, err := ring.Keep(bg, pool, group, 7*24*time.Hour, time.Minute); err != nil || !t.Rotated {
			return fmt.Errorf("turn the ring: %+v, %v", t, err)
		}
		if n, err := ring.Compact(bg, pool, time.Minute); err != nil || n != 1 {
			return fmt.Errorf("compact: %d generations, %v", n, err)
		}
		return pool.QueryRow(bg, `SELECT `+overRing("pg_total_relation_size('kafkapg.%[1]s')")+` + `+
			strings.ReplaceAll(overRing("pg_total_relation_size('kafkapg.%[1]s')"), "idempotency_keys_", "idempotency_runs_")).Scan(&state[1])
	}
}

// legacyKeyBytes is what n keys took in the layout before migration 8 (idempotency_keys: the
// 32-byte hash, group, topic, partition, offset and time, and its two indexes), measured by
// inserting n such rows, in random hash order as records' keys come, into a database of its own.
func legacyKeyBytes(b *testing.B, topic string, n int) float64 {
	_, url := testenv.Postgres(b)
	pool := benchPool(b, url)
	defer pool.Close()
	var size int64
	if err := pool.QueryRow(context.Background(), `WITH k AS (INSERT INTO kafkapg.idempotency_keys (key_hash, consumer_group, topic, partition, "offset", applied_at)
			SELECT sha256(('key-' || i)::bytea), $1, $2, i % 8, i, clock_timestamp() FROM generate_series(1, $3) AS i RETURNING 1)
		SELECT count(*) FROM k`, topic+"-0-true", topic, n).Scan(new(int)); err != nil {
		b.Fatal(err)
	}
	if err := pool.QueryRow(context.Background(), `SELECT pg_total_relation_size('kafkapg.idempotency_keys')`).Scan(&size); err != nil {
		b.Fatal(err)
	}
	return float64(size) / float64(n)
}

// overRing sums term, a SQL expression with %[1]s for a table, over the tables of the
// idempotency key ring.
func overRing(term string) string {
	terms := make([]string, 4)
	for g := range terms {
		terms[g] = fmt.Sprintf(term, fmt.Sprintf("idempotency_keys_%d", g))
	}
	return strings.Join(terms, " + ")
}
