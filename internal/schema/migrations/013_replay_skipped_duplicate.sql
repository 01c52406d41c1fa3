-- A replayed dead letter whose idempotency key was applied before (a copy of it got through) is
-- skipped, not applied: its history says so with event skipped_duplicate where it said replayed
-- (issue 42). Its status is replayed either way: the replay settled it. An expand migration: the
-- constraint only admits one more value, which the release before never writes. NOT VALID: the rows
-- there already satisfy it, and a check of them would hold the table's lock for a scan of it.
ALTER TABLE dead_letter_events DROP CONSTRAINT dead_letter_events_event_check;
ALTER TABLE dead_letter_events ADD CONSTRAINT dead_letter_events_event_check
    CHECK (event IN ('dead_lettered', 'replay_queued', 'replayed', 'skipped_duplicate', 'discarded')) NOT VALID;
