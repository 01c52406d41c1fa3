package ops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/internal/safetext"
)

// Target is where SetPositions moves a position: exactly one of an offset, the first record at
// or after a time, the log's start or its end.
type Target struct {
	Offset *int64    `json:"offset,omitempty"`
	Time   time.Time `json:"time,omitzero"`
	Start  bool      `json:"start,omitempty"`
	End    bool      `json:"end,omitempty"`
}

func (t Target) check() error {
	n := 0
	for _, set := range []bool{t.Offset != nil, !t.Time.IsZero(), t.Start, t.End} {
		if set {
			n++
		}
	}
	if n != 1 {
		return usage("say exactly one target: an offset (--offset), a time (--time), the start (--start) or the end (--end)")
	}
	if t.Offset != nil && *t.Offset < 0 {
		return usage("offset %d: an offset is not negative", *t.Offset)
	}
	return nil
}

// PositionPlan is what SetPositions is asked: a source topic's partition (or all of them,
// AllPartitions) and where to.
type PositionPlan struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	Target    Target `json:"target"`
}

// PositionMove is one partition's position change, as planned (dry run) or made.
type PositionMove struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	// From is the stored position (offsets.next_offset): nil if the partition has none (it
	// starts from Kafka's committed offset or KAFKA_START_OFFSET). When executed, it is the
	// position at the moment of the change, which may differ from the dry run's.
	From *int64 `json:"from_offset"`
	To   int64  `json:"to_offset"`
	// Start and End are the partition's log bounds, read from Kafka.
	Start int64 `json:"log_start_offset"`
	End   int64 `json:"log_end_offset"`
	// Reapplied counts the records a rewind applies again ([To, From)); Skipped those a forward
	// move skips ([From, To)), never to be applied. Both count offsets: a compacted topic or
	// transaction markers make the records fewer.
	Reapplied int64 `json:"reapplied"`
	Skipped   int64 `json:"skipped"`
	// KeyCheck says which of the re-applied records an idempotency key would skip anyway, or
	// why that was not checked; KeySkipped counts them, when checked.
	KeyCheck   string `json:"idempotency_key_check"`
	KeySkipped *int64 `json:"idempotency_key_skips,omitempty"`
	// Paused is the pause that holds the partition (its own, or its topic's), if any: without
	// one, its owner goes on from the new position at once.
	Paused   *Pause `json:"paused,omitempty"`
	Executed bool   `json:"executed"`
	// Change is the position_changes row's id, when executed.
	Change int64 `json:"position_change,omitempty"`
}

// keyCheckNotDone is what a rewind's KeyCheck says when it is not checked (Ops has no
// IdempotencyKeys, or the move is executed).
const keyCheckNotDone = "not checked: records of the range that carry an idempotency key still in the key ring will be skipped as duplicates, not applied again"

