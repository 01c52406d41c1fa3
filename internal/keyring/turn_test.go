package keyring

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
)

// ringState reads the ring's state.
func ringState(t *testing.T, pool *pgxpool.Pool, k *Ring) State {
	t.Helper()
	s, err := k.State(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// begin starts a transaction the test ends (rolled back at cleanup if it did not).
func begin(t *testing.T, pool *pgxpool.Pool) pgx.Tx {
	t.Helper()
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	return tx
}

// TestKeyRingTurnsPastLongBatches is case 8 of issue 39: batches that recorded keys and last
// longer than the old lock timeout (2 s), overlapping so that one is always open, do not keep the
// ring from turning, and no other transaction's Record ever waits for a lock meanwhile. Before,
// the turn's TRUNCATE needed a moment with no recorder open, which never came: every keep gave up
// after 2 s, and every batch's lookups queued behind its lock meanwhile.
func TestKeyRingTurnsPastLongBatches(t *testing.T) {
	t.Parallel()
	pool := testenv.Migrated(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	k := New("kafkapg")
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.idempotency_retention VALUES ('g', '72 hours', now())`); err != nil {
		t.Fatal(err)
	}
	from := ringState(t, pool, k)
	var wg sync.WaitGroup
	defer wg.Wait()
	var (
		mu      sync.Mutex
		pids    = map[uint32]bool{} // the recorders' backends
		failure error
	)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if failure == nil {
			failure = err
		}
	}
	var seq atomic.Int64
	// record records a new key in a transaction that stays open for hold.
	record := func(hold time.Duration) {
		defer wg.Done()
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var pid uint32
			if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				return err
			}
			mu.Lock()
			pids[pid] = true
			mu.Unlock()
			key := "k" + strconv.FormatInt(seq.Add(1), 10)
			got, err := recordTx(tx, k, key)
			if err == nil && !got[key] {
				err = fmt.Errorf("key %s, never recorded before, taken for a duplicate", key)
			}
			if err != nil {
				return err
			}
			select {
			case <-time.After(hold):
			case <-ctx.Done():
			}
			return nil
		})
		if err != nil && ctx.Err() == nil && !errors.Is(err, ErrMoved) {
			fail(err)
		}
	}
	// Long batches of 3 s, one starting every second: three open at any moment.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			wg.Add(1)
			go record(3 * time.Second)
			select {
			case <-time.After(time.Second):
			case <-ctx.Done():
			}
		}
	}()
	// Short batches, one after the other.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			wg.Add(1)
			record(0)
		}
	}()
	// No recorder's backend ever waits for a lock.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			rows, err := pool.Query(ctx, `SELECT pid, wait_event FROM pg_stat_activity WHERE wait_event_type = 'Lock'`)
			if err != nil {
				if ctx.Err() == nil {
					fail(err)
				}
				return
			}
			for rows.Next() {
				var pid uint32
				var event string
				if err := rows.Scan(&pid, &event); err != nil {
					fail(err)
				}
				mu.Lock()
				recorder := pids[pid]
				mu.Unlock()
				if recorder {
					fail(fmt.Errorf("a recorder (backend %d) waits for a lock (%s)", pid, event))
				}
			}
			rows.Close()
			time.Sleep(5 * time.Millisecond)
		}
	}()
	time.Sleep(500 * time.Millisecond) // the first long batches are open
	dueNow(t, pool)
	// The processors' keep, every 100 ms: it never waits more than that for anything.
	busy := 0
	testenv.Eventually(t, 90*time.Second, func() error {
		if _, err := k.Keep(ctx, pool, "g", threeDays, 100*time.Millisecond); errors.Is(err, ErrBusy) {
			busy++
		} else if err != nil {
			return err
		}
		if _, err := k.Compact(ctx, pool, 100*time.Millisecond); err != nil && !errors.Is(err, ErrBusy) {
			return err
		}
		if s := ringState(t, pool, k); s.Step != Steady || s.Gen != (from.Gen+1)%Generations {
			return fmt.Errorf("the ring is at %s", s)
		}
		return nil
	})
	cancel()
	wg.Wait()
	if failure != nil {
		t.Fatal(failure)
	}
	mu.Lock()
	t.Logf("the ring turned past %d batches recording keys, on %d backends; %d keeps found a move not ready yet", seq.Load(), len(pids), busy)
	mu.Unlock()
}

// TestKeyRingMoveWaitsForRecordersTwoEpochsBefore is the race the try-lock closes (the one the
// old TestKeyRingTurnWaitsForRecorders tested against TRUNCATE). A records K in the retired state
// (inserting into the current generation) and stays open. The ring may go one move on (its
// oldest generation emptied), not two, to inserting into the new generation as well, while A is
// open; and no TRUNCATE's lock stands in the way of those moves: only the try-lock on the epoch
// two before. Past it, B, recording K in the new generation only, would not see A's uncommitted
// row, and K would be applied twice. With the try-lock, the ring waits in Emptied, where B inserts
// into A's generation, waits for A on K's primary key, and finds it.
func TestKeyRingMoveWaitsForRecordersTwoEpochsBefore(t *testing.T) {
	t.Parallel()
	pool := testenv.Migrated(t)
	ctx := context.Background()
	k := New("kafkapg")
	// A0, open in the steady state, keeps the ring in Retired (it looks up the oldest
	// generation's runs, which the next move empties).
	a0 := begin(t, pool)
	if _, err := recordTx(a0, k, "x"); err != nil {
		t.Fatal(err)
	}
	dueNow(t, pool)
	if turned, err := k.Keep(ctx, pool, "g", threeDays, 300*time.Millisecond); !errors.Is(err, ErrBusy) {
		t.Fatalf("keep while A0 is open = %+v, %v; want ErrBusy", turned, err)
	}
	if s := ringState(t, pool, k); s.Step != Retired {
		t.Fatalf("the ring is at %s while A0, of the steady state, is open; want it retired, no further", s)
	}
	a := begin(t, pool)
	if got, err := recordTx(a, k, "K"); err != nil || !got["K"] {
		t.Fatalf("A: %v, %v; want K new", got, err)
	}
	if err := a0.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	turned, err := k.Keep(ctx, pool, "g", threeDays, 300*time.Millisecond)
	if !errors.Is(err, ErrBusy) {
		t.Fatalf("keep while A is open = %+v, %v; want ErrBusy", turned, err)
	}
	if s := ringState(t, pool, k); s.Step != Emptied {
		t.Fatalf("the ring is at %s while A, of the retired state, is open; want it emptied, no further", s)
	}
	type result struct {
		fresh map[string]bool
		err   error
	}
	bDone := make(chan result, 1)
	b := begin(t, pool)
	var bPid uint32
	if err := b.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&bPid); err != nil {
		t.Fatal(err)
	}
	go func() {
		fresh, err := recordTx(b, k, "K")
		bDone <- result{fresh, err}
	}()
	testenv.Eventually(t, 10*time.Second, func() error {
		select {
		case rb := <-bDone:
			t.Fatalf("B recorded K while A, which recorded it, was open: %v, %v; want B to wait for A", rb.fresh, rb.err)
		default:
		}
		var waits bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted AND locktype = 'transactionid')`, bPid).Scan(&waits); err != nil {
			return err
		}
		if !waits {
			return errors.New("B does not wait for A yet")
		}
		return nil
	})
	if err := a.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	rb := <-bDone
	if rb.err != nil || rb.fresh["K"] {
		t.Fatalf("B: %v, %v; want K a duplicate of A's", rb.fresh, rb.err)
	}
	if err := b.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// A ended: the turn goes on.
	if turned, err := k.Keep(ctx, pool, "g", threeDays, 5*time.Second); err != nil || !turned.Rotated {
		t.Fatalf("keep after A = %+v, %v; want the turn made", turned, err)
	}
}

