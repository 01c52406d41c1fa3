package processor

import (
	"context"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// statsInterval is how often the retry path's group-wide metrics are read from Postgres.
const statsInterval = 5 * time.Second

// refreshStats publishes the retry path's group-wide state and the consumer lag as metrics every
// statsInterval.
func (p *Processor) refreshStats(ctx context.Context) {
	tick := time.NewTicker(statsInterval)
	defer tick.Stop()
	for {
		qctx, cancel := context.WithTimeout(ctx, statsInterval)
		st, err := p.retry.Stats(qctx, p.pool)
		if err == nil {
			p.metrics.setRetryStats(st, p.maxTiers())
			err = p.refreshStuck(qctx)
		}
		cancel()
		if err != nil && ctx.Err() == nil {
			p.log.Debug("cannot read retry path stats", "err", err)
		}
		if r := p.relay.Load(); r != nil {
			qctx, cancel := context.WithTimeout(ctx, statsInterval)
			b, err := r.Backlog(qctx)
			cancel()
			if err == nil {
				p.metrics.outboxWaiting.Set(float64(b.Waiting))
				p.metrics.outboxAside.Set(float64(b.SetAside))
				p.metrics.outboxOldest.Set(b.Oldest.Seconds())
			} else if ctx.Err() == nil {
				p.log.Debug("cannot read the outbox backlog", "err", err)
			}
		}
		if cl := p.client.Load(); cl != nil {
			qctx, cancel := context.WithTimeout(ctx, statsInterval)
			err := p.refreshLag(qctx, kadm.NewClient(cl))
			cancel()
			if err != nil && ctx.Err() == nil {
				p.log.Debug("cannot compute consumer lag", "err", err)
			}
		}
		p.checkStalls()
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// stuckScope is what counts as a stuck key for this processor.
func (p *Processor) stuckScope() retrytopics.StuckScope {
	return retrytopics.StuckScope{Older: p.cfg.StallTimeout, Tiers: p.tierCounts()}
}

// refreshStuck publishes kafkapg_stuck_keys and logs when the number of stuck keys changes.
func (p *Processor) refreshStuck(ctx context.Context) error {
	counts, err := p.retry.StuckCounts(ctx, p.pool, p.stuckScope())
	if err != nil {
		return err
	}
	changed := false
	for _, r := range retrytopics.StuckReasons {
		changed = changed || counts[r] != p.lastStuck[r]
		p.metrics.stuckKeys.WithLabelValues(r).Set(float64(counts[r]))
	}
	if changed && len(counts) > 0 {
		p.log.Warn("held keys have made no progress for StallTimeout (kafkapg_stuck_keys); see processor.StuckKeys",
			"orphaned", counts[retrytopics.StuckOrphaned], "overdue", counts[retrytopics.StuckOverdue], "unapplied", counts[retrytopics.StuckUnapplied])
	}
	p.lastStuck = counts
	return nil
}
