-- Whatever a record carries must fit the tables that move it; before this migration three things
-- a valid Kafka record may hold made those writes fail, for ever:
--
-- 1. Header keys are bytes in Kafka; text refuses NUL and invalid UTF-8. They become bytea[].
-- 2. A key longer than about 2.7 kB does not fit a btree index entry. Indexes and the primary key
--    of held_keys now use key_hash, the key's SHA-256, and queries check the key itself as well.
-- 3. A record's timestamp is any int64 of milliseconds in Kafka; timestamptz cannot hold most of
--    them (pgx even wraps some silently). "timestamp" becomes bigint: milliseconds since the Unix
--    epoch, exactly as Kafka keeps it (to_timestamp("timestamp" / 1000.0) to read it).

ALTER TABLE outbox ADD COLUMN header_keys_bytes bytea[] NOT NULL DEFAULT '{}';
UPDATE outbox SET header_keys_bytes =
    ARRAY(SELECT convert_to(k, 'UTF8') FROM unnest(header_keys) WITH ORDINALITY AS h(k, i) ORDER BY i)
    WHERE cardinality(header_keys) > 0;
ALTER TABLE outbox DROP COLUMN header_keys;
ALTER TABLE outbox RENAME COLUMN header_keys_bytes TO header_keys;

ALTER TABLE held_records ADD COLUMN header_keys_bytes bytea[] NOT NULL DEFAULT '{}';
UPDATE held_records SET header_keys_bytes =
    ARRAY(SELECT convert_to(k, 'UTF8') FROM unnest(header_keys) WITH ORDINALITY AS h(k, i) ORDER BY i)
    WHERE cardinality(header_keys) > 0;
ALTER TABLE held_records DROP COLUMN header_keys;
ALTER TABLE held_records RENAME COLUMN header_keys_bytes TO header_keys;

ALTER TABLE dead_letters ADD COLUMN header_keys_bytes bytea[] NOT NULL DEFAULT '{}';
UPDATE dead_letters SET header_keys_bytes =
    ARRAY(SELECT convert_to(k, 'UTF8') FROM unnest(header_keys) WITH ORDINALITY AS h(k, i) ORDER BY i)
    WHERE cardinality(header_keys) > 0;
ALTER TABLE dead_letters DROP COLUMN header_keys;
ALTER TABLE dead_letters RENAME COLUMN header_keys_bytes TO header_keys;

ALTER TABLE held_keys ADD COLUMN key_hash bytea GENERATED ALWAYS AS (sha256(key)) STORED;
ALTER TABLE held_keys DROP CONSTRAINT held_keys_pkey;
ALTER TABLE held_keys ADD PRIMARY KEY (consumer_group, topic, partition, key_hash);

ALTER TABLE held_records ADD COLUMN key_hash bytea GENERATED ALWAYS AS (sha256(key)) STORED;
DROP INDEX held_records_key_idx;
CREATE INDEX held_records_key_idx ON held_records (consumer_group, topic, partition, key_hash, "offset");

ALTER TABLE held_records ALTER COLUMN "timestamp" TYPE bigint
    USING round(extract(epoch FROM "timestamp") * 1000)::bigint;
ALTER TABLE dead_letters ALTER COLUMN "timestamp" TYPE bigint
    USING round(extract(epoch FROM "timestamp") * 1000)::bigint;

-- 4. A record Kafka refuses for good (too large, invalid) must not hold up the rest of the outbox:
--    the relay hands it to whoever wrote it (the processor turns a refused retry copy into a dead
--    letter), and a row nobody can publish is set aside here, with Kafka's answer, for an operator.
ALTER TABLE outbox ADD COLUMN refused_at timestamptz;
ALTER TABLE outbox ADD COLUMN refused_error text;
