package processor

import (
	"container/heap"
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"
)

// Preparer is an optional interface for a Handler whose records wait on other systems (a pricing
// service, a fraud check, a geocoder) before their effects can be written. Prepare runs outside
// the transaction, before Handle; what it leaves in rec.Prepared is there when Handle runs. With
// Config.Concurrency above 1, the records of a partition are prepared side by side, ahead of
// its transactions, which still apply them one batch at a time in offset order, exactly once.
//
// What Prepare may rely on:
//   - the Prepare calls of one key never overlap within a process, and a key's records are
//     first prepared in offset order; records without a key are prepared in any order. One
//     exception: a Prepare that ignores its context and is still running when its partition's
//     worker stops (the partition revoked, the process stopping) loses its key's lock then, and
//     its result is discarded; the partition's next worker in the process may prepare the key
//     beside it;
//   - Handle gets a record only after its Prepare returned nil, in the same process.
//
// What it must not assume:
//   - that it runs once: a record is prepared again after a crash, a rebalance, a retry (every
//     attempt prepares again) or when it was held behind its key; it may be prepared and never
//     handled (its key turned out held, a duplicate idempotency key, the partition revoked). Its
//     effects outside Postgres are at least once: read, or make idempotent calls;
//   - that the earlier records of its key have been handled: Prepare runs ahead of the
//     transactions. Read what an earlier record of the key writes in Handle, not in Prepare;
//   - that it has a transaction: the guarantee covers only what Handle writes through tx.
//
// An error fails the record as Handle's would (Permanent, Infrastructure, retryable: the same
// classes, the same retries and tiers). A panic is recovered and retried.
type Preparer interface {
	Prepare(ctx context.Context, rec *Record) error
}

// prepareOne runs the handler's Prepare over r, recovering a panic, under the lock of r's key
// (Prepare calls of one key never overlap in a process, from whichever path they come), in a
// "prepare {topic}" span of r's trace while tracing.
//
// ctx is the lifetime of what prepares: the window's or the worker's (a partition's worker, as
// long as it owns the partition) or the held records' applier's, never a shorter one: when it
// ends, the key's lock is given back even if Prepare has not returned (see prepLocks.lock), and a
// Prepare that returns after it is discarded (an error: nobody is left to handle its record).
func (p *Processor) prepareOne(ctx context.Context, pol *policy, r *Record) error {
	if d, ok := pol.preparer.(decodingPreparer); ok && d.next == nil {
		// Decoding alone: no code of the handler's runs, so no key's lock, watch or span is
		// needed (decoding is a pure function of the bytes, the registry's answers cached).
		return p.call([]*Record{r}, func() error { return d.Prepare(ctx, r) })
	}
	if r.ordered {
		unlock, err := p.prepLocks.lock(ctx, prepKey{r.Topic, r.Partition, string(r.Key)})
		if err != nil {
			return err
		}
		defer unlock()
	}
	pctx, span := ctx, trace.Span(nil)
	if p.tracer != nil {
		pctx, span = p.tracer.StartPrepare(ctx, p.delivery(r))
	}
	start := time.Now()
	returned := make(chan struct{})
	var outlived atomic.Bool
	stopWatch := context.AfterFunc(ctx, func() { p.watchAbandoned(r, start, returned, &outlived) })
	err := p.call([]*Record{r}, func() error { // a panic: retried, its stack logged
		r.Prepared = nil
		return pol.preparer.Prepare(pctx, r)
	})
	close(returned)
	stopWatch()
	p.metrics.prepareDuration.Observe(time.Since(start).Seconds())
	if ctx.Err() != nil && err == nil {
		r.Prepared = nil
		err = fmt.Errorf("prepare of %s[%d]@%d returned after its worker stopped; its result is discarded: %w", r.Topic, r.Partition, r.Offset, context.Cause(ctx))
	}
	if outlived.Load() {
		p.log.Info("a Prepare that ignored its context returned, long after its worker stopped; its result is discarded", "topic", r.Topic,
			"partition", r.Partition, "offset", r.Offset, "key_hash", keyHash(r.Key), "prepare_duration", time.Since(start).Round(time.Millisecond))
	}
	p.endProcess(span, r.Topic, err)
	return err
}

