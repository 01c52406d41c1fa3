package processor

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// errStopped means the worker was asked to stop (revoke, shutdown) while the batch was not yet
// committed: what was not committed is left for the partition's next owner.
var errStopped = errors.New("worker stopped")

// worker applies the records of one partition, in offset order, one transaction per batch. The
// partition is either a source topic's or a retry tier's (see retry.go).
//
// Ownership: the poll loop calls push; everything else runs on the worker's own goroutine
// (run), except stop/abandon, called by the rebalance callbacks and shutdown. pos and held are
// touched only by run.
type worker struct {
	p        *Processor
	cl       *kgo.Client
	tp       offsets.Partition
	pos      offsets.Position
	log      *slog.Logger
	source   string             // the source topic: tp.Topic, or the topic whose retry tier tp is
	tier     int                // 0 for a source topic's partition, n for retry tier n
	applied  prometheus.Counter // kafkapg_records_applied_total of the source topic, looked up once
	consumed prometheus.Counter // kafkapg_records_consumed_total of the partition's topic, looked up once

	prog progress // whether it moves on (see checkStalls)

	// held is a superset of the partition's held keys (source partitions only): only this
	// partition's owner ever adds a key to held_keys, and it loads the set when it starts, so a
	// key not in it cannot be held and its records need no check in Postgres. A key leaves it
	// when its next record finds it released, and on every reload (every heldRefresh), so that
	// keys that never come back do not stay in it for ever.
	held       map[string]struct{}
	heldLoaded time.Time

	mu         sync.Mutex
	queue      []*kgo.Record
	queuedCost int64     // cost of the records in queue (see buffer)
	flightCost int64     // cost of the batch being applied
	firstAt    time.Time // when the oldest queued record arrived
	full       bool      // the queue holds the partition's share of the buffer budget
	waiting    bool      // the first queued record is not due yet (retry tiers)
	paused     bool      // fetching from the partition is paused (full or waiting)
	closed     bool      // no more records are accepted
	wake       chan struct{}

	stopping chan struct{} // closed by stop: finish the transaction in flight, start nothing new
	stopOnce sync.Once
	ctx      context.Context // the transactions' context; cancelled by abandon
	cancel   context.CancelFunc
	done     chan struct{}
}

func newWorker(p *Processor, cl *kgo.Client, pos offsets.Position) *worker {
	ctx, cancel := context.WithCancel(context.Background())
	w := &worker{
		p:        p,
		cl:       cl,
		tp:       pos.TP(),
		pos:      pos,
		log:      p.log.With("topic", pos.Topic, "partition", pos.Partition),
		source:   pos.Topic,
		wake:     make(chan struct{}, 1),
		stopping: make(chan struct{}),
		ctx:      ctx,
		cancel:   cancel,
		done:     make(chan struct{}),
	}
	if t, ok := p.tierOf[pos.Topic]; ok {
		w.source, w.tier = t.source, t.n
	}
	w.applied = p.metrics.applied.WithLabelValues(w.source)
	w.consumed = p.metrics.consumed.WithLabelValues(pos.Topic)
	return w
}

// push queues fetched records. It pauses fetching from the partition when its queue holds the
// partition's share of the buffer budget.
func (w *worker) push(fetched []*kgo.Record) {
	recs := detach(fetched)
	n := costOf(recs)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return
	}
	if len(w.queue) == 0 {
		w.firstAt = time.Now()
	}
	w.queue = append(w.queue, recs...)
	w.queuedCost += n
	w.p.buf.add(n)
	w.consumed.Add(float64(len(recs)))
	if !w.full && w.queuedCost >= w.p.partitionShare() {
		w.full = true
		w.syncPause()
	}
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// release says the batch take returned last is no longer in memory: it was applied, or left to the
// partition's next owner.
func (w *worker) release() {
	w.mu.Lock()
	n := w.flightCost
	w.flightCost = 0
	w.mu.Unlock()
	w.p.buf.release(n)
}

// syncPause pauses or resumes fetching from the partition to match full and waiting. w.mu is held.
func (w *worker) syncPause() {
	want := w.full || w.waiting
	if want == w.paused {
		return
	}
	w.paused = want
	if want {
		w.cl.PauseFetchPartitions(map[string][]int32{w.tp.Topic: {w.tp.Partition}})
	} else {
		w.cl.ResumeFetchPartitions(map[string][]int32{w.tp.Topic: {w.tp.Partition}})
	}
}

