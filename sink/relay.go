package sink

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/backoff"
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Schema holds the outbox table. Required.
	Schema string
	// Group is the consumer group whose outbox rows this relay publishes. Required.
	Group string
	// Logger. Defaults to slog.Default().
	Logger *slog.Logger
	// Interval between checks for rows written by other processes (or left by a crashed one).
	// Rows written by this process wake the relay at once through Notify. Defaults to 1s.
	Interval time.Duration
	// Backoff after a failed publish. Defaults to 200ms doubling to 5s.
	Backoff backoff.Policy
	// BatchSize is the most rows published per transaction. Defaults to 500.
	BatchSize int
	// PublishTimeout bounds one batch: produce, delete, commit. A batch is not interrupted when
	// the Run or Drain context is cancelled (an interrupted produce may have reached the broker,
	// and its rows would be published twice); only this timeout, or the context's deadline if
	// sooner, ends it. Defaults to 30s.
	PublishTimeout time.Duration
	// Published, if not nil, is called with the topic of every record published and acknowledged.
	Published func(topic string)
}

// Relay publishes outbox rows to Kafka and deletes them once the broker acknowledged them.
//
// Rows are locked with FOR UPDATE SKIP LOCKED while published, so relays of several processes
// share the work without publishing a row twice while all of them are alive.
type Relay struct {
	cfg       RelayConfig
	pool      *pgxpool.Pool
	client    *kgo.Client
	notify    chan struct{}
	selectSQL string
	deleteSQL string
}

// NewRelay returns a Relay publishing through client.
func NewRelay(pool *pgxpool.Pool, client *kgo.Client, cfg RelayConfig) *Relay {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.Backoff.Base <= 0 {
		cfg.Backoff = backoff.Policy{Base: 200 * time.Millisecond, Max: 5 * time.Second}
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 500
	}
	if cfg.PublishTimeout <= 0 {
		cfg.PublishTimeout = 30 * time.Second
	}
	t := pgx.Identifier{cfg.Schema, "outbox"}.Sanitize()
	return &Relay{
		cfg:    cfg,
		pool:   pool,
		client: client,
		notify: make(chan struct{}, 1),
		selectSQL: `SELECT id, topic, partition, key, value, header_keys, header_values FROM ` + t + `
			WHERE consumer_group = $1 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED`,
		deleteSQL: `DELETE FROM ` + t + ` WHERE id = ANY($1)`,
	}
}

// Notify wakes the relay: rows were just committed. It never blocks.
func (r *Relay) Notify() {
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// Run publishes outbox rows until ctx is done. It returns nil when ctx is done.
func (r *Relay) Run(ctx context.Context) error {
	tick := time.NewTicker(r.cfg.Interval)
	defer tick.Stop()
	failures := 0
	for {
		if _, err := r.Drain(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			failures++
			d := r.cfg.Backoff.Delay(failures)
			if failures == 1 || failures%10 == 0 {
				r.cfg.Logger.Warn("outbox publish failed; will retry", "err", err, "retry_in", d, "failures", failures)
			}
			if !backoff.Sleep(ctx, nil, d) {
				return nil
			}
			continue
		}
		if failures > 0 {
			r.cfg.Logger.Info("outbox publishing recovered", "after_failures", failures)
			failures = 0
		}
		select {
		case <-ctx.Done():
			return nil
		case <-r.notify:
		case <-tick.C:
		}
	}
}

// Drain publishes every row of the group's outbox that no other relay holds, and returns how
// many it published. It stops between batches when ctx is done.
func (r *Relay) Drain(ctx context.Context) (int, error) {
	total := 0
	for ctx.Err() == nil {
		n, err := r.publishBatch(ctx)
		total += n
		if err != nil || n < r.cfg.BatchSize {
			return total, err
		}
	}
	return total, ctx.Err()
}

func (r *Relay) publishBatch(parent context.Context) (int, error) {
	deadline := time.Now().Add(r.cfg.PublishTimeout)
	if d, ok := parent.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	ctx, cancel := context.WithDeadline(context.WithoutCancel(parent), deadline)
	defer cancel()

	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("outbox: begin: %w", err)
	}
	defer tx.Rollback(ctx)

	rows, err := tx.Query(ctx, r.selectSQL, r.cfg.Group, r.cfg.BatchSize)
	if err != nil {
		return 0, fmt.Errorf("outbox: select: %w", err)
	}
	var ids []int64
	var recs []*kgo.Record
	for rows.Next() {
		var id int64
		rec := &kgo.Record{}
		var keys, vals [][]byte
		if err := rows.Scan(&id, &rec.Topic, &rec.Partition, &rec.Key, &rec.Value, &keys, &vals); err != nil {
			rows.Close()
			return 0, fmt.Errorf("outbox: scan: %w", err)
		}
		var err error
		if rec.Headers, err = JoinHeaders(keys, vals); err != nil {
			rows.Close()
			return 0, fmt.Errorf("outbox: row %d: %w", id, err)
		}
		ids = append(ids, id)
		recs = append(recs, rec)
	}
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("outbox: select: %w", err)
	}
	if len(recs) == 0 {
		return 0, nil
	}

	if err := r.client.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		return 0, fmt.Errorf("outbox: publish %d records (first to %s): %w", len(recs), recs[0].Topic, err)
	}
	// Acknowledged by Kafka. If we die before this commit, the rows are published again later
	// (at least once).
	if _, err := tx.Exec(ctx, r.deleteSQL, ids); err != nil {
		return 0, fmt.Errorf("outbox: delete published rows: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("outbox: commit: %w", err)
	}
	if r.cfg.Published != nil {
		for _, rec := range recs {
			r.cfg.Published(rec.Topic)
		}
	}
	return len(recs), nil
}
