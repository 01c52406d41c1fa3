package sink_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/sink"
)

// outboxSetup returns a migrated database, a kfake broker with a topic of one partition, and the
// outbox of group "g".
func outboxSetup(t *testing.T) (*pgxpool.Pool, *testenv.Kafka, string, *sink.Outbox) {
	t.Helper()
	pool := testenv.Migrated(t)
	k := testenv.NewKfake(t)
	return pool, k, k.CreateTopic(t, 1), newOutbox(t, "g")
}

// emit commits one transaction that emits events.
func emit(t *testing.T, pool *pgxpool.Pool, out *sink.Outbox, events ...sink.Event) {
	t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return out.Emit(ctx, tx, events...) }); err != nil {
		t.Fatal(err)
	}
}

func newOutbox(t *testing.T, group string) *sink.Outbox {
	t.Helper()
	o, err := sink.NewOutbox(sink.OutboxConfig{Schema: "kafkapg", Group: group})
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// TestOutboxKeepsCommitOrderPerKey is the order argument of sink/doc.go under load: writers whose
// transactions interleave emit to a few keys, three relays publish at once in small batches, and
// every key's records reach Kafka in the order their transactions committed.
//
// The commit order is witnessed in the database: each transaction's last statement, after its
// emits, increments one shared row and stores the number, so the row's lock is taken in commit
// order. A record inserted under a sequence but without the writers' key lock would be
// published in id order, which differs from commit order whenever a transaction that took its id
// later commits first; a relay that did not hold its lanes would publish a key's records out of
// order whenever two relays share them.
func TestOutboxKeepsCommitOrderPerKey(t *testing.T) {
	t.Parallel()
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		pool := testenv.Migrated(t)
		ctx := context.Background()
		if _, err := pool.Exec(ctx, `CREATE TABLE witness (n bigint NOT NULL); INSERT INTO witness VALUES (0);
			CREATE TABLE committed (id text PRIMARY KEY, n bigint NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		topic := k.CreateTopic(t, 4)
		out := newOutbox(t, "g")

		const writers, txs = 6, 40
		keys := []string{"a", "b", "c", "d", "e"}
		var wg sync.WaitGroup
		errs := make(chan error, writers)
		for w := range writers {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(w), 7))
				for i := range txs {
					if err := emitOne(ctx, pool, out, topic, w, i, rng, keys); err != nil {
						errs <- fmt.Errorf("writer %d tx %d: %w", w, i, err)
						return
					}
				}
			})
		}

		relayCtx, stop := context.WithCancel(ctx)
		var relays sync.WaitGroup
		for range 3 {
			r := sink.NewRelay(pool, k.Client(t, kgo.RecordPartitioner(sink.Partitioner())), sink.RelayConfig{
				Schema: "kafkapg", Group: "g", BatchSize: 3, Interval: 5 * time.Millisecond})
			relays.Go(func() { r.Run(relayCtx) })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		testenv.Eventually(t, 30*time.Second, func() error {
			var left int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.outbox`).Scan(&left); err != nil {
				return err
			}
			if left > 0 {
				return fmt.Errorf("%d rows not published", left)
			}
			return nil
		})
		stop()
		relays.Wait()

		order := map[string]int64{} // record id -> commit witness
		rows, _ := pool.Query(ctx, `SELECT id, n FROM committed`)
		ids, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
			ID string
			N  int64
		}])
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range ids {
			order[r.ID] = r.N
		}
		recs := k.ReadAll(t, topic)
		if len(recs) != len(order) {
			t.Fatalf("%d records published, want %d (one per emitted event)", len(recs), len(order))
		}
		last := map[string]int64{}
		partOf := map[string]int32{}
		for _, r := range recs {
			id := string(r.Value)
			n, ok := order[id]
			if !ok {
				t.Fatalf("record %q was not emitted by a committed transaction", id)
			}
			key := string(r.Key)
			if p, ok := partOf[key]; ok && p != r.Partition {
				t.Fatalf("key %q in partitions %d and %d", key, p, r.Partition)
			}
			partOf[key] = r.Partition
			if n < last[key] {
				t.Fatalf("key %q: %q (committed %d-th) published after a record committed %d-th", key, id, n, last[key])
			}
			last[key] = n
		}
		t.Logf("%d records of %d keys, emitted by %d interleaved writers and published by 3 relays, each key in commit order", len(recs), len(keys), writers)
	})
}

