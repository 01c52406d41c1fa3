package offsets_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"

	"github.com/kafkapg/kafkapg/offsets"
)

// TestAdvanceFailsWhilePaused: a pause row of the source topic (a partition's, or the whole
// topic's) makes the advance update nothing, for the source partition and for a retry tier's same
// partition, with ErrPaused; other partitions go on; once the row is gone the same advance passes.
func TestAdvanceFailsWhilePaused(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	parts := []offsets.Partition{{Topic: "orders", Partition: 0}, {Topic: "orders", Partition: 1}, {Topic: "orders-retry-1", Partition: 0}}
	pos, err := s.Claim(ctx, pool, "A", parts)
	if err != nil {
		t.Fatal(err)
	}
	pos[2].Source = "orders"
	for _, tc := range []struct {
		name, pause string
		paused      []bool
	}{
		{"partition", `INSERT INTO kafkapg.pauses (consumer_group, topic, partition, paused_by, reason) VALUES ('g1', 'orders', 0, 'test', 'why')`, []bool{true, false, true}},
		{"topic", `INSERT INTO kafkapg.pauses (consumer_group, topic, partition, paused_by, reason) VALUES ('g1', 'orders', -1, 'test', 'why')`, []bool{true, true, true}},
		{"other group", `INSERT INTO kafkapg.pauses (consumer_group, topic, partition, paused_by, reason) VALUES ('g2', 'orders', -1, 'test', 'why')`, []bool{false, false, false}},
	} {
		if _, err := pool.Exec(ctx, tc.pause); err != nil {
			t.Fatal(err)
		}
		for i := range pos {
			err := advance(t, pool, s, pos[i], pos[i].Next+1)
			if tc.paused[i] {
				if !errors.Is(err, offsets.ErrPaused) {
					t.Fatalf("%s: advance %v: err = %v, want ErrPaused", tc.name, pos[i].TP(), err)
				}
				continue
			}
			if err != nil {
				t.Fatalf("%s: advance %v: %v", tc.name, pos[i].TP(), err)
			}
			pos[i] = pos[i].Advanced(pos[i].Next + 1)
		}
		if _, err := pool.Exec(ctx, `DELETE FROM kafkapg.pauses`); err != nil {
			t.Fatal(err)
		}
		for i := range pos {
			if tc.paused[i] {
				if err := advance(t, pool, s, pos[i], pos[i].Next+1); err != nil {
					t.Fatalf("%s: after the resume, advance %v: %v", tc.name, pos[i].TP(), err)
				}
				pos[i] = pos[i].Advanced(pos[i].Next + 1)
			}
		}
	}
}

// TestPositionChangeIsReadAndTold: a position set by an operator (as the ops code writes it) is
// returned by Load, Stored and the next claim, and the owner's advance says ErrMoved naming it.
func TestPositionChangeIsReadAndTold(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	tp := offsets.Partition{Topic: "a", Partition: 0}
	pos, _ := s.Claim(ctx, pool, "A", []offsets.Partition{tp})
	if err := advance(t, pool, s, pos[0], 10); err != nil {
		t.Fatal(err)
	}
	mine := pos[0].Advanced(10)
	if _, err := pool.Exec(ctx, `WITH c AS (INSERT INTO kafkapg.position_changes (consumer_group, topic, partition, from_offset, to_offset, actor, reason)
		VALUES ('g1', 'a', 0, 10, 4, 'test', 'why') RETURNING id)
		UPDATE kafkapg.offsets SET next_offset = 4, position_change = (SELECT id FROM c) WHERE consumer_group = 'g1' AND topic = 'a' AND partition = 0`); err != nil {
		t.Fatal(err)
	}
	if err := advance(t, pool, s, mine, 11); !errors.Is(err, offsets.ErrMoved) {
		t.Fatalf("advance after a position set: err = %v, want ErrMoved", err)
	}
	got, err := s.Load(ctx, pool, tp)
	if err != nil || got.PositionChange == 0 || got.Next != 4 {
		t.Fatalf("Load = %+v, %v; want next 4 and a position change", got, err)
	}
	st, err := s.Stored(ctx, pool, []offsets.Partition{tp})
	if err != nil || st[tp].PositionChange != got.PositionChange {
		t.Fatalf("Stored = %+v, %v; want position change %d", st, err, got.PositionChange)
	}
	again, err := s.Claim(ctx, pool, "B", []offsets.Partition{tp})
	if err != nil || again[0].PositionChange != got.PositionChange {
		t.Fatalf("Claim = %+v, %v; want position change %d", again, err, got.PositionChange)
	}
}

// TestAPauseInFlightStopsTheAdvanceWaitingForIt: a pause's transaction locks its partitions'
// rows before it commits (as ops.Pause does). An advance that waited for that lock checks the
// pauses again once it holds the row, with a snapshot that sees the pause, and fails with
// ErrPaused: the batch rolls back instead of committing just after the pause. (The advance's own
// check ran on a snapshot from before the pause's commit, and passed.) Both the batch path
// (QueueAdvance, QueuePauseCheck in one pipeline, as package sink runs it) and Advance.
func TestAPauseInFlightStopsTheAdvanceWaitingForIt(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	pos, err := s.Claim(ctx, pool, "A", []offsets.Partition{{Topic: "orders", Partition: 0}, {Topic: "orders", Partition: 1}})
	if err != nil {
		t.Fatal(err)
	}
	batched := func(pos offsets.Position, next int64) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			b := &pgx.Batch{}
			var advanced int64
			var paused bool
			s.QueueAdvance(b, pos, next).Exec(func(tag pgconn.CommandTag) error {
				advanced = tag.RowsAffected()
				return nil
			})
			s.QueuePauseCheck(b, pos, &paused)
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			if err := s.CheckAdvance(ctx, tx, pos, next, advanced); err != nil {
				return err
			}
			return s.CheckPaused(pos, paused)
		})
	}
	for i, run := range []func(offsets.Position, int64) error{batched, func(p offsets.Position, n int64) error { return advance(t, pool, s, p, n) }} {
		p := pos[i]
		pause, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pause.Exec(ctx, `INSERT INTO kafkapg.pauses (consumer_group, topic, partition, paused_by, reason) VALUES ('g1', 'orders', $1, 'test', 'why')`, p.Partition); err != nil {
			t.Fatal(err)
		}
		if _, err := pause.Exec(ctx, `SELECT 1 FROM kafkapg.offsets WHERE consumer_group = 'g1' AND partition = $1 FOR UPDATE`, p.Partition); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- run(p, p.Next+1) }()
		// The advance waits for the row: its statement began before the pause's commit.
		testenv.Eventually(t, 10*time.Second, func() error {
			var waiting int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE %offsets%'`).Scan(&waiting); err != nil || waiting == 0 {
				return fmt.Errorf("no advance waits for the row yet (%v)", err)
			}
			return nil
		})
		if err := pause.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-done; !errors.Is(err, offsets.ErrPaused) {
			t.Errorf("partition %d: an advance that waited for a pause's commit: err = %v, want ErrPaused (it would commit just after the pause)", p.Partition, err)
		}
		var next *int64
		if err := pool.QueryRow(ctx, `SELECT next_offset FROM kafkapg.offsets WHERE consumer_group = 'g1' AND topic = 'orders' AND partition = $1`, p.Partition).Scan(&next); err != nil || next != nil {
			t.Errorf("partition %d: stored next %v (%v), want none: the advance rolled back", p.Partition, next, err)
		}
	}
}
