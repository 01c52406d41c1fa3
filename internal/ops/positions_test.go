package ops_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
)

var positionsOperator = ops.Actor{Name: "ana", Reason: "downstream fixed at 14:10"}

// wantUsage fails unless err is a usage error whose text has want.
func wantUsage(t *testing.T, err error, want string) {
	t.Helper()
	if !errors.Is(err, ops.ErrUsage) || !strings.Contains(err.Error(), want) {
		t.Fatalf("err = %v, want a usage error saying %q", err, want)
	}
}

// TestPauseAndResume: a pause is written only with execute and a reason, is listed on every
// partition it holds with who paused and why, is audited, and ends with a resume; a topic not
// the group's and a partition Kafka does not have are refused.
func TestPauseAndResume(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		e := newKeysEnv(t)
		ctx := context.Background()
		topic := k.CreateTopic(t, 2)
		e.ops = e.ops.WithTopics(topic)
		kc := k.Client(t)
		paused := func() int64 {
			return scalar[int64](e, `SELECT count(*) FROM kafkapg.pauses WHERE consumer_group = $1`, keysGroup)
		}

		c, err := e.ops.Pause(ctx, kc, topic, 1, false, ops.Actor{})
		if err != nil || !c.Changed || c.Executed || paused() != 0 {
			t.Fatalf("dry run: %+v, %v; %d pauses", c, err, paused())
		}
		_, err = e.ops.Pause(ctx, kc, topic, 1, true, ops.Actor{Name: "ana"})
		wantUsage(t, err, "a reason is required")
		_, err = e.ops.Pause(ctx, kc, topic, 7, true, positionsOperator)
		wantUsage(t, err, "has no partition 7")
		_, err = e.ops.Pause(ctx, kc, topic+".other", ops.AllPartitions, true, positionsOperator)
		wantUsage(t, err, "not a source topic")

		audits := e.audits()
		if c, err = e.ops.Pause(ctx, kc, topic, 1, true, positionsOperator); err != nil || !c.Executed {
			t.Fatalf("pause: %+v, %v", c, err)
		}
		if e.audits() != audits+1 {
			t.Errorf("a pause wrote %d audit rows", e.audits()-audits)
		}
		if got := scalar[string](e, `SELECT action || ' ' || actor || ' ' || (detail->>'partition') FROM kafkapg.audit ORDER BY id DESC LIMIT 1`); got != "pause_partition ana 1" {
			t.Errorf("the pause's audit row: %q", got)
		}
		list, _, err := e.ops.Partitions(ctx, kc)
		if err != nil || len(list) != 2 {
			t.Fatalf("Partitions: %+v, %v", list, err)
		}
		if list[0].Paused != nil || list[1].Paused == nil || list[1].Paused.By != "ana" || list[1].Paused.Reason != positionsOperator.Reason {
			t.Errorf("listed as paused: %+v, %+v", list[0].Paused, list[1].Paused)
		}

		if c, err = e.ops.Pause(ctx, kc, topic, ops.AllPartitions, true, positionsOperator); err != nil || !c.Executed {
			t.Fatalf("pause the topic: %+v, %v", c, err)
		}
		if c, err = e.ops.Pause(ctx, kc, topic, 0, true, positionsOperator); err != nil || c.Changed {
			t.Errorf("pausing a partition of a paused topic: %+v, %v; want nothing done", c, err)
		}
		_, err = e.ops.Resume(ctx, kc, topic, 0, true, positionsOperator)
		wantUsage(t, err, "paused as a whole")
		if c, err = e.ops.Resume(ctx, kc, topic, ops.AllPartitions, true, positionsOperator); err != nil || !c.Executed || paused() != 0 {
			t.Fatalf("resume the topic: %+v, %v; %d pauses left", c, err, paused())
		}
		if c, err = e.ops.Resume(ctx, kc, topic, 1, true, positionsOperator); err != nil || c.Changed {
			t.Errorf("resuming what is not paused: %+v, %v", c, err)
		}
	})
}

