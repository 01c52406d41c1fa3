// Package keyring keeps the idempotency keys a schema's processors applied, in a ring of four
// generations that is Turned a generation at a time with TRUNCATE, and compacts the generations
// past (see migration 8 and Ring).
package keyring

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Generations is the number of generations idempotency keys are kept in (migration 8): one
// current, the others looked up. A key lives between the retention and Generations/(Generations-1)
// of it.
const Generations = 4

// Ring is where a schema keeps the idempotency keys its processors applied: a ring of
// generations (idempotency_keys_0 to _3), one of them current, each a table of 16-byte hashes.
// Recording a key looks it up in every generation and inserts it into the current one; turning
// the ring empties the oldest generation with TRUNCATE and makes it current. The tables are
// shared by every group of the schema (a key's hash covers its group and topic).
//
// Why a turn cannot split two copies of a record between generations: without care, transaction
// A could insert key K into generation 1 (current), the ring turn to 2, and transaction B insert
// K into 2, looking K up in 1 but unable to see A's uncommitted row (only a unique index on one
// table makes a second insert wait for the first). TRUNCATE prevents it: it takes the emptied
// generation's ACCESS EXCLUSIVE lock, which waits for every transaction that looked a key up in
// it (every recording looks in all four, and holds their locks until it ends), and a statement
// that comes meanwhile waits for the lock before it takes its snapshot (read committed: one per
// statement, taken after its tables are locked), so it sees the turn's commit. No transaction
// recording into the old current generation overlaps one recording into the new.
//
// A generation no longer current takes no more keys, and is compacted (Compact): its keys are
// copied, sorted, runSize to a row, into idempotency_runs_<n>, a range of hashes per
// transaction, and then its table of keys is emptied: 18 bytes a key instead of 85. A key is in
// one table or the other (or both, while it is compacted), never neither.
type Ring struct {
	recordSQL  string // $1 the 16-byte hashes, $2 the full ones (the legacy table's); returns the new keys
	generation [Generations]string
	runs       [Generations]string // each generation's compacted keys
	legacy     string              // idempotency_keys, the layout before migration 8
	ring       string
	retention  string
	deadLetter string
}

func New(schema string) *Ring {
	k := &Ring{
		legacy:     pgx.Identifier{schema, "idempotency_keys"}.Sanitize(),
		ring:       pgx.Identifier{schema, "idempotency_ring"}.Sanitize(),
		retention:  pgx.Identifier{schema, "idempotency_retention"}.Sanitize(),
		deadLetter: pgx.Identifier{schema, "dead_letters"}.Sanitize(),
	}
	for g := range Generations {
		k.generation[g] = pgx.Identifier{schema, "idempotency_keys_" + strconv.Itoa(g)}.Sanitize()
		k.runs[g] = pgx.Identifier{schema, "idempotency_runs_" + strconv.Itoa(g)}.Sanitize()
	}
	// One statement: the lookups in every generation (and the legacy table), then an insert into
	// each generation of which only the current one's inserts anything. A key another
	// transaction is inserting into the current generation makes this one wait on its primary
	// key until that one ends (ON CONFLICT): a duplicate if it committed, ours if it rolled back.
	// Keys are inserted in hash order, so two transactions inserting the same keys wait for each
	// other in one order, never in a cycle.
	var s strings.Builder
	s.WriteString(`WITH ring AS (SELECT current FROM ` + k.ring + ` WHERE id = 0),
		fresh AS (SELECT u FROM unnest($1::uuid[], $2::bytea[]) AS k(u, h) WHERE true`)
	for g, t := range k.generation {
		s.WriteString("\n\t\t\tAND NOT EXISTS (SELECT 1 FROM " + t + " x WHERE x.key_hash = k.u)")
		s.WriteString("\n\t\t\tAND NOT " + inRuns(k.runs[g], "k.u"))
	}
	s.WriteString("\n\t\t\tAND NOT EXISTS (SELECT 1 FROM " + k.legacy + " x WHERE x.key_hash = k.h))")
	for g, t := range k.generation {
		fmt.Fprintf(&s, ",\n\t\ti%d AS (INSERT INTO %s SELECT u FROM fresh WHERE (SELECT current FROM ring) = %d ORDER BY u ON CONFLICT DO NOTHING RETURNING key_hash)", g, t, g)
	}
	s.WriteString("\n\t\tSELECT key_hash FROM i0")
	for g := 1; g < Generations; g++ {
		fmt.Fprintf(&s, " UNION ALL SELECT key_hash FROM i%d", g)
	}
	k.recordSQL = s.String()
	return k
}

