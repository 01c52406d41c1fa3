-- The retry path: records waiting in retry tiers, keys held behind them, records parked behind held
-- keys, and dead letters. Every row here is written in the same transaction as the offset advance
-- that moves its record off a partition (see docs/DESIGN.md, "States of a record").

-- Outgoing records go to the same partition number as their source record (modulo the target
-- topic's partition count).
ALTER TABLE outbox ADD COLUMN partition integer NOT NULL DEFAULT 0;

-- One row per source record that is somewhere in the retry tiers. attempt is the delivery attempt
-- its copy in the tier carries; a copy with another attempt, or a copy with no row, is a duplicate
-- publication and is skipped. The row is deleted when the record is applied or dead-lettered.
CREATE TABLE retries (
    consumer_group  text        NOT NULL,
    topic           text        NOT NULL, -- the source topic, partition and offset
    partition       integer     NOT NULL,
    "offset"        bigint      NOT NULL,
    key             bytea,
    attempt         integer     NOT NULL,
    first_failed_at timestamptz NOT NULL,
    due_at          timestamptz NOT NULL,
    error_class     text        NOT NULL,
    error_message   text        NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition, "offset")
);

-- One row per key whose later records must wait. The row is the lock that serializes everything
-- done to the key: parking a record behind it, applying its head, handing over to the next
-- record. state:
--   retrying: the record at head_offset is in a retry tier;
--   ready:    the head is settled; the parked records are applied next, in offset order;
--   blocked:  the record at head_offset was dead-lettered and ON_DEAD_LETTER=block: the key waits
--             for an operator (set state = 'ready' to release it).
CREATE TABLE held_keys (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    key            bytea       NOT NULL,
    state          text        NOT NULL CHECK (state IN ('retrying', 'ready', 'blocked')),
    head_offset    bigint,
    held_since     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition, key)
);
CREATE INDEX held_keys_ready_idx ON held_keys (consumer_group, updated_at) WHERE state = 'ready';

-- Records that arrived while their key was held, in the order they will be applied.
CREATE TABLE held_records (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    "offset"       bigint      NOT NULL,
    key            bytea       NOT NULL,
    value          bytea,
    header_keys    text[]      NOT NULL DEFAULT '{}',
    header_values  bytea[]     NOT NULL DEFAULT '{}',
    "timestamp"    timestamptz NOT NULL,
    held_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition, "offset")
);
CREATE INDEX held_records_key_idx ON held_records (consumer_group, topic, partition, key, "offset");

-- One row per dead-lettered record, written with the decision. status is for operators and replay
-- tooling: new, replayed, discarded.
CREATE TABLE dead_letters (
    id               bigserial   PRIMARY KEY,
    consumer_group   text        NOT NULL,
    topic            text        NOT NULL,
    partition        integer     NOT NULL,
    "offset"         bigint      NOT NULL,
    key              bytea,
    value            bytea,
    header_keys      text[]      NOT NULL DEFAULT '{}',
    header_values    bytea[]     NOT NULL DEFAULT '{}',
    "timestamp"      timestamptz NOT NULL,
    error_class      text        NOT NULL,
    error_message    text        NOT NULL,
    attempts         integer     NOT NULL,
    first_failed_at  timestamptz NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    status           text        NOT NULL DEFAULT 'new' CHECK (status IN ('new', 'replayed', 'discarded')),
    UNIQUE (consumer_group, topic, partition, "offset")
);
CREATE INDEX dead_letters_status_idx ON dead_letters (consumer_group, status, dead_lettered_at);