// TestSetPositions: a dry run says where each partition is and would go and how many records
// that applies again or skips, changing nothing; executed, it moves the stored position, records
// the change (from the position at that moment) in position_changes and offsets.position_change,
// and audits it. Targets past the log's end or before its start are refused.
func TestSetPositions(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		e := newKeysEnv(t)
		ctx := context.Background()
		topic := k.CreateTopic(t, 2)
		e.ops = e.ops.WithTopics(topic)
		kc := k.Client(t)
		base := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
		var recs []*kgo.Record
		for i := range 10 {
			for p := range int32(2) {
				recs = append(recs, &kgo.Record{Topic: topic, Partition: p, Value: []byte("v"), Timestamp: base.Add(time.Duration(i) * time.Minute)})
			}
		}
		if err := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner())).ProduceSync(ctx, recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
		var del kadm.Offsets
		del.Add(kadm.Offset{Topic: topic, Partition: 1, At: 2})
		if resp, err := kadm.NewClient(kc).DeleteRecords(ctx, del); err != nil || resp.Error() != nil {
			t.Fatalf("delete records: %v, %v", err, resp.Error())
		}
		e.position(topic, 0, 8)
		off := func(n int64) *int64 { return &n }

		moves, err := e.ops.SetPositions(ctx, kc, ops.PositionPlan{Topic: topic, Partition: 0, Target: ops.Target{Offset: off(3)}}, false, ops.Actor{})
		if err != nil || len(moves) != 1 {
			t.Fatalf("dry run: %+v, %v", moves, err)
		}
		if m := moves[0]; m.From == nil || *m.From != 8 || m.To != 3 || m.Reapplied != 5 || m.Skipped != 0 || m.Executed || !strings.HasPrefix(m.KeyCheck, "not checked") {
			t.Errorf("dry run: %+v", m)
		}
		if got := scalar[int64](e, `SELECT next_offset FROM kafkapg.offsets WHERE topic = $1 AND partition = 0`, topic); got != 8 {
			t.Errorf("a dry run moved the position to %d", got)
		}

		for _, tc := range []struct {
			name   string
			plan   ops.PositionPlan
			actor  ops.Actor
			wanted string
		}{
			{"past the end", ops.PositionPlan{Topic: topic, Partition: 0, Target: ops.Target{Offset: off(11)}}, positionsOperator, "past the end"},
			{"before the start", ops.PositionPlan{Topic: topic, Partition: 1, Target: ops.Target{Offset: off(1)}}, positionsOperator, "before the start"},
			{"two targets", ops.PositionPlan{Topic: topic, Partition: 0, Target: ops.Target{Offset: off(1), End: true}}, positionsOperator, "exactly one target"},
			{"no reason", ops.PositionPlan{Topic: topic, Partition: 0, Target: ops.Target{End: true}}, ops.Actor{Name: "ana"}, "a reason is required"},
			{"no such partition", ops.PositionPlan{Topic: topic, Partition: 2, Target: ops.Target{End: true}}, positionsOperator, "has no partition 2"},
		} {
			_, err := e.ops.SetPositions(ctx, kc, tc.plan, true, tc.actor)
			if !errors.Is(err, ops.ErrUsage) || !strings.Contains(err.Error(), tc.wanted) {
				t.Errorf("%s: err = %v, want a usage error saying %q", tc.name, err, tc.wanted)
			}
		}

		// The position moved on since the dry run: the change records where it was then.
		e.exec(`UPDATE kafkapg.offsets SET next_offset = 9 WHERE topic = $1 AND partition = 0`, topic)
		audits := e.audits()
		moves, err = e.ops.SetPositions(ctx, kc, ops.PositionPlan{Topic: topic, Partition: 0, Target: ops.Target{Offset: off(3)}}, true, positionsOperator)
		if err != nil || len(moves) != 1 || !moves[0].Executed || *moves[0].From != 9 || moves[0].Reapplied != 6 {
			t.Fatalf("execute: %+v, %v", moves, err)
		}
		var next, change int64
		if err := e.pool.QueryRow(ctx, `SELECT next_offset, position_change FROM kafkapg.offsets WHERE topic = $1 AND partition = 0`, topic).Scan(&next, &change); err != nil {
			t.Fatal(err)
		}
		if next != 3 || change != moves[0].Change {
			t.Errorf("offsets: next_offset %d, position_change %d; want 3, %d", next, change, moves[0].Change)
		}
		var from, to int64
		var actor, reason string
		if err := e.pool.QueryRow(ctx, `SELECT from_offset, to_offset, actor, reason FROM kafkapg.position_changes WHERE id = $1`, change).Scan(&from, &to, &actor, &reason); err != nil {
			t.Fatal(err)
		}
		if from != 9 || to != 3 || actor != "ana" || reason != positionsOperator.Reason {
			t.Errorf("position_changes: %d → %d by %s (%s)", from, to, actor, reason)
		}
		if e.audits() != audits+1 {
			t.Errorf("a change wrote %d audit rows", e.audits()-audits)
		}

		// The whole topic, to the first record at or after a time: partition 1 has no stored
		// position yet; its row is made.
		moves, err = e.ops.SetPositions(ctx, kc, ops.PositionPlan{Topic: topic, Partition: ops.AllPartitions, Target: ops.Target{Time: base.Add(4*time.Minute + time.Second)}}, true, positionsOperator)
		if err != nil || len(moves) != 2 {
			t.Fatalf("by time: %+v, %v", moves, err)
		}
		if moves[0].To != 5 || moves[0].Skipped != 2 || moves[1].To != 5 || moves[1].From != nil {
			t.Errorf("by time: %+v", moves)
		}
		if got := scalar[int64](e, `SELECT next_offset FROM kafkapg.offsets WHERE topic = $1 AND partition = 1`, topic); got != 5 {
			t.Errorf("partition 1's position: %d, want 5", got)
		}
		moves, err = e.ops.SetPositions(ctx, kc, ops.PositionPlan{Topic: topic, Partition: 1, Target: ops.Target{Start: true}}, false, positionsOperator)
		if err != nil || moves[0].To != 2 || moves[0].Reapplied != 3 {
			t.Errorf("to the start: %+v, %v", moves, err)
		}
		moves, err = e.ops.SetPositions(ctx, kc, ops.PositionPlan{Topic: topic, Partition: 1, Target: ops.Target{End: true}}, false, positionsOperator)
		if err != nil || moves[0].To != 10 || moves[0].Skipped != 5 {
			t.Errorf("to the end: %+v, %v", moves, err)
		}
	})
}

