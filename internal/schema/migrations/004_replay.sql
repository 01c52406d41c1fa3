-- Dead letters an operator can act on: replay (back through the pipeline, exactly once), discard,
-- release a key, and the audit of who did what (see docs/runbook.md).

-- A replay holds a key of a partition from outside the partition's owner. It bumps keys_epoch in
-- the same transaction; every batch transaction of the owner checks the epoch in its Advance, so the
-- owner's next batch fails (offsets.ErrKeysChanged), re-reads its held keys and runs again,
-- holding the key's later records behind the replayed one.
ALTER TABLE offsets ADD COLUMN keys_epoch bigint NOT NULL DEFAULT 0;

-- A replayed dead letter waits in held_records like a record held behind its key; attempt is the
-- delivery attempt it is handled as (its dead letter's attempts + 1), dead_letter_id its row.
-- A record without a key waits under a key of its own (keyless; the handler gets a nil key).
ALTER TABLE held_records ADD COLUMN attempt integer NOT NULL DEFAULT 1;
ALTER TABLE held_records ADD COLUMN dead_letter_id bigint;
ALTER TABLE held_records ADD COLUMN keyless boolean NOT NULL DEFAULT false;
-- ... and, sent round the retry tiers again, it keeps its row's id. tier is the retry tier its copy
-- is in: attempt - 1, except for a replayed record, whose attempts count on from its earlier ones.
ALTER TABLE retries ADD COLUMN dead_letter_id bigint;
ALTER TABLE retries ADD COLUMN tier integer;
UPDATE retries SET tier = attempt - 1;
ALTER TABLE retries ALTER COLUMN tier SET NOT NULL;

-- status: new (dead), replaying (brought back, not settled yet), replayed (applied by a replay),
-- discarded (an operator gave up on it). A replayed record that fails for good again is dead in
-- the same row: status new, its earlier deaths kept in dead_letter_events.
ALTER TABLE dead_letters DROP CONSTRAINT dead_letters_status_check;
ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_status_check
    CHECK (status IN ('new', 'replaying', 'replayed', 'discarded'));
ALTER TABLE dead_letters ADD COLUMN status_changed_at timestamptz;
UPDATE dead_letters SET status_changed_at = dead_lettered_at;
ALTER TABLE dead_letters ALTER COLUMN status_changed_at SET NOT NULL;
ALTER TABLE dead_letters ALTER COLUMN status_changed_at SET DEFAULT now();
ALTER TABLE dead_letters ADD COLUMN replays integer NOT NULL DEFAULT 0;
ALTER TABLE dead_letters ADD COLUMN key_hash bytea GENERATED ALWAYS AS (sha256(key)) STORED;
CREATE INDEX dead_letters_key_idx ON dead_letters (consumer_group, key_hash);
CREATE INDEX dead_letters_class_idx ON dead_letters (consumer_group, topic, error_class, status);

-- A dead letter's history, oldest first: each time it was dead-lettered (with the error), queued
-- for replay, applied by a replay, discarded.
CREATE TABLE dead_letter_events (
    id             bigserial   PRIMARY KEY,
    dead_letter_id bigint      NOT NULL REFERENCES dead_letters (id) ON DELETE CASCADE,
    at             timestamptz NOT NULL DEFAULT now(),
    event          text        NOT NULL CHECK (event IN ('dead_lettered', 'replay_queued', 'replayed', 'discarded')),
    task_id        bigint,
    attempt        integer,
    error_class    text,
    error_message  text
);
CREATE INDEX dead_letter_events_dl_idx ON dead_letter_events (dead_letter_id, id);
CREATE INDEX dead_letter_events_task_idx ON dead_letter_events (task_id, event) WHERE task_id IS NOT NULL;
INSERT INTO dead_letter_events (dead_letter_id, at, event, attempt, error_class, error_message)
    SELECT id, dead_lettered_at, 'dead_lettered', attempts, error_class, error_message FROM dead_letters;

-- A replay or discard over the dead letters a filter matched when it started (ids up to max_id),
-- worked through in id order by one runner at a time (runner, heartbeat_at: a runner that stops
-- heart-beating is gone, and `dlq resume` takes over from cursor_id).
CREATE TABLE tasks (
    id             bigserial   PRIMARY KEY,
    consumer_group text        NOT NULL,
    action         text        NOT NULL CHECK (action IN ('replay', 'discard')),
    filter         jsonb       NOT NULL,
    reason         text        NOT NULL,
    actor          text        NOT NULL,
    rate           double precision, -- records per second; NULL: as fast as it goes
    max_id         bigint      NOT NULL,
    matched        bigint      NOT NULL, -- rows the filter matched when the task started
    cursor_id      bigint      NOT NULL DEFAULT 0,
    done           bigint      NOT NULL DEFAULT 0, -- rows queued for replay, or discarded
    skipped        bigint      NOT NULL DEFAULT 0, -- matched at the start, no longer new when reached
    status         text        NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'done', 'cancelled')),
    runner         text,
    heartbeat_at   timestamptz,
    created_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz,
    cancelled_by   text
);
CREATE INDEX tasks_group_idx ON tasks (consumer_group, id);

-- Every operator action, by whom and why.
CREATE TABLE audit (
    id             bigserial   PRIMARY KEY,
    at             timestamptz NOT NULL DEFAULT now(),
    consumer_group text        NOT NULL,
    actor          text        NOT NULL,
    action         text        NOT NULL,
    reason         text        NOT NULL,
    task_id        bigint,
    detail         jsonb       NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_group_idx ON audit (consumer_group, id);
