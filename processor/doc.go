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
// stored there. Kafka offsets are committed after the Postgres commits: lag tools read them, and
// the processor reads them only for a partition with no row in Postgres (another consumer's commit
// is where it starts; kafkapg's own means the database forgot the partition: see package offsets).
//
// # What it guarantees
//
//   - Every record's effects written through the handler's transaction are committed exactly
//     once, or the record is dead-lettered (topic {topic}.{group}.dlq and one dead_letters row)
//     exactly once in Postgres terms: every move of a record (to a retry tier, to the DLQ,
//     held behind its key) is committed in the same transaction as the offset advance that
//     skips it, and the record it publishes goes through an outbox, at least once. This holds
//     across crashes, restarts, rebalances and zombie owners.
//   - A failing record does not block the others: the records before it are committed, it is
//     retried alone (Config.LocalAttempts tries with backoff), then goes through the retry tiers
//     (Config.RetryTiers: topics {topic}.{group}.retry.{n}, each delivered no earlier than its
//     delay after the failure), then is dead-lettered; the partition moves on meanwhile.
//   - Records with the same key are applied in their partition's order, also across retries:
//     while a key has a record in the retry path, its later records wait, held in Postgres, and
//     are applied in order once it is applied or dead-lettered (Config.OnDeadLetter). Records of
//     other keys, and records without a key, are not held.
//   - A handler that waits on other systems can split that wait off as Prepare (Preparer): with
//     Config.Concurrency above 1 a partition prepares records of different keys side by side,
//     each key's one at a time in offset order, ahead of its transactions, which still apply
//     them in offset order with the offset, as above. Prepare itself is at least once.
//   - Infrastructure failures (Postgres unreachable, serialization failures) never dead-letter a
//     record: the partition retries in place and resumes where it was. A failure that waiting
//     will not fix is never retried in place silently: a handler's is the record's (it moves
//     on), kafkapg's own is logged as an error and counted; a partition or key that makes no
//     progress shows in kafkapg_stalled_partitions or kafkapg_stuck_keys with the cause.
//   - Only committed records are applied (read_committed: an aborted Kafka transaction's records
//     never are), whatever bytes they carry.
//   - Fetched records are counted against Config.MaxBufferedBytes, across all partitions,
//     whatever the backlog: fetching stops once they reach it, so they exceed it by one poll at
//     most (docs/guarantees.md, Memory, has the whole bound).
//   - What a handler emits with Record.Emit is published to Kafka if and only if its transaction
//     commits, a key's records in commit order, each with a message id that is the same however
//     often the record is handled (see package sink). On a topic with an idempotency key
//     (TopicPolicy.IdempotencyKey), a record whose key was applied before, within
//     Config.IdempotencyRetention, is skipped: the key is recorded in the transaction that
//     applies the record. Keyed on the message id (KeyFromHeader(sink.HeaderMessageID)), the
//     events a kafkapg service emitted are skipped by their stream's numbers instead, with no
//     key and no retention (streamdedupe.go; the argument is in package sink, "Streams").
//
// # What it does not guarantee
//
//   - Effects outside the transaction (calls to other services from a handler) may happen more
//     than once.
//   - A retry or dead-letter record may be published more than once if the process dies between
//     Kafka's acknowledgement and the outbox delete. A second copy in a retry tier is recognised
//     and skipped; a second copy in the DLQ topic is not (deduplicate on the kafkapg-original-*
//     headers, or read the dead_letters table, which has exactly one row per dead letter).
//   - Records that Kafka deleted (retention) before they were applied are not recovered.
//
// # Reading the code
//
// The files follow a record. processor.go: the Processor, Run and its shutdown; group.go: the
// Kafka client, partitions assigned, claimed (and their start offsets resolved), revoked and
// lost; worker.go: a partition's worker, taking fetched records from the memory budget
// (buffer.go); prepare.go: a partition's window of records prepared concurrently (Preparer);
// batch.go: a batch's pipeline — admitted (tier records due, held behind their key,
// duplicates skipped), applied in one transaction, a failing record isolated; transact.go: the
// transaction, retried in place while the failure is the infrastructure's; handler.go: the
// Handler and how it is called, and Record.Emit; idempotency.go: idempotency keys, duplicates
// skipped (kept in internal/keyring: a ring of generations, dropped one at a time); streams.go and
// streamdedupe.go: the emitting and the consuming side of numbered events; error.go: error markers and classification; route.go: where a
// failed record goes — local retries, the circuit breaker (breaker.go), a retry tier (tier.go),
// the DLQ; held.go: the held records of keys that are ready again; refused.go: records Kafka
// refuses for good; stall.go, stats.go, lag.go, metrics.go: what an operator sees;
// operator.go: what an operator does.
package processor