// emitOne runs one writer transaction: it emits one to three events to random keys (one Emit
// call: its key locks are taken in one order), waits a little so that transactions interleave,
// then takes the commit witness and commits.
func emitOne(ctx context.Context, pool *pgxpool.Pool, out *sink.Outbox, topic string, w, i int, rng *rand.Rand, keys []string) error {
	for {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var evs []sink.Event
			id := fmt.Sprintf("w%d-t%d", w, i)
			for j := range 1 + rng.IntN(3) {
				evs = append(evs, sink.Event{Topic: topic, Key: []byte(keys[rng.IntN(len(keys))]), Value: fmt.Appendf(nil, "%s-%d", id, j)})
			}
			if err := out.Emit(ctx, tx, evs...); err != nil {
				return err
			}
			time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
			var n int64
			if err := tx.QueryRow(ctx, `UPDATE witness SET n = n + 1 RETURNING n`).Scan(&n); err != nil {
				return err
			}
			for _, e := range evs {
				if _, err := tx.Exec(ctx, `INSERT INTO committed VALUES ($1, $2)`, string(e.Value), n); err != nil {
					return err
				}
			}
			return nil
		})
		if err == nil || !strings.Contains(err.Error(), "40P01") {
			return err
		}
		// A deadlock Postgres broke (possible only across Emit calls; see Outbox.Emit): retry.
	}
}

// TestOutboxPublishesARowThatCommitsLate: a transaction that emits first and commits last is
// published; nothing skips it because later rows were published before it.
func TestOutboxPublishesARowThatCommitsLate(t *testing.T) {
	t.Parallel()
	pool, k, topic, out := outboxSetup(t)
	ctx := context.Background()
	relay := sink.NewRelay(pool, k.Client(t, kgo.RecordPartitioner(sink.Partitioner())), sink.RelayConfig{Schema: "kafkapg", Group: "g"})

	late, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	if err := out.Emit(ctx, late, sink.Event{Topic: topic, Key: []byte("x"), Value: []byte("late")}); err != nil {
		t.Fatal(err)
	}
	emit(t, pool, out, sink.Event{Topic: topic, Key: []byte("y"), Value: []byte("early")})
	if n, err := relay.Flush(ctx); n != 1 || err != nil {
		t.Fatalf("Flush = %d, %v; want the committed row only", n, err)
	}
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := relay.Flush(ctx); n != 1 || err != nil {
		t.Fatalf("Flush after the late commit = %d, %v; want it published", n, err)
	}
	var got []string
	for _, r := range k.ReadAll(t, topic) {
		got = append(got, string(r.Value))
	}
	if !slices.Equal(got, []string{"early", "late"}) {
		t.Fatalf("published %q, want [early late]", got)
	}
}

// TestOutboxRollbackEmitsNothing: events of a transaction that rolls back never reach Kafka.
func TestOutboxRollbackEmitsNothing(t *testing.T) {
	t.Parallel()
	pool, k, topic, out := outboxSetup(t)
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := out.Emit(ctx, tx, sink.Event{Topic: topic, Key: []byte("k"), Value: []byte("v")}); err != nil {
			return err
		}
		return errors.New("the business change failed")
	})
	if err == nil {
		t.Fatal("the transaction should have failed")
	}
	relay := sink.NewRelay(pool, k.Client(t), sink.RelayConfig{Schema: "kafkapg", Group: "g"})
	if n, err := relay.Flush(ctx); n != 0 || err != nil {
		t.Fatalf("Flush = %d, %v; want nothing", n, err)
	}
}

