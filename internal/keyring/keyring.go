// Package keyring keeps the idempotency keys a schema's processors applied, in a ring of four
// generations that turns a generation at a time, and compacts the generations past (see
// migrations 8 and 10, Ring, and state.go for the protocol).
//
// It guarantees, for recorders in read committed transactions: no key is taken for new by two
// transactions that both commit; a key committed less than the longest retention ago is found;
// nothing the ring's turner does makes a recorder wait (a recorder may fail with ErrMoved, to be
// retried, in a rare race). It does not promise when a turn ends: a move waits, without queueing,
// for the recorders of the epoch two before it to end, however long they last.
package keyring

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
// generations (idempotency_keys_0 to _3), one of them current, each a table of 16-byte hashes,
// and their compacted copies (idempotency_runs_0 to _3). The tables are shared by every group of
// the schema (a key's hash covers its group and topic).
//
// Recording keys (Record) looks them up in the tables the ring's state says, and inserts the new
// ones into its current generation (two, while it turns). Turning the ring (Keep) is a sequence
// of moves, each an epoch (state.go): stop looking up the oldest generation (its keys that dead
// letters share copied into the current one first), empty it with TRUNCATE, insert into both it
// and the current one, then into it only, then freeze the one before: compact it (Compact), look
// it up by its runs, and empty its table of keys.
//
// Why two copies of a record cannot land in two generations unseen by each other: recorders alive
// at once are of two consecutive epochs at most (a move to E waits until no recorder of E-2 is
// alive, and a recorder that finds the ring two epochs past its own fails), and two consecutive
// states always insert into a common table of keys, whose primary key makes the second insert of
// a key wait for the first and find it.
type Ring struct {
	schema     string
	generation [Generations]string
	runs       [Generations]string // each generation's compacted keys
	legacy     string              // idempotency_keys, the layout before migration 8
	ring       string
	retention  string
	deadLetter string
	offsets    string
	pending    string // schema_migrations_pending: while the upgrade window is open, the legacy table stays
	enterSQL   string
	ns         int32 // the namespace of the ring's advisory locks

	// grace is how long a move waits after the one before it: a processor recording keys sees
	// each state before the next (one whose view of the ring is older than grace/2 reads it again
	// first, see Record), so that ErrMoved stays a rare race.
	grace time.Duration

	seen   atomic.Pointer[seenState] // the last state this process read
	sqls   sync.Map                  // View -> its record statement
	window atomic.Pointer[string]    // the group whose keys go into the legacy table too, while the upgrade window is open
}

// SetWindow says whether the upgrade window of the schema is open (see package schema): while it
// is, the keys group records go into the table of the release before (idempotency_keys) as well
// as into the ring, so that its processors, which look only there, find them; and a key counts as
// recorded before if either has it.
func (k *Ring) SetWindow(group string, open bool) {
	if open {
		k.window.Store(&group)
	} else {
		k.window.Store(nil)
	}
}

// seenState is a state read, and when (before the statement that read it was sent).
type seenState struct {
	s  State
	at time.Time
}

// New returns the ring of schema.
func New(schema string) *Ring {
	k := &Ring{
		schema:     schema,
		legacy:     pgx.Identifier{schema, "idempotency_keys"}.Sanitize(),
		ring:       pgx.Identifier{schema, "idempotency_ring"}.Sanitize(),
		retention:  pgx.Identifier{schema, "idempotency_retention"}.Sanitize(),
		deadLetter: pgx.Identifier{schema, "dead_letters"}.Sanitize(),
		offsets:    pgx.Identifier{schema, "offsets"}.Sanitize(),
		pending:    pgx.Identifier{schema, "schema_migrations_pending"}.Sanitize(),
		grace:      250 * time.Millisecond,
	}
	k.enterSQL = `SELECT epoch, gen, step, legacy FROM ` + pgx.Identifier{schema, "idempotency_ring_enter"}.Sanitize() + `($1, $2)`
	for g := range Generations {
		k.generation[g] = pgx.Identifier{schema, "idempotency_keys_" + strconv.Itoa(g)}.Sanitize()
		k.runs[g] = pgx.Identifier{schema, "idempotency_runs_" + strconv.Itoa(g)}.Sanitize()
	}
	h := fnv.New32a()
	h.Write([]byte("kafkapg.keyring:" + schema))
	k.ns = int32(h.Sum32())
	return k
}

