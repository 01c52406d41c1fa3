package processor

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

// ringSize is the number of generations idempotency keys are kept in (migration 8): one current,
// the others looked up. A key lives between the retention and ringSize/(ringSize-1) of it.
const ringSize = 4

// keyRing is where a schema keeps the idempotency keys its processors applied: a ring of
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
type keyRing struct {
	recordSQL  string // $1 the 16-byte hashes, $2 the full ones (the legacy table's); returns the new keys
	generation [ringSize]string
	legacy     string // idempotency_keys, the layout before migration 8
	ring       string
	retention  string
	deadLetter string
}

func newKeyRing(schema string) *keyRing {
	k := &keyRing{
		legacy:     pgx.Identifier{schema, "idempotency_keys"}.Sanitize(),
		ring:       pgx.Identifier{schema, "idempotency_ring"}.Sanitize(),
		retention:  pgx.Identifier{schema, "idempotency_retention"}.Sanitize(),
		deadLetter: pgx.Identifier{schema, "dead_letters"}.Sanitize(),
	}
	for g := range ringSize {
		k.generation[g] = pgx.Identifier{schema, "idempotency_keys_" + strconv.Itoa(g)}.Sanitize()
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
	for _, t := range k.generation {
		s.WriteString("\n\t\t\tAND NOT EXISTS (SELECT 1 FROM " + t + " x WHERE x.key_hash = k.u)")
	}
	s.WriteString("\n\t\t\tAND NOT EXISTS (SELECT 1 FROM " + k.legacy + " x WHERE x.key_hash = k.h))")
	for g, t := range k.generation {
		fmt.Fprintf(&s, ",\n\t\ti%d AS (INSERT INTO %s SELECT u FROM fresh WHERE (SELECT current FROM ring) = %d ORDER BY u ON CONFLICT DO NOTHING RETURNING key_hash)", g, t, g)
	}
	s.WriteString("\n\t\tSELECT key_hash FROM i0")
	for g := 1; g < ringSize; g++ {
		fmt.Fprintf(&s, " UNION ALL SELECT key_hash FROM i%d", g)
	}
	k.recordSQL = s.String()
	return k
}

// shortHash is the part of a key's hash the ring keeps: its first 16 bytes.
func shortHash(h [32]byte) [16]byte { return [16]byte(h[:16]) }

// record records keys (their hashes, in hash order) in tx and returns the ones no transaction
// recorded before, by their short hash. One round trip.
func (k *keyRing) record(ctx context.Context, tx pgx.Tx, keys [][32]byte) (map[[16]byte]bool, error) {
	short := make([][16]byte, len(keys))
	full := make([][]byte, len(keys))
	for i := range keys {
		short[i], full[i] = shortHash(keys[i]), keys[i][:]
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

// turned is what one keep did.
type turned struct {
	rotated bool  // the oldest generation was emptied and made current
	legacy  bool  // the legacy table was emptied
	emptied int64 // keys removed, as Postgres's statistics count them
}

// errRingBusy is keep's when it could not empty the oldest generation in time: transactions
// recording keys held it; the next keep tries again.
var errRingBusy = errors.New("the idempotency key ring is busy")

// keep says that group keeps its keys for retention, and turns the ring if it is due: when its
// current generation is older than a third of the longest retention of the groups seen within
// their retention. It also empties the legacy table once its newest key is older than that
// retention. A key that a dead letter which may still be replayed (new, replaying) shares is
// copied into the current generation first: the replay must find it, however late it comes.
//
// The turn waits for the batches recording keys at that moment, and the batches that come
// meanwhile wait for it: at most lockTimeout, past which keep gives up with errRingBusy and the
// batches go on. Replicas turning at once take turns on the ring's row.
func (k *keyRing) keep(ctx context.Context, pool *pgxpool.Pool, group string, retention time.Duration, lockTimeout time.Duration) (turned, error) {
	var out turned
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
		// Again, holding the ring's row: another replica may have turned it meanwhile.
		if err := tx.QueryRow(ctx, k.dueSQL()).Scan(&due, &legacyDue); err != nil {
			return err
		}
		if due {
			next := (current + 1) % ringSize
			n, err := k.empty(ctx, tx, k.generation[next], k.generation[current], `k.key_hash = encode(substr(d.idempotency_key_hash, 1, 16), 'hex')::uuid`)
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `UPDATE `+k.ring+` SET current = $1, rotated_at = now() WHERE id = 0`, next); err != nil {
				return err
			}
			out.rotated, out.emptied, current = true, out.emptied+n, next
		}
		if legacyDue {
			n, err := k.empty(ctx, tx, k.legacy, k.generation[current], `k.key_hash = d.idempotency_key_hash`)
			if err != nil {
				return err
			}
			out.legacy, out.emptied = true, out.emptied+n
		}
		return nil
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
		return turned{}, errRingBusy
	}
	if err != nil {
		return turned{}, fmt.Errorf("turn the ring: %w", err)
	}
	return out, nil
}

// dueSQL says whether the ring is due to turn, and whether the legacy table is due to be emptied.
func (k *keyRing) dueSQL() string {
	return `WITH longest AS (SELECT coalesce(max(retention), interval '0') AS r FROM ` + k.retention + ` WHERE seen_at + retention > now())
		SELECT g.rotated_at <= now() - (SELECT r FROM longest) / 3 AND (SELECT r FROM longest) > interval '0',
			coalesce((SELECT max(applied_at) FROM ` + k.legacy + `) <= now() - (SELECT r FROM longest), false)
		FROM ` + k.ring + ` g WHERE g.id = 0`
}

// empty empties table, a generation or the legacy table, with TRUNCATE, after copying into
// current the keys of it that dead letters which may still be replayed share (match says how a
// row k of table matches a dead letter d). It returns how many keys the table held, as Postgres's
// statistics count them (inserts only: exact, short of a crash's).
func (k *keyRing) empty(ctx context.Context, tx pgx.Tx, table, current, match string) (int64, error) {
	var keep, rows int64
	if err := tx.QueryRow(ctx, `WITH kept AS (INSERT INTO `+current+` SELECT DISTINCT encode(substr(d.idempotency_key_hash, 1, 16), 'hex')::uuid
			FROM `+k.deadLetter+` d JOIN `+table+` k ON `+match+`
			WHERE d.idempotency_key_hash IS NOT NULL AND d.status IN ('new', 'replaying')
			ON CONFLICT DO NOTHING RETURNING 1)
		SELECT (SELECT count(*) FROM kept), coalesce((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = $1::regclass), 0)`,
		table).Scan(&keep, &rows); err != nil {
		return 0, fmt.Errorf("keep the keys dead letters share: %w", err)
	}
	if _, err := tx.Exec(ctx, `TRUNCATE `+table); err != nil {
		return 0, fmt.Errorf("empty %s: %w", table, err)
	}
	return max(rows-keep, 0), nil
}

// size is the keys the ring (and the legacy table) holds, as Postgres's statistics count them
// (no scan of tables that may hold billions), and their disk space, indexes included.
func (k *keyRing) size(ctx context.Context, pool *pgxpool.Pool) (rows, bytes int64, err error) {
	tables := append(k.generation[:], k.legacy)
	err = pool.QueryRow(ctx, `SELECT coalesce(sum((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = c.oid)), 0)::int8,
			coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8
		FROM unnest($1::text[]) AS t(name) JOIN pg_class c ON c.oid = to_regclass(t.name)`, tables).Scan(&rows, &bytes)
	return rows, bytes, err
}
