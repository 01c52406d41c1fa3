-- Idempotency keys in a ring of four generations, instead of one table pruned row by row (see
-- processor/keyring.go).
--
-- A key is the first 16 bytes of the SHA-256 that processor.keyHash computes over the group, the
-- topic and the key, stored as a uuid (16 bytes inline), and nothing else: the group, topic,
-- partition, offset and time idempotency_keys kept per row are left out. Two different keys share
-- those 16 bytes with a probability below 10^-20 among the 1.8 billion keys of a week at 3,000
-- records/s. A row is then its tuple header, the 16 bytes and a line pointer (44 bytes), plus its
-- primary key's entry (28 bytes, in pages a random key leaves about 70 % full): about 85 bytes a
-- key while its generation is current, against about 235 in idempotency_keys; then 18 (below).
--
-- One generation is current: keys are recorded in it and looked up in all four. Every
-- IDEMPOTENCY_RETENTION / 3 (the longest retention any group of the schema asks for, see
-- idempotency_retention) the oldest generation is emptied with TRUNCATE, which leaves nothing
-- behind for vacuum, and becomes the current one: a key is kept between the retention and 4/3 of
-- it. TRUNCATE's lock waits for the transactions that looked keys up in the generation, and the
-- statements that come meanwhile take their snapshot after it: no transaction still recording
-- into the old current generation overlaps one recording into the new (two copies of a record,
-- one in each, would not see each other).
CREATE TABLE idempotency_keys_0 (key_hash uuid PRIMARY KEY);
CREATE TABLE idempotency_keys_1 (key_hash uuid PRIMARY KEY);
CREATE TABLE idempotency_keys_2 (key_hash uuid PRIMARY KEY);
CREATE TABLE idempotency_keys_3 (key_hash uuid PRIMARY KEY);

-- A generation that is no longer current takes no new keys, and is compacted: its keys, sorted,
-- 120 to a row (lo, the row's first key, the primary key; keys, a sorted array), which stays
-- under the size Postgres would move out of line (a row of about 2 kB, four to a page): about 18
-- bytes a key instead of 85. A key is looked up as the last row whose lo is not above it. The
-- keys are copied a range of hashes at a time, then idempotency_keys_<n> is emptied (TRUNCATE):
-- a key is in one table or the other, or both, never neither.
CREATE TABLE idempotency_runs_0 (lo uuid PRIMARY KEY, keys uuid[] NOT NULL);
CREATE TABLE idempotency_runs_1 (lo uuid PRIMARY KEY, keys uuid[] NOT NULL);
CREATE TABLE idempotency_runs_2 (lo uuid PRIMARY KEY, keys uuid[] NOT NULL);
CREATE TABLE idempotency_runs_3 (lo uuid PRIMARY KEY, keys uuid[] NOT NULL);

-- The ring's state: which generation is current, and since when.
CREATE TABLE idempotency_ring (
    id         smallint    PRIMARY KEY DEFAULT 0 CHECK (id = 0),
    current    smallint    NOT NULL CHECK (current BETWEEN 0 AND 3),
    rotated_at timestamptz NOT NULL
);
INSERT INTO idempotency_ring (current, rotated_at) VALUES (0, now());

-- The retention each group with idempotency keys asks for (IDEMPOTENCY_RETENTION), written by its
-- processors; the ring turns at the longest one among the groups seen within their retention.
CREATE TABLE idempotency_retention (
    consumer_group text        PRIMARY KEY,
    retention      interval    NOT NULL,
    seen_at        timestamptz NOT NULL
);

-- idempotency_keys, the layout before, is still looked up (by its full 32-byte hash) until its
-- newest key is older than the longest retention; then it is emptied with TRUNCATE, once, and
-- nothing writes to it again. The keys dead letters that may still be replayed share are copied
-- into the current generation first, as at every rotation.
