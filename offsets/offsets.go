package offsets

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrFenced means another owner has claimed the partition since this worker did: the worker must
// stop processing it. The transaction that observed it has applied nothing.
var ErrFenced = errors.New("partition was claimed by another owner (fenced)")

// ErrMoved means the partition's stored position is not where its owner left it, and no other
// owner has claimed it since: the database lost the owner's last commits or its claim (a failover
// to a standby that lacked them, a restore from a backup), or an operator moved the position. The
// transaction that observed it has applied nothing. The owner must not go on from its own
// position: it starts again from the stored one, which applies again what the database lost. If
// the database lost its claim (a lower token, or no row), it claims the partition again above its
// own token (Reclaim) before it does: the stored token may be a previous owner's, perhaps a zombie
// that has not found out it lost the partition, and two owners with one token both pass the fence,
// each blind to the keys the other holds.
var ErrMoved = errors.New("the partition's stored position moved under its owner, and nobody else claimed it")

// ErrPositionSet is the ErrMoved of a position an operator set (offsets.position_change grew past
// the one the owner claimed at): a rewind or a skip, not a loss. errors.Is(err, ErrMoved) holds
// for it; the owner starts again from the stored position all the same.
var ErrPositionSet = fmt.Errorf("an operator set the partition's position: %w", ErrMoved)

// ErrAlreadyAdvanced means the stored offset already equals the target of an Advance made with the
// same token: an earlier commit whose outcome was unknown did succeed. Nothing must be re-applied.
var ErrAlreadyAdvanced = errors.New("offset already advanced by an earlier commit of this owner")

// ErrKeysChanged means an operator's replay held a key of the partition since the owner last read
// its held keys (the row's keys_epoch moved on): the owner must read them again and run the batch
// again. The transaction that observed it has applied nothing.
var ErrKeysChanged = errors.New("the partition's held keys changed (a replay); read them again")

// ErrPaused means an operator paused the partition's source topic or partition (a row in the
// pauses table): the owner applies nothing of it until the row is gone, and keeps its place. The
// transaction that observed it has applied nothing; the owner waits and runs the batch again
// once the pause is lifted. Not a failure: nothing is wrong with the record, the database or the
// owner.
var ErrPaused = errors.New("the partition is paused by an operator")

// Partition names one topic partition.
type Partition struct {
	Topic     string
	Partition int32
}

func (p Partition) String() string { return fmt.Sprintf("%s[%d]", p.Topic, p.Partition) }

// Position is what an owner knows about its partition: its token and the stored next offset.
// Next is meaningful only when Known is true; an unknown position means nothing has been committed
// for this partition yet.
type Position struct {
	Topic     string
	Partition int32
	Token     int64
	Next      int64
	Known     bool
	// Start is where the partition's first owner started it (see Store.SetStart); meaningful only
	// when StartKnown is true (partitions first claimed before kafkapg kept it have none).
	Start      int64
	StartKnown bool
	// KeysEpoch is the row's keys_epoch as the owner last read it with its held keys (see
	// ErrKeysChanged).
	KeysEpoch int64
	// PositionChange is the row's position_change (the id of the last position an operator set,
	// 0 for none) as the owner read it at its claim: a larger stored one means an operator set
	// the position since, and the owner starts again from the stored position.
	PositionChange int64
	// Source is the source topic whose pauses hold the partition back: Topic itself for a
	// source topic's partition (an empty Source means Topic), the source topic of a retry tier's
	// partition (its same partition number). Not stored; Advance reads the pauses of
	// (Source, Partition).
	Source string
}

// source returns the topic whose pauses apply to the position's partition.
func (p Position) source() string {
	if p.Source != "" {
		return p.Source
	}
	return p.Topic
}

// TP returns the position's partition.
func (p Position) TP() Partition { return Partition{p.Topic, p.Partition} }

// Advanced returns the position after a successful Advance to next.
func (p Position) Advanced(next int64) Position {
	p.Next, p.Known = next, true
	return p
}

