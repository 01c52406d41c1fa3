package processor_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
)

// The tests of issue 43's protocol: operators' pauses and positions obeyed by running processors.
// The control rows are written as the ops code writes them (internal/ops), in SQL, here.

// applications records every application of a record, in the order applied (id).
const applicationsSQL = `CREATE TABLE applications (id bigserial PRIMARY KEY, partition int NOT NULL, "offset" bigint NOT NULL)`

func recordApplications() processor.Handler {
	return processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
		_, err := tx.Exec(ctx, `INSERT INTO applications (partition, "offset") VALUES ($1, $2)`, rec.Partition, rec.Offset)
		return err
	})
}

func newPositionsHarness(t *testing.T, k *testenv.Kafka, partitions int32) *testkit.Harness {
	h := testkit.New(t, k, partitions)
	if _, err := h.Pool.Exec(context.Background(), applicationsSQL); err != nil {
		t.Fatal(err)
	}
	return h
}

// produceTo produces n records to partition p of the harness's topic.
func produceTo(h *testkit.Harness, p int32, n int) {
	h.T.Helper()
	cl := h.K.Client(h.T, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	recs := make([]*kgo.Record, n)
	for i := range recs {
		recs[i] = &kgo.Record{Topic: h.Topic, Partition: p, Key: []byte(strconv.Itoa(i)), Value: []byte("v")}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		h.T.Fatal(err)
	}
}

// produceKeys produces a record of each key, in order, to partition 0 of the harness's topic; a
// record's value is its index.
func produceKeys(h *testkit.Harness, keys ...string) {
	h.T.Helper()
	cl := h.K.Client(h.T, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	recs := make([]*kgo.Record, len(keys))
	for i, k := range keys {
		recs[i] = &kgo.Record{Topic: h.Topic, Key: []byte(k), Value: []byte(strconv.Itoa(i))}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		h.T.Fatal(err)
	}
}

// applied returns the offsets of partition p applied, in the order applied.
func applied(h *testkit.Harness, p int32) []int64 {
	h.T.Helper()
	rows, _ := h.Pool.Query(context.Background(), `SELECT "offset" FROM applications WHERE partition = $1 ORDER BY id`, p)
	out, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		h.T.Fatal(err)
	}
	return out
}

func waitApplied(h *testkit.Harness, p int32, n int, timeout time.Duration) {
	h.T.Helper()
	testenv.Eventually(h.T, timeout, func() error {
		if got := len(applied(h, p)); got < n {
			return fmt.Errorf("partition %d: %d of %d applications", p, got, n)
		}
		return nil
	})
}

func pause(h *testkit.Harness, p int32) {
	h.T.Helper()
	if _, err := h.Pool.Exec(context.Background(), `INSERT INTO kafkapg.pauses (consumer_group, topic, partition, paused_by, reason)
		VALUES ($1, $2, $3, 'test', 'the test pauses it')`, h.Group, h.Topic, p); err != nil {
		h.T.Fatal(err)
	}
}

func resume(h *testkit.Harness, p int32) {
	h.T.Helper()
	if _, err := h.Pool.Exec(context.Background(), `DELETE FROM kafkapg.pauses WHERE consumer_group = $1 AND topic = $2 AND partition = $3`,
		h.Group, h.Topic, p); err != nil {
		h.T.Fatal(err)
	}
}

// setPosition sets partition p's position to to, as the ops code does: the row locked, the change
// audited, the position and position_change written in one transaction, the token untouched.
func setPosition(h *testkit.Harness, p int32, to int64) {
	h.T.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, h.Pool, func(tx pgx.Tx) error {
		var from *int64
		err := tx.QueryRow(ctx, `SELECT next_offset FROM kafkapg.offsets WHERE consumer_group = $1 AND topic = $2 AND partition = $3 FOR UPDATE`,
			h.Group, h.Topic, p).Scan(&from)
		if err != nil {
			return err
		}
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO kafkapg.position_changes (consumer_group, topic, partition, from_offset, to_offset, actor, reason)
			VALUES ($1, $2, $3, $4, $5, 'test', 'the test moves it') RETURNING id`, h.Group, h.Topic, p, from, to).Scan(&id); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE kafkapg.offsets SET next_offset = $4, position_change = $5 WHERE consumer_group = $1 AND topic = $2 AND partition = $3`,
			h.Group, h.Topic, p, to, id)
		return err
	})
	if err != nil {
		h.T.Fatal(err)
	}
}