// TestPositionsRefusedInTheUpgradeWindow: while processors of the release before may run, which
// know neither pauses nor position changes, neither is made.
func TestPositionsRefusedInTheUpgradeWindow(t *testing.T) {
	k := testenv.NewKfake(t)
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, pool, "kafkapg", schema.PreviousSchema); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	topic := k.CreateTopic(t, 1)
	o := ops.New(pool, "kafkapg", keysGroup).WithTopics(topic)
	_, err := o.Pause(ctx, k.Client(t), topic, ops.AllPartitions, true, positionsOperator)
	wantUsage(t, err, "upgrade window")
	_, err = o.SetPositions(ctx, k.Client(t), ops.PositionPlan{Topic: topic, Partition: 0, Target: ops.Target{End: true}}, true, positionsOperator)
	wantUsage(t, err, "upgrade window")
}

// TestTraceTellsPositionChanges: trace of an offset a forward change skipped says it was
// skipped, by whom, when and why (not applied); of one a rewind went back over, that it is
// applied again after the rewind, or will be.
func TestTraceTellsPositionChanges(t *testing.T) {
	k := testenv.NewKfake(t)
	e := newKeysEnv(t)
	ctx := context.Background()
	topic := k.CreateTopic(t, 1)
	e.ops = e.ops.WithTopics(topic)
	kc := k.Client(t)
	var recs []*kgo.Record
	for range 10 {
		recs = append(recs, &kgo.Record{Topic: topic, Value: []byte("v")})
	}
	k.Produce(t, recs...)
	e.position(topic, 0, 2)
	skip := ops.Actor{Name: "bo", Reason: "test events"}
	if _, err := e.ops.SetPositions(ctx, kc, ops.PositionPlan{Topic: topic, Partition: 0, Target: ops.Target{Offset: func() *int64 { n := int64(6); return &n }()}}, true, skip); err != nil {
		t.Fatal(err)
	}
	got := e.trace(ops.TraceQuery{Topic: topic, Partition: 0, Offset: 4}, kc).Records[0]
	if got.State != ops.TraceSkippedByOperator || !strings.Contains(got.Now, "bo set the partition's position from 2 to 6") || !strings.Contains(got.Now, "test events") {
		t.Errorf("a skipped offset: %s: %s", got.State, got.Now)
	}
	for _, st := range got.Steps {
		if st.Kind == ops.StepApplied {
			t.Errorf("a skipped offset has an applied step: %+v", got.Steps)
		}
	}
	if got := e.trace(ops.TraceQuery{Topic: topic, Partition: 0, Offset: 1}, kc).Records[0]; got.State != ops.TraceApplied {
		t.Errorf("an offset before the skipped range: %s: %s", got.State, got.Now)
	}

	rewind := ops.Actor{Name: "cy", Reason: "bug fixed"}
	if _, err := e.ops.SetPositions(ctx, kc, ops.PositionPlan{Topic: topic, Partition: 0, Target: ops.Target{Offset: func() *int64 { n := int64(5); return &n }()}}, true, rewind); err != nil {
		t.Fatal(err)
	}
	if got := e.trace(ops.TraceQuery{Topic: topic, Partition: 0, Offset: 5}, kc).Records[0]; got.State != ops.TraceNotConsumed || !strings.Contains(got.Now, "to be applied again: cy rewound") {
		t.Errorf("an offset rewound over, not passed again: %s: %s", got.State, got.Now)
	}
	e.exec(`UPDATE kafkapg.offsets SET next_offset = 8 WHERE topic = $1`, topic)
	if got := e.trace(ops.TraceQuery{Topic: topic, Partition: 0, Offset: 5}, kc).Records[0]; got.State != ops.TraceApplied || !strings.Contains(got.Now, "applied again after the rewind by cy") {
		t.Errorf("an offset rewound over, passed again: %s: %s", got.State, got.Now)
	}
	if got := e.trace(ops.TraceQuery{Topic: topic, Partition: 0, Offset: 4}, kc).Records[0]; got.State != ops.TraceSkippedByOperator {
		t.Errorf("a skipped offset the rewind did not reach: %s: %s", got.State, got.Now)
	}

	// A partition with no stored position, set to 3: the records before it were never applied.
	other := k.CreateTopic(t, 1)
	var more []*kgo.Record
	for range 5 {
		more = append(more, &kgo.Record{Topic: other, Value: []byte("v")})
	}
	k.Produce(t, more...)
	o := e.ops.WithTopics(topic, other)
	if _, err := o.SetPositions(ctx, kc, ops.PositionPlan{Topic: other, Partition: 0, Target: ops.Target{Offset: func() *int64 { n := int64(3); return &n }()}}, true, skip); err != nil {
		t.Fatal(err)
	}
	if got, err := o.Trace(ctx, ops.TraceQuery{Topic: other, Partition: 0, Offset: 1}, kc); err != nil || got.Records[0].State != ops.TraceSkippedByOperator ||
		!strings.Contains(got.Records[0].Now, "from none stored to 3") {
		t.Errorf("an offset before a first position set: %+v, %v", got.Records, err)
	}
}

