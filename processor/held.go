package processor

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// heldApplier applies the records held behind keys that are ready again (their head was applied or
// dead-lettered), key by key in offset order. Every processor runs one; they share the work
// through row locks (a ready key is locked with SKIP LOCKED), so any processor of the group can
// finish what another started or left behind when it died.
//
// A held record is applied exactly once because the transaction that applies it also deletes it
// from held_records, under its key's lock.
type heldApplier struct {
	p    *Processor
	log  *slog.Logger
	wake chan struct{}

	analyzed time.Time // when held_records was last analyzed (see analyze)

	mu       sync.Mutex
	prepared map[retrytopics.Origin]keptPrepare // see keepPrepared; nil if no handler prepares

	stopping chan struct{} // closed: finish the transaction in flight, start nothing new
	stopOnce sync.Once
	ctx      context.Context
	cancel   context.CancelFunc
	done     chan struct{}
}

func newHeldApplier(p *Processor) *heldApplier {
	ctx, cancel := context.WithCancel(context.Background())
	d := &heldApplier{
		p:        p,
		log:      p.log.With("component", "heldApplier"),
		wake:     make(chan struct{}, 1),
		stopping: make(chan struct{}),
		ctx:      ctx,
		cancel:   cancel,
		done:     make(chan struct{}),
	}
	for _, pol := range p.policies {
		if pol.preparer != nil {
			d.prepared = map[retrytopics.Origin]keptPrepare{}
		}
	}
	return d
}

// pageBytes bounds the values of the held records one heldApplier goroutine takes at once: all of
// them together hold at most a quarter of Config.MaxBufferedBytes.
func (d *heldApplier) pageBytes() int { return d.p.cfg.MaxBufferedBytes / 4 / d.workers() }

// workers is how many keys one processor applies at once: as many as its pool has connections
// (partitions are applied as concurrently), at least minHeldWorkers and at most maxHeldWorkers.
func (d *heldApplier) workers() int {
	return min(max(int(d.p.pool.Config().MaxConns), minHeldWorkers), maxHeldWorkers)
}

// notify wakes the heldApplier: a key may have become ready.
func (d *heldApplier) notify() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// stop, abandon, finished and describe make the heldApplier a stopper (see Processor.stopWorkers).
func (d *heldApplier) stop()                     { d.stopOnce.Do(func() { close(d.stopping) }) }
func (d *heldApplier) abandon()                  { d.cancel() }
func (d *heldApplier) finished() <-chan struct{} { return d.done }
func (d *heldApplier) describe() []any           { return []any{"component", "heldApplier"} }

const (
	readyKeysPerRead = 100 // ready keys read at once
	minHeldWorkers   = 4   // held-record transactions one processor runs at once: at least
	maxHeldWorkers   = 16  // ... and at most
	maxBundleKeys    = 16  // keys one held-record transaction applies at most
	// heldInterval is how often a heldApplier looks for keys that other processors, or an
	// operator's release, made ready (an index of ready keys answers it); it is woken at once for
	// the keys its own processor readies.
	heldInterval = 100 * time.Millisecond
	// analyzeHeldAfter is how many records this process holds before the heldApplier has
	// held_records analyzed, at most once every analyzeHeldEvery.
	analyzeHeldAfter = 10_000
	analyzeHeldEvery = time.Minute
	// pruneHistoryEvery is how often a heldApplier deletes the rows of skipped_duplicates and
	// held_history (what a trace tells of skipped duplicates and held records) older than
	// Config.IdempotencyRetention, pruneHistoryBatch rows a statement.
	pruneHistoryEvery = time.Minute
	pruneHistoryBatch = 1000
	// pruneHistoryBudget bounds the time a prune takes from applying held records: it goes on
	// with its next batch only within it, and leaves the rest to the next prune.
	pruneHistoryBudget = time.Second
)