// Store reads and writes the offsets table of one consumer group.
type Store struct {
	group       string
	claimSQL    string
	reclaimSQL  string
	advanceSQL  string
	readSQL     string
	listSQL     string
	startSQL    string
	staleSQL    string
	storedSQL   string
	pausedSQL   string
	keyShareSQL string
	controlSQL  string
}

// Querier runs queries; *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// NewStore returns a Store for group whose table lives in schema.
func NewStore(schema, group string) *Store {
	t := pgx.Identifier{schema, "offsets"}.Sanitize()
	pauses := pgx.Identifier{schema, "pauses"}.Sanitize()
	return &Store{
		group: group,
		claimSQL: `INSERT INTO ` + t + ` AS o (consumer_group, topic, partition, owner, owner_token)
			SELECT $1, topic, partition, $4, greatest($5::bigint, 1)
			FROM unnest($2::text[], $3::int[]) AS c(topic, partition)
			ORDER BY topic, partition
			ON CONFLICT (consumer_group, topic, partition) DO UPDATE
			SET owner_token = greatest(o.owner_token + 1, $5::bigint), owner = EXCLUDED.owner, claimed_at = now()
			RETURNING topic, partition, owner_token, next_offset, keys_epoch, start_offset, coalesce(position_change, 0)`,
		// Only while the stored token is at most the owner's own ($6): a higher one is another
		// owner's claim, which stands.
		reclaimSQL: `INSERT INTO ` + t + ` AS o (consumer_group, topic, partition, owner, owner_token)
			VALUES ($1, $2, $3, $4, $5)
			ON CONFLICT (consumer_group, topic, partition) DO UPDATE
			SET owner_token = EXCLUDED.owner_token, owner = EXCLUDED.owner, claimed_at = now()
			WHERE o.owner_token <= $6
			RETURNING topic, partition, owner_token, next_offset, keys_epoch, start_offset, coalesce(position_change, 0)`,
		// clock_timestamp(): the time of the advance, which a trace tells after the batch's
		// failures (timed in the transaction), not now(), the transaction's start. The pause
		// check is an InitPlan run once before the row is touched: a probe of pauses' primary
		// key, or a scan of a table that small (13 µs for 100 pauses of the group, EXPLAIN
		// ANALYZE on Postgres 15); BenchmarkAdvance's whole transaction (about 0.2-0.3 ms here)
		// does not tell it from the advance without it.
		advanceSQL: `UPDATE ` + t + ` SET next_offset = $5, updated_at = clock_timestamp()
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3
			AND owner_token = $4 AND next_offset IS NOT DISTINCT FROM $6 AND keys_epoch = $7
			AND NOT EXISTS (SELECT 1 FROM ` + pauses + ` AS z
				WHERE z.consumer_group = $1 AND z.topic = $8 AND z.partition IN ($3, -1))`,
		keyShareSQL: `SELECT 1 FROM ` + t + ` WHERE consumer_group = $1 AND topic = $2 AND partition = $3 FOR KEY SHARE`,
		pausedSQL: `SELECT EXISTS (SELECT 1 FROM ` + pauses + `
			WHERE consumer_group = $1 AND topic = $2 AND partition IN ($3, -1))`,
		readSQL: `SELECT owner_token, next_offset, keys_epoch, start_offset, coalesce(position_change, 0) FROM ` + t + `
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3`,
		listSQL: `SELECT topic, partition, next_offset FROM ` + t + `
			WHERE consumer_group = $1 AND topic = ANY($2) AND next_offset IS NOT NULL`,
		storedSQL: `SELECT topic, partition, owner_token, coalesce(next_offset, -1), coalesce(position_change, 0) FROM ` + t + `
			WHERE consumer_group = $1 AND (topic, partition) IN (SELECT * FROM unnest($2::text[], $3::int[]))`,
		controlSQL: `SELECT topic, partition, owner_token, coalesce(next_offset, -1), coalesce(position_change, 0), NULL::timestamptz FROM ` + t + `
			WHERE consumer_group = $1 AND (topic, partition) IN (SELECT * FROM unnest($2::text[], $3::int[]))
			UNION ALL
			SELECT topic, partition, 0, 0, 0, paused_at FROM ` + pauses + ` WHERE consumer_group = $1`,
		// A row an uncommitted UPDATE locks has the updating transaction's id as its xmax; the
		// backend running that transaction shows it as backend_xid.
		staleSQL: `SELECT a.pid, o.topic, o.partition, pg_terminate_backend(a.pid) FROM ` + t + ` AS o
			JOIN pg_stat_activity AS a ON a.backend_xid = o.xmax
			WHERE o.consumer_group = $1 AND (o.topic, o.partition) IN (SELECT * FROM unnest($2::text[], $3::int[]))
			AND a.state IN ('idle in transaction', 'idle in transaction (aborted)') AND a.pid <> pg_backend_pid()`,
		startSQL: `UPDATE ` + t + ` AS o SET next_offset = s.next, start_offset = s.next, updated_at = now()
			FROM unnest($2::text[], $3::int[], $4::bigint[], $5::bigint[]) AS s(topic, partition, token, next)
			WHERE o.consumer_group = $1 AND o.topic = s.topic AND o.partition = s.partition
			AND o.owner_token = s.token AND o.next_offset IS NULL
			RETURNING o.topic, o.partition`,
	}
}

