package processor

import (
	"log/slog"
	"sync"
	"time"
)

// Why a partition makes no progress: the values of kafkapg_stalled_partitions' cause label.
const (
	// stallInfrastructure: its transactions fail because Postgres (or a dependency the handler
	// reports with Infrastructure) is down; they are retried in place.
	stallInfrastructure = "infrastructure"
	// stallError: kafkapg's own statements fail in a way waiting will not fix (a bug, or the
	// database changed underneath: a table dropped, a column altered). Retried in place, loudly.
	stallError = "error"
	// stallBreaker: a failing record waits in place while the circuit breaker is open.
	stallBreaker = "breaker"
	// stallHandler: the handler (or the local retries of a record) has not finished: a handler
	// that ignores its context, or one far slower than it should be.
	stallHandler = "handler"
)

var stallCauses = []string{stallInfrastructure, stallError, stallBreaker, stallHandler}

// progress tracks whether a partition worker moves on: it is stalled once it has had records to
// apply and committed nothing for Config.StallTimeout. Its worker reports to it; the stats loop
// reads it (checkStalls).
type progress struct {
	mu       sync.Mutex
	busy     bool      // records are waiting to be applied, or being applied
	since    time.Time // when it last committed, or became busy
	cause    string    // why it is retrying or waiting in place; "" while the handler runs
	err      error     // the failure it is retrying, if any
	reported bool      // this stall was logged
	paused   bool      // an operator paused the partition: waiting is its purpose, not a stall
}

// pause says whether an operator paused the partition. A resume counts as progress: the time
// paused is not a stall's.
func (pr *progress) pause(paused bool) {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	if pr.paused && !paused {
		pr.since = time.Now()
	}
	pr.paused = paused
}

// working says that records wait to be applied.
func (pr *progress) working() {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	if !pr.busy {
		pr.busy, pr.since = true, time.Now()
	}
}

// idle says that nothing waits to be applied (or nothing is due).
func (pr *progress) idle() {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	pr.busy, pr.cause, pr.err, pr.reported = false, "", nil, false
}

// advanced says that a transaction committed.
func (pr *progress) advanced() {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	pr.since, pr.cause, pr.err, pr.reported = time.Now(), "", nil, false
}

// waiting says why the worker waits in place (a stall cause), and on what error.
func (pr *progress) waiting(cause string, err error) {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	pr.cause, pr.err = cause, err
}

// stall is a partition's lack of progress, as checkStalls sees it.
type stall struct {
	cause string
	err   error
	since time.Duration
	first bool // seen for the first time: log it
}

// stalled returns the stall older than timeout, if any.
func (pr *progress) stalled(now time.Time, timeout time.Duration) (stall, bool) {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	if !pr.busy || pr.paused || now.Sub(pr.since) < timeout {
		return stall{}, false
	}
	st := stall{cause: pr.cause, err: pr.err, since: now.Sub(pr.since), first: !pr.reported}
	if st.cause == "" {
		st.cause = stallHandler
	}
	pr.reported = true
	return st, true
}

// checkStalls counts the partitions of this process that are stalled, by cause, into
// kafkapg_stalled_partitions, and logs each stall once, with its cause, when it is first seen.
func (p *Processor) checkStalls() {
	now := time.Now()
	counts := map[string]int{}
	p.mu.Lock()
	ws := make([]*worker, 0, len(p.workers))
	for _, w := range p.workers {
		ws = append(ws, w)
	}
	p.mu.Unlock()
	for _, w := range ws {
		st, ok := w.prog.stalled(now, p.cfg.StallTimeout)
		if !ok {
			continue
		}
		counts[st.cause]++
		if st.first {
			attrs := []any{"cause", st.cause, "for", st.since.Round(time.Second), "stall_timeout", p.cfg.StallTimeout}
			if st.err != nil {
				attrs = append(attrs, "err", st.err)
			}
			w.log.Error("partition has made no progress; see the cause (kafkapg_stalled_partitions)", attrs...)
		}
	}
	for _, c := range stallCauses {
		p.metrics.stalled.WithLabelValues(c).Set(float64(counts[c]))
	}
}

// stallLog logs the first and every tenth failure of a retry in place: infrastructure failures
// as warnings, failures that waiting will not fix as errors (they are bugs, or a database changed
// underneath, and must be seen).
func stallLog(log *slog.Logger, cause string, err error, failures int, retryIn time.Duration) {
	if failures != 1 && failures%10 != 0 {
		return
	}
	if cause == stallError {
		log.Error("a transaction of kafkapg's own fails in a way waiting will not fix (a bug, or the database was changed underneath); retrying in place until it is fixed",
			"err", err, "failures", failures, "retry_in", retryIn)
		return
	}
	log.Warn("transaction failed for a reason outside the record; retrying in place",
		"err", err, "failures", failures, "retry_in", retryIn)
}
