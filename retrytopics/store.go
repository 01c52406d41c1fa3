package retrytopics

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/sink"
)

// Store keeps the retry path's state in Postgres for one consumer group: records waiting in
// retry tiers (table retries), keys held behind them (held_keys), later records of those keys
// (held_records) and dead letters (dead_letters).
//
// Its methods that take a pgx.Tx run inside the caller's transaction, which also advances the
// offset of the partition the record is moved off (or, for a held record, deletes it from
// held_records): a record's move and its new state commit together or not at all.
//
// The held_keys row of a key is the lock that serializes everything done to the key. Whoever
// holds a record behind the key, applies the key's head or hands the key over to its next held
// record first locks that row (SELECT ... FOR UPDATE), so a record cannot be held behind a key
// that is being released at the same moment and then be forgotten.
//
// The times of a record's steps (sent to a tier, held, dead-lettered, kept in skipped_duplicates and held_history) are
// clock_timestamp(), not now(): now() is when the transaction began, before the failure it
// records (timed by the processor's clock, in the transaction), and a trace tells the steps in
// time order.
type Store struct {
	group       string
	retries     string
	heldKeys    string
	heldRecords string
	deadLetters string
	events      string
	offsets     string
	tasks       string
	skipped     string
	heldHistory string
}

// NewStore returns a Store for group whose tables live in schema.
func NewStore(schema, group string) *Store {
	t := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	return &Store{
		group:       group,
		retries:     t("retries"),
		heldKeys:    t("held_keys"),
		heldRecords: t("held_records"),
		deadLetters: t("dead_letters"),
		events:      t("dead_letter_events"),
		offsets:     t("offsets"),
		tasks:       t("tasks"),
		skipped:     t("skipped_duplicates"),
		heldHistory: t("held_history"),
	}
}

// Querier runs queries; *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Execer runs statements; *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Origin names a record in its source topic.
type Origin struct {
	Topic     string
	Partition int32
	Offset    int64
}

func (o Origin) String() string { return fmt.Sprintf("%s[%d]@%d", o.Topic, o.Partition, o.Offset) }

// Rec is a source record: its origin and contents.
type Rec struct {
	Origin
	Key       []byte // nil for a record without a key
	Value     []byte
	Headers   []kgo.RecordHeader
	Timestamp time.Time
	// Attempt is the delivery attempt a held record is handled as: 1, or for a dead letter a
	// replay brought back, one more than the attempts it died after (0 means 1).
	Attempt int
	// DeadLetter is the dead_letters row of a record a replay brought back; 0 otherwise.
	DeadLetter int64
	// Duplicate is said by the caller of Applied, AppliedHeld and AppliedHeldKeys: the handler
	// did not get the record, skipped as a duplicate of a record with its idempotency key. A
	// replayed dead letter's history then says skipped_duplicate instead of replayed.
	Duplicate bool
}

// Key names a key of a source partition.
type Key struct {
	Topic     string
	Partition int32
	Key       []byte
}

// Stage says where a record is when it fails.
type Stage int

const (
	// FromSource: the record was consumed from its source topic.
	FromSource Stage = iota
	// FromTier: the record was consumed from a retry tier.
	FromTier
	// FromHeld: the record was held behind its key and has just been taken from held_records.
	FromHeld
	// FromRetryCopy: the record's copy for the next retry tier could not be published (Kafka
	// refused it); its retry state expects the delivery attempt after Move.Attempt.
	FromRetryCopy
)

// ErrStale means the retry state of a record is not what its copy in a tier says: the copy is a
// duplicate publication, and the record has already moved on.
var ErrStale = errors.New("retry state changed: duplicate or stale copy")

// Move describes a failed record's next step.
type Move struct {
	Rec
	// Held says the record's key orders it: later records of the key wait while it is in the
	// retry path (or dead-lettered, with Block). False for records without a key.
	Held bool
	From Stage
	// Attempt is the delivery attempt that failed (1 = first delivery).
	Attempt       int
	Class         string
	Message       string
	FirstFailedAt time.Time
	// DueAt is when the record may be tried again, and Tier (1 or more) the retry tier it goes
	// to (ToTier only).
	DueAt time.Time
	Tier  int
	// Block keeps the key held after a dead letter, until an operator releases it (DeadLetter
	// only).
	Block bool
	// IdempotencyKeyHash is the hash of the record's idempotency key, as idempotency_keys has it,
	// if its topic has one (DeadLetter only): while the dead letter may be replayed, that key is
	// not pruned.
	IdempotencyKeyHash []byte
}