// TestRelayWakesOnNotify: with LISTEN, a commit in another process is published at once, though
// the relay polls only every minute; without it (PgBouncer in transaction mode), the poll finds
// it.
func TestRelayWakesOnNotify(t *testing.T) {
	t.Parallel()
	pool := testenv.Migrated(t)
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 2)
	ctx := t.Context()
	out := newOutbox(t, "g")
	for _, tc := range []struct {
		name     string
		listen   bool
		interval time.Duration
	}{
		{"listen", true, time.Minute},
		{"poll", false, 200 * time.Millisecond},
	} {
		cfg := sink.RelayConfig{Schema: "kafkapg", Group: "g", Interval: tc.interval}
		if tc.listen {
			cfg.Listen = pool.Config().ConnConfig.Copy()
		}
		published := make(chan sink.Message, 10)
		cfg.Published = func(m sink.Message, _ time.Duration) { published <- m }
		relayCtx, stop := context.WithCancel(ctx)
		relay := sink.NewRelay(pool, k.Client(t, kgo.RecordPartitioner(sink.Partitioner())), cfg)
		done := make(chan struct{})
		go func() { defer close(done); relay.Run(relayCtx) }()
		time.Sleep(300 * time.Millisecond) // the relay's first pass and LISTEN are done
		began := time.Now()
		emit(t, pool, out, sink.Event{Topic: topic, Key: []byte(tc.name), Value: []byte("v")})
		select {
		case m := <-published:
			t.Logf("%s: published %v after the commit", tc.name, time.Since(began).Round(time.Millisecond))
			if id := header(m.Headers, sink.HeaderMessageID); len(id) != 36 {
				t.Errorf("%s: message id %q, want a UUID", tc.name, id)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: not published within 10s", tc.name)
		}
		stop()
		<-done
	}
}