func span(from, to int64) []int64 {
	var out []int64
	for o := from; o < to; o++ {
		out = append(out, o)
	}
	return out
}

// TestRewindOfAnIdlePartition: a partition caught up and idle, set back by an operator, applies
// the range again, in order, once, without a restart of the process: the control loop finds the
// position_change and restarts the partition from the stored position.
func TestRewindOfAnIdlePartition(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newPositionsHarness(t, k, 1)
		r := h.Start(h.Config(recordApplications()))
		produceTo(h, 0, 10)
		waitApplied(h, 0, 10, 30*time.Second)
		time.Sleep(1500 * time.Millisecond) // idle: nothing more comes
		setPosition(h, 0, 3)
		waitApplied(h, 0, 17, 30*time.Second)
		time.Sleep(1500 * time.Millisecond) // nothing more than the range
		want := append(span(0, 10), span(3, 10)...)
		if got := applied(h, 0); !slices.Equal(got, want) {
			t.Fatalf("applied %v, want %v", got, want)
		}
		if n := r.Counter("kafkapg_forgotten_partitions_total"); n != 0 {
			t.Errorf("kafkapg_forgotten_partitions_total = %v: an operator's rewind is not a loss", n)
		}
	})
}

// TestForwardSetSkips: a position set forward skips the range, and nothing of it is applied, even
// by the owner that fetched it before the set (its advance fails: the stored next is not its own).
func TestForwardSetSkips(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newPositionsHarness(t, k, 1)
		h.Start(h.Config(recordApplications()))
		produceTo(h, 0, 5)
		waitApplied(h, 0, 5, 30*time.Second)
		setPosition(h, 0, 12)
		produceTo(h, 0, 15) // offsets 5..19
		waitApplied(h, 0, 5+8, 30*time.Second)
		time.Sleep(1500 * time.Millisecond)
		want := append(span(0, 5), span(12, 20)...)
		if got := applied(h, 0); !slices.Equal(got, want) {
			t.Fatalf("applied %v, want %v", got, want)
		}
	})
}

// TestRewindOverSkippedRecords: a rewind over records a forward set skipped applies them, in
// offset order with the rest of its range, and so after the records past the skip that the group
// applied before the rewind (the runbook says so; the chaos run's order check allows for it).
func TestRewindOverSkippedRecords(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newPositionsHarness(t, k, 1)
		h.Start(h.Config(recordApplications()))
		produceTo(h, 0, 5)
		waitApplied(h, 0, 5, 30*time.Second)
		setPosition(h, 0, 8)
		produceTo(h, 0, 7) // offsets 5..11: 5..7 skipped
		waitApplied(h, 0, 5+4, 30*time.Second)
		setPosition(h, 0, 3)
		waitApplied(h, 0, 5+4+9, 30*time.Second)
		time.Sleep(1500 * time.Millisecond)
		want := slices.Concat(span(0, 5), span(8, 12), span(3, 12))
		if got := applied(h, 0); !slices.Equal(got, want) {
			t.Fatalf("applied %v, want %v", got, want)
		}
	})
}

// TestPauseIsObeyedByReplicasAndAfterRebalances: a partition paused before the group starts is
// not applied by its first owner, nor after a rebalance that a new replica causes, while the
// other partition goes on; once resumed, its records are applied once each, in order.
func TestPauseIsObeyedByReplicasAndAfterRebalances(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newPositionsHarness(t, k, 2)
		pause(h, 0)
		h.Start(h.Config(recordApplications()))
		produceTo(h, 0, 10)
		produceTo(h, 1, 10)
		waitApplied(h, 1, 10, 30*time.Second)
		h.Start(h.Config(recordApplications())) // a new replica: a rebalance
		produceTo(h, 1, 10)
		waitApplied(h, 1, 20, 60*time.Second)
		time.Sleep(2 * time.Second)
		if got := applied(h, 0); len(got) != 0 {
			t.Fatalf("paused partition 0 applied %v", got)
		}
		resume(h, 0)
		waitApplied(h, 0, 10, 30*time.Second)
		time.Sleep(1500 * time.Millisecond)
		if got := applied(h, 0); !slices.Equal(got, span(0, 10)) {
			t.Fatalf("partition 0 applied %v after the resume, want %v", got, span(0, 10))
		}
	})
}