// HeldKeys returns the keys of a source partition that are held, in any state, and the keys
// epoch of its offsets row (see offsets.ErrKeysChanged) as of the same snapshot.
func (s *Store) HeldKeys(ctx context.Context, q Querier, topic string, partition int32) (keys [][]byte, epoch int64, err error) {
	err = q.QueryRow(ctx, `SELECT coalesce((SELECT keys_epoch FROM `+s.offsets+` WHERE consumer_group = $1 AND topic = $2 AND partition = $3), 0),
			ARRAY(SELECT key FROM `+s.heldKeys+` WHERE consumer_group = $1 AND topic = $2 AND partition = $3)`,
		s.group, topic, partition).Scan(&epoch, &keys)
	if err != nil {
		return nil, 0, fmt.Errorf("read held keys of %s[%d]: %w", topic, partition, err)
	}
	return keys, epoch, nil
}

// LockHeldKeys locks the held_keys rows of the given keys of a source partition and returns the
// keys that are held.
func (s *Store) LockHeldKeys(ctx context.Context, tx pgx.Tx, topic string, partition int32, keys [][]byte) (map[string]bool, error) {
	rows, err := tx.Query(ctx, `SELECT key FROM `+s.heldKeys+`
		WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = ANY(ARRAY(SELECT sha256(k) FROM unnest($4::bytea[]) AS k)) AND key = ANY($4::bytea[])
		ORDER BY key FOR UPDATE`, s.group, topic, partition, keys)
	if err != nil {
		return nil, fmt.Errorf("lock held keys: %w", err)
	}
	held := map[string]bool{}
	var k []byte
	_, err = pgx.ForEachRow(rows, []any{&k}, func() error {
		held[string(k)] = true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("lock held keys: %w", err)
	}
	return held, nil
}

// Hold stores records behind their held keys, each with the record it waits behind (behind): the
// key's head, or, with the head settled, the first record held before it. The caller holds the
// keys' locks (LockHeldKeys). A record that already waits there (an operator set the position
// back over it) is left as it is: it is applied once, when its key's turn comes.
func (s *Store) Hold(ctx context.Context, tx pgx.Tx, recs []Rec) error {
	b := &pgx.Batch{}
	for _, r := range recs {
		keys, vals := sink.SplitHeaders(r.Headers)
		b.Queue(`INSERT INTO `+s.heldRecords+` (consumer_group, topic, partition, "offset", key, value, header_keys, header_values, "timestamp", held_at, behind)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, clock_timestamp(), (SELECT coalesce(k.head_offset,
					(SELECT min(r."offset") FROM `+s.heldRecords+` r
						WHERE r.consumer_group = $1 AND r.topic = $2 AND r.partition = $3 AND r.key_hash = sha256($5::bytea) AND r.key = $5))
				FROM `+s.heldKeys+` k WHERE k.consumer_group = $1 AND k.topic = $2 AND k.partition = $3 AND k.key_hash = sha256($5::bytea) AND k.key = $5))
			ON CONFLICT (consumer_group, topic, partition, "offset") DO NOTHING`,
			s.group, r.Topic, r.Partition, r.Offset, r.Key, r.Value, keys, vals, r.Timestamp.UnixMilli())
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("hold %d records behind held keys: %w", len(recs), err)
	}
	return nil
}

// RetryState is a record's row in the retries table.
type RetryState struct {
	Attempt       int // the delivery attempt its current copy in a tier carries
	FirstFailedAt time.Time
	DeadLetter    int64 // the dead_letters row of a record a replay brought back; 0 otherwise
}

// LockRetries locks the retry state of records and returns it; a record with no state is not in
// the retry path (any copy of it in a tier is a duplicate).
func (s *Store) LockRetries(ctx context.Context, tx pgx.Tx, recs []Origin) (map[Origin]RetryState, error) {
	topics := make([]string, len(recs))
	parts := make([]int32, len(recs))
	offs := make([]int64, len(recs))
	for i, o := range recs {
		topics[i], parts[i], offs[i] = o.Topic, o.Partition, o.Offset
	}
	rows, err := tx.Query(ctx, `SELECT topic, partition, "offset", attempt, first_failed_at, coalesce(dead_letter_id, 0) FROM `+s.retries+`
		WHERE consumer_group = $1
		AND (topic, partition, "offset") IN (SELECT * FROM unnest($2::text[], $3::int[], $4::bigint[]))
		ORDER BY topic, partition, "offset" FOR UPDATE`, s.group, topics, parts, offs)
	if err != nil {
		return nil, fmt.Errorf("lock retry state: %w", err)
	}
	out := map[Origin]RetryState{}
	var o Origin
	var st RetryState
	_, err = pgx.ForEachRow(rows, []any{&o.Topic, &o.Partition, &o.Offset, &st.Attempt, &st.FirstFailedAt, &st.DeadLetter}, func() error {
		out[o] = st
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("lock retry state: %w", err)
	}
	return out, nil
}

// Applied records that records from a tier were applied: they leave the retry path, and the
// keys of those whose held is true go on with their next held record (or are no longer held).
// One round trip for all of them. The caller holds the records' retry state locks
// (LockRetries).
func (s *Store) Applied(ctx context.Context, tx pgx.Tx, recs []Rec, held []bool) error {
	if len(recs) == 0 {
		return nil
	}
	b := &pgx.Batch{}
	var replayed settled
	for _, r := range recs {
		b.Queue(`DELETE FROM `+s.retries+` WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND "offset" = $4`,
			s.group, r.Topic, r.Partition, r.Offset)
		replayed.add(r)
	}
	s.queueReplayed(b, replayed)
	for i, r := range recs {
		if held[i] {
			s.queueRelease(b, Key{r.Topic, r.Partition, r.Key})
		}
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("forget the retry state of %d applied records (from %s): %w", len(recs), recs[0].Origin, err)
	}
	return nil
}

// ToTier records that a failed record goes to a retry tier (attempt m.Attempt+1 is next). Moving
// a record on from a tier returns ErrStale if its retry state is not at m.Attempt. A record sent
// from its source partition while it is still in the tiers (an operator set the position back
// over it) keeps the state it has: it goes on once, and the copy sent now is skipped as a
// duplicate if it comes after the state moved on (see admitRetries in package processor).
func (s *Store) ToTier(ctx context.Context, tx pgx.Tx, m Move) error {
	if m.Tier < 1 {
		return fmt.Errorf("send %s to a retry tier: tier %d", m.Origin, m.Tier)
	}
	next := m.Attempt + 1
	switch m.From {
	case FromSource, FromHeld:
		if m.From == FromHeld { // it leaves held_records for the tier, held key or not
			if err := s.unhold(ctx, tx, m.Origin); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+s.retries+` (consumer_group, topic, partition, "offset", key, attempt, first_failed_at, due_at, error_class, error_message, dead_letter_id, tier, updated_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, nullif($11::bigint, 0), $12, clock_timestamp())
			ON CONFLICT (consumer_group, topic, partition, "offset") DO NOTHING`,
			s.group, m.Topic, m.Partition, m.Offset, m.Key, next, m.FirstFailedAt, m.DueAt, m.Class, safetext.Text(m.Message, maxStoredMessage), m.DeadLetter, m.Tier); err != nil {
			return fmt.Errorf("store retry state of %s: %w", m.Origin, err)
		}
	case FromTier:
		tag, err := tx.Exec(ctx, `UPDATE `+s.retries+` SET attempt = $6, due_at = $7, error_class = $8, error_message = $9, tier = $10, updated_at = clock_timestamp()
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND "offset" = $4 AND attempt = $5`,
			s.group, m.Topic, m.Partition, m.Offset, m.Attempt, next, m.DueAt, m.Class, safetext.Text(m.Message, maxStoredMessage), m.Tier)
		if err != nil {
			return fmt.Errorf("update retry state of %s: %w", m.Origin, err)
		}
		if tag.RowsAffected() != 1 {
			return fmt.Errorf("%s at attempt %d: %w", m.Origin, m.Attempt, ErrStale)
		}
	}
	if !m.Held {
		return nil
	}
	switch m.From {
	case FromSource:
		// The key was not held (the record would have been held otherwise): it is from now on.
		if _, err := tx.Exec(ctx, `INSERT INTO `+s.heldKeys+` (consumer_group, topic, partition, key, state, head_offset)
			VALUES ($1, $2, $3, $4, 'retrying', $5)`, s.group, m.Topic, m.Partition, m.Key, m.Offset); err != nil {
			return fmt.Errorf("hold key of %s: %w", m.Origin, err)
		}
	case FromHeld:
		if _, err := tx.Exec(ctx, `UPDATE `+s.heldKeys+` SET state = 'retrying', head_offset = $5, updated_at = now()
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4`,
			s.group, m.Topic, m.Partition, m.Key, m.Offset); err != nil {
			return fmt.Errorf("make %s its key's head: %w", m.Origin, err)
		}
	}
	return nil
}

// maxStoredMessage bounds the error messages stored in Postgres, in bytes.
const maxStoredMessage = 8 << 10

// DeadLetter records that a failed record is dead-lettered: one dead_letters row, and the record
// leaves the retry path. Its key, if held, goes on with its next record, or stays held (blocked)
// if m.Block. Moving a record on from a tier returns ErrStale if its retry state is not at
// m.Attempt.
func (s *Store) DeadLetter(ctx context.Context, tx pgx.Tx, m Move) error {
	// The record leaves where it was first, which fails (ErrStale) if it is not there any more: a
	// stale copy must never get as far as a second dead letter.
	switch m.From {
	case FromTier, FromRetryCopy:
		at := m.Attempt
		if m.From == FromRetryCopy {
			at++
		}
		tag, err := tx.Exec(ctx, `DELETE FROM `+s.retries+` WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND "offset" = $4 AND attempt = $5`,
			s.group, m.Topic, m.Partition, m.Offset, at)
		if err != nil {
			return fmt.Errorf("forget retry state of %s: %w", m.Origin, err)
		}
		if tag.RowsAffected() != 1 {
			return fmt.Errorf("%s at attempt %d: %w", m.Origin, at, ErrStale)
		}
	case FromHeld:
		if err := s.unhold(ctx, tx, m.Origin); err != nil {
			return err
		}
	}
	// A record a replay brought back that fails for good again is dead in its own row again
	// (status new); its history keeps each death.
	keys, vals := sink.SplitHeaders(m.Headers)
	if _, err := tx.Exec(ctx, `WITH d AS (
			INSERT INTO `+s.deadLetters+` AS d (consumer_group, topic, partition, "offset", key, value, header_keys, header_values, "timestamp",
				error_class, error_message, attempts, first_failed_at, idempotency_key_hash, dead_lettered_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, clock_timestamp())
			ON CONFLICT (consumer_group, topic, partition, "offset") DO UPDATE
			SET status = 'new', status_changed_at = now(), dead_lettered_at = EXCLUDED.dead_lettered_at, error_class = EXCLUDED.error_class,
				error_message = EXCLUDED.error_message, attempts = EXCLUDED.attempts,
				idempotency_key_hash = coalesce(EXCLUDED.idempotency_key_hash, d.idempotency_key_hash)
			RETURNING id)
		INSERT INTO `+s.events+` (dead_letter_id, event, attempt, error_class, error_message, at)
			SELECT id, 'dead_lettered', $12, $10, $11, clock_timestamp() FROM d`,
		s.group, m.Topic, m.Partition, m.Offset, m.Key, m.Value, keys, vals, m.Timestamp.UnixMilli(),
		m.Class, safetext.Text(m.Message, maxStoredMessage), m.Attempt, m.FirstFailedAt, m.IdempotencyKeyHash); err != nil {
		return fmt.Errorf("store dead letter %s: %w", m.Origin, err)
	}
	if !m.Held {
		return nil
	}
	k := Key{m.Topic, m.Partition, m.Key}
	switch {
	case m.Block && m.From == FromSource:
		if _, err := tx.Exec(ctx, `INSERT INTO `+s.heldKeys+` (consumer_group, topic, partition, key, state, head_offset)
			VALUES ($1, $2, $3, $4, 'blocked', $5)`, s.group, m.Topic, m.Partition, m.Key, m.Offset); err != nil {
			return fmt.Errorf("block key of %s: %w", m.Origin, err)
		}
	case m.Block:
		if _, err := tx.Exec(ctx, `UPDATE `+s.heldKeys+` SET state = 'blocked', head_offset = $5, updated_at = now()
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4`,
			s.group, m.Topic, m.Partition, m.Key, m.Offset); err != nil {
			return fmt.Errorf("block key of %s: %w", m.Origin, err)
		}
	case m.From != FromSource:
		return s.release(ctx, tx, k)
	}
	return nil
}

// ReadyKeys returns up to limit keys of topics whose head is settled and whose held records
// wait to be applied, oldest first.
func (s *Store) ReadyKeys(ctx context.Context, q Querier, topics []string, limit int) ([]Key, error) {
	rows, err := q.Query(ctx, `SELECT topic, partition, key FROM `+s.heldKeys+`
		WHERE consumer_group = $1 AND state = 'ready' AND topic = ANY($3) ORDER BY updated_at LIMIT $2`, s.group, limit, topics)
	if err != nil {
		return nil, fmt.Errorf("read ready keys: %w", err)
	}
	var out []Key
	var k Key
	_, err = pgx.ForEachRow(rows, []any{&k.Topic, &k.Partition, &k.Key}, func() error {
		out = append(out, k)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read ready keys: %w", err)
	}
	return out, nil
}

// TakeHeld locks a ready key and returns its held records in offset order: up to limit of
// them, and no more than maxBytes of values (at least one record, whatever its size). It returns
// none if the key is not ready, is locked by another transaction, or has nothing held any more
// (it is then released).
func (s *Store) TakeHeld(ctx context.Context, tx pgx.Tx, k Key, limit, maxBytes int) ([]Rec, error) {
	held, err := s.TakeHeldKeys(ctx, tx, []Key{k}, limit, maxBytes)
	if err != nil {
		return nil, err
	}
	return held[0], nil
}

// TakeHeldKeys is TakeHeld for several keys, each with its own limit and maxBytes, in two or three
// round trips: held[i] are the records of keys[i].
func (s *Store) TakeHeldKeys(ctx context.Context, tx pgx.Tx, keys []Key, limit, maxBytes int) (held [][]Rec, err error) {
	held = make([][]Rec, len(keys))
	locked := make([]bool, len(keys))
	b := &pgx.Batch{}
	for i, k := range keys {
		b.Queue(`SELECT 1 FROM `+s.heldKeys+`
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4 AND state = 'ready'
			FOR UPDATE SKIP LOCKED`, s.group, k.Topic, k.Partition, k.Key).Query(func(rows pgx.Rows) error {
			locked[i] = rows.Next()
			rows.Close()
			return rows.Err()
		})
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("lock ready keys: %w", err)
	}
	// The values before a row are summed from their sizes, which Postgres knows without reading
	// them: values past the budget are never read.
	b = &pgx.Batch{}
	for i, k := range keys {
		if !locked[i] {
			continue
		}
		b.Queue(`SELECT "offset", value, header_keys, header_values, "timestamp", attempt, coalesce(dead_letter_id, 0), keyless FROM (
				SELECT "offset", value, header_keys, header_values, "timestamp", attempt, dead_letter_id, keyless,
					coalesce(sum(coalesce(octet_length(value), 0)) OVER (ORDER BY "offset" ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
				FROM `+s.heldRecords+`
				WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4
				ORDER BY "offset" LIMIT $5) page
			WHERE before < $6 ORDER BY "offset"`, s.group, k.Topic, k.Partition, k.Key, limit, max(maxBytes, 1)).Query(func(rows pgx.Rows) error {
			var r Rec
			var hkeys, hvals [][]byte
			var ms int64
			var keyless bool
			_, err := pgx.ForEachRow(rows, []any{&r.Offset, &r.Value, &hkeys, &hvals, &ms, &r.Attempt, &r.DeadLetter, &keyless}, func() error {
				r.Topic, r.Partition, r.Key, r.Timestamp = k.Topic, k.Partition, k.Key, time.UnixMilli(ms).UTC()
				if keyless {
					r.Key = nil // it waited under a key of its own (see Replay)
				}
				var err error
				if r.Headers, err = sink.JoinHeaders(hkeys, hvals); err != nil {
					return fmt.Errorf("held record at offset %d: %w", r.Offset, err)
				}
				held[i] = append(held[i], r)
				r = Rec{}
				return nil
			})
			return err
		})
	}
	if b.Len() > 0 {
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return nil, fmt.Errorf("read held records: %w", err)
		}
	}
	// A locked key with nothing held any more is released.
	b = &pgx.Batch{}
	for i, k := range keys {
		if locked[i] && len(held[i]) == 0 {
			s.queueRelease(b, k)
		}
	}
	if b.Len() > 0 {
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return nil, fmt.Errorf("release held key: %w", err)
		}
	}
	return held, nil
}

// AppliedHeld records that held records of k were applied: they are deleted, and the key goes
// on with its next held record or is no longer held. The caller holds the key's lock
// (TakeHeld).
func (s *Store) AppliedHeld(ctx context.Context, tx pgx.Tx, k Key, recs []Rec) error {
	return s.AppliedHeldKeys(ctx, tx, []Key{k}, [][]Rec{recs})
}

// AppliedHeldKeys is AppliedHeld for several keys, in one round trip: recs[i] are the applied
// records of keys[i]; a key without any is left alone.
func (s *Store) AppliedHeldKeys(ctx context.Context, tx pgx.Tx, keys []Key, recs [][]Rec) error {
	b := &pgx.Batch{}
	var replayed settled
	var stale error
	for i, k := range keys {
		applied := recs[i]
		if len(applied) == 0 {
			continue // not taken here (TakeHeldKeys released it if it had nothing left)
		}
		// applied are the first of the key's held records, in offset order (TakeHeld): they are
		// the key's records from the first offset to the last, which the key's index finds as one
		// range. (With "offset" = ANY($n), a plan made while the table was small filtered every
		// held record of the partition against the array: 80 ms a transaction at 100,000 held
		// records.) Any other record in the range would make the count differ, and the
		// transaction fail.
		b.Queue(`WITH gone AS (DELETE FROM `+s.heldRecords+`
				WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4
				AND "offset" BETWEEN $5 AND $6
				RETURNING key, "offset", held_at, behind, dead_letter_id)
			`+s.keepHeldSQL("gone")+`
			SELECT count(*) FROM gone`,
			s.group, k.Topic, k.Partition, k.Key, applied[0].Offset, applied[len(applied)-1].Offset).QueryRow(func(row pgx.Row) error {
			var n int64
			if err := row.Scan(&n); err != nil {
				return err
			}
			if n != int64(len(applied)) && stale == nil {
				stale = fmt.Errorf("deleted %d of %d applied held records: %w", n, len(applied), ErrStale)
			}
			return nil
		})
		for _, r := range applied {
			replayed.add(r)
		}
		s.queueRelease(b, k)
	}
	s.queueReplayed(b, replayed)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("delete applied held records of %d keys: %w", len(keys), err)
	}
	return stale
}

