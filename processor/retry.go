package processor

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// tierRef says which source topic a retry-tier topic belongs to, and which tier it is.
type tierRef struct {
	source string
	n      int
}

// fromTier turns a record consumed from a retry tier back into its source record, as its
// kafkapg- headers describe it. A record whose headers are missing or garbled (not published by
// kafkapg) is handled as a fresh record of its own, with a warning; having no origin to go back
// to, it is dead-lettered if it fails rather than sent round the tiers. A record whose headers
// name another consumer group or source topic belongs to them (tier topic names can collide:
// source "a" in group "b.c" and source "a.b" in group "c" share a.b.c.retry.1): it is skipped.
func (w *worker) fromTier(rec *Record) {
	f, err := retrytopics.ParseFailure(rec.Headers)
	if err != nil {
		w.log.Warn("record in a retry tier has missing or garbled kafkapg headers; handling it as a fresh record (attempt 1, no key order, dead-lettered if it fails)",
			"offset", rec.consumed, "key_hash", keyHash(rec.Key), "err", err)
		rec.ordered, rec.foreign = false, true
		return
	}
	if f.Group != w.p.cfg.Group || f.Topic != w.source {
		w.log.Debug("skipping a retry record of another group or source topic (their tier topic's name is the same as ours)",
			"offset", rec.consumed, "its_group", f.Group, "its_topic", f.Topic)
		rec.stage = retrytopics.FromTier
		rec.notOurs = true
		return
	}
	rec.Topic, rec.Partition, rec.Offset, rec.Timestamp = f.Topic, f.Partition, f.Offset, f.Timestamp
	rec.Headers = retrytopics.StripHeaders(rec.Headers)
	rec.Attempt = f.Attempt + 1
	rec.stage = retrytopics.FromTier // its first failure time is read with its retry state
}

// duePrefix returns how many of recs, from the first, are due at now, and when the first one that
// is not is due.
func duePrefix(recs []*kgo.Record, now time.Time) (int, time.Time) {
	for i, r := range recs {
		if due := dueAt(r); due.After(now) {
			return i, due
		}
	}
	return len(recs), time.Time{}
}

// dueAt reads a retry record's due time; a record without a valid one is due at once.
func dueAt(r *kgo.Record) time.Time {
	for _, h := range r.Headers {
		if h.Key == retrytopics.HeaderDueAt {
			t, err := time.Parse(time.RFC3339Nano, string(h.Value))
			if err != nil {
				return time.Time{}
			}
			return t
		}
	}
	return time.Time{}
}

// admitRetries locks the retry state of the tier's records and keeps those whose state matches
// their delivery attempt; the others are copies of records that have moved on (published twice
// by the outbox relay) and are skipped.
func (w *worker) admitRetries(ctx context.Context, tx pgx.Tx, recs []*Record, out *outcome) (live []*Record, index []int, err error) {
	var origins []retrytopics.Origin
	for _, r := range recs {
		if r.stage == retrytopics.FromTier && !r.notOurs && !r.control {
			origins = append(origins, r.origin())
		}
	}
	var states map[retrytopics.Origin]retrytopics.RetryState
	if len(origins) > 0 {
		if states, err = w.p.retry.LockRetries(ctx, tx, origins); err != nil {
			return nil, nil, err
		}
	}
	taken := map[retrytopics.Origin]bool{}
	for i, r := range recs {
		if r.notOurs || r.control {
			continue
		}
		if r.stage == retrytopics.FromTier {
			st, ok := states[r.origin()]
			// A copy is applied only if the record's retry state is at the copy's attempt, and only
			// one copy per batch: the relay publishes at least once, so two copies of the same
			// attempt can arrive together (the state changes only when this transaction commits).
			if !ok || st.Attempt != r.Attempt || taken[r.origin()] {
				out.duplicates++
				w.log.Info("skipping a duplicate copy of a retry record", "offset", r.consumed, "key_hash", keyHash(r.Key), "origin", r.origin(), "attempt", r.Attempt,
					"state_attempt", st.Attempt, "in_retry_path", ok, "copy_in_this_batch", taken[r.origin()])
				continue
			}
			taken[r.origin()] = true
			r.firstFailed = st.FirstFailedAt
		}
		live = append(live, r)
		index = append(index, i)
	}
	return live, index, nil
}

// move is a failed record's next step: the state change in Postgres and the record to publish.
type move struct {
	retrytopics.Move
	tier int // 0: dead letter
	msg  sink.Message
}

