// Package offsets keeps each partition's position in Postgres and fences stale owners.
//
// # What it guarantees
//
// The row (consumer_group, topic, partition) in the offsets table holds next_offset, the first
// offset not yet processed. The processor advances it inside the same transaction as the
// handler's effects (see package sink), so after any crash the stored offset and the effects agree:
// a batch is either applied and skipped past, or neither. Kafka's own committed offset is advisory
// where that row exists (lag tools read it); on assignment a worker resumes from next_offset, and
// reads Kafka's only for a partition without a row (below).
//
// A partition's first owner resolves where it starts (Kafka's committed offset if another
// consumer of the group made it, otherwise the log's start or end as configured; a retry tier
// always from its start) and stores it at once (SetStart), as the partition's next offset and as
// its start_offset, before it fetches: every later owner starts from the same place, however many
// rebalances happen before the first record is applied. kafkapg writes start_offset into the
// metadata of the offsets it commits to Kafka, so that a database that forgets the partition
// starts it there again rather than at kafkapg's own Kafka commit (see processor.resolveStarts).
//
// # Fencing: why a stale owner cannot apply twice
//
// A consumer can keep running after it has lost a partition: a long GC pause, a network partition
// from the group coordinator, or a handler that stalls past the session timeout. Kafka then gives
// the partition to another member, and both may try to apply the same records. The protocol:
//
//  1. Claim. When a member is assigned a partition, before it fetches anything, it runs Claim:
//     INSERT ... ON CONFLICT DO UPDATE SET owner_token = owner_token + 1 RETURNING next_offset,
//     owner_token. The member remembers the token and starts fetching at next_offset. (The
//     processor claims with ClaimAbove: the token is also at least TokenFloor of the group
//     generation that assigned the partition; see below.)
//  2. Advance. Every batch transaction begins with
//     UPDATE offsets SET next_offset = <new> WHERE <row> AND owner_token = <token> AND
//     next_offset IS NOT DISTINCT FROM <expected>.
//     If it updates one row, the transaction goes on to apply the batch and commits. If it updates
//     none, the transaction is rolled back without applying anything.
//
// Walk through the race. Old owner A holds token 4; new owner B claims and gets token 5.
//
//   - If B's claim commits before A's Advance runs, A's UPDATE sees owner_token = 5 ≠ 4, updates
//     zero rows, and A rolls back: ErrFenced. A applies nothing from then on.
//   - If A's Advance runs first, A's transaction holds the row lock. B's claim (an UPDATE of the
//     same row) waits for it. If A commits, B's claim then reads A's committed next_offset and B
//     starts after A's batch; if A rolls back, B starts where A started. Either way the batch is
//     applied at most once, and because A committed offset and effects together, at least once.
//   - Taking the row lock at the start of the transaction (Advance is its first statement) makes
//     the two owners serialize there, before any handler work is wasted.
//   - If A froze with its transaction open (its process stopped, its network gone), B's claim
//     would wait for Postgres's idle-in-transaction timeout to end it. EndStaleHolders ends it
//     sooner: A's transaction rolls back, which is the second case above.
//
// The expected-offset condition adds a second check that does not depend on tokens: a transaction
// can only move the offset forward from the position its worker believes is stored. It also
// resolves a commit whose outcome is unknown (the connection dropped during COMMIT): the retry's
// Advance finds next_offset already equal to its target and reports ErrAlreadyAdvanced instead of
// applying the batch a second time.
//
// A database can also lose the owner's last commits, or its claim (a failover to an asynchronous
// standby, a restore): the stored offset is then behind the owner's, or the token below its own,
// or the row gone. That is not another owner, and Advance says so with ErrMoved instead of
// ErrFenced: the owner starts again from the stored position, and applies again what was lost.
// Only a higher token is another owner's claim.
//
// A lost claim is claimed again (Reclaim), above the owner's own token, never taken over: the
// token the row holds again is the previous owner's, and that owner may be a zombie that never
// saw the lost claim fence it. Sharing a token, both would pass the fence; the expected-offset
// condition would still keep each batch to one of them, but each would decide which of its
// records wait behind a held key from the held keys it read, blind to those the other holds, and
// a key's records would be applied out of order. What the database forgot is remembered outside
// it: the owner remembers its own token, and the Kafka group its generation. A claim takes at
// least TokenFloor(generation), so that the claims of a later generation stay above every token an
// earlier generation's member (perhaps a zombie) reaches when it claims again after a loss.
//
// # Keys held from outside: keys_epoch
//
// The owner keeps in memory which keys of its partition are held (their later records must wait
// in held_records), and only it holds new keys, so it need not ask Postgres for every record. An
// operator's replay holds a key from outside. It bumps the row's keys_epoch in the transaction
// that holds the key, and Advance also requires keys_epoch to be the one the owner last read with
// its held keys. The replay's UPDATE takes the row lock, so it waits for the owner's batch in
// flight, and the owner's next Advance, finding another epoch, updates nothing: ErrKeysChanged.
// Nothing has been applied; the owner re-reads its held keys (and the epoch) and runs the batch
// again, now holding the key's records. A batch is thus decided either wholly before the replay
// or wholly after it.
//
// # Operators' pauses and positions
//
// Operators pause a group's source topic or partition (a row in pauses; partition -1: all of the
// topic's) and set a partition's position (the ops code, in one transaction: SELECT ... FOR
// UPDATE of the offsets row, INSERT into position_changes, UPDATE offsets SET next_offset = <to>,
// position_change = <the change's id>, the token untouched). The owners obey through the same two
// statements as above, so that no owner, current, zombie or new, applies what it must not:
//
//   - Advance also requires that no pause covers the partition's source partition (a retry tier's
//     partition is held back by its source topic's same partition: Position.Source): ErrPaused,
//     nothing applied, in the statement that locks the row. The processor's control loop (one
//     query a second: Store.Control) stops taking batches before that, but Postgres decides: a
//     replica that has not read the pause yet, after a rebalance or a start, applies nothing
//     either. The pause's transaction inserts its row, then locks the offsets rows of its
//     partitions (SELECT ... FOR UPDATE, every topic's: the retry tiers' are numbered the same)
//     before it commits: it waits for the batches whose Advance holds a row, which thus commit
//     before the pause. An Advance that comes meanwhile waits for the pause's commit, and its own
//     check, on a snapshot from before that commit, passes: so the batch checks the pauses again
//     in the next statement (QueuePauseCheck, in the same round trip), on a snapshot taken once
//     it holds the row, and rolls back (ErrPaused, TestAPauseInFlightStopsTheAdvanceWaitingForIt).
//     The held-record applier, which advances no position, takes a KEY SHARE lock of the
//     partition's row before it reads the pauses (PausedLocked): the same order, without
//     conflicting with the owner's advances.
//   - A position set moves next_offset under its owner: the owner's next Advance finds another
//     offset than its own and fails (ErrPositionSet, an ErrMoved), whatever it fetched; no
//     window in which it applies past the set. The set waits for a batch in flight (the row
//     lock) and is thus wholly after it. An idle owner finds out from the control loop
//     (position_change above the one it claimed at, or another next offset) and starts again
//     from the stored position as after ErrMoved: a rewind applies [to, from) again, a skip never
//     applies [from, to). A zombie (an older token) is fenced as always.
//
// The decisions are in package internal/positions, whose property test drives them through
// random histories of owners, zombies, rebalances, crashes, pauses, rewinds and skips.
//
// # What it does not guarantee
//
// Fencing protects the effects written through the transaction the processor opens. A handler
// that calls an external service (an HTTP request, an e-mail) from inside the transaction may do
// so more than once: the transaction can be rolled back (fenced, crashed, failed) after the call.
// Kafka's committed offset may lag Postgres or, after a restore of the database or a failover to
// an asynchronous standby, lead it; it is never used when Postgres has a position, and an offset
// kafkapg committed is never used as a start.
package offsets