// AnalyzeHeld refreshes the planner's statistics of held_records and held_keys. Tables that
// filled within the last minute (a burst of failures holding many keys' records) have none yet,
// and the plans made without them scan every held record of a partition to find one key's, and
// every ready key to lock one: the held-record applier calls it before draining such a burst
// (autovacuum would, within a minute or so).
func (s *Store) AnalyzeHeld(ctx context.Context, db Execer) error {
	if _, err := db.Exec(ctx, `ANALYZE `+s.heldRecords+`, `+s.heldKeys); err != nil {
		return fmt.Errorf("analyze held records: %w", err)
	}
	return nil
}

// settled are the dead letters a replay brought back whose records a transaction settled: ids,
// and among them the skipped ones (duplicates by their idempotency key).
type settled struct {
	ids, skipped []int64
}

// add adds r, if a replay brought it back.
func (d *settled) add(r Rec) {
	if r.DeadLetter == 0 {
		return
	}
	d.ids = append(d.ids, r.DeadLetter)
	if r.Duplicate {
		d.skipped = append(d.skipped, r.DeadLetter)
	}
}

// queueReplayed queues, in b, the statement that records that the records of the dead letters d
// names were settled by their replay: their status becomes replayed, and their history says
// replayed (applied) or skipped_duplicate. Nothing if d is empty.
func (s *Store) queueReplayed(b *pgx.Batch, d settled) {
	if len(d.ids) == 0 {
		return
	}
	b.Queue(`WITH d AS (
			UPDATE `+s.deadLetters+` SET status = 'replayed', status_changed_at = now()
			WHERE consumer_group = $1 AND id = ANY($2) AND `+statusIs("replaying")+`
			RETURNING id)
		INSERT INTO `+s.events+` (dead_letter_id, event, task_id)
			SELECT d.id, CASE WHEN d.id = ANY($3) THEN 'skipped_duplicate' ELSE 'replayed' END,
				(SELECT task_id FROM `+s.events+` e WHERE e.dead_letter_id = d.id AND e.event = 'replay_queued' ORDER BY e.id DESC LIMIT 1) FROM d`,
		s.group, d.ids, d.skipped)
}