// TestPausedPartitionIsNotStalled: a partition paused with records waiting (fetched before the
// pause) is counted in kafkapg_paused_partitions and never in kafkapg_stalled_partitions, however
// long the pause lasts; the pause's age is in kafkapg_partition_paused_seconds.
func TestPausedPartitionIsNotStalled(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newPositionsHarness(t, k, 1)
		release := make(chan struct{})
		inner := recordApplications()
		cfg := h.Config(processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			if rec.Offset == 0 {
				<-release // the other records are fetched meanwhile, and wait
			}
			return inner.Handle(ctx, tx, rec)
		}))
		cfg.BatchMaxRecords = 1
		cfg.StallTimeout = time.Second
		r := h.Start(cfg)
		produceTo(h, 0, 5)
		time.Sleep(time.Second)
		pause(h, 0)
		time.Sleep(1500 * time.Millisecond) // the control loop reads it
		close(release)
		// Offset 0's batch was in flight when the pause came: its advance may find the pause
		// (then it waits, applied after the resume) or commit first. Nothing past it is applied.
		deadline := time.Now().Add(8 * time.Second) // past StallTimeout and a stats round or more
		for time.Now().Before(deadline) {
			if n := r.Gauge("kafkapg_stalled_partitions"); n != 0 {
				t.Fatalf("kafkapg_stalled_partitions = %v while the partition is paused", n)
			}
			time.Sleep(200 * time.Millisecond)
		}
		if n := r.Gauge("kafkapg_paused_partitions"); n != 1 {
			t.Errorf("kafkapg_paused_partitions = %v, want 1", n)
		}
		if s := r.Gauge("kafkapg_partition_paused_seconds"); s < 5 {
			t.Errorf("kafkapg_partition_paused_seconds = %v, want the pause's age (> 5)", s)
		}
		if got := applied(h, 0); len(got) > 1 || len(got) == 1 && got[0] != 0 {
			t.Fatalf("applied %v while paused, want at most the record in flight, [0]", got)
		}
		resume(h, 0)
		waitApplied(h, 0, 5, 30*time.Second)
		if got := applied(h, 0); !slices.Equal(got, span(0, 5)) {
			t.Fatalf("applied %v, want %v", got, span(0, 5))
		}
	})
}

// TestNoWindowPastAPositionSet: a position set while the owner has a batch in flight (its
// transaction holds the row: the set waits for it) and more records fetched: the owner applies
// none of those past the set; it starts again from the new position. Without the advance's
// expected-offset check, it applied its fetched records [from, 10) past a skip to 8.
func TestNoWindowPastAPositionSet(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newPositionsHarness(t, k, 1)
		release := make(chan struct{})
		inner := recordApplications()
		cfg := h.Config(processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			if rec.Offset == 0 {
				<-release
			}
			return inner.Handle(ctx, tx, rec)
		}))
		cfg.BatchMaxRecords = 1
		h.Start(cfg)
		produceTo(h, 0, 10)
		time.Sleep(time.Second) // offset 0's transaction holds the row; 1..9 are fetched
		set := make(chan struct{})
		go func() {
			defer close(set)
			setPosition(h, 0, 8)
		}()
		time.Sleep(300 * time.Millisecond) // the set waits for the row
		close(release)
		<-set
		var from int64
		if err := h.Pool.QueryRow(context.Background(), `SELECT from_offset FROM kafkapg.position_changes`).Scan(&from); err != nil {
			t.Fatal(err)
		}
		waitApplied(h, 0, int(from)+2, 30*time.Second)
		time.Sleep(1500 * time.Millisecond)
		want := append(span(0, from), 8, 9)
		if got := applied(h, 0); !slices.Equal(got, want) {
			t.Fatalf("applied %v, want %v (the set moved %d to 8)", got, want, from)
		}
	})
}

