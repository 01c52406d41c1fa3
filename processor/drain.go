package processor

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// drainer applies the records parked behind keys that are ready again (their head was applied or
// dead-lettered), key by key in offset order. Every processor runs one; they share the work
// through row locks (a ready key is locked with SKIP LOCKED), so any processor of the group can
// finish what another started or left behind when it died.
//
// A parked record is applied exactly once because the transaction that applies it also deletes it
// from held_records, under its key's lock.
type drainer struct {
	p    *Processor
	log  *slog.Logger
	wake chan struct{}

	stopping chan struct{} // closed: finish the transaction in flight, start nothing new
	stopOnce sync.Once
	ctx      context.Context
	cancel   context.CancelFunc
	done     chan struct{}
}

func newDrainer(p *Processor) *drainer {
	ctx, cancel := context.WithCancel(context.Background())
	return &drainer{
		p:        p,
		log:      p.log.With("component", "drainer"),
		wake:     make(chan struct{}, 1),
		stopping: make(chan struct{}),
		ctx:      ctx,
		cancel:   cancel,
		done:     make(chan struct{}),
	}
}

// pageBytes bounds the values of the parked records one drainer goroutine takes at once: all of
// them together hold at most a quarter of Config.MaxBufferedBytes.
func (d *drainer) pageBytes() int { return d.p.cfg.MaxBufferedBytes / 4 / drainWorkers }

// notify wakes the drainer: a key may have become ready.
func (d *drainer) notify() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// stop, abandon, finished and describe make the drainer a stopper (see Processor.stopWorkers).
func (d *drainer) stop()                     { d.stopOnce.Do(func() { close(d.stopping) }) }
func (d *drainer) abandon()                  { d.cancel() }
func (d *drainer) finished() <-chan struct{} { return d.done }
func (d *drainer) describe() []any           { return []any{"component", "drainer"} }

const (
	drainBatch   = 100 // ready keys read at once
	drainWorkers = 4   // keys drained at once by one processor
	// drainInterval is how often a drainer looks for keys that other processors made ready; it
	// is woken at once for the keys its own processor readies.
	drainInterval = time.Second
)

func (d *drainer) run() {
	defer close(d.done)
	tick := time.NewTicker(drainInterval)
	defer tick.Stop()
	for {
		var keys []retrytopics.Key
		err := d.p.inPlace(d.ctx, d.stopping, d.log, "", nil, func() (err error) {
			keys, err = d.p.retry.ReadyKeys(d.ctx, d.p.pool, d.p.cfg.Topics, drainBatch)
			return err
		})
		if err != nil {
			return // stopped
		}
		progressed, err := d.drainAll(keys)
		if err != nil {
			return // stopped
		}
		if len(keys) == drainBatch && progressed {
			continue // there may be more ready keys; without progress (other processors hold
			// these keys), looking again at once would only spin on the same ones
		}
		select {
		case <-d.stopping:
			return
		case <-d.wake:
		case <-tick.C:
		}
	}
}

// drainAll drains keys, drainWorkers at a time. It reports whether any key made progress, and
// returns errStopped if it was stopped.
func (d *drainer) drainAll(keys []retrytopics.Key) (progressed bool, err error) {
	next := make(chan retrytopics.Key)
	var stopped, anyProgress atomic.Bool
	var wg sync.WaitGroup
	for range min(drainWorkers, len(keys)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range next {
				p, err := d.drainKey(k)
				if p {
					anyProgress.Store(true)
				}
				if err != nil {
					stopped.Store(true)
				}
			}
		}()
	}
	for _, k := range keys {
		next <- k
	}
	close(next)
	wg.Wait()
	if stopped.Load() {
		return anyProgress.Load(), errStopped
	}
	return anyProgress.Load(), nil
}

// drainKey applies the records parked behind k in order, until none is left, the key is held
// again (a record went to a retry tier, or was dead-lettered with OnDeadLetterBlock) or
// another processor holds it. It reports whether it applied or moved anything, and returns only
// errStopped.
func (d *drainer) drainKey(k retrytopics.Key) (progressed bool, err error) {
	for {
		select {
		case <-d.stopping:
			return progressed, errStopped
		default:
		}
		more, err := d.applyNext(k)
		if err != nil || !more {
			return progressed, err
		}
		progressed = true
	}
}

