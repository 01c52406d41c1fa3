// Package sink is the transactional write at the heart of kafkapg: one Postgres transaction that
// advances a partition's stored offset (fenced, see package offsets), applies a handler's effects
// and queues outgoing Kafka records in an outbox table, all or nothing; and the outbox itself —
// Outbox.Emit, for records any transaction emits, and the Relay that publishes them.
//
// # What it guarantees
//
//   - If Apply returns nil, the effects, the offset advance and the outbox rows are committed
//     together. If it returns an error, none of them are, except when the error reports that the
//     commit's outcome is unknown (the connection dropped during COMMIT): calling Apply again with
//     the same arguments then either applies the batch or finds it already committed
//     (offsets.ErrAlreadyAdvanced) without running the handler again.
//   - Every outbox row is published to Kafka at least once by a Relay and deleted (or marked
//     published) only after the broker acknowledged it. A process that dies between the
//     acknowledgement and the delete leaves the row, which is published again: a record may appear
//     twice in its topic, never zero times. Records emitted with Outbox.Emit carry an id
//     (HeaderMessageID) that is the same in both copies. Each row's produce result counts on its
//     own: one row Kafka refuses for good (too large, invalid, a topic missing for longer than
//     RelayConfig.MissingTopicGrace) never holds up the others; it goes back to its writer
//     (RelayConfig.Refused) or is set aside in the outbox (refused_at) for an operator.
//   - Records of the same topic and key are published in the order their transactions committed
//     (see below), by any number of relays at once.
//   - A handler's failure and Postgres's are told apart: a failed statement the handler swallowed
//     (ErrTxAborted) and a connection the handler's own context closed while Postgres stays up
//     (ErrConnClosedByHandler) come back as a HandlerError; a connection lost otherwise as
//     ErrConnLost.
//
// # Order: why a key's records reach Kafka in commit order
//
// An outbox ordered by a sequence (bigserial id) is ordered by when each transaction took its id,
// not by when it committed: T1 takes id 10, T2 takes id 11 and commits, a relay publishes 11, then
// T1 commits and 10 is published after it — or, with a "highest id published" cursor, skipped for
// ever. The protocol:
//
//  1. Writers lock the key. Outbox.Emit first takes a transaction-scoped advisory lock on each
//     (topic, key) it emits to (pg_advisory_xact_lock, in sorted order), then inserts the rows; the
//     row id is taken by the insert, after the lock. A second transaction emitting to the same key
//     waits at step 1 until the first commits or rolls back, so it takes its id after the first's
//     commit. For one key, id order is therefore commit order, and a row with a larger id becomes
//     visible only after every smaller one of its key is (or is gone, rolled back).
//  2. One relay per lane. Each key belongs to one of Lanes lanes (a hash of topic and key). A
//     relay's batch transaction first locks the lanes it will publish
//     (pg_try_advisory_xact_lock, skipping lanes another relay holds), then, in a later statement
//     whose snapshot is taken after those locks, reads the lanes' oldest unpublished rows in id
//     order, produces them in that order (franz-go keeps the order of one partition's records, and
//     a key's records share a partition), deletes them and commits, releasing the lanes. The next
//     relay to take a lane sees the previous one's deletes: it starts after them.
//  3. Nothing committed late is skipped. A relay never keeps a cursor: it reads every unpublished
//     row of its lanes each time. A row of key K that commits after the relay read the lane has a
//     larger id than every row of K read (step 1), so it is published after them, in a later batch.
//
// Walk through it with two writers and two relays. T1 emits to K and holds K's lock; T2 emits to K
// and waits. Relay A locks K's lane (it has rows of other keys) and reads nothing of K (T1 has
// not committed). T1 commits (id 10); T2 gets the lock, inserts id 11 and commits. Relay B tries
// K's lane: A holds it, so B takes other lanes. A's batch ends; A or B takes the lane again and
// reads 10 then 11, in that order.
// Without the writers' lock T2 could have taken id 9 and committed first; without the lane lock A
// and B could each have read one of the two rows and published them in either order. The test
// TestOutboxKeepsCommitOrderPerKey witnesses commit order in the database and fails without
// either lock.
//
// Costs and limits: two transactions that each emit to the same two keys in separate Emit calls,
// in opposite orders, can deadlock (Postgres aborts one, SQLSTATE 40P01, which a processor
// retries); records without a key have no order to keep and are spread over the lanes. A relay
// takes every free lane that has rows, so a second replica mostly stands by, taking lanes over
// when the first's transaction ends (at worst after its TxIdleTimeout, if it froze).
//
// # What it does not guarantee
//
// Order across keys, and the order of a key's record that was set aside relative to the key's
// later records (they flow on). A relay does not create topics.
package sink
