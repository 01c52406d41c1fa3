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

// worker applies the records of one partition, in offset order, one transaction per batch.
//
// Ownership: the poll loop calls push; everything else runs on the worker's own goroutine
// (run), except stop/abandon, called by the rebalance callbacks and shutdown. pos is touched only
// by run.
type worker struct {
	p       *Processor
	cl      *kgo.Client
	tp      offsets.Partition
	pos     offsets.Position
	log     *slog.Logger
	applied prometheus.Counter // kafkapg_records_applied_total for this topic, looked up once

	mu          sync.Mutex
	queue       []*kgo.Record
	queuedBytes int       // keys and values in queue
	firstAt     time.Time // when the oldest queued record arrived
	paused      bool      // fetching from the partition is paused because the queue is full
	closed      bool      // no more records are accepted
	wake        chan struct{}

	stopping chan struct{} // closed by stop: finish the transaction in flight, start nothing new
	stopOnce sync.Once
	ctx      context.Context // the transactions' context; cancelled by abandon
	cancel   context.CancelFunc
	done     chan struct{}
}

func newWorker(p *Processor, cl *kgo.Client, pos offsets.Position) *worker {
	ctx, cancel := context.WithCancel(context.Background())
	return &worker{
		p:        p,
		cl:       cl,
		tp:       pos.TP(),
		pos:      pos,
		log:      p.log.With("topic", pos.Topic, "partition", pos.Partition),
		applied:  p.metrics.applied.WithLabelValues(pos.Topic),
		wake:     make(chan struct{}, 1),
		stopping: make(chan struct{}),
		ctx:      ctx,
		cancel:   cancel,
		done:     make(chan struct{}),
	}
}

// push queues fetched records. It pauses fetching from the partition when the queue is full.
func (w *worker) push(recs []*kgo.Record) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return
	}
	if len(w.queue) == 0 {
		w.firstAt = time.Now()
	}
	w.queue = append(w.queue, recs...)
	for _, r := range recs {
		w.queuedBytes += len(r.Key) + len(r.Value)
	}
	if !w.paused && w.queuedBytes >= w.p.cfg.MaxBufferedBytes {
		w.paused = true
		w.cl.PauseFetchPartitions(map[string][]int32{w.tp.Topic: {w.tp.Partition}})
	}
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// take returns the next batch, waiting for records and for the batch to fill (BatchMaxWait).
// It returns nil once the worker is stopping.
func (w *worker) take() []*kgo.Record {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		var wait <-chan time.Time
		w.mu.Lock()
		if n := len(w.queue); n > 0 {
			max := w.p.cfg.BatchMaxRecords
			linger := w.p.cfg.BatchMaxWait - time.Since(w.firstAt)
			if n >= max || linger <= 0 {
				k := min(n, max)
				batch := w.queue[:k:k]
				w.queue = w.queue[k:]
				for _, r := range batch {
					w.queuedBytes -= len(r.Key) + len(r.Value)
				}
				if len(w.queue) > 0 {
					w.firstAt = time.Now()
				}
				if w.paused && w.queuedBytes <= w.p.cfg.MaxBufferedBytes/2 {
					w.paused = false
					w.cl.ResumeFetchPartitions(map[string][]int32{w.tp.Topic: {w.tp.Partition}})
				}
				w.mu.Unlock()
				return batch
			}
			if timer == nil {
				timer = time.NewTimer(linger)
			} else {
				timer.Reset(linger)
			}
			wait = timer.C
		}
		w.mu.Unlock()
		select {
		case <-w.wake:
		case <-wait:
		case <-w.stopping:
			return nil
		}
	}
}

// stop asks the worker to finish the transaction in flight and exit.
func (w *worker) stop() {
	w.stopOnce.Do(func() {
		w.mu.Lock()
		w.closed = true
		w.queue = nil
		w.mu.Unlock()
		close(w.stopping)
	})
}

// abandon cancels the transaction in flight: it is rolled back.
func (w *worker) abandon() { w.cancel() }

