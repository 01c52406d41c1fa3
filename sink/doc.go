// Package sink is the transactional write at the heart of kafkapg: one Postgres transaction that
// advances a partition's stored offset (fenced, see package offsets), applies a handler's effects
// and queues outgoing Kafka records (dead letters, retries) in an outbox table, all or nothing.
//
// # What it guarantees
//
//   - If Apply returns nil, the effects, the offset advance and the outbox rows are committed
//     together. If it returns an error, none of them are, except when the error reports that the
//     commit's outcome is unknown (the connection dropped during COMMIT): calling Apply again with
//     the same arguments then either applies the batch or finds it already committed
//     (offsets.ErrAlreadyAdvanced) without running the handler again.
//   - Every outbox row is published to Kafka at least once by a Relay and deleted only after the
//     broker acknowledged it. A process that dies between the acknowledgement and the delete leaves
//     the row, which is published again: a dead letter may appear twice in the DLQ topic, never
//     zero times. Each row's produce result counts on its own: one row Kafka refuses for good
//     (too large, invalid) never holds up the others; it goes back to its writer
//     (RelayConfig.Refused) or is set aside in the outbox (refused_at) for an operator.
//   - A handler's failure and Postgres's are told apart: a failed statement the handler swallowed
//     (ErrTxAborted) and a connection the handler's own context closed while Postgres stays up
//     (ErrConnClosedByHandler) come back as a HandlerError; a connection lost otherwise as
//     ErrConnLost.
//
// # What it does not guarantee
//
// Order of publication across partitions or across Relays of different processes. Records from
// the outbox of one partition are published in the order they were written when a single Relay
// publishes them, which is the normal case.
package sink