func (d *heldApplier) run() {
	defer close(d.done)
	tick := time.NewTicker(heldInterval)
	defer tick.Stop()
	var pruned time.Time
	for {
		if time.Since(pruned) >= pruneHistoryEvery {
			pruned = time.Now()
			d.pruneHistory()
		}
		var keys []retrytopics.Key
		err := d.p.inPlace(d.ctx, d.stopping, d.log, "", nil, func() (err error) {
			keys, err = d.p.retry.ReadyKeys(d.ctx, d.p.pool, d.p.cfg.Topics, readyKeysPerRead)
			return err
		})
		if err != nil {
			return // stopped
		}
		if len(keys) > 0 {
			d.analyze()
		}
		progressed, err := d.applyAll(keys)
		if err != nil {
			return // stopped
		}
		if len(keys) == readyKeysPerRead && progressed {
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

// pruneHistory deletes the group's skipped_duplicates and held_history rows older than
// Config.IdempotencyRetention, a batch at a time, until none is left, pruneHistoryBudget has
// passed, or the heldApplier stops. A failure is logged and tried again at the next prune: the
// rows wait, nothing else does.
func (d *heldApplier) pruneHistory() {
	start := time.Now()
	before := start.Add(-d.p.cfg.IdempotencyRetention)
	for time.Since(start) < pruneHistoryBudget {
		select {
		case <-d.stopping:
			return
		default:
		}
		n, err := d.p.retry.PruneHistory(d.ctx, d.p.pool, before, pruneHistoryBatch)
		if err != nil {
			if d.ctx.Err() == nil {
				d.log.Warn("cannot prune what traces keep of skipped duplicates and held records; will try again", "err", err)
			}
			return
		}
		if n < pruneHistoryBatch {
			return
		}
	}
}

// analyze has held_records analyzed if this process held many records since it last did: a
// burst of held records leaves the table without statistics for up to a minute (autovacuum's
// pace), and the plans made meanwhile read a whole partition's held records to take one key's.
// Draining 100,000 held records (BenchmarkHeldRecords) ran at 0.38x the fast path without it and
// 0.65x with it. A failure (a role that does not own the table) is logged once and changes
// nothing else.
func (d *heldApplier) analyze() {
	if d.p.heldSinceAnalyze.Load() < analyzeHeldAfter || time.Since(d.analyzed) < analyzeHeldEvery {
		return
	}
	d.p.heldSinceAnalyze.Store(0)
	first := d.analyzed.IsZero()
	d.analyzed = time.Now()
	if err := d.p.retry.AnalyzeHeld(d.ctx, d.p.pool); err != nil && first {
		d.log.Warn("cannot refresh the statistics of held records; applying them may be slower until autovacuum does", "err", err)
	}
}

// applyAll applies the held records of keys, workers() goroutines at a time. Keys are applied in
// bundles of up to maxBundleKeys keys of one topic, one transaction per bundle (see applyBundle);
// a bundle whose handler fails is applied again key by key, where a failing record is isolated.
// It reports whether any key made progress, and returns errStopped if it was stopped.
func (d *heldApplier) applyAll(keys []retrytopics.Key) (progressed bool, err error) {
	// A paused source partition's held records wait too (until the control loop reads the
	// resume and notifies the applier).
	keys = slices.DeleteFunc(slices.Clone(keys), func(k retrytopics.Key) bool { return d.p.pausedHere(k.Topic, k.Partition) })
	bundles := d.bundles(keys)
	next := make(chan []retrytopics.Key)
	var stopped, anyProgress atomic.Bool
	var wg sync.WaitGroup
	for range min(d.workers(), len(bundles)) {
		wg.Go(func() {
			for b := range next {
				p, err := d.applyKeys(b)
				if p {
					anyProgress.Store(true)
				}
				if err != nil {
					stopped.Store(true)
				}
			}
		})
	}
	for _, b := range bundles {
		next <- b
	}
	close(next)
	wg.Wait()
	if stopped.Load() {
		return anyProgress.Load(), errStopped
	}
	return anyProgress.Load(), nil
}

// bundles splits keys into bundles of keys of one topic, as many as there are workers (so that
// all of them have work) and no more than maxBundleKeys keys each.
func (d *heldApplier) bundles(keys []retrytopics.Key) [][]retrytopics.Key {
	byTopic := map[string][]retrytopics.Key{}
	var topics []string
	for _, k := range keys {
		if _, ok := byTopic[k.Topic]; !ok {
			topics = append(topics, k.Topic)
		}
		byTopic[k.Topic] = append(byTopic[k.Topic], k)
	}
	size := min(max((len(keys)+d.workers()-1)/d.workers(), 1), maxBundleKeys)
	var out [][]retrytopics.Key
	for _, t := range topics {
		for chunk := range slices.Chunk(byTopic[t], size) {
			out = append(out, chunk)
		}
	}
	return out
}

// applyKeys applies the held records of keys, one topic's: bundled while the handler accepts
// them, then key by key.
func (d *heldApplier) applyKeys(keys []retrytopics.Key) (progressed bool, err error) {
	for len(keys) > 1 {
		more, applied, err := d.applyBundle(keys)
		if errors.Is(err, errBundleFailed) {
			break // key by key
		}
		if err != nil {
			return progressed, err
		}
		if !applied {
			return progressed, nil // not ready here (any more), or nothing left
		}
		progressed = true
		keys = more
	}
	for _, k := range keys {
		p, err := d.applyKey(k)
		progressed = progressed || p
		if err != nil {
			return progressed, err
		}
	}
	return progressed, nil
}

// errBundleFailed says that a bundle's handler failed: its keys are applied one by one.
var errBundleFailed = errors.New("bundle failed")

// applyBundle applies the first held records of each of keys (of one topic), up to
// BatchMaxRecords in all, in one transaction: the handler gets them key after key, each key's in
// offset order. It returns the keys that may have more records (those it applied records of) and
// whether it applied anything; errBundleFailed if the handler failed (nothing is applied: the
// caller goes key by key, where a failing record is isolated), or errStopped.
//
// Bundling is what makes held records cheap when each key has few of them (a replay brings back
// one or two records per key): one commit for many keys instead of one each.
func (d *heldApplier) applyBundle(keys []retrytopics.Key) (more []retrytopics.Key, applied bool, err error) {
	perKey := max(d.p.cfg.BatchMaxRecords/len(keys), 1)
	topic := keys[0].Topic
	var recs []*Record
	err = d.transact(func(ctx context.Context, tx pgx.Tx) error {
		recs, more = recs[:0], more[:0]
		// A pause holds the keys of its partitions back, decided here under the partition's
		// lock as applyHeld decides it (the skip of paused keys before the transaction reads the
		// control loop's view, up to a control interval old).
		live, err := d.unpaused(ctx, tx, keys)
		if err != nil || len(live) == 0 {
			return own(err)
		}
		held, err := d.p.retry.TakeHeldKeys(ctx, tx, live, perKey, d.pageBytes()/len(keys))
		if err != nil {
			return own(err)
		}
		for i, h := range held {
			for _, r := range h {
				recs = append(recs, d.heldRecord(r))
			}
			if len(h) > 0 {
				more = append(more, live[i]) // until a transaction finds none
			}
		}
		if len(recs) == 0 {
			return nil
		}
		// A BatchHandler gets one partition's records, in offset order (each key's records keep
		// theirs: a key is in one partition).
		slices.SortStableFunc(recs, func(a, b *Record) int {
			return cmp.Or(cmp.Compare(a.Partition, b.Partition), cmp.Compare(a.Offset, b.Offset))
		})
		if err := d.p.handle(ctx, tx, topic, recs); err != nil {
			d.keepPrepared(recs)
			return err // retried here if Postgres failed (see Processor.inPlace)
		}
		markDuplicates(held, recs)
		return own(d.p.retry.AppliedHeldKeys(ctx, tx, live, held))
	}, topic)
	var herr *sink.HandlerError
	if errors.Is(err, retrytopics.ErrStale) || (errors.As(err, &herr) && !errors.Is(err, errStopped)) {
		return nil, false, errBundleFailed
	}
	if err != nil {
		return nil, false, err
	}
	d.applied(topic, recs)
	return more, len(recs) > 0, nil
}

// unpaused returns the keys of keys whose source partition no pause covers, each partition
// checked once with Store.PausedLocked in tx.
func (d *heldApplier) unpaused(ctx context.Context, tx pgx.Tx, keys []retrytopics.Key) ([]retrytopics.Key, error) {
	paused := map[int32]bool{}
	live := make([]retrytopics.Key, 0, len(keys))
	for _, k := range keys {
		p, ok := paused[k.Partition]
		if !ok {
			var err error
			if p, err = d.p.store.PausedLocked(ctx, tx, k.Topic, k.Partition); err != nil {
				return nil, err
			}
			paused[k.Partition] = p
		}
		if !p {
			live = append(live, k)
		}
	}
	return live, nil
}

// applyKey applies the records held behind k in order, until none is left, the key is held
// again (a record went to a retry tier, or was dead-lettered with OnDeadLetterBlock) or
// another processor holds it. It reports whether it applied or moved anything, and returns only
// errStopped.
func (d *heldApplier) applyKey(k retrytopics.Key) (progressed bool, err error) {
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

// applyNext applies k's next held records: up to BatchMaxRecords of them in one transaction
// while the handler accepts them; a failing record is isolated the way a partition batch's is
// (the records before it are applied, it is retried alone within its delivery, then moved on).
// more says whether the key may have more records ready.
func (d *heldApplier) applyNext(k retrytopics.Key) (more bool, err error) {
	limit := d.p.cfg.BatchMaxRecords
	for {
		n, first, err := d.applyHeld(k, limit)
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

// applyHeld applies up to limit of k's held records, in offset order, in one transaction. It
// returns how many it applied (0 if the key is not ready, is locked elsewhere or has nothing
// held) and the first of them, which a *sink.HandlerError refers to.
func (d *heldApplier) applyHeld(k retrytopics.Key, limit int) (int, *Record, error) {
	var recs []*Record
	err := d.transact(func(ctx context.Context, tx pgx.Tx) error {
		// An operator's pause of the key's source partition holds its held records back too,
		// decided here as an advance decides it (applyAll skips them earlier, once the control
		// loop has read the pause): nothing is taken, the key waits for the resume.
		if paused, err := d.p.store.PausedLocked(ctx, tx, k.Topic, k.Partition); err != nil || paused {
			return own(err)
		}
		held, err := d.p.retry.TakeHeld(ctx, tx, k, limit, d.pageBytes())
		if err != nil {
			return own(err)
		}
		recs = recs[:0]
		for _, r := range held {
			recs = append(recs, d.heldRecord(r))
		}
		if len(recs) == 0 {
			return nil
		}
		if err := d.p.handle(ctx, tx, k.Topic, recs); err != nil {
			d.keepPrepared(recs)
			return err
		}
		markDuplicates([][]retrytopics.Rec{held}, recs)
		return own(d.p.retry.AppliedHeld(ctx, tx, k, held))
	}, k.Topic)
	var first *Record
	if len(recs) > 0 {
		first = recs[0]
	}
	if err != nil {
		return 0, first, err
	}
	d.applied(k.Topic, recs)
	return len(recs), first, nil
}

// markDuplicates says, in held, which of the replayed records among recs (the same records,
// handled) were skipped as duplicates: their dead letters' history says so.
func markDuplicates(held [][]retrytopics.Rec, recs []*Record) {
	var dups map[retrytopics.Origin]bool
	for _, r := range recs {
		if r.deadLetter != 0 && r.duplicate != nil {
			if dups == nil {
				dups = map[retrytopics.Origin]bool{}
			}
			dups[r.origin()] = true
		}
	}
	for _, h := range held {
		for i := range h {
			h[i].Duplicate = dups[h[i].Origin]
		}
	}
}

// applied counts held records of topic that a transaction just applied.
func (d *heldApplier) applied(topic string, recs []*Record) {
	if len(recs) == 0 {
		return
	}
	d.forgetPrepared(recs)
	d.p.metrics.applied.WithLabelValues(topic).Add(float64(len(recs) - d.p.committed(topic, recs)))
	d.p.countReplayed(topic, recs)
	d.p.breaker.succeeded(len(recs))
}

// retryFirst handles k's first held record, rec, whose handler just failed with cause: it is
// retried alone (see retryAlone), then moved to the first retry tier or dead-lettered. more says
// whether the key goes on with its next record.
func (d *heldApplier) retryFirst(k retrytopics.Key, rec *Record, cause error) (more bool, err error) {
	f, settled, err := d.p.retryAlone(d.ctx, d.stopping, nil, k.Topic, true, cause, func() error {
		_, first, err := d.applyHeld(k, 1)
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

// route moves a held record that keeps failing to the first retry tier or the dead-letter
// topic. more says whether the key goes on with its next record.
func (d *heldApplier) route(k retrytopics.Key, rec *Record, f failure) (more bool, err error) {
	m := d.p.plan(rec, k.Topic, f)
	err = d.transact(func(ctx context.Context, tx pgx.Tx) error {
		head, err := d.p.retry.TakeHeld(ctx, tx, k, 1, d.pageBytes())
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
func (d *heldApplier) transact(apply func(context.Context, pgx.Tx) error, blame string, msgs ...sink.Message) error {
	return d.p.inPlace(d.ctx, d.stopping, d.log, blame, nil, func() error {
		return d.p.sink.Transact(d.ctx, apply, msgs)
	})
}

// heldRecord is the Record of a held record: attempt 1, like any record delivered for the
// first time, or the attempt after its last for a dead letter a replay brought back. A record
// a failed transaction of this applier prepared keeps its Prepare (see keepPrepared).
func (d *heldApplier) heldRecord(r retrytopics.Rec) *Record {
	rec := heldRecord(r)
	if d.prepared != nil {
		d.mu.Lock()
		if c, ok := d.prepared[rec.origin()]; ok && c.attempt == rec.Attempt {
			rec.prepared, rec.Prepared, rec.Decoded, rec.DecodedKey = true, c.v, c.decoded, c.decodedKey
		}
		d.mu.Unlock()
	}
	return rec
}

// keepPrepared remembers what the handler's Prepare left for recs, read by a transaction that did
// not commit (a record failed, Postgres failed): the next transaction reads them again from
// held_records, new Records, and would otherwise prepare them all again — every record of a key
// once per record isolated before it.
func (d *heldApplier) keepPrepared(recs []*Record) {
	if d.prepared == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.prepared) > maxKeptPrepared {
		clear(d.prepared)
	}
	for _, r := range recs {
		if r.prepared {
			d.prepared[r.origin()] = keptPrepare{attempt: r.Attempt, v: r.Prepared, decoded: r.Decoded, decodedKey: r.DecodedKey}
		}
	}
}

// forgetPrepared drops what keepPrepared kept of recs, applied.
func (d *heldApplier) forgetPrepared(recs []*Record) {
	if d.prepared == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range recs {
		delete(d.prepared, r.origin())
	}
}

// maxKeptPrepared bounds keepPrepared's memory (the values are the handler's): past it, it starts
// afresh.
const maxKeptPrepared = 10000

// keptPrepare is what a held record's Prepare left, at its delivery attempt.
type keptPrepare struct {
	attempt             int
	v                   any // Record.Prepared
	decoded, decodedKey any // Record.Decoded and DecodedKey: decoding is part of the Prepare
}

func heldRecord(r retrytopics.Rec) *Record {
	return &Record{
		Attempt:    max(r.Attempt, 1),
		deadLetter: r.DeadLetter,
		ordered:    r.Key != nil,
		Topic:      r.Topic,
		Partition:  r.Partition,
		Offset:     r.Offset,
		Key:        r.Key,
		Value:      r.Value,
		Headers:    r.Headers,
		Timestamp:  r.Timestamp,
		stage:      retrytopics.FromHeld,
	}
}
