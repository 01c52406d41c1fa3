package ledger

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
)

// PreparedSchema is the table Prepared writes what it saw go wrong into, in the transaction of
// the record that saw it: a check reads it empty or names each violation.
const PreparedSchema = `
CREATE TABLE IF NOT EXISTS prepare_violations (
    event_id  text   NOT NULL,
    problem   text   NOT NULL,
    at        timestamptz NOT NULL DEFAULT now()
);`

// Prepared is a ledger handler with a step that waits on another system, as an enrichment call
// does (a pricing service, a fraud check): its Prepare parses the event and waits a uniform
// 0 to MaxWait, outside the transaction, so that with processor.Config.Concurrency above 1 a
// partition's records wait side by side. It checks what processor.Preparer promises: two
// Prepare calls of one key never overlap in the process, and Handle gets a record only with its
// own Prepare's result. A violation is written to prepare_violations (PreparedSchema) in the
// record's transaction; the handler's tables are those of the handler it wraps.
type Prepared struct {
	Handler processor.Handler // Handler or Careless
	MaxWait time.Duration

	st *prepState
}

// prepState is what Prepared's copies share.
type prepState struct {
	mu       sync.Mutex
	busy     map[string]int64 // key -> offset of the record being prepared
	inFlight atomic.Int64
	maxSeen  atomic.Int64
	prepares atomic.Int64
	problems []string
}

// NewPrepared wraps h (Handler or Careless) with a Prepare that waits up to maxWait. The result
// is a processor.BatchHandler if h is one.
func NewPrepared(h processor.Handler, maxWait time.Duration) processor.Handler {
	p := Prepared{Handler: h, MaxWait: maxWait, st: &prepState{busy: map[string]int64{}}}
	if _, ok := h.(processor.BatchHandler); ok {
		return preparedBatch{p}
	}
	return p
}

// preparedBatch is a Prepared whose handler is a processor.BatchHandler.
type preparedBatch struct{ Prepared }

var (
	_ processor.Preparer     = Prepared{}
	_ processor.BatchHandler = preparedBatch{}
)

// prepared is what Prepare leaves in Record.Prepared.
type prepared struct {
	offset  int64
	attempt int
	problem string // what this Prepare saw go wrong, if anything
}

// Prepare waits like a call to another system, and checks that no other Prepare of the key runs.
func (p Prepared) Prepare(ctx context.Context, rec *processor.Record) error {
	st := p.st
	var problem string
	key := string(rec.Key)
	if rec.Key != nil {
		st.mu.Lock()
		if other, ok := st.busy[key]; ok {
			problem = fmt.Sprintf("prepared while offset %d of its key was being prepared", other)
		}
		st.busy[key] = rec.Offset
		st.mu.Unlock()
	}
	n := st.inFlight.Add(1)
	for m := st.maxSeen.Load(); n > m && !st.maxSeen.CompareAndSwap(m, n); m = st.maxSeen.Load() {
	}
	st.prepares.Add(1)
	var err error
	if p.MaxWait > 0 {
		t := time.NewTimer(rand.N(p.MaxWait))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			err = ctx.Err()
		}
	}
	st.inFlight.Add(-1)
	if rec.Key != nil {
		st.mu.Lock()
		if st.busy[key] == rec.Offset {
			delete(st.busy, key)
		}
		if problem != "" {
			st.problems = append(st.problems, fmt.Sprintf("%s@%d: %s", rec.Topic, rec.Offset, problem))
		}
		st.mu.Unlock()
	}
	if err != nil {
		return err
	}
	rec.Prepared = &prepared{offset: rec.Offset, attempt: rec.Attempt, problem: problem}
	return nil
}

// Handle checks the record's Prepare and applies it with the wrapped handler.
func (p Prepared) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	if err := p.check(ctx, tx, []*processor.Record{rec}); err != nil {
		return err
	}
	return p.Handler.Handle(ctx, tx, rec)
}

// HandleBatch checks the records' Prepare and applies them with the wrapped handler.
func (p preparedBatch) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	if err := p.check(ctx, tx, recs); err != nil {
		return err
	}
	return p.Handler.(processor.BatchHandler).HandleBatch(ctx, tx, recs)
}

// check writes what went wrong with the records' Prepare into prepare_violations.
func (p Prepared) check(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	for _, rec := range recs {
		pr, _ := rec.Prepared.(*prepared)
		var problem string
		switch {
		case pr == nil:
			problem = "handled without a Prepare"
		case pr.offset != rec.Offset || pr.attempt != rec.Attempt:
			problem = fmt.Sprintf("handled at attempt %d with the Prepare of offset %d, attempt %d", rec.Attempt, pr.offset, pr.attempt)
		default:
			problem = pr.problem
		}
		if problem != "" {
			ev, _ := Parse(rec.Value)
			if _, err := tx.Exec(ctx, `INSERT INTO prepare_violations (event_id, problem) VALUES ($1, $2)`,
				ev.EventID, fmt.Sprintf("%s@%d (attempt %d): %s", rec.Topic, rec.Offset, rec.Attempt, problem)); err != nil {
				return err
			}
		}
	}
	return nil
}

// PrepareStats are what a Prepared saw in this process: prepares run, the most at once, and
// the overlaps of a key's prepares.
type PrepareStats struct {
	Prepares  int64
	MaxAtOnce int64
	Problems  []string
}

// PrepareStatsOf returns what h, made by NewPrepared, saw so far.
func PrepareStatsOf(h processor.Handler) PrepareStats {
	var p Prepared
	switch h := h.(type) {
	case Prepared:
		p = h
	case preparedBatch:
		p = h.Prepared
	default:
		panic(fmt.Sprintf("ledger: PrepareStatsOf(%T): not made by NewPrepared", h))
	}
	p.st.mu.Lock()
	defer p.st.mu.Unlock()
	return PrepareStats{Prepares: p.st.prepares.Load(), MaxAtOnce: p.st.maxSeen.Load(), Problems: append([]string(nil), p.st.problems...)}
}

// PrepareViolations returns the violations Prepared handlers wrote into prepare_violations.
func PrepareViolations(ctx context.Context, db Querier) ([]string, error) {
	rows, err := db.Query(ctx, `SELECT problem FROM prepare_violations ORDER BY at LIMIT 20`)
	if err != nil {
		return nil, fmt.Errorf("read prepare_violations: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
