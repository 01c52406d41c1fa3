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
// because of where they come from:
//
//  1. A stream is what one group's source partition emits to one partition of one topic. The
//     partition is fixed when the event is emitted (Event.Source; its key's partition, as Kafka's
//     producers place it), so all of a stream's events reach one partition of its topic, and so
//     one consumer at a time; the header names that partition and topic (Stream.Fits), so a
//     header another producer copied onto a record elsewhere is not taken for one.
//  2. Numbers are dense, and each is taken once in a database history. The emitting transaction
//     takes the next numbers of its streams from a counter row (outbox_streams), locked until it
//     ends: a rolled-back transaction took none, and a stream's numbers follow the order its
//     transactions commit in. A copy of an event (its row published twice: a relay that died
//     between Kafka's acknowledgement and its delete, or a database restored with the row still
//     in its outbox) carries the same header, hence the same number.
//  3. So, for a stream, "this event was applied" is "its number was applied", and the numbers
//     applied are the numbers up to the highest applied, less the few not applied yet (a relay
//     publishes a stream's events of different keys in any order; a consumer holds some in its
//     retry path or as dead letters; Kafka refused some for good).
//
// What breaks the argument is a database that forgets commits: a failover to a standby that lacked
// the last ones, a restore to a point in time, a copy of the data directory started as it was.
// Its counter rows went back with the records they numbered, so the numbers past what it kept are
// taken again, by the same records applied again or by others, on every path that emits: the
// partition's worker, a retry tier's, the held records', a replay's. None of those is trusted to
// notice: the counter row does. Each row records the database's identity when it last took a
// number — its system identifier, WAL timeline and the server's start time (DatabaseIdentitySQL):
// a promoted standby and a point-in-time restore start a timeline, and a copy started as it was
// starts a server. A row written under another identity forks its stream at its next number,
// whatever path takes it: a new stream, numbered from 1, whose header names the stream it replaces
// (its parent), the last number of that one the database kept (fork seq) and Since, the latest
// time a number was taken under the parent's identity among the rows the database kept (the
// commits it lost came after that, and a relay publishes after a commit). A stream whose row the
// database lost entirely is created again, under the same root (derived from the group, source
// partition and destination partition), which every stream of the lineage names. A plain restart
// forks too: it cannot be told from a copy started as it was, and costs a consumer only keys for
// a while (below).
//
// The consumer (package internal/streams decides, processor keeps the state per lineage in
// idempotency_lineages) then reasons path by path:
//
//   - Its partition's worker observes every numbered record, in offset order, in the transaction
//     that moves its position past it, whatever becomes of the record (applied, a copy, held,
//     sent to a retry tier, dead-lettered). Streams are registered in the order they first
//     appear, and every record before the position was observed.
//   - A newer stream may repeat, under its own numbers, the events of older streams that its own
//     history does not keep: a fork's parent's past the fork seq (and its parent's past its own
//     fork point), all of a sibling's or of a stream created again's. Both events of such a pair
//     are decided by their key as well: the older's, because a newer stream may repeat it; the
//     newer's, if it comes from a source offset at or below its horizon — the highest source
//     offset among the older streams' events it may repeat that were observed (a repeat comes
//     from a source record applied again). Keys are kept in the key ring, for
//     IDEMPOTENCY_RETENTION.
//   - An older event applied by number before the newer stream was met was not keyed: the newer
//     stream's registration reads those events back from Kafka (a fork's parent's from the first
//     record published at or after Since less five minutes, others' from where they were first
//     observed) and records the keys of the ones applied, before any record of the lineage is
//     decided again. An older event that comes after the newer stream's first record (a relay of
//     the old database finishing a produce; a copy of the database restored after another
//     publishing what it kept) raises the horizon, and the newer stream's events applied by
//     number up to it are read back the same way. A read back runs with no transaction open and
//     records what it found a chunk at a time, with its progress: it survives retries and
//     restarts, holds no connection while it reads, and never takes a second one.
//   - Records of other paths (retry tiers, held records, replays) were observed when the worker
//     passed them; a record the worker never observed (a dead letter of a release before this
//     protocol) is prepared first, as an older stream's event. A replay is decided by key as well
//     as by number; so is every numbered record during a group's first IDEMPOTENCY_RETENTION
//     under this protocol if it consumed before (a release before applied copies by key only),
//     while the upgrade window is open and for a retention after it is finalized (processes of
//     the release before act beside this one's, by key, observing nothing: docs/upgrading.md),
//     and every number below the first one observed of a stream.
//   - The upstream's own release before emits its events unnumbered (decided by key). If its
//     database loses such a commit, this release applies the source record again and numbers the
//     event, in a stream that may be new to the consumer: by number alone, a copy. So an event
//     numbered while the upstream schema's upgrade window is open, or while its group's window of
//     keys runs (a retention after finalizing), is marked Keyed in its header, and every consumer
//     decides it by key as well (Stream.Keyed). A database that loses a commit restores a state
//     from before it, whose window the number then reads.
//   - A dead letter discarded marks its number done. Numbers stay missing only for records in
//     the retry path or dead-lettered and not yet replayed or discarded, and for events Kafka
//     refused upstream that nobody published again: state grows with those, not with events.
//   - A stream no record of which was met for IDEMPOTENCY_RETENTION is forgotten (Lineage.Forget),
//     as keys are: every event of it was applied more than the retention ago. A record of it met
//     later is of a stream new here: the worker registers it again (before a fork of it the
//     lineage keeps), numbers below the first one observed and records from offsets before it are
//     decided by key, and a copy of an event applied before it was forgotten may be applied again
//     — a copy more than the retention after its twin, as with keys. A newer stream whose chain of
//     parents passes through a stream forgotten counts the streams past it as not kept: more is
//     decided by key, never less; and nothing is forgotten while a read back is pending. So a
//     lineage holds the streams met within the retention, however often the upstream starts.
//
// TestProtocol (internal/streams) is the check of this argument: a state-machine property test
// that drives the consumer's decisions through random histories of an upstream database losing
// commits (same identity and new, with and without restarts), relays publishing late, twice, in
// any order or never, every path, dead letters replayed and discarded, and a release before it
// on both sides (first alone, then beside this one while the upgrade window is open; upstream, it
// emits unnumbered),
// and streams forgotten, and fails if an event is applied twice (in histories that forget: twice
// within the retention), or not at all when everything is done, or a number published stays
// missing, or a lineage keeps anything a retention after its last record. It found six of the
// rules above missing while they were written (the newer stream's read back, waiting for a read
// back on every path, a stream's keyed numbers after its chain of parents grew, the horizon of
// what only other paths met, what other paths met of a stream counting as seen once it is
// registered or before its first offset, records before a stream's first offset decided by
// key), and reading the rules for forgetting found a seventh (a parent registered after its fork
// raises the fork's horizon): the shrunk histories are the tests in
// internal/streams/regressions_test.go.
//
// Not covered: a consumer that had not kept the events it must read back in Kafka (retention
// deleted them first) cannot record their keys, and applies their repeats again; a repeat that
// comes more than IDEMPOTENCY_RETENTION after its twin's key was recorded, or a copy of an event
// of a stream forgotten, is applied again (as any copy decided by key); a database that loses commits without a new identity (synchronous_commit
// off and a crash of a backend only); clocks more than five minutes apart between the emitting
// database and the relays' Kafka timestamps; an event the upstream's release before emitted
// unnumbered and this release numbered without the Keyed mark: across a restore of the upstream's
// database between a state finalized more than a retention ago and one where the release before
// acted less than a retention ago (a backup from before finalizing, restored more than a
// retention after it: the way back docs/upgrading.md gives), or to a backup of a history an
// earlier restore abandoned. Events an upstream emitted with an id of its own
// (Event.ID set), or through Outbox.Emit, or from a database that cannot tell its identity
// (CheckStreams), are unnumbered: consumers keep their ids, for IDEMPOTENCY_RETENTION.
//
// # What it does not guarantee
//
// Order across keys, and the order of a key's record that was set aside relative to the key's
// later records (they flow on). A relay does not create topics.
package sink