// Group returns the consumer group the store is for.
func (s *Store) Group() string { return s.group }

// Claim takes ownership of parts for owner (a free-form label for humans, e.g. the member id):
// it bumps each partition's token, fencing any previous owner, and returns the new positions in
// the order of parts. Rows are locked in (topic, partition) order, so concurrent claims of
// overlapping sets cannot deadlock.
func (s *Store) Claim(ctx context.Context, q Querier, owner string, parts []Partition) ([]Position, error) {
	return s.ClaimAbove(ctx, q, owner, 0, parts)
}

// ClaimAbove is Claim with a floor: each partition's new token is its stored token plus one, or
// floor if that is higher (a partition without a row gets floor, or 1). The processor passes
// TokenFloor of the group generation that assigned the partitions.
func (s *Store) ClaimAbove(ctx context.Context, q Querier, owner string, floor int64, parts []Partition) ([]Position, error) {
	if len(parts) == 0 {
		return nil, nil
	}
	topics := make([]string, len(parts))
	nums := make([]int32, len(parts))
	for i, p := range parts {
		topics[i], nums[i] = p.Topic, p.Partition
	}
	rows, err := q.Query(ctx, s.claimSQL, s.group, topics, nums, owner, floor)
	if err != nil {
		return nil, fmt.Errorf("claim %d partitions: %w", len(parts), err)
	}
	got := make(map[Partition]Position, len(parts))
	for rows.Next() {
		pos, err := scanClaim(rows)
		if err != nil {
			rows.Close()
			return nil, fmt.Errorf("claim: %w", err)
		}
		got[pos.TP()] = pos
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim %d partitions: %w", len(parts), err)
	}
	out := make([]Position, len(parts))
	for i, p := range parts {
		pos, ok := got[p]
		if !ok {
			return nil, fmt.Errorf("claim: no row returned for %s", p)
		}
		out[i] = pos
	}
	return out, nil
}

// scanClaim reads the position a claim returns.
func scanClaim(row pgx.Row) (Position, error) {
	var pos Position
	var next, start *int64
	if err := row.Scan(&pos.Topic, &pos.Partition, &pos.Token, &next, &pos.KeysEpoch, &start, &pos.PositionChange); err != nil {
		return pos, err
	}
	if next != nil {
		pos.Next, pos.Known = *next, true
	}
	if start != nil {
		pos.Start, pos.StartKnown = *start, true
	}
	return pos, nil
}

