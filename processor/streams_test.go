package processor_test

import (
	"context"
	"crypto/sha256"
	encbinary "encoding/binary"

	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/sink"
)

// midRecorder inserts each record's message id into table got, which has no unique constraint:
// an event applied twice shows as two rows. A record whose value is "fail" fails permanently on
// its first delivery (it is dead-lettered), and succeeds when replayed.
type midRecorder struct{}

func (midRecorder) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	if string(rec.Value) == "fail" && rec.Attempt == 1 {
		return processor.Permanent(errors.New("told to fail"))
	}
	var mid string
	for _, h := range rec.Headers {
		if h.Key == sink.HeaderMessageID {
			mid = string(h.Value)
		}
	}
	_, err := tx.Exec(ctx, `INSERT INTO got (mid) VALUES ($1)`, mid)
	return err
}

// midHarness is a harness with a table got (no unique constraint: an event applied twice is two
// rows) and the config of a processor whose topic is deduplicated on the message id (numbered
// events by their streams), handled by handler.
func midHarness(t *testing.T, k *testenv.Kafka, partitions int32, handler processor.Handler) (*harness, *processor.Config) {
	t.Helper()
	h := newHarness(t, k, partitions)
	if _, err := h.Pool.Exec(context.Background(), `CREATE TABLE got (mid text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	cfg := h.Config(handler)
	cfg.TopicPolicies = map[string]processor.TopicPolicy{h.Topic: {IdempotencyKey: processor.KeyFromHeader(sink.HeaderMessageID)}}
	return h, cfg
}

// waitConsumed waits until h's group has consumed n records of its partition 0.
func waitConsumed(t *testing.T, h *harness, n int64) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, func() error {
		var next int64
		if err := h.Pool.QueryRow(context.Background(), `SELECT coalesce(max(next_offset), 0) FROM kafkapg.offsets WHERE consumer_group = $1`, h.Group).Scan(&next); err != nil || next < n {
			return fmt.Errorf("consumed %d (%v), want %d", next, err, n)
		}
		return nil
	})
}

// streamRec is a record as a kafkapg service's relay publishes a numbered event to partition 0 of
// topic: number seq of stream, in root's lineage, emitted by the source record at offset (fork:
// " <parent> <fork_seq> <since ms>" for a fork, "" for a stream created afresh).
func streamRec(topic, stream string, seq int, root string, offset int, fork, mid, value string) *kgo.Record {
	th := sha256.Sum256([]byte(topic))
	return &kgo.Record{Topic: topic, Partition: 0, Key: []byte(mid), Value: []byte(value), Headers: []kgo.RecordHeader{
		{Key: sink.HeaderMessageID, Value: []byte(mid)},
		{Key: sink.HeaderStream, Value: fmt.Appendf(nil, "%s %d %s %d 0@%x%s", stream, seq, root, offset, th[:4], fork)},
	}}
}

const (
	streamA = "0a000000-0000-4000-8000-000000000001"
	streamZ = "0a000000-0000-4000-8000-00000000000f" // a fork of A
	streamB = "0a000000-0000-4000-8000-00000000000b" // A's root's stream, created again
	rootR   = "0a000000-0000-5000-8000-0000000000ff"
)

// TestStreamsDecideCopiesByNumber: a consumer deduplicating on the message id keeps, for numbered
// events, a few numbers per stream and no key per event, and applies each event once: numbers
// out of order, copies (a relay's second publish), a number dead-lettered and then brought again
// by a copy, and the dead letter replayed after that (a copy then: skipped). Then two forks: Z,
// which a database failed over to a standby that lacked A's last commits emits, repeats A's last
// two events under its own numbers, and adds one; B, a stream created again for A's root after
// the database lost A's row entirely, repeats A's first three. The repeats are read back from
// Kafka and skipped by their key; a late copy of A's is still skipped by its number. Keys are
// recorded only for numbers below the first one observed of a stream (A's 1 and 2: a release
// before may have applied them by key), and for what a newer stream may repeat.
func TestStreamsDecideCopiesByNumber(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	ctx := context.Background()
	r := h.Start(cfg)
	// A's number n is emitted by the source record at offset 10n.
	a := func(seq int, value string) *kgo.Record {
		return streamRec(h.Topic, streamA, seq, rootR, 10*seq, "", "m"+strconv.Itoa(seq), value)
	}
	applied := func() map[string]int {
		rows, _ := h.Pool.Query(ctx, `SELECT mid FROM got`)
		mids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]int{}
		for _, m := range mids {
			out[m]++
		}
		return out
	}
	waitApplied := func(want map[string]int) {
		t.Helper()
		testenv.Eventually(t, 20*time.Second, func() error {
			if got := applied(); fmt.Sprint(got) != fmt.Sprint(want) {
				return fmt.Errorf("applied %v, want %v", got, want)
			}
			return nil
		})
	}
	waitConsumed := func(n int64) {
		t.Helper()
		testenv.Eventually(t, 20*time.Second, func() error {
			var next int64
			if err := h.Pool.QueryRow(ctx, `SELECT coalesce(max(next_offset), 0) FROM kafkapg.offsets WHERE consumer_group = $1`, h.Group).Scan(&next); err != nil {
				return err
			}
			if next < n {
				return fmt.Errorf("consumed %d of %d records", next, n)
			}
			return nil
		})
	}

	// 3 before 1, a copy of 1, then 5; then 2, 4 (dead-lettered), a copy of 3; then a copy of 4
	// (applied: its number was missing) and 6.
	k.Produce(t, a(3, "ok"), a(1, "ok"), a(1, "ok"), a(5, "ok"), a(2, "ok"), a(4, "fail"), a(3, "ok"), a(4, "ok"), a(6, "ok"))
	waitApplied(map[string]int{"m1": 1, "m2": 1, "m3": 1, "m4": 1, "m5": 1, "m6": 1})
	waitConsumed(9)
	// The dead letter of 4, replayed: a copy of an applied event.
	o := ops.New(h.Pool, "kafkapg", h.Group)
	task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, ops.Actor{Name: "tester", Reason: "fixed"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task, err = o.RunTask(ctx, task.ID, "test", nil); err != nil || task.Done != 1 {
		t.Fatalf("RunTask = %+v, %v; want the one dead letter queued", task, err)
	}
	testenv.Eventually(t, 20*time.Second, func() error {
		if got := r.Counter("kafkapg_duplicate_keys_skipped_total"); got != 3 {
			return fmt.Errorf("%v records skipped as copies, want 3 (1's and 3's copies, 4's replay)", got)
		}
		return nil
	})
	// The copy of 3 (offset 6) was skipped by its number: its trace names the stream and the
	// number, and says it was not applied (issue 42).
	res, err := o.Trace(ctx, ops.TraceQuery{Topic: h.Topic, Partition: 0, Offset: 6}, k.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	if r := res.Records[0]; r.State != ops.TraceSkippedDuplicate || !strings.Contains(r.Now, "skipped as a duplicate by its stream "+streamA+", event number 3 (message id \"m3\")") {
		t.Errorf("trace of the copy of 3: %s %q, want skipped as a duplicate by stream A's number 3", r.State, r.Now)
	}
	if keys := ringKeys(t, h.Pool); keys != 2 {
		t.Errorf("%d idempotency keys recorded, want 2: A's 1 and 2, below the first number observed (3)", keys)
	}
	lineage := func() map[string]map[string]any {
		t.Helper()
		var state []byte
		if err := h.Pool.QueryRow(ctx, `SELECT state FROM kafkapg.idempotency_lineages WHERE consumer_group = $1 AND root = $2`, h.Group, rootR).Scan(&state); err != nil {
			t.Fatal(err)
		}
		var l struct{ Streams []map[string]any }
		if err := json.Unmarshal(state, &l); err != nil {
			t.Fatal(err)
		}
		out := map[string]map[string]any{}
		for _, s := range l.Streams {
			out[s["id"].(string)] = s
		}
		return out
	}
	if a := lineage()[streamA]; a["high"] != 6.0 || a["missing"] != "{}" || a["floor"] != 3.0 {
		t.Errorf("stream A: %v; want floor 3, high 6 and none missing", a)
	}

	// Z forks from A at 4: it repeats m5 and m6 as its 1 and 2, and adds m7; B, created again
	// for A's root, repeats m1 to m3 and adds m8. A late copy of A's 6 comes after them, and a
	// copy of Z's 2.
	forkAt := strconv.FormatInt(time.Now().Add(-time.Minute).UnixMilli(), 10)
	z := func(seq, offset int, mid string) *kgo.Record {
		return streamRec(h.Topic, streamZ, seq, rootR, offset, " "+streamA+" 4 "+forkAt, mid, "ok")
	}
	b := func(seq, offset int, mid string) *kgo.Record {
		return streamRec(h.Topic, streamB, seq, rootR, offset, "", mid, "ok")
	}
	k.Produce(t, z(1, 50, "m5"), z(2, 60, "m6"), z(3, 70, "m7"), b(1, 10, "m1"), b(2, 20, "m2"), b(3, 30, "m3"), b(4, 80, "m8"), a(6, "ok"), z(2, 60, "m6"))
	waitApplied(map[string]int{"m1": 1, "m2": 1, "m3": 1, "m4": 1, "m5": 1, "m6": 1, "m7": 1, "m8": 1})
	waitConsumed(18)
	testenv.Eventually(t, 20*time.Second, func() error {
		if got := r.Counter("kafkapg_duplicate_keys_skipped_total"); got != 3+7 {
			return fmt.Errorf("%v records skipped as copies, want 10 (3 before; Z's 1 and 2, B's 1 to 3, A's 6, Z's 2 again)", got)
		}
		return nil
	})
	// Z may repeat A's past 4 (source offsets up to 60); B, created again, any of A's and Z's (up
	// to 70).
	if l := lineage(); l[streamZ]["horizon"] != 60.0 || l[streamB]["horizon"] != 70.0 {
		t.Errorf("horizons: Z %v, B %v; want 60 and 70 (lineage %v)", l[streamZ]["horizon"], l[streamB]["horizon"], l)
	}
}

// emitter emits, for each record, one event to topic, keyed by the record's key.
type emitter struct{ topic string }

func (e emitter) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	return rec.Emit(ctx, tx, sink.Event{Topic: e.topic, Key: rec.Key, Value: rec.Value})
}

// TestEmittedEventsAreNumbered: the events Record.Emit derives the id of are numbered in their
// stream (source partition to destination partition), published to the partition their key
// maps to; the stream forks when the database's identity changes (a failover, a restore, a
// restart: see TestStreamsForkAtEveryStart), and when the row has none: the new stream names the
// one it replaces, the last number the database kept of it, and since when what it lost was
// published.
func TestEmittedEventsAreNumbered(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h := newHarness(t, k, 1)
	ctx := context.Background()
	out := k.CreateTopic(t, 3)
	cfg := h.Config(emitter{topic: out})
	cfg.OutboxPollInterval = 50 * time.Millisecond
	h.Start(cfg)
	produce := func(from, to int) {
		for i := from; i < to; i++ {
			k.Produce(t, &kgo.Record{Topic: h.Topic, Key: []byte("k"), Value: []byte(strconv.Itoa(i))})
		}
	}
	published := func(n int) []*kgo.Record {
		t.Helper()
		var recs []*kgo.Record
		testenv.Eventually(t, 20*time.Second, func() error {
			if recs = k.ReadAll(t, out); len(recs) < n {
				return fmt.Errorf("%d events published, want %d", len(recs), n)
			}
			return nil
		})
		return recs
	}
	produce(0, 3)
	published(3)
	if _, err := h.Pool.Exec(ctx, `UPDATE kafkapg.outbox_streams SET database = 'another database'`); err != nil {
		t.Fatal(err)
	}
	produce(3, 5)
	published(5)
	if _, err := h.Pool.Exec(ctx, `UPDATE kafkapg.outbox_streams SET database = NULL`); err != nil {
		t.Fatal(err)
	}
	produce(5, 6)
	all := published(6)
	if len(all) != 6 {
		t.Fatalf("%d events published, want 6", len(all))
	}
	var destPartition int32
	if err := h.Pool.QueryRow(ctx, `SELECT dest_partition FROM kafkapg.outbox_streams WHERE consumer_group = $1`, h.Group).Scan(&destPartition); err != nil {
		t.Fatal(err)
	}
	streams := map[[16]byte]sink.Stream{}
	var order [][16]byte
	for i, r := range all {
		st, ok := sink.ParseStream(r.Headers)
		if !ok {
			t.Fatalf("event %d has no stream headers: %v", i, r.Headers)
		}
		if r.Partition != destPartition {
			t.Errorf("event %d in partition %d, want %d (its key's, as numbered)", i, r.Partition, destPartition)
		}
		if _, seen := streams[st.ID]; !seen {
			order = append(order, st.ID)
		}
		streams[st.ID] = st
		want := map[int]int64{0: 1, 1: 2, 2: 3, 3: 1, 4: 2, 5: 1}[int(mustAtoi(t, string(r.Value)))]
		if st.Seq != want {
			t.Errorf("event %s is number %d of its stream, want %d", r.Value, st.Seq, want)
		}
	}
	if len(order) != 3 {
		t.Fatalf("%d streams, want 3 (the first, and a fork at each change)", len(order))
	}
	one, two, three := streams[order[0]], streams[order[1]], streams[order[2]]
	if !one.IsRoot() {
		t.Errorf("the first stream is a fork of %x at %d, want one created afresh", one.Parent, one.ForkSeq)
	}
	if two.Parent != one.ID || two.ForkSeq != 3 || two.Since.IsZero() {
		t.Errorf("the second stream forks from %x at %d (%v), want the first at 3", two.Parent, two.ForkSeq, two.Since)
	}
	if three.Parent != two.ID || three.ForkSeq != 2 {
		t.Errorf("the third stream forks from %x at %d, want the second at 2", three.Parent, three.ForkSeq)
	}
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestForkReadBackOutlivesTheIdleTimeout: reading a fork's parent back from Kafka can take longer
// than a transaction's idle timeout (Config.TxIdleTimeout, which Postgres enforces): it runs
// with no transaction open, and records what it found in short transactions of its own.
func TestForkReadBackOutlivesTheIdleTimeout(t *testing.T) {
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	ctx := context.Background()
	cfg.TxIdleTimeout = 400 * time.Millisecond
	h.Start(cfg)
	a := func(seq int) *kgo.Record {
		return streamRec(h.Topic, streamA, seq, rootR, 10*seq, "", "m"+strconv.Itoa(seq), "ok")
	}
	k.Produce(t, a(1), a(2), a(3), a(4))
	testenv.Eventually(t, 20*time.Second, func() error {
		var n int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM got`).Scan(&n); err != nil || n != 4 {
			return fmt.Errorf("%d applied (%v), want 4", n, err)
		}
		return nil
	})
	defer processor.SetReadBackPause(300 * time.Millisecond)() // 4 records read back: 1.2 s
	forkAt := strconv.FormatInt(time.Now().Add(-time.Minute).UnixMilli(), 10)
	z := func(seq, offset int, mid string) *kgo.Record {
		return streamRec(h.Topic, streamZ, seq, rootR, offset, " "+streamA+" 1 "+forkAt, mid, "ok")
	}
	k.Produce(t, z(1, 20, "m2"), z(2, 30, "m3"), z(3, 40, "m4"), z(4, 50, "m5"))
	testenv.Eventually(t, 30*time.Second, func() error {
		rows, _ := h.Pool.Query(ctx, `SELECT mid, count(*) FROM got GROUP BY mid ORDER BY mid`)
		got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
			var mid string
			var n int
			err := r.Scan(&mid, &n)
			return fmt.Sprintf("%s:%d", mid, n), err
		})
		if err != nil {
			return err
		}
		if want := "[m1:1 m2:1 m3:1 m4:1 m5:1]"; fmt.Sprint(got) != want {
			return fmt.Errorf("applied %v, want %s: the fork's repeats skipped, m5 applied", got, want)
		}
		return nil
	})
}