func (w *worker) run() {
	defer close(w.done)
	defer w.cancel()
	for {
		batch := w.take()
		if batch == nil {
			return
		}
		recs := w.records(batch)
		if len(recs) == 0 {
			continue
		}
		err := w.applyRange(recs)
		switch {
		case err == nil:
		case errors.Is(err, errStopped):
			return
		case errors.Is(err, offsets.ErrFenced):
			w.p.metrics.fenced.Inc()
			w.log.Warn("partition was claimed by another owner; this worker stops and applies nothing more", "err", err)
			w.stop()
			// Stop fetching a partition nobody here processes. The group rebalance that gave it
			// to the other owner will revoke it from us; the pause is cleared then.
			w.cl.PauseFetchPartitions(map[string][]int32{w.tp.Topic: {w.tp.Partition}})
			return
		default:
			// applyRange returns only nil, errStopped or ErrFenced; anything else is a bug. Stop
			// the whole processor rather than leave the partition silently stuck: a restart
			// resumes from Postgres.
			w.stop()
			w.p.fail(fmt.Errorf("partition %s: %w", w.tp, err))
			return
		}
	}
}

// records converts a fetched batch, dropping records below the stored position (already
// applied).
func (w *worker) records(batch []*kgo.Record) []*Record {
	out := make([]*Record, 0, len(batch))
	for _, r := range batch {
		if w.pos.Known && r.Offset < w.pos.Next {
			continue
		}
		out = append(out, &Record{
			Topic:       r.Topic,
			Partition:   r.Partition,
			Offset:      r.Offset,
			Key:         r.Key,
			Value:       r.Value,
			Headers:     r.Headers,
			Timestamp:   r.Timestamp,
			Attempt:     1,
			leaderEpoch: r.LeaderEpoch,
		})
	}
	return out
}

