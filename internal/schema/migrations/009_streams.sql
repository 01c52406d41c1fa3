-- Streams: the events a processor emits while applying a record (Record.Emit) are numbered per
-- stream, so that a kafkapg consumer can tell a copy from a new event with a few numbers per
-- stream instead of a key per event (see sink/doc.go, "Streams", and processor/streams.go).

-- The emitting side. A stream is what one group's source partition emits to one partition of one
-- topic; seq is the last number taken, in the transaction that emitted the event. database is the
-- database's identity (system identifier and WAL timeline) when seq was last taken: a row that
-- finds another one (a failover, a restore) or NULL (a processor found the partition's position
-- gone back) forks: a new stream, numbered from 1, that names the one it replaces and how far
-- that one is known to have gone (parent, fork_seq, fork_at), for consumers to find the events
-- it may repeat. A stream created afresh names its root instead (a UUID derived from the five
-- columns of the key) with fork_seq 0: one created again after the database lost it is found by
-- its siblings. Every event names its stream's root too (its lineage).
CREATE TABLE outbox_streams (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    dest_topic     text        NOT NULL,
    dest_partition integer     NOT NULL,
    stream         uuid        NOT NULL,
    seq            bigint      NOT NULL,
    database       text,
    parent         uuid        NOT NULL,
    fork_seq       bigint      NOT NULL,
    fork_at        timestamptz,
    updated_at     timestamptz NOT NULL,
    PRIMARY KEY (consumer_group, topic, partition, dest_topic, dest_partition)
);

-- The consuming side: per group and stream, the highest number applied and the numbers below it
-- not applied yet (a relay publishes a stream's events of different keys in any order; a record
-- in the retry path or dead-lettered stays missing until it is applied). A record is a copy if
-- its number is at most high and not missing. root names the stream's lineage (the streams one
-- upstream source partition emitted to this topic's partition, a fork after another). A
-- successor (a fork, or a stream created again for its root) may repeat, under its own numbers,
-- events its lineage's earlier streams carried: when the group first meets one, those records are
-- read again from Kafka, the keys of the ones it applied recorded, and horizon set to the highest
-- source offset among them; from then on the successor's records from source offsets up to
-- horizon (and all of them for ten minutes), and the records it may repeat, are deduplicated by
-- their key as well. first_offset is where the group first saw the stream in its topic (topic,
-- partition).
CREATE TABLE idempotency_streams (
    consumer_group text           NOT NULL,
    stream         uuid           NOT NULL,
    topic          text           NOT NULL,
    partition      integer        NOT NULL,
    root           uuid           NOT NULL,
    parent         uuid           NOT NULL,
    fork_seq       bigint         NOT NULL,
    successor      boolean        NOT NULL,
    horizon        bigint         NOT NULL,
    high           bigint         NOT NULL,
    missing        int8multirange NOT NULL,
    first_offset   bigint         NOT NULL,
    created_at     timestamptz    NOT NULL,
    updated_at     timestamptz    NOT NULL,
    PRIMARY KEY (consumer_group, stream)
);
CREATE INDEX idempotency_streams_root_idx ON idempotency_streams (consumer_group, root);
