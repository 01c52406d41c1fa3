package processor

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// outcome counts what a batch transaction did with its records.
type outcome struct {
	applied    int // handled
	held       int // held behind their keys
	duplicates int // copies of retry records that had moved on
	// released are the keys of worker.held that this transaction found no longer held. They
	// leave worker.held only once it commits: a try that fails (retried in place) must check
	// them in Postgres again, since the release it saw may be gone (a failover to a standby that
	// lacked it: its next try runs on a database where the key is held).
	released []string
}

// applyRange applies recs, isolating the ones that fail: the whole range is tried in one
// transaction; if the handler fails, the records before the failing one are applied in one
// transaction, the failing record alone is retried, sent to a retry tier or dead-lettered, and the
// rest is applied the same way. When a batch handler's error does not say which record failed,
// the range is split in halves until the failures are isolated. The fast path (no failure) is one
// transaction.
//
// It returns nil, errStopped or an error wrapping offsets.ErrFenced or offsets.ErrMoved.
func (w *worker) applyRange(recs []*Record) error {
	if len(recs) == 0 {
		return nil
	}
	err := w.handleAll(recs)
	var herr *sink.HandlerError
	if !errors.As(err, &herr) {
		return err
	}
	if k, cause := failedRecord(herr.Err, len(recs)); k >= 0 {
		if err := w.applyRange(recs[:k]); err != nil {
			return err
		}
		if err := w.applyFailed(recs[k], cause); err != nil {
			return err
		}
		return w.applyRange(recs[k+1:])
	}
	if len(recs) == 1 {
		return w.applyFailed(recs[0], herr.Err)
	}
	mid := len(recs) / 2
	if err := w.applyRange(recs[:mid]); err != nil {
		return err
	}
	return w.applyRange(recs[mid:])
}

// handleAll applies recs in one transaction: records that must wait behind their key are held,
// copies of retry records that have moved on are skipped, the handler runs over the rest.
//
// It returns nil, a *sink.HandlerError (the handler failed; its RecordError indexes recs),
// errStopped or an error wrapping offsets.ErrFenced or offsets.ErrMoved.
func (w *worker) handleAll(recs []*Record) error {
	for {
		err := w.handleOnce(recs)
		if !errors.Is(err, offsets.ErrKeysChanged) {
			return err
		}
		// A replay held a key: decide again which records wait behind their keys.
	}
}

func (w *worker) handleOnce(recs []*Record) error {
	var out outcome
	var live []*Record
	var span trace.Span
	err := w.transact(recs, nil, func(ctx context.Context, tx pgx.Tx) error {
		if w.p.tracer != nil {
			tracing.End(span, errRetried, "retried") // a try before this one, retried in place
			ctx, span = w.p.tracer.StartBatch(ctx, w.tp.Topic, w.tp.Partition, len(recs))
			w.txSpan = span.SpanContext()
		}
		out = outcome{}
		ctx, ls := withLineages(ctx)
		if w.tier == 0 {
			// Every numbered record the partition's worker passes is observed, whatever
			// becomes of it, with the position's advance (see streamdedupe.go).
			if err := w.p.observeStreams(ctx, tx, w.source, recs); err != nil {
				return own(err)
			}
		}
		var index []int
		var err error
		live, index, err = w.admit(ctx, tx, recs, &out)
		if err != nil {
			return own(err)
		}
		if len(live) > 0 {
			if err := w.p.handle(ctx, tx, w.source, live); err != nil {
				if k, cause := failedRecord(err, len(live)); k >= 0 && index != nil {
					return &RecordError{Index: index[k], Err: cause} // an index in recs
				}
				return err
			}
		}
		if err := w.settle(ctx, tx, live); err != nil {
			return own(err)
		}
		if err := ls.flush(ctx, w.p, tx); err != nil {
			return own(fmt.Errorf("streams: %w", err))
		}
		out.applied = len(live)
		return nil
	}, true)
	tracing.End(span, err, batchErrorType(err))
	w.txSpan = trace.SpanContext{}
	if err == nil {
		for _, k := range out.released {
			delete(w.held, k)
		}
		out.applied -= w.p.committed(w.source, live)
		w.applied.Add(float64(out.applied))
		w.p.countReplayed(w.source, live)
		w.p.breaker.succeeded(out.applied)
		if w.tier > 0 && out.applied > 0 {
			w.p.heldApplier.notify() // the records' keys may have become ready
		}
		if out.held > 0 {
			w.p.metrics.recordsHeld.WithLabelValues(w.source).Add(float64(out.held))
			w.p.heldSinceAnalyze.Add(int64(out.held))
			// A heldApplier may have skipped a ready key while this transaction held its lock.
			w.p.heldApplier.notify()
		}
		if out.duplicates > 0 {
			w.p.metrics.duplicates.WithLabelValues(w.source).Add(float64(out.duplicates))
		}
	}
	return err
}