// plan decides where a record that failed as f says goes: the next retry tier if the error is
// retryable and tiers remain, the dead-letter topic otherwise.
func (p *Processor) plan(rec *Record, source string, f failure) move {
	cause, class := f.cause, f.class
	pol := p.policy(source)
	now := time.Now()
	first := rec.firstFailed
	if first.IsZero() {
		first = now
	}
	m := move{Move: retrytopics.Move{
		Rec:           rec.rec(),
		Held:          rec.ordered,
		From:          rec.stage,
		Attempt:       rec.Attempt,
		Class:         class.String(),
		Message:       cause.Error(),
		FirstFailedAt: first,
		Block:         pol.onDeadLetter == OnDeadLetterBlock,
	}}
	hf := retrytopics.Failure{
		Topic:         rec.Topic,
		Partition:     rec.Partition,
		Offset:        rec.Offset,
		Timestamp:     rec.Timestamp,
		Group:         p.cfg.Group,
		Attempt:       rec.Attempt,
		Tries:         f.tries,
		Class:         class.String(),
		Message:       cause.Error(),
		FailedAt:      now,
		FirstFailedAt: first,
	}
	topic := retrytopics.DLQTopic(source, p.cfg.Group)
	if class == ClassRetryable && rec.Attempt <= len(pol.tiers) && !rec.foreign {
		m.tier = rec.Attempt
		m.DueAt = retrytopics.DueAt(now, pol.tiers[m.tier-1], rand.Float64())
		hf.DueAt = m.DueAt
		topic = retrytopics.TierTopic(source, p.cfg.Group, m.tier)
	}
	m.msg = sink.Message{
		Topic:     topic,
		Partition: rec.Partition,
		Key:       rec.Key,
		Value:     rec.Value,
		Headers:   retrytopics.Headers(rec.Headers, hf),
	}
	if errors.Is(cause, ErrRecordTooLarge) {
		// The DLQ topic may not take it either; the dead_letters row keeps the value.
		m.msg.Value = nil
		m.msg.Headers = append(m.msg.Headers, kgo.RecordHeader{Key: retrytopics.HeaderValueOmitted, Value: []byte(strconv.Itoa(len(rec.Value)))})
	}
	return m
}

// write stores the move's state change in tx.
func (p *Processor) write(ctx context.Context, tx pgx.Tx, m move) error {
	if m.tier > 0 {
		return p.retry.ToTier(ctx, tx, m.Move)
	}
	return p.retry.DeadLetter(ctx, tx, m.Move)
}

// moved counts and logs a committed move.
func (p *Processor) moved(m move, source string, f failure) {
	if m.From != retrytopics.FromSource {
		p.drainer.notify() // the record's key may have become ready
	}
	log := p.log.With("topic", source, "partition", m.Partition, "offset", m.Offset, "key_hash", keyHash(m.Key),
		"attempt", m.Attempt, "tries", f.tries, "class", m.Class, "to", m.msg.Topic)
	if m.tier > 0 {
		p.metrics.routed.WithLabelValues(source, tierLabel(m.tier)).Inc()
		log.Info("record sent to a retry tier", "due_at", m.DueAt, "err", f.cause)
		return
	}
	p.metrics.deadLettered.WithLabelValues(source, m.Class).Inc()
	if m.Held && m.Block {
		log.Warn("record dead-lettered; its key stays held until an operator releases it (OnDeadLetterBlock)", "err", f.cause)
		return
	}
	log.Warn("record dead-lettered", "err", f.cause)
}

// route moves a failed record off the partition: to the next retry tier or the dead-letter topic,
// in one transaction with the offset advance that skips it.
func (w *worker) route(rec *Record, f failure) error {
	m := w.p.plan(rec, w.source, f)
	err := w.transact([]*Record{rec}, []sink.Message{m.msg}, func(ctx context.Context, tx pgx.Tx) error {
		return w.p.write(ctx, tx, m)
	}, false)
	if errors.Is(err, retrytopics.ErrStale) {
		// Only a duplicate copy of a retry record can get here; its state has moved on.
		w.log.Info("retry record moved on while it was being retried; skipping this copy", "offset", rec.consumed, "key_hash", keyHash(rec.Key), "origin", rec.origin(), "err", err)
		w.p.metrics.duplicates.WithLabelValues(w.source).Inc()
		return w.transact([]*Record{rec}, nil, nil, false)
	}
	if err != nil {
		return err
	}
	w.p.moved(m, w.source, f)
	if w.tier == 0 && m.Held && (m.tier > 0 || m.Block) {
		w.held[string(rec.Key)] = struct{}{}
	}
	return nil
}