// prepareGrace is how long a Prepare may take to return after its context ended before it is
// logged as ignoring it.
const prepareGrace = time.Second

// watchAbandoned runs when the context of r's Prepare ends (its worker stopped: the partition
// revoked, the process stopping): it warns if the Prepare has not returned within prepareGrace.
// Its key's lock is already given back; outlived tells prepareOne to log its return.
func (p *Processor) watchAbandoned(r *Record, start time.Time, returned <-chan struct{}, outlived *atomic.Bool) {
	t := time.NewTimer(prepareGrace)
	defer t.Stop()
	select {
	case <-returned:
	case <-t.C:
		outlived.Store(true)
		p.log.Warn("a Prepare ignores its context: its worker stopped and it has not returned; its key's lock is given back to the "+
			"partition's next worker, and its result will be discarded", "topic", r.Topic, "partition", r.Partition, "offset", r.Offset,
			"key_hash", keyHash(r.Key), "running_for", time.Since(start).Round(time.Millisecond))
	}
}

// prepareInline prepares, before their Handle, the records of recs that are not prepared yet:
// those that did not come through a partition's window (a retry tier's, the held records, a
// record tried again alone), with up to Config.Concurrency of them at once, the records of a key
// one at a time in order. It returns the index of the first record whose Prepare failed (that
// failed in the window, or now) and its error, or -1. A failed record is unprepared: its next
// attempt prepares it again.
func (p *Processor) prepareInline(ctx context.Context, pol *policy, recs []*Record) (int, error) {
	first, firstErr := -1, error(nil)
	for i, r := range recs {
		if r.prepErr != nil {
			first, firstErr = i, r.prepErr
			break
		}
	}
	todo := recs
	if first >= 0 {
		todo = recs[:first]
	}
	var groups [][]int // indexes in recs, a key's in order
	byKey := map[string]int{}
	for i, r := range todo {
		if r.prepared || r.control {
			continue
		}
		if !r.ordered {
			groups = append(groups, []int{i})
			continue
		}
		g, ok := byKey[string(r.Key)]
		if !ok {
			g = len(groups)
			byKey[string(r.Key)] = g
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], i)
	}
	errs := make([]error, len(todo))
	run := func(g []int) {
		for _, i := range g {
			if errs[i] = p.prepareOne(ctx, pol, recs[i]); errs[i] != nil {
				return // the key's later records wait for this one
			}
			recs[i].prepared = true
		}
	}
	if len(groups) == 1 || pol.concurrency <= 1 {
		for _, g := range groups {
			run(g)
		}
	} else {
		sem := make(chan struct{}, pol.concurrency)
		var wg sync.WaitGroup
		for _, g := range groups {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				run(g)
			})
		}
		wg.Wait()
	}
	for i, err := range errs {
		if err != nil {
			first, firstErr = i, err
			break
		}
	}
	if first >= 0 {
		recs[first].unprepare()
	}
	return first, firstErr
}

// unprepare forgets r's Prepare: its next attempt prepares it again.
func (r *Record) unprepare() {
	r.prepared, r.prepErr, r.Prepared = false, nil, nil
}

// prepKey is a key of a partition, for prepLocks.
type prepKey struct {
	topic     string
	partition int32
	key       string
}

