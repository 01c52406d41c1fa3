-- What a trace tells of a record after the tables of the retry path forgot it (issue 42): that it
-- was skipped as a duplicate by its idempotency key, or held behind an earlier record of its key
-- and for how long. The key ring keeps 16 bytes of a key's hash and nothing else (migration 8),
-- and held_records forgets a record once it is applied: without these rows a trace says
-- "applied" of a skipped copy, and nothing of a wait behind its key.
--
-- Both are written in the transaction that settles the record, only for what is rare (a skipped
-- duplicate, a held record), and deleted by the processors once older than IDEMPOTENCY_RETENTION
-- (7 days by default), a thousand rows a statement. Expand migrations: the release before never
-- reads them, and writes NULL into held_records.behind.

-- A record skipped as a duplicate: its idempotency key (its first 256 bytes) and the hash the key
-- ring has; the copy applied before when the skip knew it (an earlier record of the same batch);
-- the stream and number of an event a kafkapg service emitted, decided by its stream.
CREATE TABLE skipped_duplicates (
    consumer_group  text        NOT NULL,
    topic           text        NOT NULL, -- the source topic, partition and offset
    partition       integer     NOT NULL,
    "offset"        bigint      NOT NULL,
    skipped_at      timestamptz NOT NULL,
    idempotency_key bytea,
    key_hash        bytea,
    first_partition integer,
    first_offset    bigint,
    stream          uuid,
    stream_seq      bigint,
    PRIMARY KEY (consumer_group, topic, partition, "offset")
);
CREATE INDEX skipped_duplicates_at_idx ON skipped_duplicates (skipped_at);

-- Records of a key that waited behind an earlier record of it, a row per key per transaction that
-- took them out of held_records (applied, or moved on to a tier or a dead letter): a drain of a
-- key's held records writes a row per batch, not per record. offsets, held_at and behind go
-- together, in offset order: each record, when it was held, and the record it waited behind (the
-- key's head then, or the first record held before it; NULL if not known). A trace finds a
-- record's row as its key's last row starting at or before its offset.
CREATE TABLE held_history (
    consumer_group text          NOT NULL,
    topic          text          NOT NULL,
    partition      integer       NOT NULL,
    key_hash       bytea         NOT NULL, -- sha256 of the key
    first_offset   bigint        NOT NULL,
    offsets        bigint[]      NOT NULL,
    held_at        timestamptz[] NOT NULL,
    behind         bigint[]      NOT NULL,
    until          timestamptz   NOT NULL, -- when they left held_records
    PRIMARY KEY (consumer_group, topic, partition, key_hash, first_offset)
);
CREATE INDEX held_history_until_idx ON held_history (until);

-- The record a held record waits behind, written when it is held (NULL from the release before).
ALTER TABLE held_records ADD COLUMN behind bigint;