// runSize is how many keys a row of a compacted generation holds: a row (a 24-byte tuple header,
// lo, the array's 24-byte header and 16 bytes a key) stays under the 2,032 bytes past which
// Postgres would move it out of line, and four fill a page.
const runSize = 120

// inRuns is the SQL condition "key (an expression) is in the compacted generation runs": in the
// last row whose lo is not above it.
func inRuns(runs, key string) string {
	return `EXISTS (SELECT 1 FROM (SELECT r.keys FROM ` + runs + ` r WHERE r.lo <= ` + key + ` ORDER BY r.lo DESC LIMIT 1) r WHERE ` + key + ` = ANY(r.keys))`
}

// Short is the part of a key's hash the ring keeps: its first 16 bytes.
func Short(h [32]byte) [16]byte { return [16]byte(h[:16]) }

// Record records keys (their hashes, in hash order) in tx and returns the ones no transaction
// recorded before, by their short hash. One round trip.
func (k *Ring) Record(ctx context.Context, tx pgx.Tx, keys [][32]byte) (map[[16]byte]bool, error) {
	short := make([][16]byte, len(keys))
	full := make([][]byte, len(keys))
	for i := range keys {
		short[i], full[i] = Short(keys[i]), keys[i][:]
	}
	rows, err := tx.Query(ctx, k.recordSQL, short, full)
	if err != nil {
		return nil, err
	}
	fresh, err := pgx.CollectRows(rows, pgx.RowTo[[16]byte])
	if err != nil {
		return nil, err
	}
	out := make(map[[16]byte]bool, len(fresh))
	for _, h := range fresh {
		out[h] = true
	}
	return out, nil
}

// Turned is what one Keep did.
type Turned struct {
	Rotated bool  // the oldest generation was emptied and made current
	Legacy  bool  // the legacy table was emptied
	Emptied int64 // keys removed, as Postgres's statistics count them
}

// ErrBusy is Keep's when it could not empty the oldest generation in time: transactions
// recording keys held it; the next keep tries again.
var ErrBusy = errors.New("the idempotency key ring is busy")

// Keep says that group keeps its keys for retention, and turns the ring if it is due: when its
// current generation is older than a third of the longest retention of the groups seen within
// their retention. It also empties the legacy table once its newest key is older than that
// retention. A key that a dead letter which may still be replayed (new, replaying) shares is
// copied into the current generation first: the replay must find it, however late it comes.
//
// The turn waits for the batches recording keys at that moment, and the batches that come
// meanwhile wait for it: at most lockTimeout, past which keep gives up with ErrBusy and the
// batches go on. Replicas turning at once take turns on the ring's row.
func (k *Ring) Keep(ctx context.Context, pool *pgxpool.Pool, group string, retention time.Duration, lockTimeout time.Duration) (Turned, error) {
	var out Turned
	// The ring turns at the longest retention of the groups seen within it; a group's row is
	// refreshed every hour (every quarter of its retention, if shorter), not every minute.
	if _, err := pool.Exec(ctx, `INSERT INTO `+k.retention+` AS r (consumer_group, retention, seen_at) VALUES ($1, $2, now())
		ON CONFLICT (consumer_group) DO UPDATE SET retention = EXCLUDED.retention, seen_at = EXCLUDED.seen_at
		WHERE r.retention <> EXCLUDED.retention OR r.seen_at < now() - least(interval '1 hour', r.retention / 4)`, group, retention); err != nil {
		return out, fmt.Errorf("record the retention: %w", err)
	}
	var due, legacyDue bool
	if err := pool.QueryRow(ctx, k.dueSQL()).Scan(&due, &legacyDue); err != nil {
		return out, fmt.Errorf("read the ring: %w", err)
	}
	if !due && !legacyDue {
		return out, nil
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, strconv.FormatInt(lockTimeout.Milliseconds(), 10)); err != nil {
			return err
		}
		var current int
		if err := tx.QueryRow(ctx, `SELECT current FROM `+k.ring+` WHERE id = 0 FOR UPDATE`).Scan(&current); err != nil {
			return err
		}
		// Again, holding the ring's row: another replica may have Turned it meanwhile.
		if err := tx.QueryRow(ctx, k.dueSQL()).Scan(&due, &legacyDue); err != nil {
			return err
		}
		if due {
			next := (current + 1) % Generations
			n, err := k.empty(ctx, tx, k.generation[next], k.generation[current], `k.key_hash = encode(substr(d.idempotency_key_hash, 1, 16), 'hex')::uuid`, "1", 1)
			if err != nil {
				return err
			}
			m, err := k.empty(ctx, tx, k.runs[next], k.generation[current], `k.lo = (SELECT r.lo FROM `+k.runs[next]+` r
				WHERE r.lo <= encode(substr(d.idempotency_key_hash, 1, 16), 'hex')::uuid ORDER BY r.lo DESC LIMIT 1)
				AND encode(substr(d.idempotency_key_hash, 1, 16), 'hex')::uuid = ANY(k.keys)`, "cardinality(k.keys)", runSize)
			if err != nil {
				return err
			}
			n += m
			if _, err := tx.Exec(ctx, `UPDATE `+k.ring+` SET current = $1, rotated_at = now() WHERE id = 0`, next); err != nil {
				return err
			}
			out.Rotated, out.Emptied, current = true, out.Emptied+n, next
		}
		if legacyDue {
			n, err := k.empty(ctx, tx, k.legacy, k.generation[current], `k.key_hash = d.idempotency_key_hash`, "1", 1)
			if err != nil {
				return err
			}
			out.Legacy, out.Emptied = true, out.Emptied+n
		}
		return nil
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
		return Turned{}, ErrBusy
	}
	if err != nil {
		return Turned{}, fmt.Errorf("turn the ring: %w", err)
	}
	return out, nil
}

