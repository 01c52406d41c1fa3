package processor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/retrytopics"
)

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
	txSpan   trace.SpanContext  // the batch transaction's span, while tracing: its exemplar
	source   string             // the source topic: tp.Topic, or the topic whose retry tier tp is
	tier     int                // 0 for a source topic's partition, n for retry tier n
	applied  prometheus.Counter // kafkapg_records_applied_total of the source topic, looked up once
	consumed prometheus.Counter // kafkapg_records_consumed_total of the partition's topic, looked up once

	prog progress // whether it moves on (see checkStalls)

	// win, on a source partition whose handler prepares concurrently (Config.Concurrency), holds
	// the records taken from queue while they are prepared; nil otherwise.
	win *window

	// token is pos.Token, and nextSeen the stored next offset as this worker last wrote it (-1:
	// none yet), for Processor.controlOnce, which reads them from another goroutine.
	token    int64
	nextSeen atomic.Int64
	// change is pos.PositionChange at the worker's start: the control loop restarts the
	// partition once the stored one is larger (an operator set the position since).
	change int64

	// held is a superset of the partition's held keys (source partitions only): only this
	// partition's owner ever adds a key to held_keys, and it loads the set when it starts, so a
	// key not in it cannot be held and its records need no check in Postgres. A key leaves it
	// when a transaction that found it released commits (not before: a try retried in place may
	// run on a promoted standby that lacks the release), and on every reload (every
	// heldRefresh), so that keys that never come back do not stay in it for ever.
	held       map[string]struct{}
	heldLoaded time.Time

	mu         sync.Mutex
	queue      []*kgo.Record
	queuedCost int64     // cost of the records in queue (see buffer)
	flightCost int64     // cost of the batch being applied
	firstAt    time.Time // when the oldest queued record arrived
	full       bool      // the queue holds the partition's share of the buffer budget
	waiting    bool      // the first queued record is not due yet (retry tiers)
	paused     bool      // fetching from the partition is paused (full, waiting or byOperator)
	byOperator bool      // its source partition is paused (the pauses table): no batch is taken
	busy       bool      // the partition holds records (queued or in flight): counted in Processor.busy
	closed     bool      // no more records are accepted
	verify     bool      // check the stored position between batches (requestVerify)
	// dropped: the queued records of a retry tier, none due for a while, were dropped, to be
	// fetched again from rewindTo at dueAt (see dropWaiting): records fetched meanwhile are
	// dropped too, until the poll loop has moved the partition's fetch back (rewound).
	dropped   bool
	rewinding bool // the rewind was asked for
	rewindTo  int64
	dueAt     time.Time
	wake      chan struct{}

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
	w.pos.Source = w.source // a pause of the source holds its retry tiers' same partitions back
	w.token, w.change = pos.Token, pos.PositionChange
	w.byOperator = p.pausedHere(w.source, w.tp.Partition)
	w.prog.pause(w.byOperator)
	w.nextSeen.Store(-1)
	if pos.Known {
		w.nextSeen.Store(pos.Next)
	}
	if pol := p.policy(w.source); w.tier == 0 && pol != nil && pol.preparer != nil && pol.concurrency > 1 {
		w.win = newWindow(w, pol)
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
	if w.closed || w.dropped { // dropped: they are fetched again after the rewind
		return
	}
	if len(w.queue) == 0 {
		w.firstAt = time.Now()
	}
	w.queue = append(w.queue, recs...)
	w.queuedCost += n
	w.syncBusy()
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
	w.mu.Unlock()
	w.releaseCost(n)
}

// releaseCost says records costing n, of those take (or the window) took, are no longer in memory.
func (w *worker) releaseCost(n int64) {
	w.mu.Lock()
	w.flightCost -= n
	w.syncBusy()
	w.mu.Unlock()
	w.p.buf.release(n)
}

// syncBusy counts the partition in Processor.busy while it holds records. w.mu is held.
func (w *worker) syncBusy() {
	if busy := w.queuedCost+w.flightCost > 0; busy != w.busy {
		w.busy = busy
		if busy {
			w.p.busy.Add(1)
		} else {
			w.p.busy.Add(-1)
		}
	}
}

// pauseByOperator pauses or resumes the worker as its source partition's pause says: fetching
// stops, take hands out no batch (the queue and the place are kept), and the stall detection does
// not count the partition. It reports whether that changed.
func (w *worker) pauseByOperator(paused bool) bool {
	w.mu.Lock()
	changed := w.byOperator != paused
	w.byOperator = paused
	w.prog.pause(paused)
	w.syncPause()
	w.mu.Unlock()
	if changed {
		select {
		case w.wake <- struct{}{}:
		default:
		}
	}
	return changed
}

