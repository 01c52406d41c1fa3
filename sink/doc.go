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
// # Streams: why a consumer can deduplicate a processor's events with a few numbers
//
// A consumer that deduplicates events by their message id keeps, naively, one id per event for as
// long as a copy may come: rate x retention. The events a processor emits while applying a
// record (processor.Record.Emit, with the id it derives) can do with a few numbers per stream,
// forever, because of where they come from:
//
//  1. A stream is what one group's source partition emits to one partition of one topic. The
//     partition is fixed when the event is emitted (Event.Source; its key's partition, as Kafka's
//     producers place it), so all of a stream's events reach one partition of its topic, and so
//     one consumer at a time.
//  2. Numbers are dense, and each is taken once. The emitting transaction takes the next numbers
//     of its streams from a counter row (outbox_streams), locked until it ends: a rolled-back
//     transaction took none, and a stream's numbers follow the order its transactions commit in.
//     A copy of an event (its row published twice: a relay that died between Kafka's
//     acknowledgement and its delete, or lost its "published" mark) carries the same header,
//     hence the same number.
//  3. So, for a stream, "this event was applied" is "its number was applied", and the numbers
//     applied are the numbers up to the highest applied, less the few not applied yet: a relay
//     publishes a stream's events of different keys in any order (lanes), and a consumer may hold
//     one in its retry path or as a dead letter, or its record may have been refused by Kafka for
//     good. The consumer keeps the highest number and those missing numbers (as ranges), and
//     applies an event exactly when its number is above the highest or missing: constant state,
//     whatever the number of events.
//
// What breaks the argument is a database that forgets: a failover to a standby that lacked the
// last commits, or a restore. Its counter rows went back with the records they numbered, so the
// numbers past what it kept are taken again, by the same records applied again (their events
// have the same message ids) or by others. The stream forks: each counter row records the
// database's identity (its system identifier and WAL timeline: a promoted standby and a restored
// backup start a new timeline) when it last took a number, and a row that finds another one, or
// none (a processor found its partition's position gone back, see processor), starts a new
// stream, numbered from 1, whose header names the stream it replaces (its parent), the last
// number of that one the database kept (fork seq) and when it was taken. A stream whose row the
// database lost entirely is created again: every header names its lineage's root (derived from
// the group, source partition and destination partition), which the lost stream named too. The
// consumer, when it first meets such a successor, reads its topic's partition again from Kafka
// (from the parent's fork time less five minutes, or from where it first met the lost sibling),
// records the message ids of the parent's events past the fork seq (of the sibling's, all) that it
// had applied, and notes the highest source offset among them: the successor repeats only
// events of records applied again, which come from source offsets up to that horizon. The
// successor's records from those offsets (and all of its records for ten minutes, for a relay of
// the old database that published just before it went), and the parent's past the fork seq, are
// then deduplicated by message id as well. State per event only for what a failover lost; the
// events of an upstream that never forgets are never keyed.
//
// Walk through a failover with a consumer sharing the upstream's database. Stream X is at 100;
// the standby had it at 80 and the consumer at 70. After the failover, the consumer applies X's
// 71 to 100 again from its topic (its own applications of them were lost too), by number. The
// upstream applies again the records that emitted X's 81 to 100, now under fork Y (parent X, fork
// seq 80): Y's 1 to 20 carry the same message ids. Meeting Y, the consumer reads X's 81 to 100
// back, finds them applied, records their ids: Y's 1 to 20 are skipped by id. Without the read
// back they would be applied twice by number; without the fork, numbered 81 to 100 again after
// the consumer applied the first 81 to 100, a record the upstream dead-lettered the second time
// would have let a new event take its number, and be skipped. TestStreamsDecideCopiesByNumber
// and the chain's chaos run through failovers to an asynchronous standby witness it.
//
// Not covered: a consumer that had not kept the parent's records in Kafka (retention deleted
// them before it met the fork) cannot read them back, and applies their repeats again; events an
// upstream emitted with an id of its own (Event.ID set), or through Outbox.Emit, or from a
// database that cannot tell its identity (CheckStreams), are unnumbered: consumers keep their
// ids, for IDEMPOTENCY_RETENTION.
//
// # What it does not guarantee
//
// Order across keys, and the order of a key's record that was set aside relative to the key's
// later records (they flow on). A relay does not create topics.
package sink