// statusIs is SQL that a dead_letters row's status is status, written so that the planner
// cannot use it to pick the status index: a statement that names its rows by id must find them
// by the primary key. A replay changes the statuses of many rows at once, faster than
// statistics follow; a plan made while statistics said that few rows were replaying read every
// replaying row through the status index for each transaction's ids, and a replay of 20,000
// dead letters read 20,000 rows per held-record transaction by its end.
func statusIs(status string) string { return `status || '' = '` + status + `'` }

// unhold deletes a held record, failing if it is not there.
func (s *Store) unhold(ctx context.Context, tx pgx.Tx, o Origin) error {
	var n int64
	err := tx.QueryRow(ctx, `WITH gone AS (DELETE FROM `+s.heldRecords+` WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND "offset" = $4
			RETURNING key, "offset", held_at, behind, dead_letter_id)
		`+s.keepHeldSQL("gone")+`
		SELECT count(*) FROM gone`,
		s.group, o.Topic, o.Partition, o.Offset).Scan(&n)
	if err != nil {
		return fmt.Errorf("delete held record %s: %w", o, err)
	}
	if n != 1 {
		return fmt.Errorf("held record %s: %w", o, ErrStale)
	}
	return nil
}

// keepHeldSQL is the part of a statement, after the CTE gone (held_records rows of the group $1
// and the partition $2, $3 just deleted, returning key, "offset", held_at, behind,
// dead_letter_id), that keeps in held_history that they waited behind their key, and until now:
// what a trace tells of them after held_records forgot them. A row per key: a drain of a key's
// held records writes one per transaction, not one per record. A replayed dead letter waited
// there to be applied, not behind its key: its dead letter's history tells it.
func (s *Store) keepHeldSQL(gone string) string {
	return `, kept AS (INSERT INTO ` + s.heldHistory + ` (consumer_group, topic, partition, key_hash, first_offset, offsets, held_at, behind, until)
			SELECT $1, $2, $3, sha256(g.key), min(g."offset"), array_agg(g."offset" ORDER BY g."offset"), array_agg(g.held_at ORDER BY g."offset"),
				array_agg(g.behind ORDER BY g."offset"), clock_timestamp()
			FROM ` + gone + ` g WHERE g.dead_letter_id IS NULL GROUP BY g.key
			ON CONFLICT (consumer_group, topic, partition, key_hash, first_offset) DO UPDATE
			SET offsets = EXCLUDED.offsets, held_at = EXCLUDED.held_at, behind = EXCLUDED.behind, until = EXCLUDED.until)`
}

