package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/ops"
)

// -positions adds an operator's positions commands to the faults, run with the code the
// `positions` command and the console run (internal/ops), against stage 1's topic while the
// group runs and the other faults hit it. It needs a chain: stage 1 decides by idempotency key,
// so a rewind applies nothing twice, and the producer sends no copies then, so that each event
// has one offset.
//
//   - position-pause: a partition (one in four times the whole topic) paused for 1-3 s. Once
//     Pause returns (it waits for the batches in flight), nothing of it may change until the
//     resume: not its position nor its retry tiers', not one of its events applied (from the
//     partition, its tiers or its held records).
//   - position-rewind: a partition set back by 1-300 records: read again, skipped as duplicates
//     (or dead-lettered again), exactly once still.
//   - position-skip: a partition set forward by 1-30 records (at most to the log's end), half the
//     time paused first and resumed after, as the runbook does: never applied nor dead-lettered.
//
// Each run pauses, skips (paused first) and rewinds at least once, right after the measurements.
//
// skippedItems replays position_changes to tell, per partition, which records the group passed
// (from each change's to_offset to the next one's from_offset, and from the last on); the others
// were skipped, and the verification expects nothing of them. A record skipped and then passed by
// a later rewind is applied by it, after its account's later events: the order check leaves it
// out (ledger.VerifyOptions.Unordered).

// placement is where an item was produced.
type placement struct {
	partition int32
	offset    int64
}

// positionsRig is what the positions faults need: the ops code of stage 1's group and a Kafka
// client for the logs' bounds.
type positionsRig struct {
	ops *ops.Ops
	kc  *kgo.Client
}

var chaosActor = ops.Actor{Name: "chaos", Reason: "the chaos run's operator"}

func (s *suite) positionsFaults() []fault {
	return []fault{
		{"position-pause", 2, s.positionPause},
		{"position-rewind", 2, s.positionRewind},
		{"position-skip", 1, s.positionSkip},
		{"position-skip", 1, s.positionSkipPaused},
	}
}

func (s *suite) setupPositions() error {
	kc, err := kgo.NewClient(kgo.SeedBrokers(s.clientSeeds...))
	if err != nil {
		return err
	}
	s.positions = &positionsRig{ops: ops.New(s.pool, schema, s.group), kc: kc}
	return nil
}

// retryOp runs an ops command until it succeeds, for 30 s: the suite's own faults (a broker
// restart) can fail it.
func retryOp(ctx context.Context, op func() error) error {
	return localrun.WaitFor(ctx, 30*time.Second, op)
}

// partitionState is what must not change while partition p (or all, with ops.AllPartitions) is
// paused: the positions of stage 1's group in it and its retry tiers, and how many of ids (its
// events) are applied. The ids are the same for both reads: an event is placed when its produce
// is acknowledged, which can be after it was applied, so the events known at the second read may
// include some applied before the pause.
func (s *suite) partitionState(ctx context.Context, p int32, ids []string) (string, error) {
	var positions string
	var applied int
	err := s.pool.QueryRow(ctx, `SELECT coalesce((SELECT string_agg(topic || '/' || partition || '@' || coalesce(next_offset, -1), ' ' ORDER BY topic, partition)
			FROM offsets WHERE consumer_group = $1 AND ($2 < 0 OR partition = $2)), ''),
		(SELECT count(*) FROM ledger_entries WHERE event_id = ANY($3))`, s.group, p, ids).Scan(&positions, &applied)
	return fmt.Sprintf("%d applied; positions %s", applied, positions), err
}

// placedIn returns the ids of the events known to be in partition p (or all) so far.
func (s *suite) placedIn(p int32) []string {
	var ids []string
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, pl := range s.placed {
		if pl.offset >= 0 && (p == ops.AllPartitions || pl.partition == p) {
			ids = append(ids, s.eventIDs[i])
		}
	}
	return ids
}

