package retrytopics

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/internal/safetext"
)

// Why a held key is stuck (StuckKey.Reason; the kafkapg_stuck_keys metric's reason label).
const (
	// StuckOrphaned: the record the key waits for can no longer come back. It has no retry
	// state, or its retry tier is no longer configured (the tiers were shortened), or its source
	// topic is no longer consumed.
	StuckOrphaned = "orphaned"
	// StuckOverdue: the record the key waits for is in a retry tier and long past its due time:
	// its copy is gone (the tier's retention deleted it, the tier topic was deleted) or the
	// tier's consumer is stuck.
	StuckOverdue = "overdue"
	// StuckUnapplied: the key is ready, its held records waiting to be applied, and nothing has
	// applied them for a long time.
	StuckUnapplied = "unapplied"
)

// StuckReasons lists the reasons a key can be stuck.
var StuckReasons = []string{StuckOrphaned, StuckOverdue, StuckUnapplied}

// StuckKey is a held key that has made no progress for too long. Blocked keys (a dead letter
// under processor.OnDeadLetterBlock) wait for an operator by design and are not stuck.
type StuckKey struct {
	Key
	State  string // retrying or ready
	Head   int64  // the offset of the record it waits for (retrying), -1 if none
	Reason string // one of the Stuck* reasons
	Since  time.Time
	// Attempt is the delivery attempt the head's retry state expects next (0 without one).
	Attempt int
}

// StuckScope says what counts as stuck: keys that have made no progress for Older, given the
// source topics consumed and the number of retry tiers each has.
type StuckScope struct {
	Older time.Duration
	Tiers map[string]int // by source topic
}

// args returns the scope's query arguments: $2 the topics, $3 Older, $4 their tier counts.
func (sc StuckScope) args() (topics []string, older time.Duration, tiers []int32) {
	for _, t := range slices.Sorted(maps.Keys(sc.Tiers)) {
		topics = append(topics, t)
		tiers = append(tiers, int32(sc.Tiers[t]))
	}
	return topics, sc.Older, tiers
}

func (s *Store) stuckSQL(what string) string {
	return `WITH stuck AS (
		SELECT h.topic, h.partition, h.key, h.state, coalesce(h.head_offset, -1) AS head, h.updated_at, coalesce(r.attempt, 0) AS attempt,
			CASE
				WHEN h.state = 'ready' THEN 'unapplied'
				WHEN r."offset" IS NULL OR c.tiers IS NULL OR r.tier > c.tiers THEN 'orphaned'
				ELSE 'overdue'
			END AS reason
		FROM ` + s.heldKeys + ` h
		LEFT JOIN ` + s.retries + ` r ON r.consumer_group = h.consumer_group AND r.topic = h.topic
			AND r.partition = h.partition AND r."offset" = h.head_offset
		LEFT JOIN unnest($2::text[], $4::int[]) AS c(topic, tiers) ON c.topic = h.topic
		WHERE h.consumer_group = $1 AND h.state <> 'blocked'
		AND h.updated_at < now() - $3::interval
		AND (h.state = 'ready' OR r."offset" IS NULL OR c.tiers IS NULL OR r.tier > c.tiers OR r.due_at < now() - $3::interval)
	) ` + what
}

// StuckKeys returns up to limit stuck keys, the longest stuck first.
func (s *Store) StuckKeys(ctx context.Context, q Querier, scope StuckScope, limit int) ([]StuckKey, error) {
	topics, older, tiers := scope.args()
	rows, err := q.Query(ctx, s.stuckSQL(`SELECT topic, partition, key, state, head, updated_at, attempt, reason FROM stuck ORDER BY updated_at LIMIT $5`),
		s.group, topics, older, tiers, limit)
	if err != nil {
		return nil, fmt.Errorf("read stuck keys: %w", err)
	}
	var out []StuckKey
	var k StuckKey
	if _, err := pgx.ForEachRow(rows, []any{&k.Topic, &k.Partition, &k.Key.Key, &k.State, &k.Head, &k.Since, &k.Attempt, &k.Reason}, func() error {
		out = append(out, k)
		k = StuckKey{}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("read stuck keys: %w", err)
	}
	return out, nil
}

// StuckCounts counts the stuck keys by reason.
func (s *Store) StuckCounts(ctx context.Context, q Querier, scope StuckScope) (map[string]int, error) {
	topics, older, tiers := scope.args()
	rows, err := q.Query(ctx, s.stuckSQL(`SELECT reason, count(*) FROM stuck GROUP BY reason`), s.group, topics, older, tiers)
	if err != nil {
		return nil, fmt.Errorf("count stuck keys: %w", err)
	}
	out := map[string]int{}
	var reason string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&reason, &n}, func() error {
		out[reason] = n
		return nil
	}); err != nil {
		return nil, fmt.Errorf("count stuck keys: %w", err)
	}
	return out, nil
}