// SetPositions moves the group's position in a source topic's partition, or in each of its
// partitions, to plan's target, while the group runs. Without execute it changes nothing and says,
// per partition, where it is, where it would go, and how many records that applies again or
// skips. With execute (a reason required) each partition changes in a transaction of its own:
// its offsets row locked (inserted if none), the change recorded in position_changes (trace
// tells of it), the position and offsets.position_change set (the owner restarts from it), and
// an audit row. Refused, as bad usage: while the upgrade window is open, a topic not a source
// of the group, a partition Kafka does not have, an offset past the log's end or before its
// start.
func (o *Ops) SetPositions(ctx context.Context, kc *kgo.Client, plan PositionPlan, execute bool, a Actor) ([]PositionMove, error) {
	if kc == nil {
		return nil, usage("setting a position needs Kafka (KAFKA_BROKERS): the log's bounds are read from it")
	}
	if err := plan.Target.check(); err != nil {
		return nil, err
	}
	if err := o.checkTarget(ctx, kc, plan.Topic, plan.Partition); err != nil {
		return nil, err
	}
	if execute {
		if err := a.check(); err != nil {
			return nil, err
		}
	}
	bounds, err := partitionBounds(ctx, kc, plan.Topic)
	if err != nil {
		return nil, err
	}
	var parts []int32
	for p := range bounds {
		if plan.Partition == AllPartitions || p == plan.Partition {
			parts = append(parts, p)
		}
	}
	slices.Sort(parts)
	var at map[int32]int64
	if !plan.Target.Time.IsZero() {
		if at, err = afterTime(ctx, kc, plan.Topic, plan.Target.Time); err != nil {
			return nil, err
		}
	}
	moves := make([]PositionMove, 0, len(parts))
	for _, p := range parts {
		b := bounds[p]
		m := PositionMove{Topic: plan.Topic, Partition: p, Start: b.start, End: b.end}
		switch t := plan.Target; {
		case t.Offset != nil:
			if *t.Offset > b.end {
				return nil, usage("offset %d is past the end of %s/%d (%d)", *t.Offset, plan.Topic, p, b.end)
			}
			if *t.Offset < b.start {
				return nil, usage("offset %d is before the start of %s/%d (%d): those records were deleted", *t.Offset, plan.Topic, p, b.start)
			}
			m.To = *t.Offset
		case t.Start:
			m.To = b.start
		case t.End:
			m.To = b.end
		default:
			to, ok := at[p]
			if !ok || to < 0 || to > b.end {
				to = b.end // no record at or after the time
			}
			m.To = max(to, b.start)
		}
		moves = append(moves, m)
	}
	stored, err := o.Positions(ctx)
	if err != nil {
		return nil, err
	}
	pauses, err := o.Pauses(ctx)
	if err != nil {
		return nil, err
	}
	for i := range moves {
		m := &moves[i]
		for _, s := range stored {
			if s.Topic == m.Topic && s.Partition == m.Partition {
				m.From = s.Next
			}
		}
		m.count()
		for _, p := range pauses {
			if p.Topic == m.Topic && (p.Partition == AllPartitions || p.Partition == m.Partition) {
				m.Paused = &p
				break
			}
		}
	}
	if !execute {
		budget := keyBudget{records: KeyCheckRecords, bytes: KeyCheckBytes} // for the whole dry run
		for i := range moves {
			o.checkKeys(ctx, kc, &moves[i], &budget)
		}
		return moves, nil
	}
	for i := range moves {
		if err := o.setPosition(ctx, &moves[i], a); err != nil {
			return moves, fmt.Errorf("set the position of %s/%d: %w", moves[i].Topic, moves[i].Partition, err)
		}
	}
	return moves, nil
}

// count fills in what the move applies again or skips, from From.
func (m *PositionMove) count() {
	m.Reapplied, m.Skipped, m.KeyCheck = 0, 0, ""
	if m.From == nil {
		return
	}
	switch from := *m.From; {
	case m.To < from:
		m.Reapplied = from - m.To
		m.KeyCheck = keyCheckNotDone
	case m.To > from:
		m.Skipped = m.To - from
	}
}

// setPosition makes m in one transaction, From read (and the row locked) in it.
func (o *Ops) setPosition(ctx context.Context, m *PositionMove, a Actor) error {
	return pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		// The upgrade window is read again in the transaction: a release before started since
		// the check would not obey.
		if err := o.checkWindow(ctx); err != nil {
			return err
		}
		var from *int64
		err := tx.QueryRow(ctx, `SELECT next_offset FROM `+o.table("offsets")+`
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3 FOR UPDATE`, o.group, m.Topic, m.Partition).Scan(&from)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			// No row: a partition the group never claimed. Insert it, unowned, its first owner to
			// start at the new position (start_offset: where the first owner started it); a
			// concurrent first claim's insert waits for this one (the primary key) and finds it.
			if _, err := tx.Exec(ctx, `INSERT INTO `+o.table("offsets")+` (consumer_group, topic, partition, next_offset, owner, start_offset)
				VALUES ($1, $2, $3, NULL, '', $4)`, o.group, m.Topic, m.Partition, m.To); err != nil {
				return err
			}
		case err != nil:
			return err
		}
		m.From = from
		m.count()
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO `+o.table("position_changes")+` (consumer_group, topic, partition, from_offset, to_offset, actor, reason)
			VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id`, o.group, m.Topic, m.Partition, from, m.To, a.Name, a.Reason).Scan(&id); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE `+o.table("offsets")+` SET next_offset = $4, position_change = $5, updated_at = now()
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3`, o.group, m.Topic, m.Partition, m.To, id); err != nil {
			return err
		}
		m.Executed, m.Change = true, id
		return o.audit(ctx, tx, a, "set_position", 0, map[string]any{"topic": m.Topic, "partition": m.Partition,
			"from_offset": from, "to_offset": m.To, "position_change": id, "reapplied": m.Reapplied, "skipped": m.Skipped})
	})
}