// table is the name of t.
func (k *Ring) table(t Table) string {
	switch {
	case t.Legacy:
		return k.legacy
	case t.Runs:
		return k.runs[t.Gen]
	default:
		return k.generation[t.Gen]
	}
}

// recordSQL is the statement a recorder of v runs: $1 the 16-byte hashes, $2 the full ones if v
// looks up the legacy table. It references only v's tables (a statement locks every table it
// names, whatever it reads). It looks the keys up, inserts the ones not found into each table v
// inserts into, in hash order, and returns those inserted into all of them: a key another
// transaction is inserting makes this one wait on the key's primary key until that one ends (ON
// CONFLICT): a duplicate if it committed, ours if it rolled back.
func (k *Ring) recordSQL(v View) string {
	if s, ok := k.sqls.Load(v); ok {
		return s.(string)
	}
	var s strings.Builder
	if v.Legacy {
		s.WriteString(`WITH fresh AS (SELECT u FROM unnest($1::uuid[], $2::bytea[]) AS k(u, h) WHERE true`)
	} else {
		s.WriteString(`WITH fresh AS (SELECT u FROM unnest($1::uuid[]) AS k(u) WHERE true`)
	}
	for g := range Generations {
		if (v.Keys|v.Insert)&bit(g) != 0 {
			s.WriteString("\n\t\tAND NOT EXISTS (SELECT 1 FROM " + k.generation[g] + " x WHERE x.key_hash = k.u)")
		}
		if v.Runs&bit(g) != 0 {
			s.WriteString("\n\t\tAND NOT " + inRuns(k.runs[g], "k.u"))
		}
	}
	if v.Legacy {
		s.WriteString("\n\t\tAND NOT EXISTS (SELECT 1 FROM " + k.legacy + " x WHERE x.key_hash = k.h)")
	}
	s.WriteString(")")
	var ins []string
	if v.Legacy && v.LegacyInsert {
		// The release before's row: it prunes by group and applied_at, and reads nothing else.
		// A key it inserts at the same time makes this insert wait and find it (and the other
		// way round): a key is fresh only if both inserts took it.
		s.WriteString(",\n\til AS (INSERT INTO " + k.legacy + ` (key_hash, consumer_group, topic, partition, "offset")
		SELECT k.h, $3, '', -1, -1 FROM unnest($1::uuid[], $2::bytea[]) AS k(u, h) WHERE k.u IN (SELECT u FROM fresh)
		ORDER BY k.h ON CONFLICT DO NOTHING RETURNING encode(substring(key_hash FROM 1 FOR 16), 'hex')::uuid AS key_hash)`)
		ins = append(ins, "il")
	}
	for g := range Generations {
		if v.Insert&bit(g) != 0 {
			name := "i" + strconv.Itoa(g)
			fmt.Fprintf(&s, ",\n\t%s AS (INSERT INTO %s SELECT u FROM fresh ORDER BY u ON CONFLICT DO NOTHING RETURNING key_hash)", name, k.generation[g])
			ins = append(ins, name)
		}
	}
	s.WriteString("\nSELECT key_hash FROM " + ins[0])
	for i, name := range ins[1:] {
		if i == 0 {
			s.WriteString(" WHERE")
		} else {
			s.WriteString(" AND")
		}
		s.WriteString(" key_hash IN (SELECT key_hash FROM " + name + ")")
	}
	out, _ := k.sqls.LoadOrStore(v, s.String())
	return out.(string)
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

// ErrMoved is Record's when the ring moved two states past the one this process saw while it
// recorded (a rare race, see state.go): the transaction must be rolled back and retried. It wraps
// a *pgconn.PgError of SQLSTATE class 40 (transaction rollback).
var ErrMoved = errors.New("the idempotency key ring moved on: retry the transaction")

// codeMoved is the SQLSTATE of idempotency_ring_enter's refusal (migration 10).
const codeMoved = "40K01"

// Record records keys (their hashes, in hash order) in tx, a read committed transaction, and
// returns the ones no transaction recorded before, by their short hash. One round trip (two, if
// this process has not read the ring for grace/2). On ErrMoved, roll tx back and retry.
func (k *Ring) Record(ctx context.Context, tx pgx.Tx, keys [][32]byte) (map[[16]byte]bool, error) {
	seen := k.seen.Load()
	if seen == nil || time.Since(seen.at) > k.grace/2 {
		at := time.Now()
		s, err := k.read(ctx, tx, "")
		if err != nil {
			return nil, fmt.Errorf("read the idempotency key ring: %w", err)
		}
		seen = k.remember(s, at)
	}
	short := make([][16]byte, len(keys))
	full := make([][]byte, len(keys))
	for i := range keys {
		short[i], full[i] = Short(keys[i]), keys[i][:]
	}
	view := seen.s.View()
	args := []any{short}
	if view.Legacy {
		args = append(args, full)
		if g := k.window.Load(); g != nil {
			view.LegacyInsert = true
			args = append(args, *g)
		}
	}
	at := time.Now()
	b := &pgx.Batch{}
	b.Queue(k.enterSQL, k.ns, seen.s.Epoch)
	b.Queue(k.recordSQL(view), args...)
	br := tx.SendBatch(ctx, b)
	var now State
	if err := br.QueryRow().Scan(&now.Epoch, &now.Gen, &now.Step, &now.Legacy); err != nil {
		br.Close()
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == codeMoved {
			k.seen.CompareAndSwap(seen, nil)
			return nil, fmt.Errorf("%w: %w", ErrMoved, err)
		}
		return nil, err
	}
	k.remember(now, at)
	rows, err := br.Query()
	if err != nil {
		br.Close()
		return nil, err
	}
	fresh, err := pgx.CollectRows(rows, pgx.RowTo[[16]byte])
	if err == nil {
		err = br.Close()
	} else {
		br.Close()
	}
	if err != nil {
		return nil, err
	}
	out := make(map[[16]byte]bool, len(fresh))
	for _, h := range fresh {
		out[h] = true
	}
	return out, nil
}

// remember keeps s, read at at, as the state this process saw, unless it saw a later one.
func (k *Ring) remember(s State, at time.Time) *seenState {
	next := &seenState{s: s, at: at}
	for {
		old := k.seen.Load()
		if old != nil && (old.s.Epoch > s.Epoch || old.s.Epoch == s.Epoch && !old.at.Before(at)) {
			return old
		}
		if k.seen.CompareAndSwap(old, next) {
			return next
		}
	}
}

// querier is a transaction or a pool.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// read reads the ring's state; lock is "" or a locking clause (FOR UPDATE).
func (k *Ring) read(ctx context.Context, q querier, lock string) (State, error) {
	var s State
	err := q.QueryRow(ctx, `SELECT epoch, gen, step, legacy FROM `+k.ring+` WHERE id = 0 `+lock).Scan(&s.Epoch, &s.Gen, &s.Step, &s.Legacy)
	return s, err
}

// State reads the ring's state.
func (k *Ring) State(ctx context.Context, pool *pgxpool.Pool) (State, error) {
	return k.read(ctx, pool, "")
}

// Turned is what one Keep (or Compact) did.
type Turned struct {
	Rotated bool  // a new generation became the only one keys are inserted into
	Legacy  bool  // the legacy table was emptied
	Emptied int64 // keys removed, as Postgres's statistics count them
	Moves   int   // moves made
	// LegacyHeldBy is a consumer group of the schema (in its offsets) that has no retention row:
	// one that has not run this release yet, whose keys may still be in the legacy table, which is
	// therefore kept.
	LegacyHeldBy string
	State        State // the ring's state after
}

// ErrBusy is Keep's and Compact's when a move due could not be made yet: recorders of an epoch
// two before it are still alive (batches that recorded keys are still open), or a table to empty
// is in use. Nothing waits for them; the next keep tries again.
var ErrBusy = errors.New("the idempotency key ring is not ready to move yet")

// Register says that group runs this release, for a group without idempotency keys (a group with
// keys says it with Keep): a group of the schema without a retention row keeps the legacy table
// (idempotency_keys) from being emptied, as it may be one of the release before whose keys are
// there. It writes retention 0 if the group has no row, and changes nothing otherwise.
func (k *Ring) Register(ctx context.Context, pool *pgxpool.Pool, group string) error {
	_, err := pool.Exec(ctx, `INSERT INTO `+k.retention+` (consumer_group, retention, seen_at) VALUES ($1, interval '0', now()) ON CONFLICT DO NOTHING`, group)
	if err != nil {
		return fmt.Errorf("register group %q with the idempotency key ring: %w", group, err)
	}
	return nil
}

// Keep says that group keeps its keys for retention, and moves the ring as far as it can: into a
// turn when it is due (its last turn froze a generation a third of the longest retention of the
// groups seen within it ago), through the turn's moves up to the freeze of the generation before
// (Compact takes it from there). It also empties the legacy table once every group of the schema
// has a retention row and its newest key is older than the longest one. A key that a dead letter
// which may still be replayed (new, replaying) shares is copied into the current generation
// first: the replay must find it, however late it comes.
//
// A move waits, polling, up to patience for the recorders of the epoch two before it to end, and
// returns ErrBusy if they have not: nothing queues, and no recorder ever waits for it. Replicas
// moving at once take turns on the ring's row.
func (k *Ring) Keep(ctx context.Context, pool *pgxpool.Pool, group string, retention time.Duration, patience time.Duration) (Turned, error) {
	return k.KeepEach(ctx, pool, group, retention, patience, nil)
}

// KeepEach is Keep, calling dropped (if not nil) as soon as a move removed keys, with what that
// move did: a turn's later moves are spaced (by a quarter of a second), and the keys are gone
// already.
func (k *Ring) KeepEach(ctx context.Context, pool *pgxpool.Pool, group string, retention time.Duration, patience time.Duration, dropped func(Turned)) (Turned, error) {
	// The ring turns at the longest retention of the groups seen within it; a group's row is
	// refreshed every hour (every quarter of its retention, if shorter), not every minute.
	if _, err := pool.Exec(ctx, `INSERT INTO `+k.retention+` AS r (consumer_group, retention, seen_at) VALUES ($1, $2, now())
		ON CONFLICT (consumer_group) DO UPDATE SET retention = EXCLUDED.retention, seen_at = EXCLUDED.seen_at
		WHERE r.retention <> EXCLUDED.retention OR r.seen_at < now() - least(interval '1 hour', r.retention / 4)`, group, retention); err != nil {
		return Turned{}, fmt.Errorf("record the retention: %w", err)
	}
	out, err := k.advance(ctx, pool, patience, false, dropped)
	if err != nil && !errors.Is(err, ErrBusy) {
		err = fmt.Errorf("turn the ring: %w", err)
	}
	return out.Turned, err
}

// Compact compacts the generations that their state says to (the one the last turn froze, or the
// generations past that the release before migration 10 left), a chunk of keys per transaction,
// then makes the moves that follow: look them up by their runs, empty their tables of keys.
// Several processes may compact at once: they start each chunk from the last key copied, so a
// chunk's rows are the same whoever writes them, and the second to write one finds it there.
// It returns how many generations it finished (their tables of keys emptied).
func (k *Ring) Compact(ctx context.Context, pool *pgxpool.Pool, patience time.Duration) (int, error) {
	s, err := k.read(ctx, pool, "")
	if err != nil {
		return 0, err
	}
	for g := range Generations {
		if s.Compacting()&bit(g) != 0 {
			if err := k.compactGeneration(ctx, pool, g); err != nil {
				return 0, fmt.Errorf("compact generation %d: %w", g, err)
			}
		}
	}
	out, err := k.advance(ctx, pool, patience, true, nil)
	if err != nil && !errors.Is(err, ErrBusy) {
		err = fmt.Errorf("after compacting: %w", err)
	}
	return out.compacted, err
}

// advanced is what advance did, and the generations whose compaction it finished.
type advanced struct {
	Turned
	compacted int
}

// advance makes the moves due, one a transaction, until none is (or, unless compacting, the next
// needs a compaction; if compacting, only moves that follow one).
func (k *Ring) advance(ctx context.Context, pool *pgxpool.Pool, patience time.Duration, compacting bool, dropped func(Turned)) (advanced, error) {
	var out advanced
	start := time.Now()
	for {
		var (
			m       Move
			moved   bool
			wait    time.Duration
			emptied int64
		)
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var movedAgo time.Duration
			var s State
			if err := tx.QueryRow(ctx, `SELECT epoch, gen, step, legacy, clock_timestamp() - moved_at FROM `+k.ring+` WHERE id = 0 FOR UPDATE`).
				Scan(&s.Epoch, &s.Gen, &s.Step, &s.Legacy, &movedAgo); err != nil {
				return err
			}
			out.State = s
			var due, legacyDue bool
			if s.Step == Steady || s.Legacy == LegacyLooked {
				var err error
				if due, legacyDue, out.LegacyHeldBy, err = k.due(ctx, tx); err != nil {
					return err
				}
			}
			var ok bool
			if m, ok = s.Next(due, legacyDue); !ok {
				return nil
			}
			if compacting {
				if !(s.Step == Frozen || s.Step == Compacted || s.Step == Upgrade || s.Step == Upgraded) || m.To.Step == s.Step {
					return nil // not a move that follows a compaction (a legacy one: Keep's)
				}
			} else if m.Compact != 0 {
				return nil // Compact's
			}
			if movedAgo < k.grace {
				wait = k.grace - movedAgo
				return nil
			}
			var got bool
			if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1::int4, $2::int4)`, k.ns, lockKey(Guard(m.To.Epoch))).Scan(&got); err != nil {
				return err
			}
			if !got {
				wait = -1
				return nil
			}
			if m.Compact != 0 {
				done, err := k.compacted(ctx, tx, m.Compact)
				if err != nil || !done {
					return err // a compaction still to finish (Compact does it)
				}
			}
			for _, t := range m.Carry {
				if err := k.carry(ctx, tx, t, m.Into); err != nil {
					return err
				}
			}
			for _, t := range m.Empty {
				n, err := k.empty(ctx, tx, t, !m.Kept)
				if err != nil {
					return err
				}
				emptied += n
			}
			stamp := ""
			if m.Stamp {
				stamp = ", rotated_at = clock_timestamp()"
			}
			if _, err := tx.Exec(ctx, `UPDATE `+k.ring+` SET epoch = $1, gen = $2, step = $3, legacy = $4, moved_at = clock_timestamp()`+stamp+` WHERE id = 0`,
				m.To.Epoch, m.To.Gen, m.To.Step, m.To.Legacy); err != nil {
				return err
			}
			moved = true
			return nil
		})
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available: a table to empty is in use
			err, wait = nil, -1
		}
		if err != nil {
			return out, err
		}
		if moved {
			legacy := len(m.Empty) == 1 && m.Empty[0].Legacy
			out.Moves++
			out.State = m.To
			out.Rotated = out.Rotated || m.Rotated
			out.Legacy = out.Legacy || legacy
			out.Emptied += emptied
			if dropped != nil && len(m.Empty) > 0 && !m.Kept {
				dropped(Turned{Legacy: legacy, Emptied: emptied, Moves: 1, State: m.To})
			}
			if m.Compact != 0 {
				out.compacted += popcount(m.Compact)
			}
			start = time.Now()
			k.remember(m.To, time.Now())
			continue
		}
		switch {
		case wait == 0:
			return out, nil // nothing due
		case wait < 0 && time.Since(start) >= patience:
			return out, fmt.Errorf("%w: the move to %s waits for older recorders", ErrBusy, m.To)
		case wait < 0:
			wait = 50 * time.Millisecond
		}
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case <-time.After(wait):
		}
	}
}

func popcount(m uint8) int {
	n := 0
	for ; m != 0; m &= m - 1 {
		n++
	}
	return n
}

// due says whether the ring is due to turn, whether the legacy table is due to be emptied, and
// which group holds it back if one does. The legacy table is due only when every group with
// positions in the schema (offsets) has a retention row (it runs this release: its keys are in
// the ring), and its newest key is older than the longest retention of them all: a group's keys
// are never removed at another group's retention. Never while the upgrade window is open (the
// release before looks only there).
func (k *Ring) due(ctx context.Context, tx pgx.Tx) (due, legacyDue bool, heldBy string, err error) {
	var held *string
	err = tx.QueryRow(ctx, `WITH longest AS (SELECT coalesce(max(retention), interval '0') AS r FROM `+k.retention+` WHERE seen_at + retention > now())
		SELECT g.rotated_at <= now() - (SELECT r FROM longest) / 3 AND (SELECT r FROM longest) > interval '0',
			g.legacy = 0 AND coalesce((SELECT max(applied_at) FROM `+k.legacy+`) <= now() - (SELECT max(retention) FROM `+k.retention+`), false)
				AND NOT EXISTS (SELECT 1 FROM `+k.pending+`),
			CASE WHEN g.legacy = 0 THEN (SELECT o.consumer_group FROM (SELECT DISTINCT consumer_group FROM `+k.offsets+`) o
				WHERE NOT EXISTS (SELECT 1 FROM `+k.retention+` r WHERE r.consumer_group = o.consumer_group) ORDER BY 1 LIMIT 1) END
		FROM `+k.ring+` g WHERE g.id = 0`).Scan(&due, &legacyDue, &held)
	if held != nil {
		heldBy, legacyDue = *held, false
	}
	return due, legacyDue, heldBy, err
}

// compacted reports whether the tables of keys of the generations gens are wholly in their runs:
// a compaction copies them in hash order, from the last key copied, into runs emptied before the
// generation took keys, so they are once no key is past the last one copied.
func (k *Ring) compacted(ctx context.Context, tx pgx.Tx, gens uint8) (bool, error) {
	for g := range Generations {
		if gens&bit(g) == 0 {
			continue
		}
		var left bool
		if err := tx.QueryRow(ctx, `WITH last AS (SELECT keys[cardinality(keys)] AS k FROM `+k.runs[g]+` ORDER BY lo DESC LIMIT 1)
			SELECT EXISTS (SELECT 1 FROM `+k.generation[g]+` WHERE NOT EXISTS (SELECT 1 FROM last) OR key_hash > (SELECT k FROM last))`).Scan(&left); err != nil {
			return false, err
		}
		if left {
			return false, nil
		}
	}
	return true, nil
}

// deadLetterKey is the SQL of a dead letter d's key as the ring keeps it.
const deadLetterKey = `encode(substr(d.idempotency_key_hash, 1, 16), 'hex')::uuid`

// match is the SQL condition "row k of t holds dead letter d's key", and keys the SQL of how many
// keys row k holds.
func (k *Ring) match(t Table) (match, keys string, perRow int) {
	switch {
	case t.Legacy:
		return `k.key_hash = d.idempotency_key_hash`, "1", 1
	case t.Runs:
		return `k.lo = (SELECT r.lo FROM ` + k.runs[t.Gen] + ` r WHERE r.lo <= ` + deadLetterKey + ` ORDER BY r.lo DESC LIMIT 1)
			AND ` + deadLetterKey + ` = ANY(k.keys)`, "cardinality(k.keys)", runSize
	default:
		return `k.key_hash = ` + deadLetterKey, "1", 1
	}
}

// carry copies the keys of t that dead letters which may still be replayed share into generation
// into's table of keys.
func (k *Ring) carry(ctx context.Context, tx pgx.Tx, t Table, into int) error {
	match, _, _ := k.match(t)
	if _, err := tx.Exec(ctx, `INSERT INTO `+k.generation[into]+` SELECT DISTINCT `+deadLetterKey+`
			FROM `+k.deadLetter+` d JOIN `+k.table(t)+` k ON `+match+`
			WHERE d.idempotency_key_hash IS NOT NULL AND d.status IN ('new', 'replaying')
			ORDER BY 1 ON CONFLICT DO NOTHING`); err != nil {
		return fmt.Errorf("keep the keys dead letters share: %w", err)
	}
	return nil
}

// empty empties t with TRUNCATE, its lock taken NOWAIT (no recorder references it: see Move), and
// returns (if count) how many keys it held, less those dead letters which may still be replayed share (carried
// into the ring before): counted if Postgres's statistics say it holds fewer than a million rows,
// else as they say (inserts only: exact, short of a crash's and the last second's).
func (k *Ring) empty(ctx context.Context, tx pgx.Tx, t Table, count bool) (int64, error) {
	name := k.table(t)
	if _, err := tx.Exec(ctx, `LOCK TABLE `+name+` IN ACCESS EXCLUSIVE MODE NOWAIT`); err != nil {
		return 0, fmt.Errorf("empty %s: %w", name, err)
	}
	var kept, held int64
	if count {
		match, keys, perRow := k.match(t)
		if err := tx.QueryRow(ctx, `WITH stat AS (SELECT coalesce((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = $1::regclass), 0) AS rows)
			SELECT (SELECT count(DISTINCT d.idempotency_key_hash) FROM `+k.deadLetter+` d JOIN `+name+` k ON `+match+`
					WHERE d.idempotency_key_hash IS NOT NULL AND d.status IN ('new', 'replaying')),
				CASE WHEN (SELECT rows FROM stat) < 1000000 THEN (SELECT coalesce(sum(`+keys+`), 0) FROM `+name+` k)
				ELSE (SELECT rows FROM stat) * `+strconv.Itoa(perRow)+` END`, name).Scan(&kept, &held); err != nil {
			return 0, fmt.Errorf("count the keys of %s: %w", name, err)
		}
	}
	if _, err := tx.Exec(ctx, `TRUNCATE `+name); err != nil {
		return 0, fmt.Errorf("empty %s: %w", name, err)
	}
	return max(held-kept, 0), nil
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

// compactChunk is how many keys a transaction of a compaction copies: whole rows of runSize.
var compactChunk = runSize * 8192

// beforeChunk, if set (tests), runs before each transaction of a compaction.
var beforeChunk func(g int)

// compactGeneration copies generation g's keys into its runs, in hash order, compactChunk keys a
// transaction, each from the key after the last one copied (the last key of the last row, read
// in the transaction: a chunk commits whole, and every key up to its last is in it). Each
// transaction holds the ring's row (FOR SHARE: no move in the middle of it) and stops unless the
// ring's state still says to compact g: the table of keys is then frozen, and the runs
// referenced by no recorder but as the state says.
func (k *Ring) compactGeneration(ctx context.Context, pool *pgxpool.Pool, g int) error {
	chunk := `WITH last AS (SELECT keys[cardinality(keys)] AS k FROM ` + k.runs[g] + ` ORDER BY lo DESC LIMIT 1),
		c AS (SELECT key_hash FROM ` + k.generation[g] + ` WHERE NOT EXISTS (SELECT 1 FROM last) OR key_hash > (SELECT k FROM last) ORDER BY key_hash LIMIT $1),
		runs AS (INSERT INTO ` + k.runs[g] + ` (lo, keys) SELECT keys[1], keys FROM (SELECT array_agg(key_hash ORDER BY key_hash) AS keys
			FROM (SELECT key_hash, (row_number() OVER (ORDER BY key_hash) - 1) / ` + strconv.Itoa(runSize) + ` AS run FROM c) AS s GROUP BY run) AS r
			ON CONFLICT (lo) DO NOTHING)
		SELECT count(*) FROM c`
	for {
		if beforeChunk != nil {
			beforeChunk(g)
		}
		n, still := 0, true
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			s, err := k.read(ctx, tx, "FOR SHARE")
			if err != nil {
				return err
			}
			if still = s.Compacting()&bit(g) != 0; !still {
				return nil
			}
			return tx.QueryRow(ctx, chunk, compactChunk).Scan(&n)
		})
		if err != nil || !still || n < compactChunk {
			return err
		}
	}
}