// Skip is a record skipped as a duplicate by its idempotency key: the handler never got it.
type Skip struct {
	Origin
	// IdempotencyKey is the record's idempotency key (its first MaxSkipKeyBytes bytes are kept),
	// and KeyHash the hash the key ring has of it.
	IdempotencyKey []byte
	KeyHash        []byte
	// First is the copy applied before, when the skip knew it (an earlier record of its batch);
	// nil otherwise (the key ring keeps only hashes).
	First *Origin
	// Stream and Seq are the stream and number of an event a kafkapg service emitted that its
	// stream decided was applied before; a zero Stream otherwise.
	Stream [16]byte
	Seq    int64
}

// MaxSkipKeyBytes bounds the idempotency key skipped_duplicates keeps of a skipped record.
const MaxSkipKeyBytes = 256

// Skipped keeps in skipped_duplicates, in tx (the transaction that moves the records' position), that
// recs were skipped as duplicates: what a trace tells of them, where the key ring keeps only a
// hash. One round trip; none if recs is empty.
func (s *Store) Skipped(ctx context.Context, tx pgx.Tx, recs []Skip) error {
	if len(recs) == 0 {
		return nil
	}
	n := len(recs)
	topics, parts, offs := make([]string, n), make([]int32, n), make([]int64, n)
	keys, hashes := make([][]byte, n), make([][]byte, n)
	firstP, firstO := make([]*int32, n), make([]*int64, n)
	streams, seqs := make([]*string, n), make([]*int64, n)
	for i, r := range recs {
		topics[i], parts[i], offs[i] = r.Topic, r.Partition, r.Offset
		keys[i], hashes[i] = r.IdempotencyKey[:min(len(r.IdempotencyKey), MaxSkipKeyBytes)], r.KeyHash
		if r.First != nil {
			firstP[i], firstO[i] = &r.First.Partition, &r.First.Offset
		}
		if r.Stream != [16]byte{} {
			id := fmt.Sprintf("%x", r.Stream[:])
			streams[i], seqs[i] = &id, &recs[i].Seq
		}
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+s.skipped+` (consumer_group, topic, partition, "offset", skipped_at, idempotency_key, key_hash,
			first_partition, first_offset, stream, stream_seq)
		SELECT $1, t, p, o, clock_timestamp(), k, kh, fp, fo, st::uuid, sq
		FROM unnest($2::text[], $3::int[], $4::bigint[], $5::bytea[], $6::bytea[], $7::int[], $8::bigint[], $9::text[], $10::bigint[])
			AS u(t, p, o, k, kh, fp, fo, st, sq)
		ON CONFLICT (consumer_group, topic, partition, "offset") DO UPDATE
		SET skipped_at = EXCLUDED.skipped_at, idempotency_key = EXCLUDED.idempotency_key, key_hash = EXCLUDED.key_hash,
			first_partition = EXCLUDED.first_partition, first_offset = EXCLUDED.first_offset, stream = EXCLUDED.stream, stream_seq = EXCLUDED.stream_seq`,
		s.group, topics, parts, offs, keys, hashes, firstP, firstO, streams, seqs); err != nil {
		return fmt.Errorf("keep %d skipped duplicates (from %s): %w", n, recs[0].Origin, err)
	}
	return nil
}