// afterTime returns, per partition of topic, the offset of its first record at or after t (the
// end offset if none).
func afterTime(ctx context.Context, kc *kgo.Client, topic string, t time.Time) (map[int32]int64, error) {
	l, err := kadm.NewClient(kc).ListOffsetsAfterMilli(ctx, t.UnixMilli(), topic)
	if err == nil {
		err = l.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("read %s's offsets at %s from Kafka: %w", topic, t.Format(time.RFC3339), err)
	}
	out := map[int32]int64{}
	l.Each(func(o kadm.ListedOffset) { out[o.Partition] = o.Offset })
	return out, nil
}

// IdempotencyKeys is how SetPositions' dry run finds which records of a rewind an idempotency key
// would skip: the schema's key ring, and each source topic's key function.
type IdempotencyKeys struct {
	Ring *keyring.Ring
	// Of returns topic's idempotency key function, nil if the topic has none known here.
	Of func(topic string) func(*kgo.Record) ([]byte, error)
}

// WithIdempotencyKeys returns the operations of o's group whose dry runs of a rewind read the
// records of the range (at most KeyCheckRecords a partition) and look their keys up in the ring.
func (o *Ops) WithIdempotencyKeys(k IdempotencyKeys) *Ops {
	c := *o
	c.keys = &k
	return &c
}

// Bounds of what a rewind's dry run reads to check idempotency keys, over all its partitions: a
// dry run of a topic of a hundred partitions reads no more than one of a single partition.
const (
	KeyCheckRecords = 10_000
	KeyCheckBytes   = 32 << 20 // of record values
)

// keyBudget is what a dry run may still read to check idempotency keys.
type keyBudget struct{ records, bytes int }

// checkKeys fills in m.KeyCheck and m.KeySkipped for a rewind: which of the records it applies
// again would be skipped as duplicates, their idempotency key still in the ring.
func (o *Ops) checkKeys(ctx context.Context, kc *kgo.Client, m *PositionMove, budget *keyBudget) {
	if m.From == nil || m.To >= *m.From {
		return
	}
	m.KeyCheck = keyCheckNotDone
	if o.keys == nil || o.keys.Ring == nil || o.keys.Of == nil {
		return
	}
	keyOf := o.keys.Of(m.Topic)
	if keyOf == nil {
		m.KeyCheck = "not checked: no idempotency key function of the topic is known here (TOPIC_<topic>_IDEMPOTENCY_KEY, or its handler's, with HANDLER set): " +
			"if it has one, records of the range whose key is still in the key ring will be skipped as duplicates"
		return
	}
	if m.Reapplied > int64(budget.records) || budget.bytes <= 0 {
		m.KeyCheck = fmt.Sprintf("not checked: %d records, more than the %d a dry run still reads (%d in all, over its partitions); those whose idempotency key is still in the key ring will be skipped as duplicates",
			m.Reapplied, budget.records, KeyCheckRecords)
		return
	}
	var hashes [][32]byte
	read, unkeyed := 0, 0
	notes := scanRanges(ctx, kc, m.Topic, map[int32][2]int64{m.Partition: {m.To, *m.From}}, budget.bytes, func(r *kgo.Record) {
		read++
		budget.bytes -= len(r.Value)
		k, err := keyOf(r)
		if err != nil || k == nil {
			unkeyed++
			return
		}
		hashes = append(hashes, keyring.Hash(o.group, m.Topic, k))
	})
	budget.records -= read
	if len(notes) > 0 {
		m.KeyCheck = "not checked: " + strings.Join(notes, "; ")
		return
	}
	found, err := o.keys.Ring.Lookup(ctx, o.pool, hashes)
	if err != nil {
		m.KeyCheck = "not checked: " + safetext.Text(err.Error(), 300)
		return
	}
	n := int64(0)
	for _, h := range hashes {
		if found[keyring.Short(h)] {
			n++
		}
	}
	m.KeySkipped = &n
	m.KeyCheck = fmt.Sprintf("%d of the %d records read would be skipped as duplicates, not applied again: their idempotency key is still in the key ring", n, read)
	if unkeyed > 0 {
		m.KeyCheck += fmt.Sprintf(" (%d have no key: applied again, or dead-lettered if the key is required)", unkeyed)
	}
}
