package retrytopics

import (
	"context"
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// Replay brings dead letters back through the pipeline, in tx: each record of ids whose row is
// still new waits in held_records behind its key, as attempt (its attempts + 1), and the held-record
// applier of any processor of the group applies it like any held record: exactly once (the
// transaction that applies it deletes it from held_records and sets its row replayed), or, if it
// fails, round the retry tiers and back into its own row (status new again).
//
// Per-key order: a key blocked by the record (OnDeadLetterBlock) becomes ready with the record
// first; a key held for another record keeps the record among its held records, in offset order;
// a key not held is held from now on, so the key's records that arrive after the replay wait
// behind it. To hold a key from outside the partition's owner, Replay bumps the keys epoch of the
// partition's offsets row (locking it, so it waits for the owner's batch in flight): the owner's
// next batch finds the epoch moved on (offsets.ErrKeysChanged), reads its held keys again and
// holds the key's records. A record without a key waits under a key of its own and has no order
// to keep.
//
// It returns the ids it queued; the others were not new (replaying, replayed, discarded), do
// not exist, are lost records whose value Postgres never had (see ReleaseStuck), or are records
// of a retry tier's topic itself (produced there by hand, or with kafkapg's headers garbled: they
// were handled as records of their own, under the tier's coordinates, which no processor applies
// held records of), and are left alone. task, if not 0, names the task that replays them.
func (s *Store) Replay(ctx context.Context, tx pgx.Tx, ids []int64, task int64) (queued []int64, err error) {
	if len(ids) == 0 {
		return nil, nil
	}
	// Lock order: partitions' offsets rows (as a batch transaction does first), then the dead
	// letters, then the held keys.
	if _, err := tx.Exec(ctx, `UPDATE `+s.offsets+` o SET keys_epoch = keys_epoch + 1
		FROM (SELECT topic, partition FROM `+s.offsets+`
			WHERE consumer_group = $1 AND (topic, partition) IN (SELECT topic, partition FROM `+s.deadLetters+` WHERE consumer_group = $1 AND id = ANY($2))
			ORDER BY topic, partition FOR UPDATE) l
		WHERE o.consumer_group = $1 AND o.topic = l.topic AND o.partition = l.partition`, s.group, ids); err != nil {
		return nil, fmt.Errorf("replay: bump the partitions' keys epoch: %w", err)
	}
	// One statement does the rest, from the rows its UPDATE takes (which locks them, in the id
	// order of the primary key's scan): each record's held_records row, its key held, its status
	// and its event. The five statements it replaced (a SELECT ... FOR UPDATE, then four more,
	// each finding the rows again by id) queued 8,130 records/s in BenchmarkReplay with nothing
	// applying them, this one 10,900 (with its status written as statusIs has it).
	rows, err := tx.Query(ctx, `WITH q AS (
			UPDATE `+s.deadLetters+` SET status = 'replaying', status_changed_at = now(), replays = replays + 1
			WHERE consumer_group = $1 AND id = ANY($2) AND `+statusIs("new")+` AND NOT (error_class = 'lost' AND value IS NULL)
				AND topic !~ $3
			RETURNING id, consumer_group, topic, partition, "offset", key, value, header_keys, header_values, "timestamp", attempts,
				coalesce(key, `+keylessKey+`) AS held_key),
		h AS (
			INSERT INTO `+s.heldRecords+` (consumer_group, topic, partition, "offset", key, value, header_keys, header_values, "timestamp",
				attempt, dead_letter_id, keyless)
			SELECT consumer_group, topic, partition, "offset", held_key, value, header_keys, header_values, "timestamp",
				attempts + 1, id, key IS NULL
			FROM q),
		-- A key blocked by one of the records becomes ready (the record is first among its held
		-- records); a key held otherwise stays as it is; a key not held is held, ready.
		k AS (
			INSERT INTO `+s.heldKeys+` AS hk (consumer_group, topic, partition, key, state)
			SELECT DISTINCT ON (topic, partition, held_key) consumer_group, topic, partition, held_key, 'ready'
			FROM q ORDER BY topic, partition, held_key
			ON CONFLICT (consumer_group, topic, partition, key_hash) DO UPDATE SET state = 'ready', head_offset = NULL, updated_at = now()
			WHERE hk.state = 'blocked' AND hk.head_offset IN (SELECT "offset" FROM q WHERE topic = hk.topic AND partition = hk.partition)),
		e AS (
			INSERT INTO `+s.events+` (dead_letter_id, event, task_id, attempt)
			SELECT id, 'replay_queued', nullif($4::bigint, 0), attempts + 1 FROM q)
		SELECT id FROM q ORDER BY id`, s.group, ids, TierTopicPattern(s.group), task)
	if err != nil {
		return nil, fmt.Errorf("replay %d dead letters: %w", len(ids), err)
	}
	if queued, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
		return nil, fmt.Errorf("replay %d dead letters: %w", len(ids), err)
	}
	return queued, nil
}

// TierTopicPattern is a regular expression (Postgres's and Go's) that the names of group's retry
// tiers match, and no source topic of it may (processor.Config refuses one).
func TierTopicPattern(group string) string {
	return `\.` + regexp.QuoteMeta(group) + `\.retry\.[0-9]+$`
}

// keylessKey is the key a replayed record without a key waits under: one of its own, from its
// dead letter's id (SQL over the dead_letters row).
const keylessKey = `convert_to('kafkapg:keyless-replay:' || id, 'UTF8')`

// Discard marks dead letters ids discarded, in tx: an operator gave up on them. Their records
// stay in their rows. It returns the ids it discarded; the others were not new and are left
// alone. task, if not 0, names the task that discards them.
func (s *Store) Discard(ctx context.Context, tx pgx.Tx, ids []int64, task int64) ([]int64, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, `WITH d AS (
			UPDATE `+s.deadLetters+` SET status = 'discarded', status_changed_at = now()
			WHERE consumer_group = $1 AND id = ANY($2) AND `+statusIs("new")+`
			RETURNING id),
		e AS (INSERT INTO `+s.events+` (dead_letter_id, event, task_id) SELECT id, 'discarded', nullif($3::bigint, 0) FROM d)
		SELECT id FROM d ORDER BY id`, s.group, ids, task)
	if err != nil {
		return nil, fmt.Errorf("discard %d dead letters: %w", len(ids), err)
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("discard %d dead letters: %w", len(ids), err)
	}
	return done, nil
}
