-- The consuming side of streams as package internal/streams decides it (the argument is in
-- sink/doc.go, "Streams"): per group and lineage (the streams one upstream source partition
-- emitted to one partition here, a fork after another), one row, locked by every transaction that
-- decides or observes a record of the lineage. state is the lineage as internal/streams.Lineage
-- writes it in JSON: its streams in the order the partition's worker first observed them (each
-- with its numbers applied, from floor to high less missing; what it may repeat of the older ones,
-- its horizon; how far the older ones' applied numbers are keyed), a pending read back (from, to,
-- cursor: its progress, kept across retries and restarts), and the streams only other paths met.
-- topic and partition name where the lineage's events are, for a read back.
CREATE TABLE idempotency_lineages (
    consumer_group text        NOT NULL,
    root           uuid        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    state          jsonb       NOT NULL,
    updated_at     timestamptz NOT NULL,
    PRIMARY KEY (consumer_group, root)
);

-- The streams of migration 9, each lineage's in the order of first_offset. What they observed and
-- did not apply, and the highest source offset among them, were not kept: max_src -1; a group
-- that had them decides every numbered record by key as well for its first retention under this
-- layout (idempotency_groups, below), which covers it.
INSERT INTO idempotency_lineages (consumer_group, root, topic, partition, state, updated_at)
SELECT consumer_group, root, min(topic), min(partition),
       jsonb_build_object('streams', jsonb_agg(jsonb_build_object(
           'id', stream,
           'parent', CASE WHEN fork_seq > 0 THEN parent ELSE '00000000-0000-0000-0000-000000000000'::uuid END,
           'fork_seq', fork_seq,
           'since', '0001-01-01T00:00:00Z',
           'first', first_offset,
           'seen_high', high,
           'max_src', -1,
           'floor', 1,
           'high', high,
           'missing', missing::text,
           'keyed_above', 9223372036854775807,
           'horizon', horizon) ORDER BY first_offset, stream)),
       now()
FROM idempotency_streams
GROUP BY consumer_group, root;

DROP TABLE idempotency_streams;

-- Per group deduplicating numbered events: until keys_all_until, every numbered record whose
-- number was not applied is decided by its key as well. A group that consumed before it first ran
-- this release (it has offsets) gets its first IDEMPOTENCY_RETENTION so: a release before kept
-- keys only, and a copy of an event it applied carries a number this one never marked.
CREATE TABLE idempotency_groups (
    consumer_group text        PRIMARY KEY,
    keys_all_until timestamptz NOT NULL
);
