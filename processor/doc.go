// Package processor consumes Kafka topics in a consumer group and applies every record's effects
// to PostgreSQL exactly once.
//
// # How it works
//
// Each assigned partition gets one worker goroutine that applies its records in offset order,
// in batches of up to Config.BatchMaxRecords. A batch is one Postgres transaction that holds both
// the Handler's effects and the partition's next offset (package sink); partitions run
// concurrently, bounded by the connection pool. On assignment the processor claims the partition
// in Postgres, which fences any previous owner (package offsets), and resumes from the offset
// stored there. Kafka offsets are committed after the Postgres commits, for lag tools only.
//
// # What it guarantees
//
//   - Every record's effects written through the handler's transaction are committed exactly
//     once, or the record is dead-lettered (topic {topic}.{group}.dlq) exactly once in Postgres
//     terms: the dead letter is committed to an outbox in the same transaction as the offset
//     advance that skips the record, then published at least once. This holds across crashes,
//     restarts, rebalances and zombie owners.
//   - Records of a partition are applied in offset order. A failing record does not block the
//     others: the records before it are committed, it is retried alone (Config.LocalAttempts
//     tries with backoff) and then dead-lettered, and the partition moves on.
//   - Infrastructure failures (Postgres unreachable, serialization failures) never dead-letter a
//     record: the partition retries in place and resumes where it was.
//
// # What it does not guarantee
//
//   - Effects outside the transaction (calls to other services from a handler) may happen more
//     than once.
//   - A dead letter may be published to the DLQ topic more than once if the process dies between
//     Kafka's acknowledgement and the outbox delete.
//   - Records that Kafka deleted (retention) before they were applied are not recovered.
package processor