// applyNext applies k's next parked records: up to BatchMaxRecords of them in one transaction
// while the handler accepts them; a failing record is isolated the way a partition batch's is
// (the records before it are applied, it is retried alone within its delivery, then moved on).
// more says whether the key may have more records ready.
func (d *drainer) applyNext(k retrytopics.Key) (more bool, err error) {
	limit := d.p.cfg.BatchMaxRecords
	for {
		n, first, err := d.applyParked(k, limit)
		if err == nil {
			return n > 0, nil
		}
		if errors.Is(err, retrytopics.ErrStale) {
			return true, nil // the records moved on under us (cannot happen under the key's lock); look again
		}
		var herr *sink.HandlerError
		if !errors.As(err, &herr) {
			return false, err // stopped
		}
		index, cause := failedRecord(herr.Err, limit)
		switch {
		case index > 0:
			limit = index // apply the records before the failing one
		case index < 0 && limit > 1:
			limit = max(1, limit/2) // the error does not say which record: narrow down
		default:
			return d.retryFirst(k, first, cause)
		}
	}
}

// applyParked applies up to limit of k's parked records, in offset order, in one transaction. It
// returns how many it applied (0 if the key is not ready, is locked elsewhere or has nothing
// parked) and the first of them, which a *sink.HandlerError refers to.
func (d *drainer) applyParked(k retrytopics.Key, limit int) (int, *Record, error) {
	var recs []*Record
	err := d.transact(func(ctx context.Context, tx pgx.Tx) error {
		parked, err := d.p.retry.TakeParked(ctx, tx, k, limit, d.pageBytes())
		if err != nil {
			return own(err)
		}
		recs = recs[:0]
		for _, r := range parked {
			recs = append(recs, parkedRecord(r))
		}
		if len(recs) == 0 {
			return nil
		}
		if err := d.p.handle(ctx, tx, k.Topic, recs); err != nil {
			return err
		}
		return own(d.p.retry.AppliedParked(ctx, tx, k, parked))
	}, k.Topic)
	var first *Record
	if len(recs) > 0 {
		first = recs[0]
	}
	if err != nil {
		return 0, first, err
	}
	if len(recs) > 0 {
		d.p.metrics.applied.WithLabelValues(k.Topic).Add(float64(len(recs)))
		d.p.breaker.succeeded(len(recs))
	}
	return len(recs), first, nil
}

// retryFirst handles k's first parked record, rec, whose handler just failed with cause: it is
// retried alone (see retryAlone), then moved to the first retry tier or dead-lettered. more says
// whether the key goes on with its next record.
func (d *drainer) retryFirst(k retrytopics.Key, rec *Record, cause error) (more bool, err error) {
	f, settled, err := d.p.retryAlone(d.ctx, d.stopping, nil, k.Topic, true, cause, func() error {
		_, first, err := d.applyParked(k, 1)
		if errors.Is(err, retrytopics.ErrStale) || (first != nil && first.Offset != rec.Offset) {
			more = true // another processor moved the record on meanwhile; look again
			return nil
		}
		if first == nil {
			return err // the key is not ready here any more, or stopped
		}
		more = true
		return err // nil: applied; *sink.HandlerError: failed again
	})
	if settled {
		return more, err
	}
	return d.route(k, rec, f)
}

// route moves a parked record that keeps failing to the first retry tier or the dead-letter
// topic. more says whether the key goes on with its next record.
func (d *drainer) route(k retrytopics.Key, rec *Record, f failure) (more bool, err error) {
	m := d.p.plan(rec, k.Topic, f)
	err = d.transact(func(ctx context.Context, tx pgx.Tx) error {
		head, err := d.p.retry.TakeParked(ctx, tx, k, 1, d.pageBytes())
		if err != nil {
			return own(err)
		}
		if len(head) == 0 || head[0].Offset != rec.Offset {
			// Another processor moved the record on meanwhile: roll back, message included.
			return retrytopics.ErrStale
		}
		return own(d.p.write(ctx, tx, m))
	}, "", m.msg)
	if errors.Is(err, retrytopics.ErrStale) {
		return true, nil // look again
	}
	if err != nil {
		return false, err
	}
	d.p.moved(m, k.Topic, f)
	return m.tier == 0 && !m.Block, nil
}

// transact runs one transaction that stores msgs in the outbox and runs apply (see
// Processor.inPlace; blame is the source topic whose handler apply runs, or ""); apply must fail
// for the messages not to be stored.
func (d *drainer) transact(apply func(context.Context, pgx.Tx) error, blame string, msgs ...sink.Message) error {
	return d.p.inPlace(d.ctx, d.stopping, d.log, blame, nil, func() error {
		return d.p.sink.Transact(d.ctx, apply, msgs)
	})
}

// parkedRecord is the Record of a parked record: attempt 1, like any record delivered for the
// first time.
func parkedRecord(r retrytopics.Rec) *Record {
	return &Record{
		Topic:     r.Topic,
		Partition: r.Partition,
		Offset:    r.Offset,
		Key:       r.Key,
		Value:     r.Value,
		Headers:   r.Headers,
		Timestamp: r.Timestamp,
		Attempt:   1,
		stage:     retrytopics.FromHeld,
		ordered:   true,
	}
}
