package retrytopics_test

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// TestStuckReasons: each key is brought to its state through the Store's own writes (to a tier,
// applied, dead-lettered with Block); only the time since the key last changed is faked, by moving
// its updated_at back two hours (except ready-now's). A key is stuck (kafkapg_stuck_keys) when it
// has not changed for Older and the record it waits for cannot come back (orphaned), is in a
// configured tier and more than Older past due (overdue), or it is ready and nothing applied its
// held records (unapplied). A key whose record is not due, or due less than Older ago, a key made
// ready just now and a blocked key are not stuck.
func TestStuckReasons(t *testing.T) {
	s, pool := newStore(t)
	now := time.Now()
	scope := retrytopics.StuckScope{Older: time.Minute, Tiers: map[string]int{"orders": 1}}
	cases := []struct {
		key, topic string
		tier       int
		due        time.Duration // from now
		then       string        // "applied", "blocked" or nothing
		want       string        // the reason; "" for not stuck
	}{
		{key: "overdue", topic: "orders", tier: 1, due: -2 * time.Hour, want: retrytopics.StuckOverdue},
		{key: "not-due", topic: "orders", tier: 1, due: time.Hour},
		{key: "due-recently", topic: "orders", tier: 1, due: -30 * time.Second},
		{key: "tier-removed", topic: "orders", tier: 2, due: time.Hour, want: retrytopics.StuckOrphaned},
		{key: "not-consumed", topic: "gone", tier: 1, due: time.Hour, want: retrytopics.StuckOrphaned},
		{key: "ready", topic: "orders", tier: 1, due: -2 * time.Hour, then: "applied", want: retrytopics.StuckUnapplied},
		{key: "ready-now", topic: "orders", tier: 1, due: -2 * time.Hour, then: "applied"},
		{key: "blocked", topic: "orders", tier: 1, due: -2 * time.Hour, then: "blocked"},
	}
	wantCounts := map[string]int{}
	for i, c := range cases {
		head := retrytopics.Rec{Origin: retrytopics.Origin{Topic: c.topic, Partition: 0, Offset: int64(2 * i)}, Key: []byte(c.key), Value: []byte("v"), Timestamp: now}
		later := head
		later.Offset++
		move := retrytopics.Move{Rec: head, Held: true, From: retrytopics.FromSource, Attempt: 1, Tier: c.tier, Class: "retryable",
			Message: "boom", FirstFailedAt: now.Add(c.due), DueAt: now.Add(c.due)}
		inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
			if err := s.ToTier(ctx, tx, move); err != nil {
				return err
			}
			return s.Hold(ctx, tx, []retrytopics.Rec{later})
		})
		switch c.then {
		case "applied":
			inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
				return s.Applied(ctx, tx, []retrytopics.Rec{head}, []bool{true})
			})
		case "blocked":
			dead := move
			dead.From, dead.Attempt, dead.Block = retrytopics.FromTier, 2, true
			inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error { return s.DeadLetter(ctx, tx, dead) })
		}
		if c.want != "" {
			wantCounts[c.want]++
		}
	}
	if _, err := pool.Exec(context.Background(), `UPDATE kafkapg.held_keys SET updated_at = updated_at - interval '2 hours' WHERE key <> 'ready-now'`); err != nil {
		t.Fatal(err)
	}

	counts, err := s.StuckCounts(context.Background(), pool, scope)
	if err != nil || !maps.Equal(counts, wantCounts) {
		t.Errorf("StuckCounts = %v, %v; want %v", counts, err, wantCounts)
	}
	stuck, err := s.StuckKeys(context.Background(), pool, scope, 100)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, k := range stuck {
		got[string(k.Key.Key)] = k.Reason
	}
	for _, c := range cases {
		if got[c.key] != c.want {
			t.Errorf("key %s: stuck as %q, want %q", c.key, got[c.key], c.want)
		}
	}
}
