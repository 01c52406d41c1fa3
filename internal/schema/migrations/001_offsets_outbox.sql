-- Offsets: the authoritative position of every partition a consumer group has processed. The row is
-- updated in the same transaction as the handler's effects, so the two can never disagree.
-- owner_token fences stale owners; see package offsets.
CREATE TABLE offsets (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    -- The next offset to process. NULL until the first batch commits: the partition then starts
    -- from Kafka's committed offset or from KAFKA_START_OFFSET.
    next_offset    bigint,
    owner_token    bigint      NOT NULL DEFAULT 1,
    owner          text        NOT NULL DEFAULT '',
    claimed_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition)
);

-- Outbox: records to publish to Kafka (dead letters, later retry tiers), written in the same
-- transaction as the offset advance that skips their source record, and deleted once published.
CREATE TABLE outbox (
    id             bigserial   PRIMARY KEY,
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    key            bytea,
    value          bytea,
    header_keys    text[]      NOT NULL DEFAULT '{}',
    header_values  bytea[]     NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_group_id_idx ON outbox (consumer_group, id);