// PruneHistory deletes up to limit rows of each of the group's skipped_duplicates and
// held_history older than before, and returns how many it deleted.
func (s *Store) PruneHistory(ctx context.Context, db Execer, before time.Time, limit int) (int64, error) {
	n := int64(0)
	for _, t := range []struct{ table, at string }{{s.skipped, "skipped_at"}, {s.heldHistory, "until"}} {
		tag, err := db.Exec(ctx, `DELETE FROM `+t.table+` WHERE ctid = ANY(ARRAY(SELECT ctid FROM `+t.table+`
			WHERE `+t.at+` < $1 AND consumer_group = $3 LIMIT $2))`, before, limit, s.group)
		if err != nil {
			return n, fmt.Errorf("prune %s: %w", t.table, err)
		}
		n = max(n, tag.RowsAffected())
	}
	return n, nil
}

// release settles a key's head: the key becomes ready if records are held behind it, and is no
// longer held otherwise. It locks the key's row first; the statements after the lock see every
// record held before it was taken.
func (s *Store) release(ctx context.Context, tx pgx.Tx, k Key) error {
	b := &pgx.Batch{}
	s.queueRelease(b, k)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("release held key: %w", err)
	}
	return nil
}

// queueRelease queues release's statements in b.
func (s *Store) queueRelease(b *pgx.Batch, k Key) {
	b.Queue(`SELECT 1 FROM `+s.heldKeys+` WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4 FOR UPDATE`,
		s.group, k.Topic, k.Partition, k.Key)
	b.Queue(`UPDATE `+s.heldKeys+` h SET state = 'ready', head_offset = NULL, updated_at = now()
		WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4
		AND EXISTS (SELECT 1 FROM `+s.heldRecords+` r
			WHERE r.consumer_group = h.consumer_group AND r.topic = h.topic AND r.partition = h.partition AND r.key_hash = h.key_hash AND r.key = h.key)`,
		s.group, k.Topic, k.Partition, k.Key)
	b.Queue(`DELETE FROM `+s.heldKeys+` h
		WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4
		AND NOT EXISTS (SELECT 1 FROM `+s.heldRecords+` r
			WHERE r.consumer_group = h.consumer_group AND r.topic = h.topic AND r.partition = h.partition AND r.key_hash = h.key_hash AND r.key = h.key)`,
		s.group, k.Topic, k.Partition, k.Key)
}

