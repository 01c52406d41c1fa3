-- Positions in the operator's hand (issue 43): pauses and position changes of a group's
-- partitions, made by operators (the positions commands, the API, the console) while the group
-- runs. Expand migrations: the release before never reads them; operators cannot pause or move
-- positions while the upgrade window is open (a processor of the release before would not obey).

-- A paused topic (partition -1: all of its partitions, those added later too) or partition of a
-- group: its processors take no new record of it (nor of its retry tiers' same partitions, nor
-- its held records), keep their place, and apply nothing of it while the row exists: a
-- position's advance fails in the transaction that would apply a paused partition's records.
CREATE TABLE pauses (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL, -- a source topic of the group
    partition      integer     NOT NULL CHECK (partition >= -1), -- -1: every partition
    paused_at      timestamptz NOT NULL DEFAULT now(),
    paused_by      text        NOT NULL, -- the actor, as in audit
    reason         text        NOT NULL,
    PRIMARY KEY (consumer_group, topic, partition)
);

-- Each position an operator set: from where (NULL: the partition had no stored position) to
-- where, by whom, when and why. A forward change skipped [from_offset, to_offset); a backward one
-- applies [to_offset, from_offset) again. What trace tells of an offset in such a range.
CREATE TABLE position_changes (
    id             bigserial   PRIMARY KEY,
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    from_offset    bigint,
    to_offset      bigint      NOT NULL,
    changed_at     timestamptz NOT NULL DEFAULT now(),
    actor          text        NOT NULL,
    reason         text        NOT NULL
);
CREATE INDEX position_changes_partition_idx ON position_changes (consumer_group, topic, partition, id);

-- The last position change of the partition (position_changes.id): an owner that claimed the
-- partition before it (a smaller or NULL value read at its claim) restarts from the stored
-- position, idle or not. NULL from the release before.
ALTER TABLE offsets ADD COLUMN position_change bigint;
