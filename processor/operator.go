package processor

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// ReleaseBlockedKeys releases keys that a dead letter blocked (Config.OnDeadLetter =
// OnDeadLetterBlock): their held records are applied next, in order, by whichever processor of
// the group picks them up (within a second). key nil releases every blocked key of the partition.
// It returns how many keys it released. The same in SQL:
//
//	UPDATE kafkapg.held_keys SET state = 'ready', head_offset = NULL, updated_at = now()
//	WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key = $4 AND state = 'blocked';
func ReleaseBlockedKeys(ctx context.Context, db *pgxpool.Pool, schemaName, group, topic string, partition int32, key []byte) (int64, error) {
	if schemaName == "" {
		schemaName = "kafkapg"
	}
	return retrytopics.NewStore(schemaName, group).Unblock(ctx, db, topic, partition, key)
}

// StuckKeys returns up to limit of group's held keys that have made no progress for
// scope.Older (see retrytopics.StuckKey for the reasons), the longest stuck first; they are the
// kafkapg_stuck_keys metric's. Pass the group's configuration as scope (its retry tiers and
// source topics).
func StuckKeys(ctx context.Context, db *pgxpool.Pool, schemaName, group string, scope retrytopics.StuckScope, limit int) ([]retrytopics.StuckKey, error) {
	if schemaName == "" {
		schemaName = "kafkapg"
	}
	return retrytopics.NewStore(schemaName, group).StuckKeys(ctx, db, scope, limit)
}

// ReleaseStuckKey takes a stuck key out of its wait: the record it waits for, which can no longer
// come back, is dead-lettered as lost (a dead_letters row with class lost and the note: its
// coordinates and key, its value left in the source topic), and the key goes on with its held
// records. It returns retrytopics.ErrNotStuck if the key moved on since it was found.
func ReleaseStuckKey(ctx context.Context, db *pgxpool.Pool, schemaName, group string, k retrytopics.StuckKey, note string) error {
	if schemaName == "" {
		schemaName = "kafkapg"
	}
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		return retrytopics.NewStore(schemaName, group).ReleaseStuck(ctx, tx, k, note)
	})
}