// Unblock releases keys held after a dead letter (OnDeadLetterBlock): their held records are
// applied next. key nil releases every blocked key of the partition. It returns how many keys it
// released.
func (s *Store) Unblock(ctx context.Context, db Execer, topic string, partition int32, key []byte) (int64, error) {
	tag, err := db.Exec(ctx, `UPDATE `+s.heldKeys+` SET state = 'ready', head_offset = NULL, updated_at = now()
		WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND ($4::bytea IS NULL OR (key_hash = sha256($4::bytea) AND key = $4)) AND state = 'blocked'`,
		s.group, topic, partition, key)
	if err != nil {
		return 0, fmt.Errorf("release blocked keys: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Stats describes the retry path of a group.
type Stats struct {
	HeldKeys    int
	BlockedKeys int
	HeldRecords int
	OldestHeld  time.Duration // age of the oldest held record; 0 if none
	Tiers       map[int]TierStats
	// DeadLetters counts dead_letters rows by status (see DeadLetterStatuses).
	DeadLetters map[string]int
	// OldestNew is how long the oldest dead letter with status new has waited for an operator
	// (since it was dead-lettered); 0 if none.
	OldestNew    time.Duration
	TasksRunning int // replay and discard tasks not finished
	// TasksInterrupted counts the running tasks whose runner has not heart-beat for 15 s (its
	// lease, see internal/ops): it stopped halfway, and the task waits to be resumed.
	TasksInterrupted int
}

// DeadLetterStatuses are the statuses of a dead_letters row: new (dead), replaying (brought
// back by a replay, not settled yet), replayed (settled by a replay: applied, or skipped as a
// duplicate by its idempotency key, as its history says), discarded.
var DeadLetterStatuses = []string{"new", "replaying", "replayed", "discarded"}

// TierStats describes the records waiting in one retry tier.
type TierStats struct {
	Records int
	// Overdue is how long past its due time the most overdue record of the tier is: how far the
	// tier's consumer is behind. 0 if nothing is overdue.
	Overdue time.Duration
}

// Stats reads the group's retry path state.
func (s *Store) Stats(ctx context.Context, q Querier) (Stats, error) {
	st := Stats{Tiers: map[int]TierStats{}, DeadLetters: map[string]int{}}
	var oldest, oldestNew float64
	err := q.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM `+s.heldKeys+` WHERE consumer_group = $1),
			(SELECT count(*) FROM `+s.heldKeys+` WHERE consumer_group = $1 AND state = 'blocked'),
			(SELECT count(*) FROM `+s.heldRecords+` WHERE consumer_group = $1),
			(SELECT coalesce(extract(epoch FROM now() - min(held_at)), 0)::float8 FROM `+s.heldRecords+` WHERE consumer_group = $1),

			(SELECT count(*) FROM `+s.tasks+` WHERE consumer_group = $1 AND status = 'running'),
			(SELECT count(*) FROM `+s.tasks+` WHERE consumer_group = $1 AND status = 'running'
				AND (heartbeat_at IS NULL OR heartbeat_at < now() - interval '15 seconds')),
			(SELECT coalesce(extract(epoch FROM now() - min(dead_lettered_at)), 0)::float8 FROM `+s.deadLetters+`
				WHERE consumer_group = $1 AND status = 'new')`, s.group).
		Scan(&st.HeldKeys, &st.BlockedKeys, &st.HeldRecords, &oldest, &st.TasksRunning, &st.TasksInterrupted, &oldestNew)
	if err != nil {
		return st, fmt.Errorf("read retry path stats: %w", err)
	}
	st.OldestHeld = time.Duration(oldest * float64(time.Second))
	st.OldestNew = time.Duration(max(oldestNew, 0) * float64(time.Second))
	rows, err := q.Query(ctx, `SELECT status, count(*) FROM `+s.deadLetters+` WHERE consumer_group = $1 GROUP BY status`, s.group)
	if err != nil {
		return st, fmt.Errorf("read dead letter stats: %w", err)
	}
	var status string
	var count int
	if _, err := pgx.ForEachRow(rows, []any{&status, &count}, func() error {
		st.DeadLetters[status] = count
		return nil
	}); err != nil {
		return st, fmt.Errorf("read dead letter stats: %w", err)
	}
	rows, err = q.Query(ctx, `SELECT tier, count(*), coalesce(extract(epoch FROM max(now() - due_at)), 0)::float8
		FROM `+s.retries+` WHERE consumer_group = $1 GROUP BY tier`, s.group)
	if err != nil {
		return st, fmt.Errorf("read retry tier stats: %w", err)
	}
	var tier, n int
	var overdue float64
	_, err = pgx.ForEachRow(rows, []any{&tier, &n, &overdue}, func() error {
		st.Tiers[tier] = TierStats{Records: n, Overdue: time.Duration(max(overdue, 0) * float64(time.Second))}
		return nil
	})
	if err != nil {
		return st, fmt.Errorf("read retry tier stats: %w", err)
	}
	return st, nil
}