// ErrNotStuck is ReleaseStuck's answer for a key that moved on (or changed) since it was found
// stuck: nothing was done.
var ErrNotStuck = errors.New("the key is not stuck any more")

// ReleaseStuck takes a stuck key out of its wait, in tx. A key waiting for a record in the retry
// path (orphaned or overdue) has that record dead-lettered as lost: a dead_letters row with class
// "lost", the note, and the record's coordinates and key (its value is not in Postgres: read it
// from the source topic by its coordinates while retention keeps it), and its retry state
// forgotten, so that a copy still in a tier is skipped if it ever arrives. Then the key goes on
// with its held records, as after any dead letter. An unapplied key has nothing to give up: it
// is made ready again, for a heldApplier to pick up. It returns ErrNotStuck if the key is no longer
// in the state k describes.
func (s *Store) ReleaseStuck(ctx context.Context, tx pgx.Tx, k StuckKey, note string) error {
	var state string
	var head int64
	err := tx.QueryRow(ctx, `SELECT state, coalesce(head_offset, -1) FROM `+s.heldKeys+`
		WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4 FOR UPDATE`,
		s.group, k.Topic, k.Partition, k.Key.Key).Scan(&state, &head)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && (state != k.State || head != k.Head)) {
		return fmt.Errorf("%s[%d], a %d-byte key: %w", k.Topic, k.Partition, len(k.Key.Key), ErrNotStuck)
	}
	if err != nil {
		return fmt.Errorf("lock stuck key: %w", err)
	}
	if state == "ready" {
		_, err := tx.Exec(ctx, `UPDATE `+s.heldKeys+` SET updated_at = now()
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = sha256($4::bytea) AND key = $4`,
			s.group, k.Topic, k.Partition, k.Key.Key)
		if err != nil {
			return fmt.Errorf("wake stuck key: %w", err)
		}
		return nil
	}
	var first time.Time
	err = tx.QueryRow(ctx, `DELETE FROM `+s.retries+` WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND "offset" = $4
		RETURNING first_failed_at`, s.group, k.Topic, k.Partition, head).Scan(&first)
	if errors.Is(err, pgx.ErrNoRows) {
		first, err = time.Now(), nil
	}
	if err != nil {
		return fmt.Errorf("forget retry state of the stuck key's record: %w", err)
	}
	if _, err := tx.Exec(ctx, `WITH d AS (
			INSERT INTO `+s.deadLetters+` (consumer_group, topic, partition, "offset", key, value, "timestamp",
				error_class, error_message, attempts, first_failed_at)
			VALUES ($1, $2, $3, $4, $5, NULL, 0, 'lost', $6, $7, $8)
			-- A replayed record lost on its way has its row, with its value: it is dead there again.
			ON CONFLICT (consumer_group, topic, partition, "offset") DO UPDATE
			SET status = 'new', status_changed_at = now(), dead_lettered_at = now(), error_class = EXCLUDED.error_class,
				error_message = EXCLUDED.error_message, attempts = EXCLUDED.attempts
			RETURNING id, error_class, error_message, attempts)
		INSERT INTO `+s.events+` (dead_letter_id, event, attempt, error_class, error_message)
			SELECT id, 'dead_lettered', attempts, error_class, error_message FROM d`,
		s.group, k.Topic, k.Partition, head, k.Key.Key, safeNote(note, k), max(k.Attempt-1, 1), first); err != nil {
		return fmt.Errorf("dead-letter the stuck key's record: %w", err)
	}
	return s.release(ctx, tx, k.Key)
}

func safeNote(note string, k StuckKey) string {
	return safetext.Text(fmt.Sprintf("lost in the retry path (%s since %s): %s; its value is in the source topic at these coordinates while retention keeps it",
		k.Reason, k.Since.UTC().Format(time.RFC3339), note), maxStoredMessage)
}
