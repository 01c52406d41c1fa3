package keyring

import (
	"context"
	"crypto/sha256"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
)

// ringKey is a key's hash, as a processor would compute it (its SHA-256 with the group and topic).
func ringKey(key string) [32]byte { return sha256.Sum256([]byte("g/t/" + key)) }

// recordIn records keys in a transaction of its own and reports which were new.
func recordIn(t *testing.T, pool *pgxpool.Pool, k *Ring, keys ...string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		fresh, err := recordTx(tx, k, keys...)
		out = fresh
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func recordTx(tx pgx.Tx, k *Ring, keys ...string) (map[string]bool, error) {
	hashes := make([][32]byte, len(keys))
	for i, key := range keys {
		hashes[i] = ringKey(key)
	}
	fresh, err := k.Record(context.Background(), tx, hashes)
	out := map[string]bool{}
	for _, key := range keys {
		out[key] = fresh[Short(ringKey(key))]
	}
	return out, err
}

// dueNow makes the ring due to turn at keep's next call, for group g's retention of 3 days.
func dueNow(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `UPDATE kafkapg.idempotency_ring SET rotated_at = now() - interval '1 day 1 minute'`); err != nil {
		t.Fatal(err)
	}
}

const threeDays = 72 * time.Hour

// TestKeyRingKeepsKeysForTheRetention: a key is found for the three turns of the ring a
// retention spans (each turn a third of it), and is gone at the fourth; a key a dead letter that
// may still be replayed shares is carried into the current generation instead.
func TestKeyRingKeepsKeysForTheRetention(t *testing.T) {
	t.Parallel()
	pool := testenv.Migrated(t)
	ctx := context.Background()
	k := New("kafkapg")
	if got := recordIn(t, pool, k, "a", "b"); !got["a"] || !got["b"] {
		t.Fatalf("first record: %v, want both new", got)
	}
	b := ringKey("b")
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.dead_letters (consumer_group, topic, partition, "offset", key, value, header_keys, header_values,
			"timestamp", error_class, error_message, attempts, first_failed_at, idempotency_key_hash)
		VALUES ('g', 't', 0, 1, 'k', 'v', '{}', '{}', 0, 'retryable', 'm', 1, now(), $1)`, b[:]); err != nil {
		t.Fatal(err)
	}
	for turn := 1; turn <= 5; turn++ {
		dueNow(t, pool)
		done, err := k.Keep(ctx, pool, "g", threeDays, 5*time.Second)
		if err != nil || !done.Rotated {
			t.Fatalf("turn %d: keep = %+v, %v; want a turn", turn, done, err)
		}
		// The generation made current was emptied whole: no pages left, nothing for vacuum
		// (a DELETE would leave its pages, their rows dead), but for the dead letter's key.
		var pages int64
		if err := pool.QueryRow(ctx, `SELECT pg_relation_size(format('kafkapg.idempotency_keys_%s', (gen + 1) % 4)) / 8192 FROM kafkapg.idempotency_ring`).Scan(&pages); err != nil {
			t.Fatal(err)
		}
		if pages > 0 {
			t.Errorf("after turn %d the current generation has %d pages, want none (emptied, b carried into the one before)", turn, pages)
		}
		if _, err := k.Compact(ctx, pool, 5*time.Second); err != nil {
			t.Fatal(err)
		}
		got := recordIn(t, pool, k, "a", "b")
		if wantNew := turn == 4; got["a"] != wantNew { // recorded again at turn 4
			t.Errorf("after turn %d, key a is new: %v, want %v (kept for three turns)", turn, got["a"], wantNew)
		}
		if got["b"] {
			t.Errorf("after turn %d, key b is new: a dead letter shares it, it must be kept", turn)
		}
		if done.Emptied > 1 { // from Postgres's statistics, which may lag
			t.Errorf("turn %d emptied %d keys, want at most 1 (a; b carried over)", turn, done.Emptied)
		}
	}
	// Not due: nothing happens.
	if done, err := k.Keep(ctx, pool, "g", threeDays, 5*time.Second); err != nil || done.Rotated {
		t.Errorf("keep right after a turn = %+v, %v; want nothing done", done, err)
	}
}

// TestKeyRingLooksInTheTableBefore: keys recorded before migration 8 (in idempotency_keys) are
// still found after it, until the newest of them is older than the retention and the upgrade
// window is finalized; then that table is emptied, except for a key a dead letter that may still be replayed shares, which moves into
// the ring.
func TestKeyRingLooksInTheTableBefore(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, pool, "kafkapg", 7); err != nil {
		t.Fatal(err)
	}
	old, dead := ringKey("old"), ringKey("dead")
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.idempotency_keys (key_hash, consumer_group, topic, partition, "offset", applied_at)
		VALUES ($1, 'g', 't', 0, 1, now() - interval '2 hours'), ($2, 'g', 't', 0, 2, now() - interval '2 hours')`, old[:], dead[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.dead_letters (consumer_group, topic, partition, "offset", key, value, header_keys, header_values,
			"timestamp", error_class, error_message, attempts, first_failed_at, idempotency_key_hash)
		VALUES ('g', 't', 0, 3, 'k', 'v', '{}', '{}', 0, 'retryable', 'm', 1, now(), $1)`, dead[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	k := New("kafkapg")
	if got := recordIn(t, pool, k, "old", "dead", "new"); got["old"] || got["dead"] || !got["new"] {
		t.Fatalf("after the upgrade: %v; want old and dead found in the table before, new new", got)
	}
	// A retention of 3 hours: the table's keys (2 hours old) stay.
	if done, err := k.Keep(ctx, pool, "g", 3*time.Hour, 5*time.Second); err != nil || done.Legacy {
		t.Fatalf("keep = %+v, %v; want the table before kept", done, err)
	}
	// One of an hour, but the upgrade window open (the release before looks only there): kept.
	if done, err := k.Keep(ctx, pool, "g", time.Hour, 5*time.Second); err != nil || done.Legacy {
		t.Fatalf("keep with the upgrade window open = %+v, %v; want the table before kept", done, err)
	}
	// The window finalized: it is emptied, dead's key carried into the ring.
	if _, err := schema.Finalize(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	done, err := k.Keep(ctx, pool, "g", time.Hour, 5*time.Second)
	if err != nil || !done.Legacy {
		t.Fatalf("keep = %+v, %v; want the table before emptied", done, err)
	}
	if got := recordIn(t, pool, k, "old", "dead"); !got["old"] || got["dead"] {
		t.Errorf("after the retention: %v; want old new again, dead still found (a dead letter shares it)", got)
	}
}

// TestKeyRingCompacts: a generation past keeps its keys, 120 to a row, and every one of them is
// found there (the first and last of each row, the ones between), as are the keys of a
// compaction cut short (some ranges copied, the table of keys not emptied yet); a key not
// recorded is not found; a compacted key takes a fifth of what it took before.
func TestKeyRingCompacts(t *testing.T) {
	t.Parallel()
	pool := testenv.Migrated(t)
	ctx := context.Background()
	k := New("kafkapg")
	const n = 1000
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "key-" + strconv.Itoa(i)
	}
	if got := recordIn(t, pool, k, keys...); len(got) != n || !all(got, true) {
		t.Fatalf("first record: %d keys, want all %d new", len(got), n)
	}
	var before int64
	if err := pool.QueryRow(ctx, `SELECT pg_total_relation_size('kafkapg.idempotency_keys_0')`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	// The current generation is never compacted (as if a turn had made it current while a
	// compaction of it went on): nothing copied, nothing emptied.
	if err := k.compactGeneration(ctx, pool, 0); err != nil {
		t.Fatal(err)
	}
	var inKeys, inRuns int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM kafkapg.idempotency_keys_0), (SELECT count(*) FROM kafkapg.idempotency_runs_0)`).Scan(&inKeys, &inRuns); err != nil {
		t.Fatal(err)
	}
	if inKeys != n || inRuns != 0 {
		t.Fatalf("compacting the current generation: %d keys left in its table, %d runs; want %d and none", inKeys, inRuns, n)
	}
	dueNow(t, pool)
	if _, err := k.Keep(ctx, pool, "g", threeDays, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	// A compaction cut short: the runs of the hashes below 0x80 only.
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.idempotency_runs_0 (lo, keys) SELECT keys[1], keys FROM (SELECT array_agg(key_hash ORDER BY key_hash) AS keys
		FROM (SELECT key_hash, (row_number() OVER (ORDER BY key_hash) - 1) / 120 AS run FROM kafkapg.idempotency_keys_0 WHERE key_hash < '80000000-0000-0000-0000-000000000000') s GROUP BY run) r`); err != nil {
		t.Fatal(err)
	}
	if got := recordIn(t, pool, k, keys...); !all(got, false) {
		t.Fatalf("a compaction cut short: %d of %d keys taken for new", count(got, true), n)
	}
	if done, err := k.Compact(ctx, pool, 5*time.Second); err != nil || done != 1 {
		t.Fatalf("compact = %d, %v; want generation 0 compacted", done, err)
	}
	var left, runs, after int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM kafkapg.idempotency_keys_0), (SELECT count(*) FROM kafkapg.idempotency_runs_0),
			(SELECT sum(cardinality(keys)) FROM kafkapg.idempotency_runs_0), pg_total_relation_size('kafkapg.idempotency_runs_0')`).Scan(&left, &runs, new(int64), &after); err != nil {
		t.Fatal(err)
	}
	var compacted int64
	if err := pool.QueryRow(ctx, `SELECT sum(cardinality(keys)) FROM kafkapg.idempotency_runs_0`).Scan(&compacted); err != nil {
		t.Fatal(err)
	}
	if left != 0 || compacted != n || runs < n/120 || runs > n/120+2 {
		t.Errorf("after compaction: %d keys left in the table, %d in %d runs; want 0, %d in about %d", left, compacted, runs, n, n/120+1)
	}
	if got := recordIn(t, pool, k, keys...); !all(got, false) {
		t.Errorf("after compaction: %d of %d keys taken for new", count(got, true), n)
	}
	if got := recordIn(t, pool, k, "not recorded", "neither"); !all(got, true) {
		t.Errorf("keys never recorded: %v, want new", got)
	}
	t.Logf("%d keys: %d bytes in the table of keys, %d compacted (%.2fx)", n, before, after, float64(after)/float64(before))
}