func (s *suite) positionPause(ctx context.Context) error {
	p := int32(s.rng.IntN(s.cfg.partitions))
	if s.rng.IntN(4) == 0 {
		p = ops.AllPartitions
	}
	r := s.positions
	if err := retryOp(ctx, func() error {
		_, err := r.ops.Pause(ctx, r.kc, s.topic, p, true, chaosActor)
		return err
	}); err != nil {
		return fmt.Errorf("pause %s/%d: %w", s.topic, p, err)
	}
	ids := s.placedIn(p)
	before, err := s.partitionState(ctx, p, ids)
	if err != nil {
		return err
	}
	if err := sleep(ctx, time.Duration(1000+s.rng.IntN(2000))*time.Millisecond); err != nil {
		return err
	}
	after, err := s.partitionState(ctx, p, ids)
	if err != nil {
		return err
	}
	waiting, err := s.waiting(ctx, p)
	if err != nil {
		return err
	}
	if err := retryOp(ctx, func() error {
		_, err := r.ops.Resume(ctx, r.kc, s.topic, p, true, chaosActor)
		return err
	}); err != nil {
		return fmt.Errorf("resume %s/%d: %w", s.topic, p, err)
	}
	s.count(func(st *stats) {
		st.pauses++
		if waiting > 0 {
			st.pausesWaiting++
		}
		if after != before {
			st.violations = append(st.violations, fmt.Sprintf("pause %d of %s/%d (-1: all): it changed while paused: %s, then %s", st.pauses, s.topic, p, before, after))
		}
	})
	return nil
}

// waiting is how many records of stage 1's topic, in partition p (or all), are past the stored
// positions: what a pause holds back.
func (s *suite) waiting(ctx context.Context, p int32) (int64, error) {
	var ends kadm.ListedOffsets
	if err := retryOp(ctx, func() error {
		var err error
		ends, err = kadm.NewClient(s.positions.kc).ListEndOffsets(ctx, s.topic)
		if err == nil {
			err = ends.Error()
		}
		return err
	}); err != nil {
		return 0, err
	}
	var n int64
	for q := range int32(s.cfg.partitions) {
		if p != ops.AllPartitions && q != p {
			continue
		}
		next, _, err := s.storedNext(ctx, q)
		if err != nil {
			return 0, err
		}
		if o, ok := ends.Lookup(s.topic, q); ok {
			n += max(o.Offset-next, 0)
		}
	}
	return n, nil
}