// TestRewindDryRunChecksIdempotencyKeys: with the topic's key function and the key ring, a
// rewind's dry run reads the records of its range and counts those whose key the ring has (they
// would be skipped as duplicates); without a key function it says it did not check.
func TestRewindDryRunChecksIdempotencyKeys(t *testing.T) {
	k := testenv.NewKfake(t)
	e := newKeysEnv(t)
	ctx := context.Background()
	topic := k.CreateTopic(t, 1)
	kc := k.Client(t)
	var recs []*kgo.Record
	for i := range 6 {
		recs = append(recs, &kgo.Record{Topic: topic, Key: []byte(fmt.Sprint("k", i)), Value: []byte("v")})
	}
	recs = append(recs, &kgo.Record{Topic: topic, Value: []byte("no key")})
	k.Produce(t, recs...)
	e.position(topic, 0, 7)
	ring := keyring.New("kafkapg")
	e.tx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := ring.Record(ctx, tx, [][32]byte{keyring.Hash(keysGroup, topic, []byte("k1")), keyring.Hash(keysGroup, topic, []byte("k4"))})
		return err
	})
	byKey := func(r *kgo.Record) ([]byte, error) {
		if r.Key == nil {
			return nil, errors.New("no key")
		}
		return r.Key, nil
	}
	plan := ops.PositionPlan{Topic: topic, Partition: 0, Target: ops.Target{Start: true}}

	o := e.ops.WithTopics(topic).WithIdempotencyKeys(ops.IdempotencyKeys{Ring: ring, Of: func(string) func(*kgo.Record) ([]byte, error) { return byKey }})
	moves, err := o.SetPositions(ctx, kc, plan, false, ops.Actor{})
	if err != nil {
		t.Fatal(err)
	}
	if m := moves[0]; m.Reapplied != 7 || m.KeySkipped == nil || *m.KeySkipped != 2 || !strings.HasPrefix(m.KeyCheck, "2 of the 7 records read would be skipped") ||
		!strings.Contains(m.KeyCheck, "(1 have no key") {
		t.Errorf("with keys: %+v (%v)", m, m.KeySkipped)
	}
	o = e.ops.WithTopics(topic).WithIdempotencyKeys(ops.IdempotencyKeys{Ring: ring, Of: func(string) func(*kgo.Record) ([]byte, error) { return nil }})
	if moves, err = o.SetPositions(ctx, kc, plan, false, ops.Actor{}); err != nil || moves[0].KeySkipped != nil || !strings.HasPrefix(moves[0].KeyCheck, "not checked: no idempotency key function") {
		t.Errorf("without a key function: %+v, %v", moves, err)
	}
}