// take returns the next batch, waiting for records, for the batch to fill (BatchMaxWait) and, in
// a retry tier, for the first record to be due (fetching from the partition is paused meanwhile).
// It returns nil once the worker is stopping.
func (w *worker) take() []*kgo.Record {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		wait := time.Duration(-1)
		w.mu.Lock()
		if n := len(w.queue); n > 0 {
			limit := w.p.cfg.BatchMaxRecords
			ready, nextDue := min(n, limit), time.Time{}
			if w.tier > 0 {
				ready, nextDue = duePrefix(w.queue[:min(n, limit)], time.Now())
			}
			if w.waiting != (ready == 0) {
				w.waiting = ready == 0
				w.syncPause()
			}
			linger := w.p.cfg.BatchMaxWait - time.Since(w.firstAt)
			switch {
			case ready == 0:
				w.prog.idle() // nothing is due
				wait = max(time.Until(nextDue), time.Millisecond)
			case ready >= limit || ready < n || linger <= 0:
				batch := w.queue[:ready:ready]
				w.queue = w.queue[ready:]
				n := costOf(batch)
				w.queuedCost -= n
				w.flightCost = n
				if len(w.queue) > 0 {
					w.firstAt = time.Now()
				}
				// Fetch the next records while this batch is applied (the global budget still
				// counts the batch until release).
				if w.full && w.queuedCost <= w.p.partitionShare()/2 {
					w.full = false
					w.syncPause()
				}
				w.mu.Unlock()
				w.prog.working()
				return batch
			default:
				wait = linger
			}
		} else {
			w.prog.idle()
		}
		w.mu.Unlock()
		var timeout <-chan time.Time
		if wait >= 0 {
			if timer == nil {
				timer = time.NewTimer(wait)
			} else {
				timer.Reset(wait)
			}
			timeout = timer.C
		}
		select {
		case <-w.wake:
		case <-timeout:
		case <-w.stopping:
			return nil
		}
	}
}

// stop asks the worker to finish the transaction in flight and exit. Its queued records are
// dropped: the partition's next owner fetches them again.
func (w *worker) stop() {
	w.stopOnce.Do(func() {
		w.mu.Lock()
		w.closed = true
		w.queue = nil
		n := w.queuedCost
		w.queuedCost = 0
		w.mu.Unlock()
		w.p.buf.release(n)
		close(w.stopping)
	})
}

// abandon cancels the transaction in flight: it is rolled back.
func (w *worker) abandon() { w.cancel() }

func (w *worker) finished() <-chan struct{} { return w.done }

func (w *worker) describe() []any {
	return []any{"topic", w.tp.Topic, "partition", w.tp.Partition}
}

func (w *worker) run() {
	defer close(w.done)
	defer w.cancel()
	err := w.loadHeld()
	for err == nil {
		if len(w.held) > 0 && time.Since(w.heldLoaded) > heldRefresh {
			if err = w.loadHeld(); err != nil {
				break
			}
		}
		batch := w.take()
		if batch == nil {
			return
		}
		err = w.applyRange(w.records(batch))
		w.release()
	}
	switch {
	case errors.Is(err, errStopped):
	case errors.Is(err, offsets.ErrFenced):
		w.p.metrics.fenced.Inc()
		w.log.Warn("partition was claimed by another owner; this worker stops and applies nothing more", "err", err)
		w.stop()
		// Stop fetching a partition nobody here processes. The group rebalance that gave it
		// to the other owner will revoke it from us; the pause is cleared then.
		w.cl.PauseFetchPartitions(map[string][]int32{w.tp.Topic: {w.tp.Partition}})
	default:
		// applyRange returns only nil, errStopped or ErrFenced; anything else is a bug. Stop
		// the whole processor rather than leave the partition silently stuck: a restart
		// resumes from Postgres.
		w.stop()
		w.p.fail(fmt.Errorf("partition %s: %w", w.tp, err))
	}
}

// heldRefresh is how often a partition with held keys reloads them (see worker.held).
const heldRefresh = time.Minute

