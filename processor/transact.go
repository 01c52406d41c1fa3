package processor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// transact commits recs (running apply, if not nil) and msgs in one transaction that advances the
// partition past recs. While the failure is the infrastructure's, it retries in place with
// backoff, keeping the partition's position, for as long as the worker runs. A failure of apply is
// the record's (returned, not retried) only if blame is set and it is not classified as
// infrastructure.
//
// If a replay held a key of the partition since the worker read its held keys, nothing is
// applied: it reads them again and returns offsets.ErrKeysChanged, for the caller to decide
// again which records wait behind their keys.
//
// It returns nil, a *sink.HandlerError, errStopped, or an error wrapping offsets.ErrFenced,
// offsets.ErrMoved, offsets.ErrKeysChanged or retrytopics.ErrStale.
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
		if errors.Is(err, offsets.ErrKeysChanged) {
			w.log.Info("a replay held a key of this partition; reading its held keys again")
			if rerr := w.readHeld(); rerr != nil {
				return rerr // Postgres failed: retried in place
			}
			return err
		}
		if err != nil {
			return err
		}
		w.pos = w.pos.Advanced(next)
		w.nextSeen.Store(next)
		w.prog.advanced()
		w.cl.MarkCommitOffsets(map[string]map[int32]kgo.EpochOffset{
			w.tp.Topic: {w.tp.Partition: {Epoch: last.leaderEpoch, Offset: next}},
		})
		observe(w.p.metrics.txDuration, time.Since(start).Seconds(), w.txSpan)
		w.p.metrics.batchRecords.Observe(float64(len(recs)))
		return nil
	})
}

// workInARow is how many pieces of streams' work (streamsWork) one transaction may ask for in a
// row before inPlace backs off between them.
const workInARow = 100

// inPlace runs tx until it succeeds, retrying in place with backoff while the failure is not the
// record's, until ctx is done or stopping is closed (then it returns errStopped). It returns at
// once an error wrapping offsets.ErrFenced, offsets.ErrMoved, offsets.ErrKeysChanged or retrytopics.ErrStale, and, if blame names a source
// topic, a *sink.HandlerError that its handler's error is not classified as infrastructure: a
// failure of the record.
//
// What it retries is either the infrastructure's failure (Postgres down, or a dependency the
// handler reports with Infrastructure), which passes by waiting, or a failure of kafkapg's own
// statements that waiting will not fix (a bug, a table changed underneath): the latter is logged
// as an error and counted in kafkapg_internal_errors_total. prog, if not nil, is told which.
func (p *Processor) inPlace(ctx context.Context, stopping <-chan struct{}, log *slog.Logger, blame string, prog *progress, tx func() error) error {
	for failures, work := 0, 0; ; {
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
		// Numbered records to prepare, or a read back, before the transaction can decide them:
		// done here, with no transaction open, and tried again. Each piece of work moves the
		// lineages on (a stream registered, a horizon raised, a read back's cursor), so the work
		// is always done; but more than workInARow pieces in a row for one transaction is not
		// progress any more (a bug, or paths that keep widening a read back): from then on each
		// is followed by the backoff, logged and counted, never a tight loop.
		var sw *streamsWork
		if errors.As(err, &sw) {
			work++
			werr := p.doStreams(ctx, sw)
			if ctx.Err() != nil {
				return errStopped
			}
			if werr == nil && work <= workInARow {
				continue
			}
			if werr != nil {
				err = werr
			} else {
				err = fmt.Errorf("%d pieces of streams' work in a row for one transaction: %w", work, err)
			}
		}
		if errors.Is(err, offsets.ErrPaused) {
			// An operator paused the partition while the batch was on its way (the control
			// loop stops the next ones): nothing was applied. Not a failure: no metric, no
			// backoff growth; the advance is tried again once a control interval.
			if prog != nil {
				prog.pause(true)
			}
			if !backoff.Sleep(ctx, stopping, controlInterval) {
				return errStopped
			}
			continue
		}
		if errors.Is(err, offsets.ErrFenced) || errors.Is(err, offsets.ErrMoved) || errors.Is(err, offsets.ErrKeysChanged) || errors.Is(err, retrytopics.ErrStale) {
			return err
		}
		var herr *sink.HandlerError
		var oerr *ownError
		if errors.As(err, &herr) && !errors.As(herr.Err, &oerr) && blame != "" && p.classify(blame, herr.Err) != ClassInfrastructure {
			return herr
		}
		failures++
		cause := stallInfrastructure
		if ownOutage(err) {
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