// TokenFloor is the lowest token a claim made by a member of the given group generation (the
// member epoch under Kafka's consumer group protocol) takes: generation << 32 (0 for none).
//
// The Kafka group remembers what the database can forget. Suppose A owned a partition with token
// t, and froze; the group gave the partition to B, whose claim took t+1; then the database lost
// both claims (a failover to an asynchronous standby, a restore) and the row holds t-1. Claiming
// above the stored token, B could take t again: A's token, and A, waking, would pass the fence
// beside B. Claiming above its own token, A (finding its claim gone) could take t+1: B's. With
// floors, tokens of a later generation are above every token an earlier generation's member can
// reach by claiming again after a loss (fewer than 2^32 times): B's claim is at least its
// generation's floor, and A's claims stay below it.
//
// It keeps tokens apart while the group's generations rise, which they do for as long as the
// group lives; a group that was emptied and expired on the brokers starts again from generation
// 1, and its first claims are then above the stored tokens by one only.
func TokenFloor(generation int32) int64 {
	if generation <= 0 {
		return 0
	}
	return int64(generation) << 32
}

// Reclaim claims pos's partition again for its owner after the database lost the owner's claim:
// Advance or a position check found a stored token below pos.Token, or no row (ErrMoved). The new
// token is above pos.Token and at least floor (TokenFloor of the owner's current generation): never
// the stored token, which may be a previous owner's, nor any token handed out before the owner's
// own claim. It returns the stored position with the new token, or ErrFenced, leaving the row
// alone, if the stored token is above pos.Token: another owner claimed the partition since.
func (s *Store) Reclaim(ctx context.Context, q Querier, owner string, pos Position, floor int64) (Position, error) {
	token := max(floor, pos.Token+1)
	got, err := scanClaim(q.QueryRow(ctx, s.reclaimSQL, s.group, pos.Topic, pos.Partition, owner, token, pos.Token))
	if errors.Is(err, pgx.ErrNoRows) {
		return pos, fmt.Errorf("claim %s again: token %d, another owner claimed it since: %w", pos.TP(), pos.Token, ErrFenced)
	}
	if err != nil {
		return pos, fmt.Errorf("claim %s again: %w", pos.TP(), err)
	}
	return got, nil
}

// Holder is a transaction of a previous owner that EndStaleHolders ended.
type Holder struct {
	PID       int32 // its Postgres backend
	Partition Partition
	Ended     bool // pg_terminate_backend succeeded
}