// TestRewindDryRunReadsABoundedWhole: a rewind's dry run over every partition of a topic reads at
// most ops.KeyCheckRecords records in all, not that many per partition: with two partitions of
// 6,000 records each, the first is checked and the second says the dry run's reads are spent.
func TestRewindDryRunReadsABoundedWhole(t *testing.T) {
	k := testenv.NewKfake(t)
	e := newKeysEnv(t)
	ctx := context.Background()
	topic := k.CreateTopic(t, 2)
	const each = 6_000 // two of them: more than KeyCheckRecords
	if 2*each <= ops.KeyCheckRecords || each > ops.KeyCheckRecords {
		t.Fatalf("the test needs %d records a partition to be under KeyCheckRecords (%d), twice over it", each, ops.KeyCheckRecords)
	}
	var recs []*kgo.Record
	for p := range int32(2) {
		for i := range each {
			recs = append(recs, &kgo.Record{Topic: topic, Partition: p, Key: []byte(fmt.Sprint("k", i)), Value: []byte("v")})
		}
	}
	if err := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner())).ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	e.position(topic, 0, each)
	e.position(topic, 1, each)
	byKey := func(r *kgo.Record) ([]byte, error) { return r.Key, nil }
	o := e.ops.WithTopics(topic).WithIdempotencyKeys(ops.IdempotencyKeys{Ring: keyring.New("kafkapg"), Of: func(string) func(*kgo.Record) ([]byte, error) { return byKey }})
	moves, err := o.SetPositions(ctx, k.Client(t), ops.PositionPlan{Topic: topic, Partition: ops.AllPartitions, Target: ops.Target{Start: true}}, false, ops.Actor{})
	if err != nil {
		t.Fatal(err)
	}
	if len(moves) != 2 {
		t.Fatalf("moves %+v", moves)
	}
	if m := moves[0]; m.KeySkipped == nil || !strings.HasPrefix(m.KeyCheck, fmt.Sprintf("0 of the %d records read", each)) {
		t.Errorf("partition 0: %q (%v)", m.KeyCheck, m.KeySkipped)
	}
	if m := moves[1]; m.KeySkipped != nil || !strings.Contains(m.KeyCheck, fmt.Sprintf("more than the %d a dry run still reads", ops.KeyCheckRecords-each)) {
		t.Errorf("partition 1: %q (%v): want the dry run's reads spent", m.KeyCheck, m.KeySkipped)
	}
}