// TestKeyRingRecorderTwoEpochsBehindFails is the race the validation closes: a process whose view
// of the ring is two moves old (it read it just before a turn, and records before reading it
// again) would insert into the generation no longer inserted into, while another process inserts
// the same key into the new one: neither sees the other's row. It must fail with ErrMoved
// instead, and record with the new state when retried.
func TestKeyRingRecorderTwoEpochsBehindFails(t *testing.T) {
	t.Parallel()
	pool := testenv.Migrated(t)
	ctx := context.Background()
	stale := New("kafkapg")
	stale.grace = time.Hour // its view of the ring is taken for fresh
	if got := recordIn(t, pool, stale, "before"); !got["before"] {
		t.Fatalf("first record: %v", got)
	}
	turner := New("kafkapg")
	turner.grace = 0
	dueNow(t, pool)
	if turned, err := turner.Keep(ctx, pool, "g", threeDays, 5*time.Second); err != nil || !turned.Rotated {
		t.Fatalf("keep = %+v, %v; want a turn", turned, err)
	}
	// Another process records K in the new generation, and stays open.
	other := New("kafkapg")
	o := begin(t, pool)
	if got, err := recordTx(o, other, "K"); err != nil || !got["K"] {
		t.Fatalf("other: %v, %v; want K new", got, err)
	}
	s := begin(t, pool)
	got, err := recordTx(s, stale, "K")
	if !errors.Is(err, ErrMoved) {
		t.Fatalf("a recorder two epochs behind: %v, %v; want ErrMoved", got, err)
	}
	if err := o.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	s.Rollback(ctx)
	// Retried: it reads the ring again, and finds K.
	if got := recordIn(t, pool, stale, "K"); got["K"] {
		t.Errorf("retried: K new again; want the other's")
	}
}