// TestPauseHoldsRetryTiersAndHeldRecords: a pause of a source partition holds back its retry
// tier's same partition (the copy of a failed record, due meanwhile) and the records held behind
// its key; after the resume, the key's records are applied in order.
func TestPauseHoldsRetryTiersAndHeldRecords(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newPositionsHarness(t, k, 1)
		var failing atomic.Bool
		var attempts atomic.Int64 // of offset 0
		failing.Store(true)
		inner := recordApplications()
		cfg := h.Config(processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			if rec.Offset == 0 {
				attempts.Add(1)
			}
			if rec.Offset == 0 && failing.Load() {
				return errors.New("fails until the test says")
			}
			return inner.Handle(ctx, tx, rec)
		}))
		cfg.LocalAttempts = 1
		cfg.RetryTiers = []time.Duration{time.Second, time.Second, time.Second}
		h.Start(cfg)
		produceKeys(h, "a", "a", "b", "a")
		waitApplied(h, 0, 1, 30*time.Second) // "b"; "a"'s wait behind offset 0, in a tier
		pause(h, 0)
		time.Sleep(1500 * time.Millisecond) // the control loop reads it
		before := attempts.Load()
		time.Sleep(2 * time.Second) // the copy of offset 0 is due many times over
		if n := attempts.Load() - before; n != 0 {
			t.Fatalf("offset 0 was tried %d times in its retry tiers while paused", n)
		}
		failing.Store(false)
		time.Sleep(1500 * time.Millisecond)
		if got := applied(h, 0); !slices.Equal(got, []int64{2}) {
			t.Fatalf("applied %v while paused, want [2]", got)
		}
		resume(h, 0)
		waitApplied(h, 0, 4, 30*time.Second)
		if got := applied(h, 0); !slices.Equal(got, []int64{2, 0, 1, 3}) {
			t.Fatalf("applied %v, want [2 0 1 3]", got)
		}
	})
}

// countingPreparer records applications and counts prepares.
type countingPreparer struct {
	processor.Handler
	prepares *atomic.Int64
}

func (h countingPreparer) Prepare(ctx context.Context, rec *processor.Record) error {
	h.prepares.Add(1)
	return nil
}

// TestPauseStopsConcurrentPrepares: a partition whose handler prepares concurrently
// (Config.Concurrency) prepares nothing more and applies nothing while paused, and applies its
// records once each, in order, after the resume. What it shows is the fetch paused: records
// produced after the pause never reach the worker. That the window takes no record already
// queued when the pause is read (window.take) it does not show: it passes without that.
func TestPauseStopsConcurrentPrepares(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newPositionsHarness(t, k, 1)
		var prepares atomic.Int64
		cfg := h.Config(countingPreparer{Handler: recordApplications(), prepares: &prepares})
		cfg.Concurrency = 8
		h.Start(cfg)
		produceTo(h, 0, 5)
		waitApplied(h, 0, 5, 30*time.Second)
		pause(h, 0)
		time.Sleep(1500 * time.Millisecond) // the control loop reads it
		before := prepares.Load()
		produceTo(h, 0, 10)
		time.Sleep(2 * time.Second)
		if n := prepares.Load() - before; n != 0 {
			t.Fatalf("%d records prepared while paused", n)
		}
		if got := applied(h, 0); !slices.Equal(got, span(0, 5)) {
			t.Fatalf("applied %v while paused, want %v", got, span(0, 5))
		}
		resume(h, 0)
		waitApplied(h, 0, 15, 30*time.Second)
		if got := applied(h, 0); !slices.Equal(got, span(0, 15)) {
			t.Fatalf("applied %v, want %v", got, span(0, 15))
		}
	})
}

