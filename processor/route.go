package processor

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// failure is why a record failed for good within its delivery.
type failure struct {
	cause error
	class ErrorClass
	tries int // handler invocations during the delivery
}

// retryAlone retries, alone and with backoff, a record whose handler just failed with cause, for
// Config.LocalAttempts tries in all, as long as the error is retryable. attempt runs one more
// try and returns nil (it took effect), a *sink.HandlerError (the handler failed again) or
// another error (stopped, fenced, ...). If a try ends other than by the handler failing,
// retryAlone reports settled with that try's error; otherwise it returns how the record failed,
// for it to move on. While the circuit breaker is open, a record that used its local tries is
// held here, and retried when the breaker closes or lets it through as a probe; fresh says the
// record is on its first delivery, whose failure counts for the breaker.
func (p *Processor) retryAlone(ctx context.Context, stopping <-chan struct{}, prog *progress, topic string, fresh bool, cause error, attempt func() error) (f failure, settled bool, err error) {
	counted, probing := false, false
	for tries := 1; ; tries++ {
		_, cause = failedRecord(cause, 1)
		class := p.classify(topic, cause)
		if class == ClassInfrastructure {
			// inPlace retries those in place: one here means two classifications of the same
			// failure disagreed (a bug). Never dead-letter it for a dependency's fault.
			p.log.Error("a record's failure is classified infrastructure outside a retry in place (a bug); it is treated as retryable", "err", cause)
			p.metrics.internalErrors.Inc()
			class = ClassRetryable
		}
		p.metrics.failures.WithLabelValues(topic, class.String()).Inc()
		if probing {
			p.breaker.probed(class != ClassRetryable)
			probing = false
		}
		if class != ClassRetryable {
			return failure{cause: cause, class: class, tries: tries}, false, nil
		}
		if tries < p.policy(topic).localAttempts {
			if !backoff.Sleep(ctx, stopping, p.backoff.Delay(tries)) {
				return f, true, errStopped
			}
		} else {
			waitInPlace := p.breaker.state() != breakerClosed
			if fresh && !counted {
				counted = true
				waitInPlace = p.breaker.failed()
			}
			if !waitInPlace {
				return failure{cause: cause, class: class, tries: tries}, false, nil
			}
			if prog != nil {
				prog.waiting(stallBreaker, cause)
			}
			var ok bool
			if probing, ok = p.breaker.wait(ctx, stopping); !ok {
				return f, true, errStopped
			}
			if prog != nil {
				prog.waiting("", nil)
			}
		}
		err := attempt()
		var herr *sink.HandlerError
		if !errors.As(err, &herr) {
			if probing {
				if err == nil {
					p.breaker.probed(true)
				} else {
					p.breaker.done()
				}
			}
			return f, true, err
		}
		cause = herr.Err
	}
}

// move is a failed record's next step: the state change in Postgres and the record to publish.
type move struct {
	retrytopics.Move
	tier int // 0: dead letter
	msg  sink.Message
	span trace.SpanContext // of the delivery that failed; invalid if tracing is off
}

// plan decides where a record that failed as f says goes: the next retry tier if the error is
// retryable and tiers remain, the dead-letter topic otherwise. The next tier is the one after
// the tier the record came from (its Attempt too, except for a replayed dead letter, whose
// attempts count on from its earlier ones).
func (p *Processor) plan(rec *Record, source string, f failure) move {
	cause, class := f.cause, f.class
	pol := p.policy(source)
	now := p.now()
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
	if pol.idempotencyKey != nil {
		// A copy of it applied later must stay known for as long as it may be replayed.
		if k, err := p.idempotencyKey(pol.idempotencyKey, rec); err == nil && k != nil {
			h := p.keyHash(source, k)
			m.IdempotencyKeyHash = h[:]
		}
	}
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
	if class == ClassRetryable && rec.tier < len(pol.tiers) && !rec.foreign {
		m.tier = rec.tier + 1
		m.Tier = m.tier
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
	if rec.span.IsValid() {
		// The copy goes on from the delivery that failed (the relay's send span is its child),
		// in place of the context the record came with.
		// The dead_letters row keeps that context too: a replay goes on from it.
		m.span = rec.span
		sctx := trace.ContextWithSpanContext(context.Background(), rec.span)
		m.msg.Headers = p.tracer.Inject(sctx, m.msg.Headers)
		m.Rec.Headers = p.tracer.Inject(sctx, m.Rec.Headers)
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
		p.heldApplier.notify() // the record's key may have become ready
	}
	log := p.log.With("topic", source, "partition", m.Partition, "offset", m.Offset, "key_hash", keyHash(m.Key),
		"attempt", m.Attempt, "tries", f.tries, "class", m.Class, "to", m.msg.Topic)
	if m.span.IsValid() {
		log = log.With(traceAttrs(m.span)...)
	}
	if m.tier > 0 {
		p.metrics.routed.WithLabelValues(source, tierLabel(m.tier)).Inc()
		log.Info("record sent to a retry tier", "due_at", m.DueAt, "err", f.cause)
		return
	}
	p.metrics.deadLettered.WithLabelValues(source, m.Class).Inc()
	if m.DeadLetter != 0 {
		p.metrics.replayed.WithLabelValues(source, "dead_lettered").Inc()
	}
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
		if w.tier == 0 {
			// Observed with the position's advance past it, as every record the worker passes.
			ctx, ls := withLineages(ctx)
			if err := w.p.observeStreams(ctx, tx, w.source, []*Record{rec}); err != nil {
				return own(err)
			}
			if err := ls.flush(ctx, w.p, tx); err != nil {
				return own(fmt.Errorf("streams: %w", err))
			}
		}
		return w.p.write(ctx, tx, m)
	}, false)
	if errors.Is(err, offsets.ErrKeysChanged) {
		// A replay held a key of the partition meanwhile, perhaps this record's: it may now
		// have to wait behind it rather than move on. Nothing was applied; decide again.
		if _, held := w.held[string(rec.Key)]; held && rec.ordered {
			err := w.handleAll([]*Record{rec}) // held behind its key, most likely
			var herr *sink.HandlerError
			if !errors.As(err, &herr) {
				return err
			}
		}
		return w.route(rec, f)
	}
	if errors.Is(err, retrytopics.ErrStale) {
		// Only a duplicate copy of a retry record can get here; its state has moved on.
		w.log.Info("retry record moved on while it was being retried; skipping this copy", "offset", rec.consumed, "key_hash", keyHash(rec.Key), "origin", rec.origin(), "err", err)
		w.p.metrics.duplicates.WithLabelValues(w.source).Inc()
		for {
			if err := w.transact([]*Record{rec}, nil, nil, false); !errors.Is(err, offsets.ErrKeysChanged) {
				return err
			}
		}
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
