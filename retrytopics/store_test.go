package retrytopics_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/retrytopics"
)

func newStore(t *testing.T) (*retrytopics.Store, *pgxpool.Pool) {
	t.Helper()
	return retrytopics.NewStore("kafkapg", "g"), testenv.Migrated(t)
}

// inTx runs fn in a committed transaction.
func inTx(t *testing.T, pool *pgxpool.Pool, fn func(ctx context.Context, tx pgx.Tx) error) {
	t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return fn(ctx, tx) }); err != nil {
		t.Fatal(err)
	}
}

func stats(t *testing.T, s *retrytopics.Store, pool *pgxpool.Pool) retrytopics.Stats {
	t.Helper()
	st, err := s.Stats(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestStoreKeyHandOver walks one key through the retry path at the Store level: its head goes
// to a tier, a later record holds behind it, the head is applied (the key becomes ready), the
// held record is applied (the key is no longer held). Stats, which the metrics publish, follow.
func TestStoreKeyHandOver(t *testing.T) {
	s, pool := newStore(t)
	key := []byte{0xff, 'k'}
	head := retrytopics.Rec{Origin: retrytopics.Origin{Topic: "orders", Partition: 2, Offset: 10}, Key: key, Value: []byte("v10"), Timestamp: time.Now()}
	later := retrytopics.Rec{Origin: retrytopics.Origin{Topic: "orders", Partition: 2, Offset: 11}, Key: key, Value: []byte("v11"), Timestamp: time.Now()}
	failedAt := time.Now().Add(-time.Minute)

	inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
		return s.ToTier(ctx, tx, retrytopics.Move{Rec: head, Held: true, From: retrytopics.FromSource, Attempt: 1, Tier: 1,
			Class: "retryable", Message: "boom", FirstFailedAt: failedAt, DueAt: failedAt.Add(time.Second)})
	})
	inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
		held, err := s.LockHeldKeys(ctx, tx, "orders", 2, [][]byte{key, []byte("other")})
		if err != nil {
			return err
		}
		if !held[string(key)] || held["other"] {
			t.Errorf("LockHeldKeys = %v, want only the head's key held", held)
		}
		return s.Hold(ctx, tx, []retrytopics.Rec{later})
	})
	st := stats(t, s, pool)
	if st.HeldKeys != 1 || st.HeldRecords != 1 || st.OldestHeld <= 0 || st.Tiers[1].Records != 1 || st.Tiers[1].Overdue < 50*time.Second {
		t.Errorf("stats with the head in tier 1 and one record held: %+v", st)
	}
	if keys, err := s.ReadyKeys(context.Background(), pool, []string{"orders"}, 10); err != nil || len(keys) != 0 {
		t.Errorf("ReadyKeys = %v, %v; want none while the head is in its tier", keys, err)
	}

	inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
		states, err := s.LockRetries(ctx, tx, []retrytopics.Origin{head.Origin})
		if err != nil {
			return err
		}
		if states[head.Origin].Attempt != 2 || !states[head.Origin].FirstFailedAt.Equal(failedAt.Truncate(time.Microsecond)) {
			t.Errorf("retry state %+v, want attempt 2 and the first failure time", states[head.Origin])
		}
		return s.Applied(ctx, tx, []retrytopics.Rec{head}, []bool{true})
	})
	keys, err := s.ReadyKeys(context.Background(), pool, []string{"orders"}, 10)
	if err != nil || len(keys) != 1 || string(keys[0].Key) != string(key) {
		t.Fatalf("ReadyKeys = %v, %v; want the key, ready for its held record", keys, err)
	}
	inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
		recs, err := s.TakeHeld(ctx, tx, keys[0], 10, 1<<20)
		if err != nil {
			return err
		}
		if len(recs) != 1 || recs[0].Offset != 11 || string(recs[0].Value) != "v11" {
			t.Errorf("TakeHeld = %+v, want the record at offset 11", recs)
		}
		return s.AppliedHeld(ctx, tx, keys[0], recs)
	})
	if st := stats(t, s, pool); st.HeldKeys != 0 || st.HeldRecords != 0 || len(st.Tiers) != 0 {
		t.Errorf("stats after the hand-over: %+v, want an empty retry path", st)
	}
}

