package processor

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// breaker is the processor's circuit breaker. It tells a downstream outage from bad records:
// when most records of a recent window failed with retryable errors, pushing every failing
// record through the retry tiers would only move the outage there (and, with per-key order,
// hold every key behind it). While the breaker is open, a record that has used its local tries
// waits in place instead of moving to a tier (so its partition waits); one waiting record at a
// time is retried as a probe, at a growing interval. The breaker closes, and the waiting records
// are retried at once, when a probe succeeds or any record is applied: either shows the
// downstream works again.
//
// What counts: a success is a record applied; a failure is a first delivery (from a source
// partition or held behind its key) that failed with a retryable error after its local
// tries. Records from the retry tiers wait like the others but do not count as failures:
// they failed before, so they say little about the downstream, and counting them would open the
// breaker on a quiet stream whose only traffic is a few bad records cycling through the tiers.
// Permanent failures (bad records) and infrastructure failures (already retried in place) do
// not count. The breaker is per process.
type breaker struct {
	cfg     breakerConfig
	log     *slog.Logger
	metrics *metrics

	mu        sync.Mutex
	st        breakerState
	buckets   []breakerBucket // ring of per-slot counts covering cfg.window
	slotWidth time.Duration   // cfg.window / breakerSlots, at least 1ns
	probeWait time.Duration   // current interval between probes
	nextProbe time.Time       // when an open breaker lets the next probe through
	openedAt  time.Time
	changed   chan struct{} // closed and replaced on every state change
}

type breakerConfig struct {
	threshold  float64 // failure ratio that opens the breaker; <= 0: disabled
	window     time.Duration
	minRecords int
	probeMin   time.Duration
	probeMax   time.Duration
}

type breakerState int

const (
	breakerClosed breakerState = iota
	breakerOpen
	breakerProbing // open, and one waiting record is being retried as the probe
)

func (s breakerState) String() string {
	switch s {
	case breakerOpen:
		return "open"
	case breakerProbing:
		return "probing"
	}
	return "closed"
}

// breakerSlots is how many buckets the window is cut into.
const breakerSlots = 10

type breakerBucket struct {
	slot       int64 // the bucket's time slot, in slot units since the epoch
	ok, failed int
}

func newBreaker(cfg breakerConfig, log *slog.Logger, m *metrics) *breaker {
	return &breaker{cfg: cfg, log: log, metrics: m, buckets: make([]breakerBucket, breakerSlots),
		slotWidth: max(cfg.window/breakerSlots, 1), changed: make(chan struct{})}
}

func (b *breaker) enabled() bool { return b.cfg.threshold > 0 }

// bucket returns the bucket of now, emptied if it held an older slot. b.mu must be held.
func (b *breaker) bucket(now time.Time) *breakerBucket {
	slot := now.UnixNano() / int64(b.slotWidth)
	bk := &b.buckets[slot%breakerSlots]
	if bk.slot != slot {
		*bk = breakerBucket{slot: slot}
	}
	return bk
}

// counts returns the successes and failures within the window. b.mu must be held.
func (b *breaker) counts(now time.Time) (ok, failed int) {
	slot := now.UnixNano() / int64(b.slotWidth)
	for _, bk := range b.buckets {
		if slot-bk.slot < breakerSlots {
			ok += bk.ok
			failed += bk.failed
		}
	}
	return ok, failed
}

// succeeded counts n applied records; an open breaker closes.
func (b *breaker) succeeded(n int) {
	if !b.enabled() || n == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	if b.st != breakerClosed {
		b.close(now, "records are applied again")
	}
	b.bucket(now).ok += n
}

// close closes the breaker. b.mu must be held.
func (b *breaker) close(now time.Time, why string) {
	clear(b.buckets) // the outage's failures must not reopen the breaker at once
	b.setState(breakerClosed, now)
	b.log.Info("circuit breaker closed: "+why+"; waiting records are retried now", "open_for", now.Sub(b.openedAt).Round(time.Millisecond))
}

// failed counts a first delivery that failed with a retryable error and reports whether the
// breaker is open: then the record must wait in place (see wait) instead of moving on.
func (b *breaker) failed() (waitInPlace bool) {
	if !b.enabled() {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	b.bucket(now).failed++
	if b.st != breakerClosed {
		return true
	}
	ok, failed := b.counts(now)
	if ok+failed < b.cfg.minRecords || float64(failed) < b.cfg.threshold*float64(ok+failed) {
		return false
	}
	b.probeWait = b.cfg.probeMin
	b.openedAt = now
	b.setState(breakerOpen, now)
	b.metrics.breakerOpened.Inc()
	b.log.Warn("circuit breaker open: most records fail with retryable errors, which looks like a downstream outage; keeping failed records waiting in place instead of sending them to the retry tiers",
		"failed", failed, "applied", ok, "window", b.cfg.window, "threshold", b.cfg.threshold, "first_probe_in", b.probeWait)
	return true
}

// setState changes the state and wakes the waiters. b.mu must be held.
func (b *breaker) setState(s breakerState, now time.Time) {
	b.st = s
	if s == breakerOpen {
		b.nextProbe = now.Add(b.probeWait)
	}
	close(b.changed)
	b.changed = make(chan struct{})
	open := 0.0
	if s != breakerClosed {
		open = 1
	}
	b.metrics.breakerOpen.Set(open)
}

// wait keeps a failed record until the breaker closes (probe false) or lets it through as the
// probe (probe true: the caller retries it and reports with probed). It returns ok false if ctx
// ends or stopping closes first.
func (b *breaker) wait(ctx context.Context, stopping <-chan struct{}) (probe, ok bool) {
	b.mu.Lock()
	b.metrics.breakerWaiting.Inc()
	defer b.metrics.breakerWaiting.Dec()
	for {
		now := time.Now()
		if b.st == breakerClosed {
			b.mu.Unlock()
			return false, true
		}
		sleep := time.Hour // probing: until the probe's outcome changes the state
		if b.st == breakerOpen {
			if !now.Before(b.nextProbe) {
				b.setState(breakerProbing, now)
				b.mu.Unlock()
				return true, true
			}
			sleep = b.nextProbe.Sub(now)
		}
		changed := b.changed
		b.mu.Unlock()
		timer := time.NewTimer(sleep)
		select {
		case <-ctx.Done():
			timer.Stop()
			return false, false
		case <-stopping:
			timer.Stop()
			return false, false
		case <-changed:
		case <-timer.C:
		}
		timer.Stop()
		b.mu.Lock()
	}
}

// probed reports the outcome of a probe: recovered is true unless the record failed again with a
// retryable error. A probe that ended otherwise (stopped, fenced) should report done instead.
func (b *breaker) probed(recovered bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.st != breakerProbing {
		return
	}
	now := time.Now()
	if recovered {
		b.close(now, "a probe succeeded")
		return
	}
	b.probeWait = min(2*b.probeWait, b.cfg.probeMax)
	b.setState(breakerOpen, now)
	b.log.Info("circuit breaker still open: the probe failed", "next_probe_in", b.probeWait)
}

// done ends a probe that had no outcome (the worker stopped): the next waiting record probes.
func (b *breaker) done() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.st == breakerProbing {
		b.setState(breakerOpen, time.Now())
		b.nextProbe = time.Now() // at once, not after another interval
	}
}

// state returns the current state.
func (b *breaker) state() breakerState {
	if !b.enabled() {
		return breakerClosed
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.st
}