// dueSQL says whether the ring is due to turn, and whether the legacy table is due to be emptied.
func (k *Ring) dueSQL() string {
	return `WITH longest AS (SELECT coalesce(max(retention), interval '0') AS r FROM ` + k.retention + ` WHERE seen_at + retention > now())
		SELECT g.rotated_at <= now() - (SELECT r FROM longest) / 3 AND (SELECT r FROM longest) > interval '0',
			coalesce((SELECT max(applied_at) FROM ` + k.legacy + `) <= now() - (SELECT r FROM longest), false)
		FROM ` + k.ring + ` g WHERE g.id = 0`
}

// empty empties table, a table of keys or of runs of a generation, or the legacy table, with
// TRUNCATE, after copying into current the keys of it that dead letters which may still be
// replayed share (match says how a row k of table matches a dead letter d). It returns how many
// keys the table held, less those copied: counted if Postgres's statistics say it holds fewer
// than a million rows, else as they say (inserts only: exact, short of a crash's and the last
// second's, perRow keys a row). keys is the SQL of the keys of a row k.
func (k *Ring) empty(ctx context.Context, tx pgx.Tx, table, current, match, keys string, perRow int) (int64, error) {
	var keep, held int64
	if err := tx.QueryRow(ctx, `WITH kept AS (INSERT INTO `+current+` SELECT DISTINCT encode(substr(d.idempotency_key_hash, 1, 16), 'hex')::uuid
			FROM `+k.deadLetter+` d JOIN `+table+` k ON `+match+`
			WHERE d.idempotency_key_hash IS NOT NULL AND d.status IN ('new', 'replaying')
			ON CONFLICT DO NOTHING RETURNING 1),
		stat AS (SELECT coalesce((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = $1::regclass), 0) AS rows)
		SELECT (SELECT count(*) FROM kept), CASE WHEN (SELECT rows FROM stat) < 1000000
			THEN (SELECT coalesce(sum(`+keys+`), 0) FROM `+table+` k)
			ELSE (SELECT rows FROM stat) * `+strconv.Itoa(perRow)+` END`, table).Scan(&keep, &held); err != nil {
		return 0, fmt.Errorf("keep the keys dead letters share: %w", err)
	}
	if _, err := tx.Exec(ctx, `TRUNCATE `+table); err != nil {
		return 0, fmt.Errorf("empty %s: %w", table, err)
	}
	return max(held-keep, 0), nil
}