// syncPause pauses or resumes fetching from the partition to match full and waiting. w.mu is held.
func (w *worker) syncPause() {
	want := w.full || w.waiting || w.byOperator
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

// take returns the next batch, waiting for records, for the batch to fill (BatchMaxWait, while
// Postgres is busy) and, in a retry tier, for the first record to be due (fetching from the
// partition is paused meanwhile).
// It returns nil once the worker is stopping.
func (w *worker) take() []*kgo.Record {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		wait, rewindTo := time.Duration(-1), int64(-1)
		w.mu.Lock()
		if w.verify {
			w.verify = false
			w.mu.Unlock()
			return verifyBatch
		}
		if w.byOperator {
			// Nothing is taken; pauseByOperator wakes the worker when the pause goes.
		} else if n := len(w.queue); n > 0 {
			limit := w.p.cfg.BatchMaxRecords
			ready, nextDue := min(n, limit), time.Time{}
			if w.tier > 0 {
				ready, nextDue = duePrefix(w.queue[:min(n, limit)], w.p.now())
			}
			if w.waiting != (ready == 0) {
				w.waiting = ready == 0
				w.syncPause()
			}
			linger := w.p.cfg.BatchMaxWait - time.Since(w.firstAt)
			switch {
			case ready == 0:
				w.prog.idle() // nothing is due
				wait = max(w.p.untilDue(nextDue), time.Millisecond)
				if nextDue.Sub(w.p.now()) > tierHold {
					w.dropWaiting(nextDue)
				}
			case ready >= limit || ready < n || linger <= 0 || !w.p.dbBusy():
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
				// Look again soon: Postgres may have become free.
				wait = min(linger, busyRecheck)
			}
		} else {
			w.prog.idle()
			if w.dropped && !w.rewinding {
				if wait = w.p.untilDue(w.dueAt); wait <= 0 {
					w.rewinding, wait = true, -1
					rewindTo = w.rewindTo
				}
			}
		}
		w.mu.Unlock()
		if rewindTo >= 0 {
			// Not under w.mu: the processor's lock is taken before a worker's, never after.
			w.p.rewind(w, rewindTo)
		}
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

// busyRecheck is how often a partition waiting for its batch to fill looks whether Postgres is
// still busy.
const busyRecheck = 2 * time.Millisecond

// tierHold is how long a retry tier's partition keeps records none of which is due: records due
// later than that are dropped and fetched again when they are (dropWaiting). Kept, a tier's
// partitions with backlogs due in an hour held the buffer budget for that hour, and no source
// partition was fetched meanwhile.
const tierHold = time.Second

// dropWaiting drops the queued records of a retry tier's partition, the first of which is due at
// due, none before: their budget is released, fetching stays paused, and at due the poll loop
// moves the partition's fetch back to the first of them (Processor.rewind). w.mu is held.
func (w *worker) dropWaiting(due time.Time) {
	if w.dropped || len(w.queue) == 0 {
		return
	}
	w.rewindTo, w.dueAt, w.dropped = w.queue[0].Offset, due, true
	n := w.queuedCost
	w.queue, w.queuedCost, w.full = nil, 0, false
	w.syncBusy()
	w.syncPause() // still paused: waiting
	w.p.buf.release(n)
	w.log.Debug("records of the retry tier are not due for a while; dropped from memory, to be fetched again when due",
		"from_offset", w.rewindTo, "due_at", due)
}

// rewound says the poll loop moved the partition's fetch back to rewindTo: fetching resumes.
func (w *worker) rewound() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.dropped, w.rewinding, w.waiting = false, false, false
	w.syncPause()
}

// dbBusy reports whether every connection of the pool is in use: a transaction would wait for
// one.
func (p *Processor) dbBusy() bool {
	st := p.pool.Stat()
	return st.AcquiredConns() >= st.MaxConns()
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
		w.syncBusy()
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
	if w.win != nil {
		defer w.release() // the window's records: the partition's next owner fetches them again
		defer w.win.close()
	}
	err := w.loadHeld()
	for err == nil {
		if len(w.held) > 0 && time.Since(w.heldLoaded) > heldRefresh {
			if err = w.loadHeld(); err != nil {
				break
			}
		}
		if w.win != nil {
			recs, verify := w.win.take()
			switch {
			case verify:
				err = w.verifyPosition()
			case recs == nil:
				return
			default:
				err = w.applyRange(recs)
				w.win.applied(recs)
				if err == nil {
					err = injectedBug(w.tp)
				}
			}
			continue
		}
		batch := w.take()
		if batch == nil {
			return
		}
		if len(batch) == 0 { // verifyBatch
			err = w.verifyPosition()
			continue
		}
		err = w.applyRange(w.records(batch))
		w.release()
		if err == nil {
			err = injectedBug(w.tp)
		}
	}
	switch {
	case errors.Is(err, errStopped):
	case errors.Is(err, offsets.ErrPositionSet):
		// An operator's rewind or skip: not a loss (kafkapg_forgotten_partitions_total is
		// not counted). Its streams do not fork: the database forgot nothing, its counter rows
		// go on, and what is applied again emits new events under new numbers (sink/doc.go).
		w.log.Info("an operator set the partition's position; starting again from it", "err", err)
		w.stop()
		w.cl.PauseFetchPartitions(map[string][]int32{w.tp.Topic: {w.tp.Partition}})
		w.p.restartPartition(w)
	case errors.Is(err, offsets.ErrMoved):
		// Not a zombie: the database lost this owner's last commits (or its claim), or an
		// operator moved the position. Going on from here would skip what the database lost;
		// a new worker starts again from the stored position, with a new claim above this
		// worker's token if the claim was lost (see storedPosition).
		w.p.metrics.forgotten.Inc()
		w.log.Warn("the partition's position in Postgres moved under this owner (a failover to a standby that lacked its last commits, a restore, or an edit); starting again from the stored position", "err", err)
		w.stop()
		w.cl.PauseFetchPartitions(map[string][]int32{w.tp.Topic: {w.tp.Partition}})
		w.p.restartPartition(w)
	case errors.Is(err, offsets.ErrFenced):
		w.p.metrics.fenced.Inc()
		w.log.Warn("partition was claimed by another owner; this worker stops and applies nothing more", "err", err)
		w.stop()
		// Stop fetching a partition nobody here processes. The group rebalance that gave it
		// to the other owner will revoke it from us; the pause is cleared then.
		w.cl.PauseFetchPartitions(map[string][]int32{w.tp.Topic: {w.tp.Partition}})
	default:
		// applyRange returns only nil, errStopped, ErrMoved or ErrFenced; anything else is a bug. Stop
		// the whole processor rather than leave the partition silently stuck: a restart
		// resumes from Postgres.
		w.stop()
		w.p.fail(fmt.Errorf("partition %s: %w", w.tp, err))
	}
}

// workerBug, set only by tests (SetWorkerBug), returns an error that cannot happen, as if a worker
// had met a bug after applying a batch of tp: what the default case of run does with it is
// tested. Nil in production: one atomic load per batch.
var workerBug atomic.Pointer[func(tp offsets.Partition) error]

// injectedBug returns workerBug's error for tp, or nil.
func injectedBug(tp offsets.Partition) error {
	if bug := workerBug.Load(); bug != nil {
		return (*bug)(tp)
	}
	return nil
}

// verifyBatch is what take returns when the worker is to check its position (requestVerify).
var verifyBatch = []*kgo.Record{}

// requestVerify asks the worker to check, between batches, that the stored position is still its
// own (verifyPosition).
func (w *worker) requestVerify() {
	w.mu.Lock()
	w.verify = true
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// verifyPosition reads the partition's row and compares it with the worker's position, between
// batches (no transaction of the worker's is in flight): offsets.ErrMoved if the database lost
// the worker's last commits or its claim (a failover to a standby that lacked them), which an
// idle partition would otherwise never find out, offsets.ErrFenced if another owner claimed it.
func (w *worker) verifyPosition() error {
	var st offsets.Position
	if err := w.p.inPlace(w.ctx, w.stopping, w.log, "", &w.prog, func() error {
		var err error
		st, err = w.p.store.Load(w.ctx, w.p.pool, w.tp)
		return err
	}); err != nil {
		return err
	}
	switch {
	case st.Token > w.pos.Token:
		return fmt.Errorf("%s: token %d, now %d: %w", w.tp, w.pos.Token, st.Token, offsets.ErrFenced)
	case st.Token == 0:
		return fmt.Errorf("%s: the offsets row is missing (the database lost it, or it was deleted): %w", w.tp, offsets.ErrMoved)
	case st.Token < w.pos.Token:
		return fmt.Errorf("%s: token %d, stored %d (the database lost this owner's claim): %w", w.tp, w.pos.Token, st.Token, offsets.ErrMoved)
	case st.PositionChange > w.pos.PositionChange:
		return fmt.Errorf("%s: position %s, change %d (this owner's is %s, change %d): %w", w.tp, fmtNext(st), st.PositionChange,
			fmtNext(w.pos), w.pos.PositionChange, offsets.ErrPositionSet)
	case st.Known != w.pos.Known || st.Known && st.Next != w.pos.Next:
		return fmt.Errorf("%s: stored offset is %s, this owner's is %s: %w", w.tp, fmtNext(st), fmtNext(w.pos), offsets.ErrMoved)
	}
	return nil
}

// fmtNext formats a position's next offset.
func fmtNext(pos offsets.Position) string {
	if !pos.Known {
		return "none"
	}
	return strconv.FormatInt(pos.Next, 10)
}

// heldRefresh is how often a partition with held keys reloads them (see worker.held).
const heldRefresh = time.Minute

// loadHeld reads the partition's held keys (source partitions) and its keys epoch, retrying
// while Postgres fails. It runs on the worker's goroutine, between batches: every key the worker
// held is committed.
func (w *worker) loadHeld() error {
	return w.p.inPlace(w.ctx, w.stopping, w.log, "", &w.prog, w.readHeld)
}

// readHeld reads the partition's held keys and keys epoch once.
func (w *worker) readHeld() error {
	keys, epoch, err := w.p.retry.HeldKeys(w.ctx, w.p.pool, w.tp.Topic, w.tp.Partition)
	if err != nil {
		return err
	}
	w.pos.KeysEpoch = epoch
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
