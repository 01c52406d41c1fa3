package offsets_test

import (
	"context"
	"errors"
	"testing"

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
