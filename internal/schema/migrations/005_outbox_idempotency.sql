-- The outbox becomes first-class (handlers and any transaction emit through it, see sink.Outbox),
-- and records can carry idempotency keys (see processor.IdempotencyKey).

-- A record emitted with sink.Outbox is published by key, as Kafka's own producers do (murmur2 of
-- the key): partition is NULL. Retry and dead-letter records keep their explicit partition.
ALTER TABLE outbox ALTER COLUMN partition DROP NOT NULL;
ALTER TABLE outbox ALTER COLUMN partition DROP DEFAULT;
-- lane orders publication: records of one topic and key share a lane (a hash of both), and one
-- relay at a time publishes a lane, in id order, holding a transaction-scoped advisory lock on it.
-- Writers take a transaction-scoped lock on the topic and key before inserting, so a key's id order
-- is the order in which its transactions committed (see sink/doc.go).
ALTER TABLE outbox ADD COLUMN lane smallint NOT NULL DEFAULT 0;
-- published_at is set instead of deleting the row when the relay keeps published rows for a while
-- (RelayConfig.Retention); they are pruned once older than that.
ALTER TABLE outbox ADD COLUMN published_at timestamptz;
DROP INDEX outbox_group_id_idx;
CREATE INDEX outbox_waiting_idx ON outbox (consumer_group, lane, id) WHERE published_at IS NULL AND refused_at IS NULL;
CREATE INDEX outbox_published_idx ON outbox (consumer_group, published_at) WHERE published_at IS NOT NULL;

-- An idempotency key applied: a record of the same group and source topic carrying the same key
-- is not given to the handler again. key_hash is the SHA-256 of the group, the topic and the key
-- (processor.keyHash): keys of any size and bytes cost 32 bytes, and the primary key, which every
-- record with a key inserts into, holds nothing else. partition and offset name the record that
-- applied it. Rows older than the configured retention are pruned in small batches, oldest first
-- (applied_at grows with inserts: its index is appended to, cheaply).
CREATE TABLE idempotency_keys (
    key_hash       bytea       PRIMARY KEY,
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    "offset"       bigint      NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idempotency_keys_applied_idx ON idempotency_keys (applied_at);