// loadHeld reads the partition's held keys (source partitions), retrying while Postgres fails.
// It runs on the worker's goroutine, between batches: every key the worker held is committed.
func (w *worker) loadHeld() error {
	if w.tier > 0 {
		return nil
	}
	return w.p.inPlace(w.ctx, w.stopping, w.log, "", &w.prog, func() error {
		keys, err := w.p.retry.HeldKeys(w.ctx, w.p.pool, w.tp.Topic, w.tp.Partition)
		if err != nil {
			return err
		}
		first := w.held == nil
		w.held = make(map[string]struct{}, len(keys))
		for _, k := range keys {
			w.held[string(k)] = struct{}{}
		}
		w.heldLoaded = time.Now()
		if first && len(keys) > 0 {
			w.log.Info("partition has held keys; their records keep waiting behind them", "held_keys", len(keys))
		}
		return nil
	})
}

// records converts a fetched batch, dropping records below the stored position (already
// applied).
func (w *worker) records(batch []*kgo.Record) []*Record {
	out := make([]*Record, 0, len(batch))
	slab := make([]Record, len(batch)) // one allocation for the batch's records
	for i, r := range batch {
		if w.pos.Known && r.Offset < w.pos.Next {
			continue
		}
		rec := &slab[i]
		if r.Attrs.IsControl() {
			// A Kafka transaction's commit or abort marker. Fetched (KeepControlRecords) so that
			// the stored position moves past it: otherwise a partition whose last write was a
			// transaction would show a lag of one for ever.
			*rec = Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, consumed: r.Offset,
				leaderEpoch: r.LeaderEpoch, control: true}
			out = append(out, rec)
			continue
		}
		*rec = Record{
			Topic:       r.Topic,
			Partition:   r.Partition,
			Offset:      r.Offset,
			Key:         r.Key,
			Value:       r.Value,
			Headers:     r.Headers,
			Timestamp:   r.Timestamp,
			Attempt:     1,
			consumed:    r.Offset,
			leaderEpoch: r.LeaderEpoch,
			stage:       retrytopics.FromSource,
			ordered:     r.Key != nil,
		}
		if w.tier > 0 {
			w.fromTier(rec)
		}
		out = append(out, rec)
	}
	return out
}

// outcome counts what a batch transaction did with its records.
type outcome struct {
	applied    int // handled
	parked     int // held behind their keys
	duplicates int // copies of retry records that had moved on
}

// applyRange applies recs, isolating the ones that fail: the whole range is tried in one
// transaction; if the handler fails, the records before the failing one are applied in one
// transaction, the failing record alone is retried, sent to a retry tier or dead-lettered, and the
// rest is applied the same way. When a batch handler's error does not say which record failed,
// the range is split in halves until the failures are isolated. The fast path (no failure) is one
// transaction.
//
// It returns nil, errStopped or an error wrapping offsets.ErrFenced.
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

// handleAll applies recs in one transaction: records that must wait behind their key are parked,
// copies of retry records that have moved on are skipped, the handler runs over the rest.
//
// It returns nil, a *sink.HandlerError (the handler failed; its RecordError indexes recs),
// errStopped or an error wrapping offsets.ErrFenced.
func (w *worker) handleAll(recs []*Record) error {
	var out outcome
	err := w.transact(recs, nil, func(ctx context.Context, tx pgx.Tx) error {
		out = outcome{}
		live, index, err := w.admit(ctx, tx, recs, &out)
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
		out.applied = len(live)
		return nil
	}, true)
	if err == nil {
		w.applied.Add(float64(out.applied))
		w.p.breaker.succeeded(out.applied)
		if w.tier > 0 && out.applied > 0 {
			w.p.drainer.notify() // the records' keys may have become ready
		}
		if out.parked > 0 {
			w.p.metrics.parked.WithLabelValues(w.source).Add(float64(out.parked))
			// A drainer may have skipped a ready key while this transaction held its lock.
			w.p.drainer.notify()
		}
		if out.duplicates > 0 {
			w.p.metrics.duplicates.WithLabelValues(w.source).Add(float64(out.duplicates))
		}
	}
	return err
}

// admit decides, inside the batch transaction, which of recs the handler applies now: on a
// source partition, records whose key is held are parked behind it; in a retry tier, copies of
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
	var park []retrytopics.Rec
	for i, r := range recs {
		if r.control {
			continue // a transaction marker: the offset moves past it, nothing to apply
		}
		if r.ordered && held[string(r.Key)] {
			park = append(park, r.rec())
			continue
		}
		if r.ordered {
			// Not held (any more): the key's last hold was settled since we saw it.
			delete(w.held, string(r.Key))
		}
		live = append(live, r)
		index = append(index, i)
	}
	if len(park) > 0 {
		if err := w.p.retry.Park(ctx, tx, park); err != nil {
			return nil, nil, err
		}
		out.parked = len(park)
	}
	return live, index, nil
}