// prepLocks keeps the Prepare calls of a key from overlapping in a process: the window's, a
// retry's and the held records' applier's.
//
// A key's lock belongs to what took it (a partition's worker, the held records' applier), for as
// long as that lives: lock's ctx. A Prepare that ignores its context, still running when its
// worker stopped (the partition revoked), would otherwise keep the key from the partition's next
// worker in this process, and from the held records' applier inside its transaction, for as long
// as it runs, with nothing to bound it. Its worker gone, its result is of no use to anyone
// (prepareOne discards it), so its lock is given back when the worker stops. Within one live
// worker nothing changes: its lock is held until its Prepare returns, and its key's records are
// prepared one at a time, in order. Only a stopped worker's Prepare may still run beside the
// next Prepare of its key.
type prepLocks struct {
	mu   sync.Mutex
	busy map[prepKey]*prepHold
}

// prepHold is a key's lock, taken.
type prepHold struct {
	free chan struct{} // closed when given back
	once sync.Once
}

// lock waits until no Prepare of k runs, and takes k; unlock gives it back. So does the end of
// ctx, the lifetime of the worker that takes it (see prepLocks), even before unlock. It fails if
// ctx ends first, or has ended.
func (l *prepLocks) lock(ctx context.Context, k prepKey) (unlock func(), err error) {
	l.mu.Lock()
	for {
		if err := ctx.Err(); err != nil {
			l.mu.Unlock()
			return nil, err
		}
		h, ok := l.busy[k]
		if !ok {
			break
		}
		l.mu.Unlock()
		select {
		case <-h.free:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		l.mu.Lock()
	}
	if l.busy == nil {
		l.busy = map[prepKey]*prepHold{}
	}
	h := &prepHold{free: make(chan struct{})}
	l.busy[k] = h
	l.mu.Unlock()
	giveBack := func() {
		h.once.Do(func() {
			l.mu.Lock()
			if l.busy[k] == h {
				delete(l.busy, k)
			}
			l.mu.Unlock()
			close(h.free)
		})
	}
	stop := context.AfterFunc(ctx, giveBack)
	return func() {
		stop()
		giveBack()
	}, nil
}

// window holds the records a source partition took from its queue, in offset order, while their
// Prepare runs ahead of the partition's transactions (Config.Concurrency above 1, a Preparer).
// The worker applies the longest prepared prefix, in one batch transaction as always: the stored
// position still says exactly which records are done, and the window is only memory, lost with
// the process and rebuilt from the stored position by the partition's next owner.
//
// Ownership: take, applied and close run on the worker's goroutine (they read w.pos and
// w.held); the prepare goroutines only finish their slots, under mu, and wake the worker.
type window struct {
	w     *worker
	pol   *policy
	limit int // prepares in flight at most: Config.Concurrency
	size  int // records in the window at most
	ctx   context.Context
	stop  context.CancelFunc

	preparing prometheus.Gauge // kafkapg_prepares_in_flight of the source topic

	mu       sync.Mutex
	slots    []*slot          // taken from the queue, not applied yet, in offset order
	runnable slotHeap         // slots whose Prepare may start, lowest offset first
	keys     map[string]*keyQ // keys with a slot running, failed, or waiting behind one
	inFlight int
}

// slot is a record in the window.
type slot struct {
	rec     *Record
	cost    int64 // its share of the buffer budget
	state   slotState
	err     error     // its Prepare's, when failed
	entered time.Time // when it entered the window
	key     *keyQ     // nil for a record without a key (or prepared by nobody: skipped)
}

type slotState int

const (
	slotWaiting slotState = iota // behind an earlier record of its key, or for a free slot
	slotRunning
	slotDone   // prepared, or nothing to prepare
	slotFailed // its Prepare failed: it fails its record when it reaches the head
)

// keyQ is a key's line in the window: one slot at a time is prepared (or failed and unsettled),
// the others wait behind it in offset order.
type keyQ struct {
	name    string
	active  *slot   // running, or failed and not settled yet
	waiting []*slot // in offset order
}

type slotHeap []*slot

func (h slotHeap) Len() int           { return len(h) }
func (h slotHeap) Less(i, j int) bool { return h[i].rec.consumed < h[j].rec.consumed }
func (h slotHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *slotHeap) Push(x any)        { *h = append(*h, x.(*slot)) }
func (h *slotHeap) Pop() any {
	old := *h
	s := old[len(old)-1]
	*h = old[:len(old)-1]
	return s
}

func newWindow(w *worker, pol *policy) *window {
	ctx, cancel := context.WithCancel(context.Background())
	return &window{w: w, pol: pol, limit: pol.concurrency,
		size: max(windowPerSlot*pol.concurrency, windowBatches*w.p.cfg.BatchMaxRecords),
		ctx:  ctx, stop: cancel, keys: map[string]*keyQ{},
		preparing: w.p.metrics.preparing.WithLabelValues(w.source)}
}

// windowPerSlot is how many records the window holds per prepare it may run: enough that a slow
// record at the head does not leave the others idle.
const windowPerSlot = 32

// windowBatches is how many batches of BatchMaxRecords the window holds at least, whatever the
// concurrency: the worker takes a whole batch while the records behind it are being prepared.
const windowBatches = 4

// take returns the longest prepared prefix of the window (at most BatchMaxRecords), or the
// window's first record alone if its Prepare failed. It refills the window from the queue and
// waits for records and prepares. verify: the worker is to check its position first. It returns
// nil once the worker is stopping.
func (win *window) take() (recs []*Record, verify bool) {
	w := win.w
	for {
		w.mu.Lock()
		if w.verify {
			w.verify = false
			w.mu.Unlock()
			return nil, true
		}
		var raw []*kgo.Record
		win.mu.Lock()
		room := win.size - len(win.slots)
		win.mu.Unlock()
		// Paused by an operator: nothing more is prepared, nothing prepared is applied (the
		// prepares under way finish); pauseByOperator wakes the worker at the resume.
		paused := w.byOperator
		if n := min(room, len(w.queue)); n > 0 && !paused {
			raw = w.queue[:n:n]
			w.queue = w.queue[n:]
			c := costOf(raw)
			w.queuedCost -= c
			w.flightCost += c
			if w.full && w.queuedCost <= w.p.partitionShare()/2 {
				w.full = false
				w.syncPause()
			}
		}
		w.mu.Unlock()
		if len(raw) > 0 {
			win.add(raw)
		}
		if !paused {
			if recs := win.prefix(); recs != nil {
				w.prog.working()
				return recs, false
			}
		}
		win.mu.Lock()
		empty := len(win.slots) == 0
		win.mu.Unlock()
		if empty {
			w.prog.idle()
		}
		select {
		case <-w.wake:
		case <-w.stopping:
			return nil, false
		}
	}
}

// add puts fetched records into the window and starts what may start.
func (win *window) add(raw []*kgo.Record) {
	w := win.w
	recs := w.records(raw)
	now := time.Now()
	win.mu.Lock()
	defer win.mu.Unlock()
	j := 0
	for _, r := range raw {
		if w.pos.Known && r.Offset < w.pos.Next {
			// records dropped it (applied already); its budget goes back at once.
			w.releaseCost(cost(r))
			continue
		}
		rec := recs[j]
		j++
		s := &slot{rec: rec, cost: cost(r), entered: now}
		win.slots = append(win.slots, s)
		_, held := w.held[string(rec.Key)]
		switch {
		case rec.control, rec.size() > win.pol.maxRecordBytes, rec.ordered && held:
			// Nothing to prepare: a marker, a record refused for its size, or a record of a
			// key that may be held (it waits behind the key, unprepared; if the key turns out
			// free, its batch prepares it).
			s.state = slotDone
		case !rec.ordered:
			heap.Push(&win.runnable, s)
		default:
			q := win.keys[string(rec.Key)]
			if q == nil {
				q = &keyQ{name: string(rec.Key)}
				win.keys[q.name] = q
			}
			s.key = q
			if q.active == nil && len(q.waiting) == 0 {
				q.active = s
				heap.Push(&win.runnable, s)
			} else {
				q.waiting = append(q.waiting, s)
			}
		}
	}
	win.dispatch()
}

// dispatch starts the runnable prepares that fit, lowest offset first. While the circuit breaker
// is open (a downstream outage) only the window's first record is prepared, alone: the others
// would fail too. If it fails, it waits in place as the breaker's probe, as any record does;
// and since the first record may always start, the window never waits for a breaker that
// only its own records could close. win.mu is held.
func (win *window) dispatch() {
	if win.w.p.breaker.state() != breakerClosed {
		if win.inFlight == 0 && win.runnable.Len() > 0 && len(win.slots) > 0 && win.runnable[0] == win.slots[0] {
			win.start(heap.Pop(&win.runnable).(*slot))
		}
		return
	}
	for win.inFlight < win.limit && win.runnable.Len() > 0 {
		win.start(heap.Pop(&win.runnable).(*slot))
	}
}

// start runs s's Prepare on a goroutine of its own. win.mu is held.
func (win *window) start(s *slot) {
	s.state = slotRunning
	win.inFlight++
	win.w.p.metrics.prepareWait.Observe(time.Since(s.entered).Seconds())
	win.preparing.Inc()
	go win.run(s)
}

// run prepares one slot, on its own goroutine.
func (win *window) run(s *slot) {
	err := win.w.p.prepareOne(win.ctx, win.pol, s.rec)
	win.preparing.Dec()
	win.mu.Lock()
	win.inFlight--
	if err != nil {
		s.state, s.err = slotFailed, err // its key's later records wait until it is settled
	} else {
		s.state, s.rec.prepared = slotDone, true
		win.next(s.key)
	}
	win.dispatch()
	win.mu.Unlock()
	select {
	case win.w.wake <- struct{}{}:
	default:
	}
}

// next lets q's next record be prepared, its active one done. win.mu is held.
func (win *window) next(q *keyQ) {
	if q == nil {
		return
	}
	q.active = nil
	if len(q.waiting) == 0 {
		delete(win.keys, q.name)
		return
	}
	q.active = q.waiting[0]
	q.waiting = q.waiting[1:]
	heap.Push(&win.runnable, q.active)
}

// prefix cuts the records to apply next: the prepared slots at the head (at most
// BatchMaxRecords), or the head alone if its Prepare failed. The other failed slots are then
// prepared again (their failure was likely the head's: a downstream blip), each ahead of its
// key's later records.
func (win *window) prefix() (recs []*Record) {
	win.mu.Lock()
	defer win.mu.Unlock()
	n := 0
	for n < len(win.slots) && n < win.w.p.cfg.BatchMaxRecords && win.slots[n].state == slotDone {
		n++
	}
	if n == 0 && len(win.slots) > 0 && win.slots[0].state == slotFailed {
		head := win.slots[0]
		head.rec.prepErr = head.err
		for _, s := range win.slots[1:] {
			if s.state == slotFailed {
				s.state, s.err = slotWaiting, nil
				heap.Push(&win.runnable, s)
			}
		}
		win.dispatch()
		return []*Record{head.rec}
	}
	if n == 0 {
		return nil
	}
	recs = make([]*Record, n)
	for i, s := range win.slots[:n] {
		recs[i] = s.rec
	}
	return recs
}

// applied says recs, the prefix take returned, are done with (applied, held, dead-lettered, or
// left to the next owner): their budget goes back, and the keys of those whose Prepare failed
// go on with their next record.
func (win *window) applied(recs []*Record) {
	var c int64
	win.mu.Lock()
	for i, r := range recs {
		s := win.slots[i]
		if s.rec != r {
			panic("processor: window out of step with the records applied") // a bug
		}
		c += s.cost
		if s.state == slotFailed {
			win.next(s.key)
		}
		win.slots[i] = nil
	}
	win.slots = win.slots[len(recs):]
	win.dispatch()
	win.mu.Unlock()
	win.w.releaseCost(c)
}

// close cancels the prepares in flight: the worker has stopped, its window is dropped.
func (win *window) close() { win.stop() }