// TestDiscardedNumbersAreNotMissing (issue 39, case 9): a numbered event dead-lettered stays
// missing in its stream (it may still be replayed); discarded, its number is done. Before, every
// discarded dead letter left a range in the stream's missing numbers for ever, and every batch of
// the stream read and wrote them all. A copy of a discarded event is skipped, as it was.
func TestDiscardedNumbersAreNotMissing(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	ctx := context.Background()
	h.Start(cfg)
	var recs []*kgo.Record
	for seq := 1; seq <= 40; seq++ {
		value := "ok"
		if seq%2 == 0 {
			value = "fail"
		}
		recs = append(recs, streamRec(h.Topic, streamA, seq, rootR, 10*seq, "", "m"+strconv.Itoa(seq), value))
	}
	k.Produce(t, recs...)
	missing := func() string {
		var m string
		if err := h.Pool.QueryRow(ctx, `SELECT x.s->>'missing' FROM kafkapg.idempotency_lineages l, jsonb_array_elements(l.state->'streams') AS x(s)
			WHERE l.consumer_group = $1 AND x.s->>'id' = $2`, h.Group, streamA).Scan(&m); err != nil {
			return err.Error()
		}
		return m
	}
	testenv.Eventually(t, 20*time.Second, func() error {
		var dead int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.dead_letters WHERE consumer_group = $1`, h.Group).Scan(&dead); err != nil || dead != 20 {
			return fmt.Errorf("%d dead letters (%v), want 20", dead, err)
		}
		if m := missing(); strings.Count(m, "[") != 19 {
			return fmt.Errorf("missing %s: want the 19 numbers dead-lettered below the highest applied", m)
		}
		return nil
	})
	o := ops.New(h.Pool, "kafkapg", h.Group)
	task, err := o.StartTask(ctx, ops.Discard, ops.Filter{}, ops.Actor{Name: "tester", Reason: "test events"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task, err = o.RunTask(ctx, task.ID, "test", nil); err != nil || task.Done != 20 {
		t.Fatalf("RunTask = %+v, %v; want the 20 dead letters discarded", task, err)
	}
	if m := missing(); m != "{}" {
		t.Errorf("missing %s after the dead letters were discarded, want none", m)
	}
	// A copy of a discarded event comes: skipped like it.
	k.Produce(t, streamRec(h.Topic, streamA, 2, rootR, 20, "", "m2", "ok"))
	waitConsumed(t, h, 41)
	var n int
	if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM got WHERE mid = 'm2'`).Scan(&n); err != nil || n != 0 {
		t.Errorf("the copy of a discarded event applied %d times (%v), want 0", n, err)
	}
}

// ringKey records mid as applied by a release before streams, which kept a key per message id in
// the key ring: the SHA-256 of the group, the topic and the key.
func ringKey(t *testing.T, h *harness, mid string) {
	t.Helper()
	sum := sha256.New()
	for _, s := range []string{h.Group, h.Topic} {
		sum.Write(encbinary.AppendUvarint(nil, uint64(len(s))))
		sum.Write([]byte(s))
	}
	sum.Write([]byte(mid))
	err := pgx.BeginFunc(context.Background(), h.Pool, func(tx pgx.Tx) error {
		_, err := keyring.New("kafkapg").Record(context.Background(), tx, [][32]byte{[32]byte(sum.Sum(nil))})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// appliedMids counts the rows of table got per message id.
func appliedMids(t *testing.T, h *harness) map[string]int {
	t.Helper()
	rows, _ := h.Pool.Query(context.Background(), `SELECT mid FROM got`)
	mids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, m := range mids {
		out[m]++
	}
	return out
}

// TestReplayAfterTheUpgradeToStreams (issue 39, case 6): a release before streams applied a copy
// of event m5 and kept its key; another copy of it, numbered, was dead-lettered. The stream is
// observed from number 3 on, so 5 is missing, and a replay decided by number alone applied m5 a
// second time. A replay is decided by key as well.
func TestReplayAfterTheUpgradeToStreams(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	ctx := context.Background()
	h.Start(cfg)
	// What the release before did: m5 applied, its key kept.
	ringKey(t, h, "m5")
	if _, err := h.Pool.Exec(ctx, `INSERT INTO got VALUES ('m5')`); err != nil {
		t.Fatal(err)
	}
	a := func(seq int, value string) *kgo.Record {
		return streamRec(h.Topic, streamA, seq, rootR, 10*seq, "", "m"+strconv.Itoa(seq), value)
	}
	k.Produce(t, a(3, "ok"), a(5, "fail"), a(6, "ok"))
	testenv.Eventually(t, 20*time.Second, func() error {
		if got := appliedMids(t, h); fmt.Sprint(got) != "map[m3:1 m5:1 m6:1]" {
			return fmt.Errorf("applied %v, want m3, m5 (the release before's) and m6 once", got)
		}
		var dead int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.dead_letters WHERE consumer_group = $1`, h.Group).Scan(&dead); err != nil || dead != 1 {
			return fmt.Errorf("%d dead letters (%v), want m5's", dead, err)
		}
		return nil
	})
	o := ops.New(h.Pool, "kafkapg", h.Group)
	task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, ops.Actor{Name: "tester", Reason: "after the upgrade"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task, err = o.RunTask(ctx, task.ID, "test", nil); err != nil || task.Done != 1 {
		t.Fatalf("RunTask = %+v, %v; want the dead letter queued", task, err)
	}
	testenv.Eventually(t, 20*time.Second, func() error {
		var status string
		if err := h.Pool.QueryRow(ctx, `SELECT status FROM kafkapg.dead_letters WHERE consumer_group = $1`, h.Group).Scan(&status); err != nil || status != "replayed" {
			return fmt.Errorf("dead letter %s (%v), want replayed", status, err)
		}
		return nil
	})
	if got := appliedMids(t, h); fmt.Sprint(got) != "map[m3:1 m5:1 m6:1]" {
		t.Errorf("applied %v after the replay, want m5 once: its other copy was applied by the release before", got)
	}
}

// TestCopiedStreamHeaderIsNotAStream (issue 39, suspicion 5, confirmed): another producer that
// forwards an event with its headers (Kafka Streams does by default) onto a record of its own, in
// another topic or partition, carries the event's stream header. Decided by the copied number, the
// record was skipped as a copy of the event (lost). The header names its stream's topic and
// partition: one that does not fit where it is, is no stream, and the record is decided by its
// own message id.
func TestCopiedStreamHeaderIsNotAStream(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	h.Start(cfg)
	k.Produce(t, streamRec(h.Topic, streamA, 1, rootR, 10, "", "m1", "ok"))
	// The same event's header, as it reads in another topic, forwarded onto a record with its
	// own message id.
	forwarded := streamRec("orders.enriched", streamA, 1, rootR, 10, "", "f1", "ok")
	forwarded.Topic = h.Topic
	k.Produce(t, forwarded)
	testenv.Eventually(t, 20*time.Second, func() error {
		if got := appliedMids(t, h); fmt.Sprint(got) != "map[f1:1 m1:1]" {
			return fmt.Errorf("applied %v, want m1 and the forwarded f1 once each", got)
		}
		return nil
	})
}

// TestLateParentRaisesTheHorizon (issue 39, case 5): after a fork Z of A at 2, a relay of A's old
// database publishes A's 3 late, after Z's first record; it is applied (decided by key, and
// keyed). Then the upstream applies A's 3's source record again (it went round the tiers) and Z
// repeats it: it must be skipped. Z's horizon did not move past what its read back found, and the
// repeat was decided by number once Z was ten minutes old: applied twice. A's late 3 raises Z's
// horizon, and Z's events applied by number up to it are read back for their keys.
func TestLateParentRaisesTheHorizon(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	h.Start(cfg)
	since := strconv.FormatInt(time.Now().Add(-time.Minute).UnixMilli(), 10)
	a := func(seq int) *kgo.Record {
		return streamRec(h.Topic, streamA, seq, rootR, 10*seq, "", "m"+strconv.Itoa(seq), "ok")
	}
	z := func(seq, src int, mid string) *kgo.Record {
		return streamRec(h.Topic, streamZ, seq, rootR, src, " "+streamA+" 2 "+since, mid, "ok")
	}
	k.Produce(t, a(1), a(2), z(1, 25, "n25"), a(3), z(2, 40, "n40"))
	testenv.Eventually(t, 20*time.Second, func() error {
		if got := appliedMids(t, h); fmt.Sprint(got) != "map[m1:1 m2:1 m3:1 n25:1 n40:1]" {
			return fmt.Errorf("applied %v", got)
		}
		return nil
	})
	// Z's 3 repeats A's 3 (the same source record, the same event).
	k.Produce(t, z(3, 30, "m3"))
	waitConsumed(t, h, 6)
	if got := appliedMids(t, h); fmt.Sprint(got) != "map[m1:1 m2:1 m3:1 n25:1 n40:1]" {
		t.Errorf("applied %v: Z's repeat of A's 3 applied again", got)
	}
}

// TestForksMetTogetherInASmallPool (issue 39, case 3): an upstream failover forks every stream at
// once, and a consumer meets the forks of all its partitions together. Each read back recorded
// the keys it found on a second connection while its batch transaction held the first: with as
// many partitions as connections, each held one and waited for another, for ever (and the relay
// starved). A read back now runs with no transaction open and records its keys, a chunk at a
// time, in a transaction of one connection. 8 partitions, a pool of 3.
func TestForksMetTogetherInASmallPool(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 8, midRecorder{})
	ctx := context.Background()
	pc, err := pgxpool.ParseConfig(h.DBURL)
	if err != nil {
		t.Fatal(err)
	}
	pc.MaxConns = 3
	small, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	p, err := processor.New(small, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(runCtx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	th := sha256.Sum256([]byte(h.Topic))
	rec := func(part int32, stream string, seq int, src int, fork, mid string) *kgo.Record {
		root := fmt.Sprintf("0a000000-0000-5000-8000-%012x", part)
		return &kgo.Record{Topic: h.Topic, Partition: part, Key: []byte(mid), Value: []byte("ok"), Headers: []kgo.RecordHeader{
			{Key: sink.HeaderMessageID, Value: []byte(mid)},
			{Key: sink.HeaderStream, Value: fmt.Appendf(nil, "%s %d %s %d %d@%x%s", stream, seq, root, src, part, th[:4], fork)},
		}}
	}
	a := func(part int32) string { return fmt.Sprintf("0a000000-0000-4000-8000-%012x", 16*part+1) }
	z := func(part int32) string { return fmt.Sprintf("0a000000-0000-4000-8000-%012x", 16*part+2) }
	mid := func(part int32, n int) string { return fmt.Sprintf("p%d-m%d", part, n) }
	cl := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	produce := func(recs []*kgo.Record) {
		t.Helper()
		if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	var first []*kgo.Record
	for part := range int32(8) {
		for n := 1; n <= 3; n++ {
			first = append(first, rec(part, a(part), n, 10*n, "", mid(part, n)))
		}
	}
	produce(first)
	want := func(n int) {
		t.Helper()
		testenv.Eventually(t, 60*time.Second, func() error {
			got := appliedMids(t, h)
			if len(got) != n {
				return fmt.Errorf("%d events applied, want %d", len(got), n)
			}
			for m, c := range got {
				if c != 1 {
					return fmt.Errorf("%s applied %d times", m, c)
				}
			}
			return nil
		})
	}
	want(24)
	// Every stream forks at 1 (the database kept A's 1): its 1 and 2 repeat A's 2 and 3, its 3 is
	// new.
	since := fmt.Sprintf(" %%s 1 %d", time.Now().Add(-time.Minute).UnixMilli())
	var forks []*kgo.Record
	for part := range int32(8) {
		f := fmt.Sprintf(since, a(part))
		forks = append(forks, rec(part, z(part), 1, 20, f, mid(part, 2)), rec(part, z(part), 2, 30, f, mid(part, 3)), rec(part, z(part), 3, 40, f, mid(part, 4)))
	}
	produce(forks)
	want(32)
}

// TestReadBackResumesWhereItStopped (issue 39, case 4): a read back ran inside the batch
// transaction, from the parent's fork point less five minutes, and was cut at two minutes; the
// failure was retried in place, reading again from the start: a read back longer than two
// minutes never finished, and the partition stayed at the fork's first record for ever. It now
// reads a chunk at a time, each chunk's keys recorded with its cursor: one that fails after a
// chunk goes on from that chunk's end.
func TestReadBackResumesWhereItStopped(t *testing.T) {
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	h.Start(cfg)
	var recs []*kgo.Record
	for seq := 1; seq <= 10; seq++ {
		recs = append(recs, streamRec(h.Topic, streamA, seq, rootR, 10*seq, "", "m"+strconv.Itoa(seq), "ok"))
	}
	k.Produce(t, recs...)
	testenv.Eventually(t, 20*time.Second, func() error {
		if n := len(appliedMids(t, h)); n != 10 {
			return fmt.Errorf("%d applied, want 10", n)
		}
		return nil
	})
	var mu sync.Mutex
	var chunks [][2]int64
	failed := false
	defer processor.SetReadBackChunks(3, func(from, to int64) error {
		mu.Lock()
		defer mu.Unlock()
		chunks = append(chunks, [2]int64{from, to})
		if !failed {
			failed = true
			return errors.New("the read back fails after its first chunk")
		}
		return nil
	})()
	// Z forks A at 2: A's 3 to 10, applied, are read back; Z's 1 repeats A's 3.
	since := strconv.FormatInt(time.Now().Add(-time.Minute).UnixMilli(), 10)
	k.Produce(t, streamRec(h.Topic, streamZ, 1, rootR, 30, " "+streamA+" 2 "+since, "m3", "ok"),
		streamRec(h.Topic, streamZ, 2, rootR, 110, " "+streamA+" 2 "+since, "m11", "ok"))
	testenv.Eventually(t, 20*time.Second, func() error {
		if got := appliedMids(t, h); len(got) != 11 || got["m3"] != 1 || got["m11"] != 1 {
			return fmt.Errorf("applied %v, want m1 to m11 once each", got)
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	// The read back covers offsets 0 to 10 (the records before Z's first), 3 a chunk: it failed
	// after [0, 3), and went on from 3.
	want := [][2]int64{{0, 3}, {3, 6}, {6, 9}, {9, 10}}
	if fmt.Sprint(chunks) != fmt.Sprint(want) {
		t.Errorf("read back chunks %v, want %v: after the failure it goes on from the last chunk's end", chunks, want)
	}
}

// TestReplacedStreamsAreForgotten (issue 39: state bounded): every start of an upstream database
// forks its streams, and the consumer kept every stream of a lineage for ever: one more per
// upstream restart, read and written with the lineage by every batch. A stream no record of which
// was met for the retention of keys is forgotten, as keys are: A, replaced by its fork Z, goes
// once Z's records have been met for a retention without one of A's; Z stays, and copies of its
// events are still skipped by number.
func TestReplacedStreamsAreForgotten(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	cfg.IdempotencyRetention = 3 * time.Second
	h.Start(cfg)
	ctx := context.Background()
	since := strconv.FormatInt(time.Now().Add(-time.Minute).UnixMilli(), 10)
	a := func(seq int) *kgo.Record {
		return streamRec(h.Topic, streamA, seq, rootR, 10*seq, "", "m"+strconv.Itoa(seq), "ok")
	}
	z := func(seq int) *kgo.Record { // Z keeps all of A's: its events are new ones
		return streamRec(h.Topic, streamZ, seq, rootR, 100+seq, " "+streamA+" 2 "+since, "z"+strconv.Itoa(seq), "ok")
	}
	kept := func() []string {
		var ids []string
		if err := h.Pool.QueryRow(ctx, `SELECT coalesce(array_agg(x.s->>'id' ORDER BY x.n), '{}') FROM kafkapg.idempotency_lineages l,
			jsonb_array_elements(l.state->'streams') WITH ORDINALITY AS x(s, n) WHERE l.consumer_group = $1 AND l.root = $2`, h.Group, rootR).Scan(&ids); err != nil {
			t.Fatal(err)
		}
		return ids
	}
	k.Produce(t, a(1), a(2), z(1))
	waitConsumed(t, h, 3)
	if got := kept(); fmt.Sprint(got) != fmt.Sprint([]string{streamA, streamZ}) {
		t.Fatalf("the lineage keeps %v after Z forked A, want A and Z", got)
	}
	// Z's records keep coming; A's do not.
	n := 3
	for seq := 2; ; seq++ {
		k.Produce(t, z(seq))
		n++
		waitConsumed(t, h, int64(n))
		if got := kept(); fmt.Sprint(got) == fmt.Sprint([]string{streamZ}) {
			break
		} else if seq > 12 { // a record every half second: 5 s past the retention
			t.Fatalf("the lineage keeps %v after Z's records were met for %d s without one of A's (retention %v)", got, seq/2, cfg.IdempotencyRetention)
		}
		time.Sleep(500 * time.Millisecond)
	}
	k.Produce(t, z(2), z(3)) // a relay publishes Z's again: copies, by number
	waitConsumed(t, h, int64(n+2))
	for mid, c := range appliedMids(t, h) {
		if c != 1 {
			t.Errorf("event %s applied %d times", mid, c)
		}
	}
}

// TestAKeyedEventMeetsItsUnnumberedCopy (issue 39, the release before beside this one upstream):
// a process of the upstream's release before emitted an event unnumbered (applied here by its
// message id); the upstream's database lost that commit, and this release applied the source
// record again while its upgrade window was open, numbering the event in a stream this consumer
// never saw. The stream header says Keyed, and the event is decided by key as well: skipped.
// Decided by its number alone (a new stream, number 1), it was applied twice.
func TestAKeyedEventMeetsItsUnnumberedCopy(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	h.Start(cfg)
	k.Produce(t, &kgo.Record{Topic: h.Topic, Partition: 0, Key: []byte("m1"), Value: []byte("ok"),
		Headers: []kgo.RecordHeader{{Key: sink.HeaderMessageID, Value: []byte("m1")}}})
	k.Produce(t, streamRec(h.Topic, streamA, 1, rootR, 10, " k", "m1", "ok"))
	k.Produce(t, streamRec(h.Topic, streamA, 2, rootR, 11, " k", "m2", "ok"))
	waitConsumed(t, h, 3)
	time.Sleep(500 * time.Millisecond)
	if got := appliedMids(t, h); fmt.Sprint(got) != "map[m1:1 m2:1]" {
		t.Fatalf("applied %v, want m1 and m2 once each", got)
	}
}