// storedNext is partition p's stored position (false: none yet).
func (s *suite) storedNext(ctx context.Context, p int32) (int64, bool, error) {
	var next *int64
	err := s.pool.QueryRow(ctx, `SELECT next_offset FROM offsets WHERE consumer_group = $1 AND topic = $2 AND partition = $3`, s.group, s.topic, p).Scan(&next)
	if errors.Is(err, pgx.ErrNoRows) || err == nil && next == nil {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	return *next, true, nil
}

func (s *suite) positionRewind(ctx context.Context) error {
	p := int32(s.rng.IntN(s.cfg.partitions))
	next, ok, err := s.storedNext(ctx, p)
	if err != nil || !ok || next == 0 {
		return err
	}
	to := max(0, next-1-int64(s.rng.IntN(300)))
	return s.setPosition(ctx, p, to)
}

func (s *suite) positionSkip(ctx context.Context) error {
	return s.skip(ctx, int32(s.rng.IntN(s.cfg.partitions)))
}

// positionSkipPaused skips as the runbook does: the partition paused first (its records wait),
// then set forward, then resumed.
func (s *suite) positionSkipPaused(ctx context.Context) error {
	p := int32(s.rng.IntN(s.cfg.partitions))
	r := s.positions
	if err := retryOp(ctx, func() error {
		_, err := r.ops.Pause(ctx, r.kc, s.topic, p, true, chaosActor)
		return err
	}); err != nil {
		return fmt.Errorf("pause %s/%d: %w", s.topic, p, err)
	}
	if err := sleep(ctx, 1500*time.Millisecond); err != nil { // records arrive meanwhile
		return err
	}
	if err := s.skip(ctx, p); err != nil {
		return err
	}
	return retryOp(ctx, func() error {
		_, err := r.ops.Resume(ctx, r.kc, s.topic, p, true, chaosActor)
		return err
	})
}

// skip sets partition p forward by 1-30 records, at most to the log's end.
func (s *suite) skip(ctx context.Context, p int32) error {
	next, ok, err := s.storedNext(ctx, p)
	if err != nil || !ok {
		return err
	}
	var end int64
	if err := retryOp(ctx, func() error {
		ends, err := kadm.NewClient(s.positions.kc).ListEndOffsets(ctx, s.topic)
		if err == nil {
			err = ends.Error()
		}
		if err != nil {
			return err
		}
		o, _ := ends.Lookup(s.topic, p)
		end = o.Offset
		return nil
	}); err != nil {
		return err
	}
	to := min(next+1+int64(s.rng.IntN(30)), end)
	if to <= next {
		return nil // nothing to skip: the partition is at its end
	}
	return s.setPosition(ctx, p, to)
}

func (s *suite) setPosition(ctx context.Context, p int32, to int64) error {
	r := s.positions
	var moves []ops.PositionMove
	if err := retryOp(ctx, func() error {
		var err error
		moves, err = r.ops.SetPositions(ctx, r.kc, ops.PositionPlan{Topic: s.topic, Partition: p, Target: ops.Target{Offset: &to}}, true, chaosActor)
		return err
	}); err != nil {
		return fmt.Errorf("set the position of %s/%d to %d: %w", s.topic, p, to, err)
	}
	s.count(func(st *stats) {
		for _, m := range moves {
			if m.Reapplied > 0 {
				st.rewinds++
				st.rewound += m.Reapplied
			}
			if m.Skipped > 0 {
				st.skips++
				st.skippedOffsets += m.Skipped
			}
		}
	})
	return nil
}

// skippedItems returns items without those the group never passed (position_changes says so), and
// how many it left out; and the ids of those it passed only after a change had jumped past them
// (a skip, then a rewind back over the skipped records): the rewind applied them after their
// accounts' later events, which the group had gone on with, so they are out of order by the
// operator's doing.
func (s *suite) skippedItems(ctx context.Context, items []ledger.Item) (kept []ledger.Item, skipped int, late map[string]bool, err error) {
	rows, err := s.pool.Query(ctx, `SELECT partition, from_offset, to_offset FROM position_changes
		WHERE consumer_group = $1 AND topic = $2 ORDER BY id`, s.group, s.topic)
	if err != nil {
		return nil, 0, nil, fmt.Errorf("read position_changes: %w", err)
	}
	type change struct {
		Partition int32
		From      *int64
		To        int64
	}
	changes, err := pgx.CollectRows(rows, pgx.RowToStructByPos[change])
	if err != nil {
		return nil, 0, nil, fmt.Errorf("read position_changes: %w", err)
	}
	// history[p] is what the group did in partition p, in order: it passed the ranges [from, to)
	// (the last one open), and each change that moved forward jumped over [from, to).
	type step struct {
		from, to int64
		jump     bool
	}
	history := map[int32][]step{}
	at := map[int32]int64{} // where the group went on from after the last change (0: the start)
	for _, c := range changes {
		from := int64(0) // no position yet: the group had passed nothing
		if c.From != nil {
			from = *c.From
		}
		if from > at[c.Partition] {
			history[c.Partition] = append(history[c.Partition], step{from: at[c.Partition], to: from})
		}
		if c.To > from {
			history[c.Partition] = append(history[c.Partition], step{from: from, to: c.To, jump: true})
		}
		at[c.Partition] = c.To
	}
	for p, o := range at {
		history[p] = append(history[p], step{from: o, to: math.MaxInt64})
	}
	// passed says whether the group passed pl, and whether a change had jumped over it before.
	passed := func(pl placement) (was, after bool) {
		h, ok := history[pl.partition]
		if !ok {
			return true, false // no change in its partition
		}
		jumped := false
		for _, st := range h {
			if pl.offset < st.from || pl.offset >= st.to {
				continue
			}
			if st.jump {
				jumped = true
				continue
			}
			return true, jumped
		}
		return false, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	kept = make([]ledger.Item, 0, len(items))
	late = map[string]bool{}
	for i, it := range items {
		pl := s.placed[i]
		if pl.offset < 0 {
			return nil, 0, nil, fmt.Errorf("item %d (%s) has no offset: not produced?", i, it.Event.EventID)
		}
		was, after := passed(pl)
		if !was {
			continue
		}
		kept = append(kept, it)
		if after {
			late[it.Event.EventID] = true
		}
	}
	return kept, len(items) - len(kept), late, nil
}