// TestKeyRingLegacyWaitsForEveryGroup is case 7 of issue 39: the legacy table (idempotency_keys,
// shared by every group of the schema) is not emptied at the retention of the first group that
// runs this release while a group that has not (no retention row) may still have keys there; once
// it has, the table goes at the longest retention.
func TestKeyRingLegacyWaitsForEveryGroup(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, pool, "kafkapg", 7); err != nil {
		t.Fatal(err)
	}
	old := ringKey("old")
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.idempotency_keys (key_hash, consumer_group, topic, partition, "offset", applied_at)
		VALUES ($1, 'slow', 't', 0, 1, now() - interval '2 days')`, old[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ('fast', 't', 0, 1), ('slow', 't', 0, 2), ('plain', 'u', 0, 3)`); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Finalize(ctx, pool, "kafkapg"); err != nil { // no process of the release before runs
		t.Fatal(err)
	}
	k := New("kafkapg")
	k.grace = 0
	legacyKeys := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.idempotency_keys`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	keep := func(group string, retention time.Duration) Turned {
		t.Helper()
		done, err := k.Keep(ctx, pool, group, retention, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return done
	}
	// fast (1 day) runs this release; slow (30 days, keys 2 days old) and plain (no keys) not yet.
	if done := keep("fast", 24*time.Hour); done.Legacy || legacyKeys() != 1 || done.LegacyHeldBy != "plain" {
		t.Fatalf("fast's keep = %+v, %d keys left; want the legacy table kept, held by plain (then slow)", done, legacyKeys())
	}
	if err := k.Register(ctx, pool, "plain"); err != nil {
		t.Fatal(err)
	}
	if done := keep("fast", 24*time.Hour); done.Legacy || legacyKeys() != 1 || done.LegacyHeldBy != "slow" {
		t.Fatalf("fast's keep = %+v, %d keys left; want the legacy table kept, held by slow", done, legacyKeys())
	}
	if got := recordIn(t, pool, k, "old"); got["old"] {
		t.Fatalf("slow's key in the legacy table not found")
	}
	// slow upgrades: its 30 days count; its key is 2 days old.
	if done := keep("slow", 30*24*time.Hour); done.Legacy || legacyKeys() != 1 || done.LegacyHeldBy != "" {
		t.Fatalf("slow's keep = %+v, %d keys left; want the legacy table kept for 30 days, held by no group", done, legacyKeys())
	}
	// 31 days later.
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.idempotency_keys SET applied_at = now() - interval '31 days'`); err != nil {
		t.Fatal(err)
	}
	if done := keep("fast", 24*time.Hour); !done.Legacy || legacyKeys() != 0 || done.Emptied != 1 {
		t.Fatalf("keep after 31 days = %+v, %d keys left; want the legacy table emptied (1 key)", done, legacyKeys())
	}
	if s := ringState(t, pool, k); s.Legacy != LegacyGone {
		t.Errorf("the ring is at %s; want the legacy table gone", s)
	}
}

// TestKeyRingCompactionResumesAfterTurns is suspicion S4 of issue 39: a compaction that read its
// start key once, then resumed after the ring turned twice (its generation emptied, filled as
// current, made past again), copied only the keys after that stale start into the runs, and then
// emptied the table of keys: the others lost. Now each chunk reads its start in its transaction,
// and the ring cannot turn while a generation is compacting (the next turn starts from Steady,
// after the compaction); the test makes the ring due and keeps between every two chunks.
func TestKeyRingCompactionResumesAfterTurns(t *testing.T) {
	pool := testenv.Migrated(t)
	ctx := context.Background()
	k := New("kafkapg")
	k.grace = 0
	keys := make([]string, 600)
	for i := range keys {
		keys[i] = "key-" + strconv.Itoa(i)
	}
	recordIn(t, pool, k, keys...)
	dueNow(t, pool)
	if done, err := k.Keep(ctx, pool, "g", threeDays, 5*time.Second); err != nil || !done.Rotated {
		t.Fatalf("keep = %+v, %v; want a turn", done, err)
	}
	compactChunk = runSize
	t.Cleanup(func() { compactChunk = runSize * 8192; beforeChunk = nil })
	chunks, later := 0, 0
	beforeChunk = func(int) {
		chunks++
		if chunks < 2 {
			return
		}
		for range 2 {
			dueNow(t, pool)
			if done, err := k.Keep(ctx, pool, "g", threeDays, 100*time.Millisecond); err != nil || done.Rotated {
				t.Errorf("keep between two chunks of a compaction = %+v, %v; want no turn", done, err)
			}
			later++
			recordIn(t, pool, k, "later-"+strconv.Itoa(later))
		}
	}
	if n, err := k.Compact(ctx, pool, 5*time.Second); err != nil || n != 1 {
		t.Fatalf("compact = %d, %v; want generation compacted", n, err)
	}
	if chunks < 5 {
		t.Fatalf("%d chunks, want 5 or more", chunks)
	}
	if got := recordIn(t, pool, k, keys...); !all(got, false) {
		t.Errorf("after the compaction: %d of %d keys taken for new", count(got, true), len(keys))
	}
	for i := 1; i <= later; i++ {
		if got := recordIn(t, pool, k, "later-"+strconv.Itoa(i)); got["later-"+strconv.Itoa(i)] {
			t.Errorf("key later-%d, recorded during the compaction, taken for new", i)
		}
	}
}