// TestRewindOverRecordsStillHeld: a rewind over records that still wait behind their key (in
// held_records) reads them again; each is held once, not twice (before, the second hold of the
// same offset broke held_records' primary key and the partition retried in place for ever), and
// applied once when its key is released. The other key's record is applied again, as a rewind
// asks, and so is the key's dead-lettered head, read again behind itself.
func TestRewindOverRecordsStillHeld(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		ctx := context.Background()
		h := newPositionsHarness(t, k, 1)
		var poison atomic.Bool
		poison.Store(true)
		inner := recordApplications()
		cfg := h.Config(processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			if rec.Offset == 0 && poison.Load() {
				return processor.Permanent(errors.New("poison until the test says"))
			}
			return inner.Handle(ctx, tx, rec)
		}))
		cfg.OnDeadLetter = processor.OnDeadLetterBlock
		h.Start(cfg)
		produceKeys(h, "a", "a", "b", "a")
		heldOffsets := func() []int64 {
			rows, _ := h.Pool.Query(ctx, `SELECT "offset" FROM kafkapg.held_records WHERE consumer_group = $1 ORDER BY "offset"`, h.Group)
			out, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				t.Fatal(err)
			}
			return out
		}
		testenv.Eventually(t, 30*time.Second, func() error {
			if got, held := applied(h, 0), heldOffsets(); !slices.Equal(got, []int64{2}) || !slices.Equal(held, []int64{1, 3}) {
				return fmt.Errorf("applied %v, held %v; want [2] applied, 1 and 3 held behind dead-lettered 0", got, held)
			}
			return nil
		})

		setPosition(h, 0, 0)
		testenv.Eventually(t, 30*time.Second, func() error {
			var next *int64
			if err := h.Pool.QueryRow(ctx, `SELECT next_offset FROM kafkapg.offsets WHERE consumer_group = $1 AND topic = $2 AND partition = 0`,
				h.Group, h.Topic).Scan(&next); err != nil {
				return err
			}
			if got := applied(h, 0); next == nil || *next != 4 || !slices.Equal(got, []int64{2, 2}) {
				return fmt.Errorf("next offset %v, applied %v; want the range read again: 2 applied again, the position at 4", fmtOffset(next), got)
			}
			if held := heldOffsets(); !slices.Equal(held, []int64{0, 1, 3}) {
				return fmt.Errorf("held %v, want [0 1 3]: 0 read again behind its blocked key, 1 and 3 still held once", held)
			}
			return nil
		})

		poison.Store(false)
		if n, err := processor.ReleaseBlockedKeys(ctx, h.Pool, "kafkapg", h.Group, h.Topic, 0, []byte("a")); err != nil || n != 1 {
			t.Fatalf("ReleaseBlockedKeys(a) = %d, %v; want 1 key released", n, err)
		}
		waitApplied(h, 0, 5, 30*time.Second)
		time.Sleep(time.Second)
		if got := applied(h, 0); !slices.Equal(got, []int64{2, 2, 0, 1, 3}) {
			t.Fatalf("applied %v, want [2 2 0 1 3]", got)
		}
	})
}

func fmtOffset(o *int64) string {
	if o == nil {
		return "none"
	}
	return strconv.FormatInt(*o, 10)
}

// TestRewindOverARecordInItsRetryTiers: a rewind over a record that is still in its retry tiers
// (keyless, so nothing waits behind it) reads it again; failing again, it is not sent round the
// tiers a second time beside the first (before, its retry state's primary key refused the second
// and the partition retried in place for ever): it goes on once, in the tiers it is in.
func TestRewindOverARecordInItsRetryTiers(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		ctx := context.Background()
		h := newPositionsHarness(t, k, 1)
		inner := recordApplications()
		cfg := h.Config(processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			if rec.Offset == 0 {
				return errors.New("fails")
			}
			return inner.Handle(ctx, tx, rec)
		}))
		cfg.LocalAttempts = 1
		cfg.RetryTiers = []time.Duration{time.Hour}
		h.Start(cfg)
		cl := h.K.Client(h.T, kgo.RecordPartitioner(kgo.ManualPartitioner()))
		recs := []*kgo.Record{
			{Topic: h.Topic, Value: []byte("0")},
			{Topic: h.Topic, Value: []byte("1")},
			{Topic: h.Topic, Value: []byte("2")},
		}
		if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
		retrying := func() (n int, attempt int) {
			if err := h.Pool.QueryRow(ctx, `SELECT count(*), coalesce(max(attempt), 0) FROM kafkapg.retries WHERE consumer_group = $1`, h.Group).Scan(&n, &attempt); err != nil {
				t.Fatal(err)
			}
			return n, attempt
		}
		testenv.Eventually(t, 30*time.Second, func() error {
			if got := applied(h, 0); !slices.Equal(got, []int64{1, 2}) {
				return fmt.Errorf("applied %v, want [1 2], 0 in its tier", got)
			}
			if n, _ := retrying(); n != 1 {
				return fmt.Errorf("%d records in the retry tiers, want offset 0", n)
			}
			return nil
		})

		setPosition(h, 0, 0)
		testenv.Eventually(t, 30*time.Second, func() error {
			var next *int64
			if err := h.Pool.QueryRow(ctx, `SELECT next_offset FROM kafkapg.offsets WHERE consumer_group = $1 AND topic = $2 AND partition = 0`,
				h.Group, h.Topic).Scan(&next); err != nil {
				return err
			}
			if got := applied(h, 0); next == nil || *next != 3 || !slices.Equal(got, []int64{1, 2, 1, 2}) {
				return fmt.Errorf("next offset %v, applied %v; want the range read again: 1 and 2 applied again, the position at 3", fmtOffset(next), got)
			}
			return nil
		})
		if n, attempt := retrying(); n != 1 || attempt != 2 {
			t.Fatalf("%d records in the retry tiers, at attempt %d; want offset 0 once, its next attempt still 2", n, attempt)
		}
	})
}