func header(hs []kgo.RecordHeader, key string) string {
	for _, h := range hs {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// TestRelayRetention: with a retention, published rows stay (published_at set), are not
// published again, and Prune deletes them once older than the retention.
func TestRelayRetention(t *testing.T) {
	t.Parallel()
	pool, k, topic, out := outboxSetup(t)
	ctx := context.Background()
	relay := sink.NewRelay(pool, k.Client(t, kgo.RecordPartitioner(sink.Partitioner())), sink.RelayConfig{Schema: "kafkapg", Group: "g", Retention: time.Hour})
	for i := range 3 {
		emit(t, pool, out, sink.Event{Topic: topic, Key: []byte("k"), Value: []byte(strconv.Itoa(i))})
	}
	if n, err := relay.Flush(ctx); n != 3 || err != nil {
		t.Fatalf("Flush = %d, %v", n, err)
	}
	if n, err := relay.Flush(ctx); n != 0 || err != nil {
		t.Fatalf("second Flush = %d, %v; want nothing (published rows are kept, not published again)", n, err)
	}
	var kept int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.outbox WHERE published_at IS NOT NULL`).Scan(&kept); err != nil || kept != 3 {
		t.Fatalf("%d published rows kept (%v), want 3", kept, err)
	}
	if n, err := relay.Prune(ctx); n != 0 || err != nil {
		t.Fatalf("Prune = %d, %v; want nothing before the retention", n, err)
	}
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.outbox SET published_at = now() - interval '2 hours' WHERE value = '0'`); err != nil {
		t.Fatal(err)
	}
	if n, err := relay.Prune(ctx); n != 1 || err != nil {
		t.Fatalf("Prune = %d, %v; want the row past the retention", n, err)
	}
	if len(k.ReadAll(t, topic)) != 3 {
		t.Fatal("want 3 records published")
	}
}

func TestDerivedIDIsStable(t *testing.T) {
	t.Parallel()
	a := sink.DerivedID("g", "orders", 3, 1200, 0)
	if a != sink.DerivedID("g", "orders", 3, 1200, 0) {
		t.Fatal("DerivedID is not a function of its arguments")
	}
	seen := map[string]bool{a: true}
	for _, id := range []string{
		sink.DerivedID("g", "orders", 3, 1200, 1),
		sink.DerivedID("g", "orders", 3, 1201, 0),
		sink.DerivedID("g", "orders", 2, 1200, 0),
		sink.DerivedID("g", "order", 3, 1200, 0),
		sink.DerivedID("g2", "orders", 3, 1200, 0),
		sink.DerivedID("go", "rders", 3, 1200, 0),
	} {
		if seen[id] {
			t.Fatalf("two coordinates share the id %s", id)
		}
		seen[id] = true
	}
	if len(a) != 36 || a[14] != '5' {
		t.Fatalf("id %q is not a version 5 UUID", a)
	}
}

// TestRelayParksARecordForAMissingTopic: a record for a topic that does not exist (and that the
// client may not create) is retried for MissingTopicGrace, then set aside with the reason;
// records for other topics, emitted before and after it, are published meanwhile.
func TestRelayParksARecordForAMissingTopic(t *testing.T) {
	t.Parallel()
	pool, k, topic, out := outboxSetup(t)
	ctx := context.Background()
	for _, e := range []sink.Event{
		{Topic: topic, Key: []byte("k"), Value: []byte("before")},
		{Topic: "no-such-topic", Key: []byte("k"), Value: []byte("lost?")},
		{Topic: topic, Key: []byte("k"), Value: []byte("after")},
	} {
		emit(t, pool, out, e)
	}
	relay := sink.NewRelay(pool, k.Client(t, kgo.RecordPartitioner(sink.Partitioner())), sink.RelayConfig{Schema: "kafkapg", Group: "g",
		MissingTopicGrace: 2 * time.Second})
	began := time.Now()
	if n, err := relay.Flush(ctx); n != 2 || err != nil {
		t.Fatalf("Flush = %d, %v; want the two records of the existing topic (the third waits apart, which is not the relay's failure)", n, err)
	}
	var waiting int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.outbox WHERE topic = 'no-such-topic' AND published_at IS NULL AND refused_at IS NULL`).Scan(&waiting); err != nil || waiting != 1 {
		t.Fatalf("%d records of the missing topic waiting (%v); want 1, kept for a retry", waiting, err)
	}
	t.Logf("first flush done after %v", time.Since(began))
	time.Sleep(2 * time.Second)
	if n, err := relay.Flush(ctx); n != 0 || err != nil {
		t.Fatalf("Flush after the grace = %d, %v; want the record set aside", n, err)
	}
	t.Logf("second flush done after %v", time.Since(began))
	var why string
	if err := pool.QueryRow(ctx, `SELECT refused_error FROM kafkapg.outbox WHERE topic = 'no-such-topic' AND refused_at IS NOT NULL`).Scan(&why); err != nil {
		t.Fatalf("the record for the missing topic is not set aside: %v", err)
	}
	if !strings.Contains(why, "UNKNOWN_TOPIC_OR_PARTITION") {
		t.Errorf("set aside with %q; want the broker's reason", why)
	}

	// A topic created within the grace gets its records (the relay asks the broker, not the
	// client's metadata cache, which can be 5 s old).
	relay = sink.NewRelay(pool, k.Client(t, kgo.RecordPartitioner(sink.Partitioner())), sink.RelayConfig{Schema: "kafkapg", Group: "g"})
	late := k.TopicName(t) + "_late"
	emit(t, pool, out, sink.Event{Topic: late, Key: []byte("k"), Value: []byte("waited")})
	if n, err := relay.Flush(ctx); n != 0 || err != nil {
		t.Fatalf("Flush = %d, %v; want the record kept for a retry", n, err)
	}
	k.CreateTopicNamed(t, late, 1)
	testenv.Eventually(t, 20*time.Second, func() error {
		if n, err := relay.Flush(ctx); n != 1 || err != nil {
			return fmt.Errorf("Flush once the topic exists = %d, %v; want the record published", n, err)
		}
		return nil
	})
}

// TestMissingTopicHoldsUpNothing: 600 records for a mistyped topic, older than everything else
// in the outbox, filled every batch of the relay (its 500 oldest rows): the other topics'
// records waited until the grace set them aside, a minute later. They wait apart now.
func TestMissingTopicHoldsUpNothing(t *testing.T) {
	t.Parallel()
	pool, k, topic, out := outboxSetup(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 600 {
		if err := out.Emit(ctx, tx, sink.Event{Topic: "mistyped-topic", Key: []byte(fmt.Sprint(i)), Value: []byte("v")}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		emit(t, pool, out, sink.Event{Topic: topic, Key: []byte(fmt.Sprint(i)), Value: []byte("on time")})
	}
	relay := sink.NewRelay(pool, k.Client(t, kgo.RecordPartitioner(sink.Partitioner())), sink.RelayConfig{Schema: "kafkapg", Group: "g"})
	start := time.Now()
	if n, err := relay.Flush(ctx); n != 10 || err != nil {
		t.Fatalf("Flush = %d, %v; want the 10 records of the existing topic published", n, err)
	}
	t.Logf("published in %v, with 600 records of a missing topic before them", time.Since(start).Round(time.Millisecond))
	if got := len(k.ReadAll(t, topic)); got != 10 {
		t.Errorf("%d records in %s; want 10", got, topic)
	}
}

// TestEmitRefusesTopicsKafkaRefuses: a topic name no relay could ever publish to (NUL, invalid
// UTF-8, a space, too long) fails Emit at once, naming the problem, and writes nothing: the
// transaction stays usable.
func TestEmitRefusesTopicsKafkaRefuses(t *testing.T) {
	t.Parallel()
	pool, _, topic, out := outboxSetup(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, bad := range []string{"", "a\x00b", "caf\xe9", "orders placed", strings.Repeat("t", 250), ".."} {
		err := out.Emit(ctx, tx, sink.Event{Topic: topic}, sink.Event{Topic: bad, Value: []byte("v")})
		if err == nil || !strings.Contains(err.Error(), "event 1") {
			t.Errorf("Emit to topic %q = %v; want an error naming event 1", bad, err)
		}
		if err != nil && !utf8.ValidString(err.Error()) {
			t.Errorf("error %q is not valid UTF-8", err)
		}
	}
	if err := out.Emit(ctx, tx, sink.Event{Topic: topic, Value: []byte("v")}); err != nil {
		t.Fatalf("the transaction is not usable after refused emits: %v", err)
	}
	var n int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM kafkapg.outbox`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d outbox rows (%v), want the one valid emit", n, err)
	}
}