// errRetried ends the span of a batch transaction tried again in place (Postgres failed).
var errRetried = errors.New("retried in place")

// batchErrorType names why a batch transaction did not commit, for its span.
func batchErrorType(err error) string {
	var herr *sink.HandlerError
	switch {
	case err == nil:
		return ""
	case errors.As(err, &herr):
		return "handler" // the records' own spans say which failed, and how
	case errors.Is(err, errStopped):
		return "stopped"
	case errors.Is(err, offsets.ErrFenced):
		return "fenced"
	case errors.Is(err, offsets.ErrMoved):
		return "moved"
	case errors.Is(err, offsets.ErrKeysChanged):
		return "keys_changed"
	}
	return "_OTHER"
}

// admit decides, inside the batch transaction, which of recs the handler applies now: on a
// source partition, records whose key is held are held behind it; in a retry tier, copies of
// records that have moved on are skipped. It returns the records to apply and their indexes in
// recs, or a nil index when it returns recs itself (the fast path: nothing held).
func (w *worker) admit(ctx context.Context, tx pgx.Tx, recs []*Record, out *outcome) (live []*Record, index []int, err error) {
	if w.tier > 0 {
		return w.admitRetries(ctx, tx, recs, out)
	}
	var keys [][]byte
	control := false
	for _, r := range recs {
		control = control || r.control
		if _, ok := w.held[string(r.Key)]; ok && r.ordered {
			keys = append(keys, r.Key)
		}
	}
	if len(keys) == 0 && !control {
		return recs, nil, nil
	}
	var held map[string]bool
	if len(keys) > 0 {
		if held, err = w.p.retry.LockHeldKeys(ctx, tx, w.tp.Topic, w.tp.Partition, keys); err != nil {
			return nil, nil, err
		}
	}
	var hold []retrytopics.Rec
	for i, r := range recs {
		if r.control {
			continue // a transaction marker: the offset moves past it, nothing to apply
		}
		if r.ordered && held[string(r.Key)] {
			hold = append(hold, r.rec())
			continue
		}
		if _, ok := w.held[string(r.Key)]; ok && r.ordered {
			// Not held any more: the key's last hold was settled since we saw it. It leaves
			// w.held when this transaction commits (see outcome.released).
			out.released = append(out.released, string(r.Key))
		}
		live = append(live, r)
		index = append(index, i)
	}
	if len(hold) > 0 {
		if err := w.p.retry.Hold(ctx, tx, hold); err != nil {
			return nil, nil, err
		}
		out.held = len(hold)
	}
	return live, index, nil
}

// settle records, in the batch transaction, that live records were applied.
func (w *worker) settle(ctx context.Context, tx pgx.Tx, live []*Record) error {
	var recs []retrytopics.Rec
	var held []bool
	for _, r := range live {
		if r.stage == retrytopics.FromTier {
			rec := r.rec()
			rec.Duplicate = r.duplicate != nil
			recs = append(recs, rec)
			held = append(held, r.ordered)
		}
	}
	return w.p.retry.Applied(ctx, tx, recs, held)
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
			r.firstFailed, r.deadLetter = st.FirstFailedAt, st.DeadLetter
		}
		live = append(live, r)
		index = append(index, i)
	}
	return live, index, nil
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
	rec.tier = w.tier
	rec.stage = retrytopics.FromTier // its first failure time is read with its retry state
}

// applyFailed handles a record whose handler just failed with cause: it is retried alone (see
// retryAlone), then sent to the next retry tier or dead-lettered.
func (w *worker) applyFailed(rec *Record, cause error) error {
	f, settled, err := w.p.retryAlone(w.ctx, w.stopping, &w.prog, w.source, w.tier == 0, cause, func() error {
		return w.handleAll([]*Record{rec})
	})
	if settled {
		return err // applied (or held, or skipped as a duplicate), stopped or fenced
	}
	return w.route(rec, f)
}