// TestAnAdvanceFoundPausedWaitsQuietly: a batch taken before the control loop read a pause finds
// it at its advance (offsets.ErrPaused). Nothing of it is applied; the worker tries again once a
// control interval, counting neither an infrastructure retry nor an internal error nor a stall,
// and goes on from there after the resume.
func TestAnAdvanceFoundPausedWaitsQuietly(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newPositionsHarness(t, k, 1)
		inner := recordApplications()
		entered, release := make(chan struct{}), make(chan struct{})
		cfg := h.Config(processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			if rec.Offset == 2 {
				close(entered)
				<-release
			}
			return inner.Handle(ctx, tx, rec)
		}))
		cfg.BatchMaxRecords = 1
		r := h.Start(cfg)
		produceTo(h, 0, 6)
		<-entered // offset 2's batch advanced before the pause; 3..5 are queued behind it
		pause(h, 0)
		close(release)
		waitApplied(h, 0, 3, 30*time.Second)
		time.Sleep(3 * time.Second) // offset 3's advance is refused three times or so
		if got := applied(h, 0); !slices.Equal(got, span(0, 3)) {
			t.Fatalf("applied %v while paused, want %v: the batch in flight, nothing after it", got, span(0, 3))
		}
		for _, m := range []string{"kafkapg_infrastructure_retries_total", "kafkapg_internal_errors_total"} {
			if n := r.Counter(m); n != 0 {
				t.Errorf("%s = %v: an advance refused by a pause is not a failure", m, n)
			}
		}
		if n := r.Gauge("kafkapg_stalled_partitions"); n != 0 {
			t.Errorf("kafkapg_stalled_partitions = %v while the partition is paused", n)
		}
		resume(h, 0)
		waitApplied(h, 0, 6, 30*time.Second)
		if got := applied(h, 0); !slices.Equal(got, span(0, 6)) {
			t.Fatalf("applied %v, want %v", got, span(0, 6))
		}
	})
}

// gatedPreparer records applications; its Prepare of offsets from gateFrom on waits for gate.
type gatedPreparer struct {
	processor.Handler
	gateFrom int64
	gate     chan struct{}
	prepared *atomic.Int64 // prepares of offsets from gateFrom on that began
}

func (h gatedPreparer) Prepare(ctx context.Context, rec *processor.Record) error {
	if rec.Offset >= h.gateFrom {
		h.prepared.Add(1)
		select {
		case <-h.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// TestPositionSetWhileRecordsArePrepared: a partition whose handler prepares concurrently
// (Config.Concurrency) holds records of its window prepared or being prepared when an operator
// sets its position, forward past them or back before them. Forward, none of them is applied;
// back, the range is applied again and then they are, once each: whether a prepare ends before or
// after the set, the worker starts again from the new position with a new window.
func TestPositionSetWhileRecordsArePrepared(t *testing.T) {
	for _, tc := range []struct {
		name string
		to   int64
		want []int64
	}{
		{"forward", 12, append(span(0, 5), span(12, 20)...)},
		{"back", 2, append(span(0, 5), span(2, 20)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
				t.Parallel()
				h := newPositionsHarness(t, k, 1)
				var prepared atomic.Int64
				gate := make(chan struct{})
				cfg := h.Config(gatedPreparer{Handler: recordApplications(), gateFrom: 5, gate: gate, prepared: &prepared})
				cfg.Concurrency = 8
				h.Start(cfg)
				produceTo(h, 0, 20)
				waitApplied(h, 0, 5, 30*time.Second)
				testenv.Eventually(t, 30*time.Second, func() error {
					if n := prepared.Load(); n < 8 {
						return fmt.Errorf("%d prepares of offsets 5 on began, want the window's 8", n)
					}
					return nil
				})
				setPosition(h, 0, tc.to)
				time.Sleep(1500 * time.Millisecond) // the control loop finds the change
				close(gate)
				waitApplied(h, 0, len(tc.want), 30*time.Second)
				time.Sleep(1500 * time.Millisecond)
				if got := applied(h, 0); !slices.Equal(got, tc.want) {
					t.Fatalf("applied %v, want %v", got, tc.want)
				}
			})
		})
	}
}
