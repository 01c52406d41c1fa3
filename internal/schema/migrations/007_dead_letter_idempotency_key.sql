-- A dead letter of a topic with an idempotency key keeps its key's hash (as idempotency_keys has
-- it): while the dead letter may still be replayed (new, replaying), the key of a copy of it that
-- was applied is not pruned, however old, so that the replay is skipped as a duplicate rather
-- than applied a second time after IDEMPOTENCY_RETENTION.
ALTER TABLE dead_letters ADD COLUMN idempotency_key_hash bytea;
CREATE INDEX dead_letters_idempotency_key_idx ON dead_letters (consumer_group, idempotency_key_hash)
    WHERE idempotency_key_hash IS NOT NULL AND status IN ('new', 'replaying');