// applyRange applies recs, isolating the ones that fail: the whole range is tried in one
// transaction; if the handler fails, the records before the failing one are applied in one
// transaction, the failing record alone is retried or dead-lettered, and the rest is applied the
// same way. When a batch handler's error does not say which record failed, the range is split
// in halves until the failures are isolated. The fast path (no failure) is one transaction.
//
// It returns nil, errStopped or an error wrapping offsets.ErrFenced.
func (w *worker) applyRange(recs []*Record) error {
	if len(recs) == 0 {
		return nil
	}
	err := w.transact(recs, nil, true)
	var herr *sink.HandlerError
	if !errors.As(err, &herr) {
		return err
	}
	var rerr *RecordError
	if errors.As(herr.Err, &rerr) && rerr.Index >= 0 && rerr.Index < len(recs) {
		k := rerr.Index
		if err := w.applyRange(recs[:k]); err != nil {
			return err
		}
		if err := w.applyFailed(recs[k], rerr.Err); err != nil {
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

// applyFailed handles a record whose handler just failed with err: it retries it alone
// (LocalAttempts tries in all, with backoff) unless the error is permanent, then dead-letters it.
func (w *worker) applyFailed(rec *Record, err error) error {
	tries := 1
	class := Classify(err)
	w.p.metrics.failures.WithLabelValues(rec.Topic, class.String()).Inc()
	for class == ClassRetryable && tries < w.p.cfg.LocalAttempts {
		d := w.p.backoff.Delay(tries)
		w.log.Debug("record failed; retrying", "offset", rec.Offset, "key_hash", keyHash(rec.Key), "try", tries, "retry_in", d, "err", err)
		if !backoff.Sleep(w.ctx, w.stopping, d) {
			return errStopped
		}
		tries++
		terr := w.transact([]*Record{rec}, nil, true)
		var herr *sink.HandlerError
		if !errors.As(terr, &herr) {
			return terr // applied, stopped or fenced
		}
		err = herr.Err
		var rerr *RecordError
		if errors.As(err, &rerr) {
			err = rerr.Err
		}
		class = Classify(err)
		w.p.metrics.failures.WithLabelValues(rec.Topic, class.String()).Inc()
	}
	return w.deadLetter(rec, err, class, tries)
}

// deadLetter skips rec, committing a dead-letter message to the outbox in the same transaction
// as the offset advance: the record cannot be skipped without its dead letter, nor the reverse.
func (w *worker) deadLetter(rec *Record, cause error, class ErrorClass, tries int) error {
	now := time.Now()
	msg := sink.Message{
		Topic: retrytopics.DLQTopic(rec.Topic, w.p.cfg.Group),
		Key:   rec.Key,
		Value: rec.Value,
		Headers: retrytopics.Headers(rec.Headers, retrytopics.Failure{
			Topic:     rec.Topic,
			Partition: rec.Partition,
			Offset:    rec.Offset,
			Timestamp: rec.Timestamp,
			Group:     w.p.cfg.Group,
			Attempt:   rec.Attempt,
			Tries:     tries,
			Class:     class.String(),
			Message:   cause.Error(),
			FailedAt:  now,
		}),
	}
	if err := w.transact([]*Record{rec}, []sink.Message{msg}, false); err != nil {
		return err
	}
	w.p.metrics.deadLettered.WithLabelValues(rec.Topic, class.String()).Inc()
	w.log.Warn("record dead-lettered", "offset", rec.Offset, "key_hash", keyHash(rec.Key),
		"class", class.String(), "tries", tries, "dlq", msg.Topic, "err", cause)
	return nil
}

// transact commits recs (running the handler if withHandler) and msgs in one transaction that
// advances the partition past recs. While the failure is the infrastructure's, it retries in
// place with backoff, keeping the partition's position, for as long as the worker runs.
//
// It returns nil, a *sink.HandlerError whose class is not infrastructure, errStopped, or an error
// wrapping offsets.ErrFenced.
func (w *worker) transact(recs []*Record, msgs []sink.Message, withHandler bool) error {
	next := recs[len(recs)-1].Offset + 1
	var apply func(context.Context, pgx.Tx) error
	if withHandler {
		apply = func(ctx context.Context, tx pgx.Tx) error { return w.p.handle(ctx, tx, recs) }
	}
	for failures := 0; ; {
		start := time.Now()
		err := w.p.sink.Apply(w.ctx, w.pos, next, apply, msgs)
		if errors.Is(err, offsets.ErrAlreadyAdvanced) {
			w.log.Info("an earlier commit whose outcome was unknown had succeeded", "next_offset", next)
			err = nil
		}
		if err == nil {
			w.pos = w.pos.Advanced(next)
			last := recs[len(recs)-1]
			w.cl.MarkCommitOffsets(map[string]map[int32]kgo.EpochOffset{
				w.tp.Topic: {w.tp.Partition: {Epoch: last.leaderEpoch, Offset: next}},
			})
			if withHandler {
				w.applied.Add(float64(len(recs)))
			}
			w.p.metrics.txDuration.Observe(time.Since(start).Seconds())
			w.p.metrics.batchRecords.Observe(float64(len(recs)))
			if failures > 0 {
				w.log.Info("postgres is back; partition resumes", "after_failures", failures)
			}
			return nil
		}
		if w.ctx.Err() != nil {
			return errStopped
		}
		if errors.Is(err, offsets.ErrFenced) {
			return err
		}
		// A failure is the record's only if its handler ran and failed for a reason that is not
		// the infrastructure's (a transaction without a handler has nobody else to blame).
		var herr *sink.HandlerError
		if withHandler && errors.As(err, &herr) && Classify(herr.Err) != ClassInfrastructure {
			return herr
		}
		failures++
		w.p.metrics.infraRetries.Inc()
		d := w.p.backoff.Delay(failures)
		if failures == 1 || failures%10 == 0 {
			w.log.Warn("transaction failed for a reason outside the record; retrying in place",
				"err", err, "failures", failures, "retry_in", d, "from_offset", recs[0].Offset)
		}
		if !backoff.Sleep(w.ctx, w.stopping, d) {
			return errStopped
		}
	}
}

// handle runs the handler over recs inside tx, recovering panics.
func (p *Processor) handle(ctx context.Context, tx pgx.Tx, recs []*Record) error {
	if p.batch != nil {
		return p.call(func() error { return p.batch.HandleBatch(ctx, tx, recs) })
	}
	for i, r := range recs {
		if err := p.call(func() error { return p.cfg.Handler.Handle(ctx, tx, r) }); err != nil {
			return &RecordError{Index: i, Err: err}
		}
	}
	return nil
}

func (p *Processor) call(fn func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			stack := debug.Stack()
			p.metrics.handlerPanics.Inc()
			p.log.Error("handler panicked; the record will be retried", "panic", fmt.Sprint(v), "stack", string(stack))
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
