-- start_offset is where the partition's first owner started it (offsets.Store.SetStart). kafkapg
-- writes it into the metadata of every offset it commits to Kafka, so that a database that has
-- forgotten the partition (restored from a backup taken before its first claim, or failed over
-- to an asynchronous standby that never received it) starts it there again, instead of at
-- Kafka's committed offset, which is ahead of everything that database holds (see
-- processor.resolveStarts). NULL for partitions first claimed before this migration.
ALTER TABLE offsets ADD COLUMN start_offset bigint;