// Size is the keys the ring (and the legacy table) holds, as Postgres's statistics count them
// (no scan of tables that may hold billions), and their disk space, indexes included.
func (k *Ring) Size(ctx context.Context, pool *pgxpool.Pool) (keys, bytes int64, err error) {
	tables := append(append(k.generation[:], k.legacy), k.runs[:]...)
	each := make([]int64, len(tables)) // keys a row holds
	for i := range each {
		each[i] = 1
		if i > Generations {
			each[i] = runSize // about: the last row of each range holds fewer
		}
	}
	err = pool.QueryRow(ctx, `SELECT coalesce(sum(t.each * (SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = c.oid)), 0)::int8,
			coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8
		FROM unnest($1::text[], $2::int8[]) AS t(name, each) JOIN pg_class c ON c.oid = to_regclass(t.name)`, tables, each).Scan(&keys, &bytes)
	return keys, bytes, err
}

// Compact compacts the generations that are not current and still hold keys in their table of
// keys (the one the last turn made old, or one a compaction cut short): a chunk of keys per
// transaction, then the table of keys emptied. Several processes may compact at once: they
// start from the same key, so a chunk's rows are the same whoever writes them, and the second to
// write one finds it there.
// It returns how many generations it finished.
func (k *Ring) Compact(ctx context.Context, pool *pgxpool.Pool, lockTimeout time.Duration) (int, error) {
	var current int
	if err := pool.QueryRow(ctx, `SELECT current FROM `+k.ring+` WHERE id = 0`).Scan(&current); err != nil {
		return 0, err
	}
	done := 0
	for g := range Generations {
		if g == current {
			continue
		}
		var left bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+k.generation[g]+`)`).Scan(&left); err != nil {
			return done, err
		}
		if !left {
			continue
		}
		if err := k.compactGeneration(ctx, pool, g, lockTimeout); err != nil {
			return done, fmt.Errorf("compact generation %d: %w", g, err)
		}
		done++
	}
	return done, nil
}

// compactChunk is how many keys a transaction of a compaction copies: whole rows of runSize.
const compactChunk = runSize * 8192

// compactGeneration copies generation g's keys into its runs, in hash order, compactChunk keys a
// transaction, from the key after the last one an earlier compaction copied (the last key of the
// last row: a chunk commits whole, and every key up to its last is in it); then empties its table
// of keys.
func (k *Ring) compactGeneration(ctx context.Context, pool *pgxpool.Pool, g int, lockTimeout time.Duration) error {
	var from *[16]byte
	if err := pool.QueryRow(ctx, `SELECT (SELECT keys[cardinality(keys)] FROM `+k.runs[g]+` ORDER BY lo DESC LIMIT 1)`).Scan(&from); err != nil {
		return err
	}
	chunk := `WITH c AS (SELECT key_hash FROM ` + k.generation[g] + ` WHERE $1::uuid IS NULL OR key_hash > $1 ORDER BY key_hash LIMIT $2),
		runs AS (INSERT INTO ` + k.runs[g] + ` (lo, keys) SELECT keys[1], keys FROM (SELECT array_agg(key_hash ORDER BY key_hash) AS keys
			FROM (SELECT key_hash, (row_number() OVER (ORDER BY key_hash) - 1) / ` + strconv.Itoa(runSize) + ` AS run FROM c) AS s GROUP BY run) AS r
			ON CONFLICT (lo) DO NOTHING)
		SELECT (SELECT count(*) FROM c), (SELECT key_hash FROM c ORDER BY key_hash DESC LIMIT 1)`
	// Each transaction first holds the ring's row (FOR SHARE): a turn, which takes it FOR UPDATE,
	// cannot make g current, and empty it, in the middle of one; and one that finds g current
	// (a turn came between two) stops, copying nothing more and emptying nothing.
	stillPast := func(tx pgx.Tx) (bool, error) {
		var current int
		err := tx.QueryRow(ctx, `SELECT current FROM `+k.ring+` WHERE id = 0 FOR SHARE`).Scan(&current)
		return current != g, err
	}
	for {
		var n int
		var last *[16]byte
		past := true
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			if past, err = stillPast(tx); err != nil || !past {
				return err
			}
			return tx.QueryRow(ctx, chunk, from, compactChunk).Scan(&n, &last)
		})
		if err != nil || !past {
			return err
		}
		if n < compactChunk {
			break
		}
		from = last
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, strconv.FormatInt(lockTimeout.Milliseconds(), 10)); err != nil {
			return err
		}
		if past, err := stillPast(tx); err != nil || !past {
			return err
		}
		_, err := tx.Exec(ctx, `TRUNCATE `+k.generation[g])
		return err
	})
}