// TestStoreBlockAndRelease: a head dead-lettered with Block keeps its key held (blocked) until
// Unblock; a copy of the head at a stale attempt is refused with ErrStale.
func TestStoreBlockAndRelease(t *testing.T) {
	s, pool := newStore(t)
	head := retrytopics.Rec{Origin: retrytopics.Origin{Topic: "orders", Partition: 0, Offset: 5}, Key: []byte("k"), Value: []byte("v"), Timestamp: time.Now()}
	move := retrytopics.Move{Rec: head, Held: true, From: retrytopics.FromSource, Attempt: 1, Tier: 1, Class: "retryable", Message: "boom",
		FirstFailedAt: time.Now(), DueAt: time.Now()}
	inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error { return s.ToTier(ctx, tx, move) })

	stale := move
	stale.From, stale.Attempt, stale.Block = retrytopics.FromTier, 5, true
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error { return s.DeadLetter(context.Background(), tx, stale) })
	if !errors.Is(err, retrytopics.ErrStale) {
		t.Fatalf("dead-lettering a stale copy: %v, want ErrStale", err)
	}

	dead := move
	dead.From, dead.Attempt, dead.Block = retrytopics.FromTier, 2, true
	inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error { return s.DeadLetter(ctx, tx, dead) })
	st := stats(t, s, pool)
	if st.HeldKeys != 1 || st.BlockedKeys != 1 || st.DeadLetters["new"] != 1 || len(st.Tiers) != 0 {
		t.Errorf("stats after a blocking dead letter: %+v", st)
	}
	n, err := s.Unblock(context.Background(), pool, "orders", 0, nil)
	if err != nil || n != 1 {
		t.Fatalf("Unblock = %d, %v; want 1 key released", n, err)
	}
	if st := stats(t, s, pool); st.BlockedKeys != 0 {
		t.Errorf("blocked keys after Unblock: %+v", st)
	}
}

// TestStoreTakesAnyRecordContent: whatever a Kafka record may carry goes through the retry path
// byte for byte: a key too long for a btree entry, header keys with NUL and invalid UTF-8, any
// int64 timestamp, an error message with binary data. Held records are taken in pages bounded in
// bytes as well as in count.
func TestStoreTakesAnyRecordContent(t *testing.T) {
	s, pool := newStore(t)
	key := make([]byte, 100_000)
	rand.Read(key) // incompressible: no btree entry could hold it
	hdr := []kgo.RecordHeader{{Key: "\xff\x00k", Value: []byte{0}}}
	rec := func(off int64, ms int64, size int) retrytopics.Rec {
		return retrytopics.Rec{Origin: retrytopics.Origin{Topic: "t", Partition: 0, Offset: off}, Key: key,
			Value: bytes.Repeat([]byte{byte(off)}, size), Headers: hdr, Timestamp: time.UnixMilli(ms).UTC()}
	}
	head := rec(1, math.MaxInt64, 10)
	inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
		return s.ToTier(ctx, tx, retrytopics.Move{Rec: head, Held: true, From: retrytopics.FromSource, Attempt: 1, Tier: 1,
			Class: "retryable", Message: "bad payload \x00\xff\xfe", FirstFailedAt: time.Now(), DueAt: time.Now()})
	})
	held := []retrytopics.Rec{rec(2, math.MinInt64, 1000), rec(3, -1, 1000), rec(4, 0, 1000), rec(5, 1, 1000)}
	inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
		if held, err := s.LockHeldKeys(ctx, tx, "t", 0, [][]byte{key}); err != nil || !held[string(key)] {
			return fmt.Errorf("LockHeldKeys = %v, %v; want the long key held", held, err)
		}
		return s.Hold(ctx, tx, held)
	})
	inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
		return s.Applied(ctx, tx, []retrytopics.Rec{head}, []bool{true})
	})
	k := retrytopics.Key{Topic: "t", Partition: 0, Key: key}
	for _, tt := range []struct {
		limit, maxBytes int
		want            []int64
	}{
		{limit: 10, maxBytes: 2500, want: []int64{2, 3, 4}}, // the third starts at 2000 bytes, within the budget
		{limit: 10, maxBytes: 1, want: []int64{2}},          // at least one record
		{limit: 2, maxBytes: 1 << 20, want: []int64{2, 3}},
	} {
		var got []retrytopics.Rec
		err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) (err error) {
			got, err = s.TakeHeld(context.Background(), tx, k, tt.limit, tt.maxBytes)
			return err // rolled back below: each case sees all of them
		})
		if err != nil {
			t.Fatal(err)
		}
		var offs []int64
		for _, r := range got {
			offs = append(offs, r.Offset)
		}
		if fmt.Sprint(offs) != fmt.Sprint(tt.want) {
			t.Errorf("TakeHeld(limit %d, %d bytes) took offsets %v, want %v", tt.limit, tt.maxBytes, offs, tt.want)
		}
		for i, r := range got {
			want := held[i]
			if !bytes.Equal(r.Key, key) || !bytes.Equal(r.Value, want.Value) || !r.Timestamp.Equal(want.Timestamp) ||
				len(r.Headers) != 1 || r.Headers[0].Key != hdr[0].Key {
				t.Errorf("held record %d came back as timestamp %v, %d-byte key, headers %q; want it byte for byte (timestamp %v)",
					r.Offset, r.Timestamp, len(r.Key), r.Headers, want.Timestamp)
			}
		}
	}
}
