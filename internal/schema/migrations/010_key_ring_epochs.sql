-- The key ring turns by epochs, and nothing waits in a queue (issue 39; see internal/keyring,
-- state.go). Before, a turn emptied the oldest generation with TRUNCATE, whose ACCESS EXCLUSIVE
-- lock had to be granted within a lock timeout: a batch that recorded keys and lasted longer kept
-- the ring from ever turning, and every attempt stalled every batch's lookups behind the waiting
-- lock.
--
-- Now every change of the ring's state is an increment of its epoch. A transaction recording keys
-- first takes a shared advisory lock on the epoch it believes current and checks, afresh, that
-- the ring is not two epochs past it (idempotency_ring_enter, below); then it records with that
-- epoch's tables. The turner moves to epoch E only if it gets the exclusive lock on E-2 at once
-- (pg_try_advisory_xact_lock: no recorder of E-2 alive), else it tries again at the next keep.
-- A turn is a sequence of such moves: stop looking up the oldest generation, empty it (TRUNCATE
-- of tables no recorder references any more, NOWAIT), insert into both the current generation
-- and the new one, then the new one only, then freeze the old one (compact it), look it up by its
-- runs, and empty its table of keys.
--
-- current becomes gen: a processor of the release before, which inserts into the current
-- generation without the advisory lock, fails on it (column "current" does not exist) instead of
-- recording keys the new turner does not wait for. Its batches with keys are retried until it is
-- upgraded.
ALTER TABLE idempotency_ring RENAME COLUMN current TO gen;
ALTER TABLE idempotency_ring
    -- Incremented by every move.
    ADD COLUMN epoch    bigint      NOT NULL DEFAULT 0,
    -- keyring.Step: 0 steady ... 6 compacted, 7 upgrade (every table looked up, the generations
    -- past compacted), 8 upgraded.
    ADD COLUMN step     smallint    NOT NULL DEFAULT 7 CHECK (step BETWEEN 0 AND 8),
    -- keyring.LegacyStep: idempotency_keys 0 looked up, 1 no longer, 2 emptied.
    ADD COLUMN legacy   smallint    NOT NULL DEFAULT 0 CHECK (legacy BETWEEN 0 AND 2),
    -- When the last move was made: moves are spaced, so that a processor recording keys sees
    -- each state before the next (one that missed two fails with ErrMoved and retries).
    ADD COLUMN moved_at timestamptz NOT NULL DEFAULT now();
COMMENT ON COLUMN idempotency_ring.rotated_at IS 'when the last turn froze a generation: no key was inserted into it after';

-- A ring whose generations past were compacted (or never held keys) and whose legacy table is
-- empty starts steady; else the processors finish what the release before left.
UPDATE idempotency_ring SET
    step = CASE WHEN (gen = 0 OR NOT EXISTS (SELECT 1 FROM idempotency_keys_0))
            AND (gen = 1 OR NOT EXISTS (SELECT 1 FROM idempotency_keys_1))
            AND (gen = 2 OR NOT EXISTS (SELECT 1 FROM idempotency_keys_2))
            AND (gen = 3 OR NOT EXISTS (SELECT 1 FROM idempotency_keys_3))
            AND NOT EXISTS (SELECT 1 FROM idempotency_runs_0 WHERE gen = 0)
            AND NOT EXISTS (SELECT 1 FROM idempotency_runs_1 WHERE gen = 1)
            AND NOT EXISTS (SELECT 1 FROM idempotency_runs_2 WHERE gen = 2)
            AND NOT EXISTS (SELECT 1 FROM idempotency_runs_3 WHERE gen = 3)
        THEN 0 ELSE 7 END,
    legacy = CASE WHEN EXISTS (SELECT 1 FROM idempotency_keys) THEN 0 ELSE 2 END;

-- A recorder's first statement: the shared lock on the epoch it believes current (seen), then the
-- ring read with a snapshot taken after it (a statement of a volatile function: its own
-- snapshot under read committed). SQLSTATE 40K01 (a transaction rollback: retry it) if the lock
-- is refused (a turner is moving to seen+2) or the ring is at seen+2 or later. ns is the ring's
-- lock namespace; the epoch's key is its low 31 bits (keyring.lockKey).
CREATE FUNCTION idempotency_ring_enter(ns integer, seen bigint)
RETURNS TABLE (epoch bigint, gen smallint, step smallint, legacy smallint)
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
DECLARE
    r idempotency_ring;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'idempotency keys are recorded in read committed transactions only, not %', current_setting('transaction_isolation');
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(ns, (seen & 2147483647)::integer) THEN
        RAISE EXCEPTION USING ERRCODE = '40K01', MESSAGE = format('the idempotency key ring is moving past epoch %s', seen);
    END IF;
    SELECT * INTO r FROM idempotency_ring WHERE id = 0;
    IF r.epoch >= seen + 2 THEN
        RAISE EXCEPTION USING ERRCODE = '40K01', MESSAGE = format('the idempotency key ring moved from epoch %s to %s', seen, r.epoch);
    END IF;
    RETURN QUERY SELECT r.epoch, r.gen, r.step, r.legacy;
END $$;

-- A group of the schema that has no row here (one whose processors run a release before this one)
-- keeps idempotency_keys from being emptied: processors write their group's row at start, with
-- retention 0 when they have no idempotency keys.