func all(m map[string]bool, v bool) bool { return count(m, v) == len(m) }

func count(m map[string]bool, v bool) int {
	n := 0
	for _, x := range m {
		if x == v {
			n++
		}
	}
	return n
}

// TestKeyRingTurnsAtTheLongestRetention: the groups of a schema share one ring, which turns every
// third of the longest retention among them, so a group with a shorter one keeps its keys that
// long too (docs/configuration.md: at most 4/3 of the longest).
func TestKeyRingTurnsAtTheLongestRetention(t *testing.T) {
	t.Parallel()
	pool := testenv.Migrated(t)
	ctx := context.Background()
	k := New("kafkapg")
	if _, err := k.Keep(ctx, pool, "long", 10*threeDays, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	dueNow(t, pool) // a third of g's 3 days ago: due for g alone
	if done, err := k.Keep(ctx, pool, "g", threeDays, 5*time.Second); err != nil || done.Rotated {
		t.Errorf("keep of g beside a group keeping its keys 30 days = %+v, %v; want no turn", done, err)
	}
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.idempotency_ring SET rotated_at = now() - interval '10 days 1 minute'`); err != nil {
		t.Fatal(err)
	}
	if done, err := k.Keep(ctx, pool, "g", threeDays, 5*time.Second); err != nil || !done.Rotated {
		t.Errorf("keep of g a third of the longest retention after the last turn = %+v, %v; want a turn", done, err)
	}
}