// settle records, in the batch transaction, that live records were applied.
func (w *worker) settle(ctx context.Context, tx pgx.Tx, live []*Record) error {
	for _, r := range live {
		if r.stage == retrytopics.FromTier {
			if err := w.p.retry.Applied(ctx, tx, r.rec(), r.ordered); err != nil {
				return err
			}
		}
	}
	return nil
}

// applyFailed handles a record whose handler just failed with cause: it is retried alone (see
// retryAlone), then sent to the next retry tier or dead-lettered.
func (w *worker) applyFailed(rec *Record, cause error) error {
	f, settled, err := w.p.retryAlone(w.ctx, w.stopping, &w.prog, w.source, w.tier == 0, cause, func() error {
		return w.handleAll([]*Record{rec})
	})
	if settled {
		return err // applied (or parked, or skipped as a duplicate), stopped or fenced
	}
	return w.route(rec, f)
}

// failure is why a record failed for good within its delivery.
type failure struct {
	cause error
	class ErrorClass
	tries int // handler invocations during the delivery
}

// failedRecord returns the index of the record a handler error names (RecordFailed) among n
// records, and the record's own error; -1 and err if it names none.
//
// The record's error keeps what sink.Apply found about the whole transaction: that the handler's
// own context closed its connection (sink.ErrConnClosedByHandler wraps the batch's error, not the
// record's), so that the record is classified the same wherever it is.
func failedRecord(err error, n int) (int, error) {
	var rerr *RecordError
	if !errors.As(err, &rerr) || rerr.Index < 0 || rerr.Index >= n {
		return -1, err
	}
	cause := rerr.Err
	if cause == nil {
		cause = errNilRecordError
	}
	if errors.Is(err, sink.ErrConnClosedByHandler) && !errors.Is(cause, sink.ErrConnClosedByHandler) {
		cause = fmt.Errorf("%w: %w", sink.ErrConnClosedByHandler, cause)
	}
	return rerr.Index, cause
}

