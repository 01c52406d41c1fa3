-- What a trace tells of a record after the tables of the retry path forgot it (issue 42): that it
-- was skipped as a duplicate by its idempotency key, or held behind an earlier record of its key
-- and for how long. The key ring keeps 16 bytes of a key's hash and nothing else (migration 8),
-- and held_records forgets a record once it is applied: without these rows a trace says
-- "applied" of a skipped copy, and nothing of a wait behind its key.
--
-- A row is written in the transaction that moves the record's partition position (or settles the
-- held record), only for what is rare: a skipped duplicate, a record held behind its key. Rows
-- older than IDEMPOTENCY_RETENTION (7 days if the group has no idempotency keys) are deleted by
-- the processors, in small batches. An expand migration: the release before never reads it, and
-- writes NULL into held_records.behind.
CREATE TABLE record_history (
    consumer_group  text        NOT NULL,
    topic           text        NOT NULL, -- the source topic, partition and offset
    partition       integer     NOT NULL,
    "offset"        bigint      NOT NULL,
    event           text        NOT NULL CHECK (event IN ('skipped_duplicate', 'held')),
    at              timestamptz NOT NULL, -- skipped_duplicate: when; held: when it was held
    until           timestamptz,          -- held: when it left held_records
    -- held: the offset of the record of its key it waited behind (the key's head then, or the
    -- first record held before it); NULL if not known.
    behind          bigint,
    -- skipped_duplicate: its idempotency key (its first 256 bytes), the hash the key ring has,
    -- the copy applied before when the skip knew it (an earlier record of the same batch), and
    -- the stream and number of an event a kafkapg service emitted, decided by its stream.
    idempotency_key bytea,
    key_hash        bytea,
    first_partition integer,
    first_offset    bigint,
    stream          uuid,
    stream_seq      bigint,
    PRIMARY KEY (consumer_group, topic, partition, "offset", event)
);
CREATE INDEX record_history_at_idx ON record_history (at);

-- The record a held record waits behind, written when it is held (NULL from the release before).
ALTER TABLE held_records ADD COLUMN behind bigint;
