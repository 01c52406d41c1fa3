package processor

import (
	"context"
	"strconv"
	"time"

	"github.com/kafkapg/kafkapg/internal/positions"
	"github.com/kafkapg/kafkapg/offsets"
)

// controlInterval is how often a processor reads what operators decided for its group (pauses,
// positions set): one query a second (Store.Control). Not LISTEN: it would not reach a processor
// whose pool goes through a pooler in transaction mode.
const controlInterval = time.Second

// pauseView is the group's pauses as the control loop last read them.
type pauseView struct {
	pauses []offsets.Pause
}

// at returns when partition n of source was paused, if it is.
func (v *pauseView) at(source string, n int32) (time.Time, bool) {
	if v == nil {
		return time.Time{}, false
	}
	for _, z := range v.pauses {
		if z.Topic == source && z.Covers(n) {
			return z.At, true
		}
	}
	return time.Time{}, false
}

// pausedHere reports whether partition n of source (or of its retry tiers) is paused, as the
// control loop last read it. Only an early stop: Postgres decides (an advance fails while the
// pause row exists, offsets.ErrPaused).
func (p *Processor) pausedHere(source string, n int32) bool {
	_, ok := p.pauses.Load().at(source, n)
	return ok
}

// control obeys operators' pauses and positions every controlInterval until ctx ends.
func (p *Processor) control(ctx context.Context) {
	tick := time.NewTicker(controlInterval)
	defer tick.Stop()
	for {
		qctx, cancel := context.WithTimeout(ctx, controlInterval)
		err := p.controlOnce(qctx)
		cancel()
		if err != nil && ctx.Err() == nil {
			p.log.Debug("cannot read pauses and stored positions", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// controlOnce reads the group's pauses and the rows of the partitions owned here, in one query,
// then: pauses or resumes each worker (its fetch, and the batches it takes), and asks each worker
// whose row is not as it left it (a position set by an operator, or a database that lost its
// commits or its claim) to check its position between batches (worker.verifyPosition), which
// starts the partition again from the stored position: an idle partition finds out too.
func (p *Processor) controlOnce(ctx context.Context) error {
	p.mu.Lock()
	ws := make([]*worker, 0, len(p.workers))
	parts := make([]offsets.Partition, 0, len(p.workers))
	for tp, w := range p.workers {
		ws = append(ws, w)
		parts = append(parts, tp)
	}
	p.mu.Unlock()
	stored, pauses, err := p.store.Control(ctx, p.pool, parts)
	if err != nil {
		return err
	}
	view := &pauseView{pauses: pauses}
	p.pauses.Store(view)
	pausedHere := map[string]int{}
	for _, w := range ws {
		at, paused := view.at(w.source, w.tp.Partition)
		w.mu.Lock()
		mine := positions.Owner{Token: w.token, Next: w.nextSeen.Load(), Change: w.change, Paused: w.byOperator}
		w.mu.Unlock()
		row := positions.Row{Paused: paused, Next: -2} // no row: not the owner's position
		if st, ok := stored[w.tp]; ok {
			row.Token, row.Next, row.Change = st.Token, st.Next, st.PositionChange
		}
		switch positions.Control(mine, row) {
		case positions.Restart, positions.Stop:
			// The worker reads the row again between batches and decides (verifyPosition):
			// one that advanced after the read finds it fine.
			w.requestVerify()
		}
		if w.pauseByOperator(paused) {
			if paused {
				w.log.Info("partition paused by an operator: no new batch is taken, its place is kept", "paused_at", at)
			} else {
				w.log.Info("partition resumed by an operator")
			}
		}
		if paused {
			pausedHere[w.source]++
		}
	}
	p.metrics.setPauses(pausedHere, pauses, time.Now())
	if len(pauses) > 0 || p.pausesRead > 0 {
		p.heldApplier.notify() // resumed keys' held records, when a pause goes
	}
	p.pausesRead = len(pauses)
	return nil
}

// pauseKey is the partition label of a pause: its number, or "all".
func pauseKey(n int32) string {
	if n < 0 {
		return "all"
	}
	return strconv.Itoa(int(n))
}