// EndStaleHolders ends the transactions that hold parts' rows locked and wait for their client
// (idle in transaction): those of a previous owner that froze or lost its network in the middle
// of a batch. A claim waits for them otherwise, until Postgres's idle_in_transaction timeout
// ends them. Ending one rolls its batch back; the claim then fences its owner, whose work the new
// owner redoes, exactly as if the timeout had ended it. Postgres lets a role end the backends of
// the same role (or a member of pg_signal_backend).
func (s *Store) EndStaleHolders(ctx context.Context, q Querier, parts []Partition) ([]Holder, error) {
	topics := make([]string, len(parts))
	nums := make([]int32, len(parts))
	for i, p := range parts {
		topics[i], nums[i] = p.Topic, p.Partition
	}
	rows, err := q.Query(ctx, s.staleSQL, s.group, topics, nums)
	if err != nil {
		return nil, fmt.Errorf("end stale transactions holding %d partitions: %w", len(parts), err)
	}
	var out []Holder
	var h Holder
	if _, err := pgx.ForEachRow(rows, []any{&h.PID, &h.Partition.Topic, &h.Partition.Partition, &h.Ended}, func() error {
		out = append(out, h)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("end stale transactions holding %d partitions: %w", len(parts), err)
	}
	return out, nil
}

// SetStart stores the positions of partitions that have none yet: where their first owner
// resolved to start (see the package doc), as their next offset and their start. Each position in starts must carry the token of its
// claim; a partition claimed by another owner since, or given a position meanwhile, is left
// alone. It returns starts with Known and StartKnown set for the positions it stored.
func (s *Store) SetStart(ctx context.Context, q Querier, starts []Position) ([]Position, error) {
	if len(starts) == 0 {
		return nil, nil
	}
	topics := make([]string, len(starts))
	nums := make([]int32, len(starts))
	tokens := make([]int64, len(starts))
	nexts := make([]int64, len(starts))
	for i, p := range starts {
		topics[i], nums[i], tokens[i], nexts[i] = p.Topic, p.Partition, p.Token, p.Next
	}
	rows, err := q.Query(ctx, s.startSQL, s.group, topics, nums, tokens, nexts)
	if err != nil {
		return nil, fmt.Errorf("store start positions of %d partitions: %w", len(starts), err)
	}
	stored := map[Partition]bool{}
	var tp Partition
	if _, err := pgx.ForEachRow(rows, []any{&tp.Topic, &tp.Partition}, func() error {
		stored[tp] = true
		return nil
	}); err != nil {
		return nil, fmt.Errorf("store start positions of %d partitions: %w", len(starts), err)
	}
	out := make([]Position, len(starts))
	for i, p := range starts {
		if stored[p.TP()] {
			p.Known, p.Start, p.StartKnown = true, p.Next, true
		}
		out[i] = p
	}
	return out, nil
}

// QueueAdvance queues the fenced offset update from pos to next on b. The caller checks the
// result with CheckAdvance. It is meant to be the first statement of the batch transaction, so the
// row lock is taken before any handler work (see the package doc).
func (s *Store) QueueAdvance(b *pgx.Batch, pos Position, next int64) *pgx.QueuedQuery {
	var expected *int64
	if pos.Known {
		expected = &pos.Next
	}
	return b.Queue(s.advanceSQL, s.group, pos.Topic, pos.Partition, pos.Token, next, expected, pos.KeysEpoch, pos.source())
}

// QueuePauseCheck queues, right after QueueAdvance on b, the read of pos's pauses that
// CheckPaused takes. It is a statement of its own, with a snapshot taken once the advance holds
// the row: a pause that committed while the advance waited for the row (the pause's transaction
// locks its partitions' rows before it commits, see the package doc) is seen here, where the
// advance's own check, whose snapshot is older, misses it.
func (s *Store) QueuePauseCheck(b *pgx.Batch, pos Position, paused *bool) {
	b.Queue(s.pausedSQL, s.group, pos.source(), pos.Partition).QueryRow(func(row pgx.Row) error {
		return row.Scan(paused)
	})
}

// CheckPaused returns ErrPaused if paused, the result of QueuePauseCheck: the transaction must
// roll back, applying nothing of the paused partition.
func (s *Store) CheckPaused(pos Position, paused bool) error {
	if paused {
		return fmt.Errorf("advance %s (source %s): paused while the advance waited for the row: %w", pos.TP(), pos.source(), ErrPaused)
	}
	return nil
}

// Advance runs the fenced offset update from pos to next in tx and checks it, with the pause
// check of QueuePauseCheck.
func (s *Store) Advance(ctx context.Context, tx pgx.Tx, pos Position, next int64) error {
	var expected *int64
	if pos.Known {
		expected = &pos.Next
	}
	tag, err := tx.Exec(ctx, s.advanceSQL, s.group, pos.Topic, pos.Partition, pos.Token, next, expected, pos.KeysEpoch, pos.source())
	if err != nil {
		return fmt.Errorf("advance %s to %d: %w", pos.TP(), next, err)
	}
	if err := s.CheckAdvance(ctx, tx, pos, next, tag.RowsAffected()); err != nil {
		return err
	}
	paused, err := s.Paused(ctx, tx, pos.source(), pos.Partition)
	if err != nil {
		return err
	}
	return s.CheckPaused(pos, paused)
}

// CheckAdvance interprets the row count of an Advance. One row: nil. Zero rows: it reads the row
// in tx and returns ErrFenced (another token), ErrAlreadyAdvanced (same token, offset already at
// next), ErrPaused (same token and offset, and a pause of the partition's source), ErrKeysChanged
// (same token and offset, another keys_epoch) or an error describing the unexpected offset.
func (s *Store) CheckAdvance(ctx context.Context, tx pgx.Tx, pos Position, next int64, rowsAffected int64) error {
	if rowsAffected == 1 {
		return nil
	}
	var token, epoch, change int64
	var stored, start *int64
	err := tx.QueryRow(ctx, s.readSQL, s.group, pos.Topic, pos.Partition).Scan(&token, &stored, &epoch, &start, &change)
	atOwners := err == nil && token == pos.Token && (stored == nil) == !pos.Known && (stored == nil || *stored == pos.Next)
	if atOwners {
		var paused bool
		if err := tx.QueryRow(ctx, s.pausedSQL, s.group, pos.source(), pos.Partition).Scan(&paused); err != nil {
			return fmt.Errorf("advance %s: read pauses: %w", pos.TP(), err)
		}
		if paused {
			return fmt.Errorf("advance %s (source %s): %w", pos.TP(), pos.source(), ErrPaused)
		}
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("advance %s: the offsets row is missing (the database lost it, or it was deleted): %w", pos.TP(), ErrMoved)
	case err != nil:
		return fmt.Errorf("advance %s: read offsets row: %w", pos.TP(), err)
	case token > pos.Token:
		return fmt.Errorf("advance %s: token %d, now %d: %w", pos.TP(), pos.Token, token, ErrFenced)
	case token < pos.Token:
		// Claims only raise the token: the database lost this owner's claim.
		return fmt.Errorf("advance %s: token %d, stored %d (the database lost this owner's claim): %w", pos.TP(), pos.Token, token, ErrMoved)
	case stored != nil && *stored == next:
		return ErrAlreadyAdvanced
	case epoch != pos.KeysEpoch && atOwners:
		return fmt.Errorf("advance %s: keys epoch %d, now %d: %w", pos.TP(), pos.KeysEpoch, epoch, ErrKeysChanged)
	default:
		// Same owner, another offset: the database lost this owner's last commits (a failover to
		// a standby that lacked them, a restore), or an operator moved the offset.
		if change > pos.PositionChange {
			return fmt.Errorf("advance %s: position %s, change %d: %w",
				pos.TP(), fmtOffset(stored), change, ErrPositionSet)
		}
		return fmt.Errorf("advance %s: stored offset is %s, this owner expected %s: %w",
			pos.TP(), fmtOffset(stored), fmtPos(pos), ErrMoved)
	}
}

// Stored is a partition's row as Stored reads it: its token, next offset (-1: none yet) and
// position_change (0: none).
type Stored struct {
	Token, Next, PositionChange int64
}

// Stored reads the token and next offset of parts, in one query; a partition without a row is
// not in the result.
func (s *Store) Stored(ctx context.Context, q Querier, parts []Partition) (map[Partition]Stored, error) {
	topics := make([]string, len(parts))
	nums := make([]int32, len(parts))
	for i, p := range parts {
		topics[i], nums[i] = p.Topic, p.Partition
	}
	rows, err := q.Query(ctx, s.storedSQL, s.group, topics, nums)
	if err != nil {
		return nil, fmt.Errorf("read stored positions: %w", err)
	}
	out := make(map[Partition]Stored, len(parts))
	var p Partition
	var st Stored
	_, err = pgx.ForEachRow(rows, []any{&p.Topic, &p.Partition, &st.Token, &st.Next, &st.PositionChange}, func() error {
		out[p] = st
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read stored positions: %w", err)
	}
	return out, nil
}

// Load returns the stored position of one partition, without claiming it (for tools and tests).
func (s *Store) Load(ctx context.Context, q Querier, p Partition) (Position, error) {
	pos := Position{Topic: p.Topic, Partition: p.Partition}
	var next, start *int64
	err := q.QueryRow(ctx, s.readSQL, s.group, p.Topic, p.Partition).Scan(&pos.Token, &next, &pos.KeysEpoch, &start, &pos.PositionChange)
	if errors.Is(err, pgx.ErrNoRows) {
		return pos, nil
	}
	if err != nil {
		return pos, fmt.Errorf("load %s: %w", p, err)
	}
	if next != nil {
		pos.Next, pos.Known = *next, true
	}
	if start != nil {
		pos.Start, pos.StartKnown = *start, true
	}
	return pos, nil
}

// Positions returns the stored next offsets of topics' partitions; partitions that never
// advanced are absent. Lag metrics compare them with the brokers' end offsets.
func (s *Store) Positions(ctx context.Context, q Querier, topics []string) (map[Partition]int64, error) {
	rows, err := q.Query(ctx, s.listSQL, s.group, topics)
	if err != nil {
		return nil, fmt.Errorf("read positions: %w", err)
	}
	out := map[Partition]int64{}
	var tp Partition
	var next int64
	_, err = pgx.ForEachRow(rows, []any{&tp.Topic, &tp.Partition, &next}, func() error {
		out[tp] = next
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read positions: %w", err)
	}
	return out, nil
}

// SortPartitions sorts ps by topic, then partition.
func SortPartitions(ps []Partition) {
	sort.Slice(ps, func(i, j int) bool {
		if ps[i].Topic != ps[j].Topic {
			return ps[i].Topic < ps[j].Topic
		}
		return ps[i].Partition < ps[j].Partition
	})
}

func fmtOffset(p *int64) string {
	if p == nil {
		return "unset"
	}
	return fmt.Sprint(*p)
}

func fmtPos(p Position) string {
	if !p.Known {
		return "unset"
	}
	return fmt.Sprint(p.Next)
}

// Pause is a row of the pauses table: the group takes nothing of Topic (a source topic) and
// Partition (-1: every partition of it) while it exists.
type Pause struct {
	Topic     string
	Partition int32
	At        time.Time
}

// Covers reports whether the pause holds back partition n of its topic.
func (z Pause) Covers(n int32) bool { return z.Partition == -1 || z.Partition == n }

// Control reads, in one query, what an owner must obey of the operators' hand: the stored rows of
// parts (as Stored) and every pause of the group.
func (s *Store) Control(ctx context.Context, q Querier, parts []Partition) (map[Partition]Stored, []Pause, error) {
	topics := make([]string, len(parts))
	nums := make([]int32, len(parts))
	for i, p := range parts {
		topics[i], nums[i] = p.Topic, p.Partition
	}
	rows, err := q.Query(ctx, s.controlSQL, s.group, topics, nums)
	if err != nil {
		return nil, nil, fmt.Errorf("read pauses and stored positions: %w", err)
	}
	stored := make(map[Partition]Stored, len(parts))
	var pauses []Pause
	var p Partition
	var st Stored
	var at *time.Time
	_, err = pgx.ForEachRow(rows, []any{&p.Topic, &p.Partition, &st.Token, &st.Next, &st.PositionChange, &at}, func() error {
		if at != nil {
			pauses = append(pauses, Pause{Topic: p.Topic, Partition: p.Partition, At: *at})
		} else {
			stored[p] = st
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("read pauses and stored positions: %w", err)
	}
	return stored, pauses, nil
}

// Paused reports whether a pause of the group covers partition n of source (a source topic), in
// q (a transaction: what it then applies of the partition is decided under the same check as an
// Advance's). For work that does not advance a position: the held records' transactions.
// PausedLocked is Paused for a transaction that applies n's records without advancing its
// position (the held-record applier): it first takes a KEY SHARE lock of the partition's row,
// which the pause's transaction must wait for (and which waits for a pause in flight), then reads
// the pauses with a snapshot taken after the lock. KEY SHARE does not conflict with an owner's
// advance.
func (s *Store) PausedLocked(ctx context.Context, tx pgx.Tx, source string, n int32) (bool, error) {
	if _, err := tx.Exec(ctx, s.keyShareSQL, s.group, source, n); err != nil {
		return false, fmt.Errorf("lock the position of %s[%d]: %w", source, n, err)
	}
	return s.Paused(ctx, tx, source, n)
}

func (s *Store) Paused(ctx context.Context, q Querier, source string, n int32) (bool, error) {
	var paused bool
	if err := q.QueryRow(ctx, s.pausedSQL, s.group, source, n).Scan(&paused); err != nil {
		return false, fmt.Errorf("read pauses of %s[%d]: %w", source, n, err)
	}
	return paused, nil
}