// TestRelaySeesATopicCreatedSecondsAgo: the relay asked whether a topic exists through kadm,
// which answers from the client's metadata cache: for seconds after its topic was created, a row
// that had waited past the grace was set aside as for a missing topic. It asks the broker.
func TestRelaySeesATopicCreatedSecondsAgo(t *testing.T) {
	t.Parallel()
	pool, k, _, out := outboxSetup(t)
	ctx := context.Background()
	late := k.TopicName(t) + "_created_late"
	emit(t, pool, out, sink.Event{Topic: late, Key: []byte("k"), Value: []byte("waited")})
	relay := sink.NewRelay(pool, k.Client(t, kgo.RecordPartitioner(sink.Partitioner())), sink.RelayConfig{Schema: "kafkapg", Group: "g",
		MissingTopicGrace: time.Second})
	if n, err := relay.Flush(ctx); n != 0 || err != nil {
		t.Fatalf("Flush = %d, %v; want the record kept for its topic", n, err)
	}
	time.Sleep(1200 * time.Millisecond) // past the grace; the client's metadata is a second old
	k.CreateTopicNamed(t, late, 1)
	if n, err := relay.Flush(ctx); n != 1 || err != nil {
		t.Fatalf("Flush once the topic exists = %d, %v; want the record published", n, err)
	}
	var aside int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.outbox WHERE refused_at IS NOT NULL`).Scan(&aside); err != nil || aside != 0 {
		t.Errorf("%d rows set aside (%v); want none", aside, err)
	}
}