// errNilRecordError is the cause of a record a batch handler named with RecordFailed(i, nil).
var errNilRecordError = errors.New("the handler reported this record failed (RecordFailed) without an error")

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
			hold := p.breaker.state() != breakerClosed
			if fresh && !counted {
				counted = true
				hold = p.breaker.failed()
			}
			if !hold {
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

// transact commits recs (running apply, if not nil) and msgs in one transaction that advances the
// partition past recs. While the failure is the infrastructure's, it retries in place with
// backoff, keeping the partition's position, for as long as the worker runs. A failure of apply is
// the record's (returned, not retried) only if blame is set and it is not classified as
// infrastructure.
//
// It returns nil, a *sink.HandlerError, errStopped, or an error wrapping offsets.ErrFenced or
// retrytopics.ErrStale.
func (w *worker) transact(recs []*Record, msgs []sink.Message, apply func(context.Context, pgx.Tx) error, blame bool) error {
	last := recs[len(recs)-1]
	next := last.consumed + 1
	blamed := ""
	if blame {
		blamed = w.source
	}
	return w.p.inPlace(w.ctx, w.stopping, w.log.With("from_offset", recs[0].consumed), blamed, &w.prog, func() error {
		start := time.Now()
		err := w.p.sink.Apply(w.ctx, w.pos, next, apply, msgs)
		if errors.Is(err, offsets.ErrAlreadyAdvanced) {
			w.log.Info("an earlier commit whose outcome was unknown had succeeded", "next_offset", next)
			err = nil
		}
		if err != nil {
			return err
		}
		w.pos = w.pos.Advanced(next)
		w.prog.advanced()
		w.cl.MarkCommitOffsets(map[string]map[int32]kgo.EpochOffset{
			w.tp.Topic: {w.tp.Partition: {Epoch: last.leaderEpoch, Offset: next}},
		})
		w.p.metrics.txDuration.Observe(time.Since(start).Seconds())
		w.p.metrics.batchRecords.Observe(float64(len(recs)))
		return nil
	})
}

// inPlace runs tx until it succeeds, retrying in place with backoff while the failure is not the
// record's, until ctx is done or stopping is closed (then it returns errStopped). It returns at
// once an error wrapping offsets.ErrFenced or retrytopics.ErrStale, and, if blame names a source
// topic, a *sink.HandlerError that its handler's error is not classified as infrastructure: a
// failure of the record.
//
// What it retries is either the infrastructure's failure (Postgres down, or a dependency the
// handler reports with Infrastructure), which passes by waiting, or a failure of kafkapg's own
// statements that waiting will not fix (a bug, a table changed underneath): the latter is logged
// as an error and counted in kafkapg_internal_errors_total. prog, if not nil, is told which.
func (p *Processor) inPlace(ctx context.Context, stopping <-chan struct{}, log *slog.Logger, blame string, prog *progress, tx func() error) error {
	for failures := 0; ; {
		err := tx()
		if err == nil {
			if failures > 0 {
				log.Info("transactions succeed again; processing resumes", "after_failures", failures)
			}
			return nil
		}
		if ctx.Err() != nil {
			return errStopped
		}
		if errors.Is(err, offsets.ErrFenced) || errors.Is(err, retrytopics.ErrStale) {
			return err
		}
		var herr *sink.HandlerError
		var oerr *ownError
		if errors.As(err, &herr) && !errors.As(herr.Err, &oerr) && blame != "" && p.classify(blame, herr.Err) != ClassInfrastructure {
			return herr
		}
		failures++
		cause := stallInfrastructure
		if Classify(err) == ClassInfrastructure {
			p.metrics.infraRetries.Inc()
		} else {
			cause = stallError
			p.metrics.internalErrors.Inc()
		}
		if prog != nil {
			prog.waiting(cause, err)
		}
		d := p.backoff.Delay(failures)
		stallLog(log, cause, err, failures, d)
		if !backoff.Sleep(ctx, stopping, d) {
			return errStopped
		}
	}
}

// handle runs the handler over recs inside tx, recovering panics. A record larger than
// MaxRecordBytes fails, permanently, without reaching the handler. A handler that returns nil
// but left tx unusable (a statement of its failed, or its connection closed) fails: nothing of
// kafkapg's own may run in that transaction, and it could not commit.
func (p *Processor) handle(ctx context.Context, tx pgx.Tx, source string, recs []*Record) error {
	pol := p.policy(source)
	for i, r := range recs {
		if n := r.size(); n > pol.maxRecordBytes {
			return &RecordError{Index: i, Err: Permanent(fmt.Errorf("%w: key, value and headers are %d bytes, more than MaxRecordBytes (%d)",
				ErrRecordTooLarge, n, pol.maxRecordBytes))}
		}
	}
	start := time.Now()
	defer func() { p.metrics.handlerDuration.Observe(time.Since(start).Seconds()) }()
	if pol.batch != nil {
		return p.call(recs, func() error { return usable(tx, pol.batch.HandleBatch(ctx, tx, recs)) })
	}
	for i, r := range recs {
		if err := p.call(recs[i:i+1], func() error { return usable(tx, pol.handler.Handle(ctx, tx, r)) }); err != nil {
			return &RecordError{Index: i, Err: err}
		}
	}
	return nil
}

// usable returns err, the handler's return, or, if it is nil, why tx cannot go on: the handler's
// connection closed under it (sink.Apply then tells whether Postgres or the handler's own context
// closed it), or one of its statements failed and aborted the transaction.
func usable(tx pgx.Tx, err error) error {
	switch {
	case err != nil:
		return err
	case tx.Conn().IsClosed():
		return sink.ErrNilOnClosedConn
	case tx.Conn().PgConn().TxStatus() == 'E':
		return sink.ErrTxAborted
	}
	return nil
}

// call runs fn, the handler over recs, turning a panic into a *PanicError.
func (p *Processor) call(recs []*Record, fn func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			stack := debug.Stack()
			p.metrics.handlerPanics.Inc()
			first := recs[0]
			log := p.log.With("topic", first.Topic, "partition", first.Partition, "offset", first.Offset)
			if len(recs) == 1 {
				log = log.With("key_hash", keyHash(first.Key))
			} else {
				log = log.With("records", len(recs))
			}
			log.Error("handler panicked; the record will be retried", "panic", fmt.Sprint(v), "stack", string(stack))
			err = &PanicError{Value: v, Stack: stack}
		}
	}()
	return fn()
}

// keyHash identifies a key in logs without logging its (possibly sensitive) bytes.
func keyHash(key []byte) string {
	if key == nil {
		return "null"
	}
	h := fnv.New64a()
	h.Write(key)
	return fmt.Sprintf("%016x", h.Sum64())
}
