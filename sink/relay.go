package sink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/internal/safetext"
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
	// BackoffBase is the delay after a failed publish; it doubles per failure in a row, with
	// jitter, up to BackoffMax. Default to 200ms and 5s.
	BackoffBase, BackoffMax time.Duration
	// BatchSize is the most rows published per transaction. Defaults to 500.
	BatchSize int
	// BatchBytes bounds the keys, values and headers published per transaction (a batch holds at
	// least one row, whatever its size). Defaults to 16 MiB.
	BatchBytes int
	// TxIdleTimeout is set as the relay transaction's idle_in_transaction_session_timeout: a
	// relay that stops answering (a frozen or partitioned process) holds the rows it locked from
	// the other relays for at most this long. Defaults to 30s.
	TxIdleTimeout time.Duration
	// PublishTimeout bounds one batch: produce, delete, commit. A batch is not interrupted when
	// the Run or Flush context is cancelled (an interrupted produce may have reached the broker,
	// and its rows would be published twice); only this timeout, or the context's deadline if
	// sooner, ends it. Defaults to four fifths of TxIdleTimeout, so that a slow broker ends the
	// batch before Postgres ends its transaction.
	PublishTimeout time.Duration
	// Published, if not nil, is called with the topic of every record published and acknowledged.
	Published func(topic string)
	// Refused, if not nil, is called inside the relay's transaction for a message Kafka refuses
	// for good (too large, invalid; see isRefusal), published alone: it may write what the
	// message's fate means for its writer, and return a message to publish in its place (nil:
	// none). The refused row is then deleted. A message Refused gives up on (it returns an
	// error), or every refused message when Refused is nil, stays in the outbox set aside
	// (refused_at, refused_error) for an operator, and the rest flows on.
	Refused func(ctx context.Context, tx pgx.Tx, m Message, refusal error) (*Message, error)
}

// Relay publishes outbox rows to Kafka and deletes them once the broker acknowledged them.
//
// Rows are locked with FOR UPDATE SKIP LOCKED while published, so relays of several processes
// share the work without publishing a row twice while all of them are alive. Each row's produce
// result is checked on its own: rows Kafka acknowledged are deleted, rows that failed for a reason
// that may pass (a broker down) are retried on the next pass, and rows Kafka refuses for good go
// to RelayConfig.Refused or are set aside; one bad row never holds up the others.
type Relay struct {
	cfg       RelayConfig
	pool      *pgxpool.Pool
	client    *kgo.Client
	notify    chan struct{}
	idleSQL   string
	selectSQL string
	deleteSQL string
	insertSQL string
	asideSQL  string
	statsSQL  string
}

// NewRelay returns a Relay publishing through client.
func NewRelay(pool *pgxpool.Pool, client *kgo.Client, cfg RelayConfig) *Relay {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.BackoffBase <= 0 {
		cfg.BackoffBase = 200 * time.Millisecond
	}
	if cfg.BackoffMax <= 0 {
		cfg.BackoffMax = 5 * time.Second
	}
	cfg.BackoffMax = max(cfg.BackoffMax, cfg.BackoffBase)
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 500
	}
	if cfg.BatchBytes <= 0 {
		cfg.BatchBytes = 16 << 20
	}
	if cfg.TxIdleTimeout <= 0 {
		cfg.TxIdleTimeout = 30 * time.Second
	}
	if cfg.PublishTimeout <= 0 {
		cfg.PublishTimeout = cfg.TxIdleTimeout * 4 / 5
	}
	t := pgx.Identifier{cfg.Schema, "outbox"}.Sanitize()
	return &Relay{
		cfg:     cfg,
		pool:    pool,
		client:  client,
		notify:  make(chan struct{}, 1),
		idleSQL: fmt.Sprintf("SET LOCAL idle_in_transaction_session_timeout = %d", max(cfg.TxIdleTimeout.Milliseconds(), 1)),
		selectSQL: `SELECT id, topic, partition, key, value, header_keys, header_values FROM ` + t + `
			WHERE consumer_group = $1 AND refused_at IS NULL ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED`,
		deleteSQL: `DELETE FROM ` + t + ` WHERE id = ANY($1)`,
		insertSQL: `INSERT INTO ` + t + ` (consumer_group, topic, partition, key, value, header_keys, header_values) VALUES ($1, $2, $3, $4, $5, $6, $7)`,
		asideSQL:  `UPDATE ` + t + ` SET refused_at = now(), refused_error = $2 WHERE id = $1`,
		statsSQL: `SELECT count(*) FILTER (WHERE refused_at IS NULL), count(*) FILTER (WHERE refused_at IS NOT NULL),
			coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE refused_at IS NULL)), 0)::float8
			FROM ` + t + ` WHERE consumer_group = $1`,
	}
}

// Backlog describes the group's outbox: rows waiting to be published, rows set aside, and how
// long the oldest waiting row has waited (0 if none).
type Backlog struct {
	Waiting, SetAside int
	Oldest            time.Duration
}

// Backlog reads the group's outbox backlog.
func (r *Relay) Backlog(ctx context.Context) (Backlog, error) {
	var b Backlog
	var oldest float64
	if err := r.pool.QueryRow(ctx, r.statsSQL, r.cfg.Group).Scan(&b.Waiting, &b.SetAside, &oldest); err != nil {
		return b, fmt.Errorf("outbox backlog: %w", err)
	}
	b.Oldest = time.Duration(max(oldest, 0) * float64(time.Second))
	return b, nil
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
		if _, err := r.Flush(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			failures++
			d := backoff.Policy{Base: r.cfg.BackoffBase, Max: r.cfg.BackoffMax}.Delay(failures)
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

// Flush publishes every row of the group's outbox that no other relay holds, and returns how
// many it published. It stops between batches when ctx is done. Rows that fail to publish for a
// reason that may pass are left for a later call, which its error reports.
func (r *Relay) Flush(ctx context.Context) (int, error) {
	total := 0
	for ctx.Err() == nil {
		n, full, err := r.publishBatch(ctx)
		total += n
		if err != nil || !full {
			return total, err
		}
	}
	return total, ctx.Err()
}

// row is an outbox row being published.
type row struct {
	id  int64
	msg Message
	rec *kgo.Record
	err error // its produce result
}

// publishBatch publishes one batch of rows in one transaction. full says the batch was as large as
// allowed (more rows may be waiting).
func (r *Relay) publishBatch(parent context.Context) (n int, full bool, err error) {
	deadline := time.Now().Add(r.cfg.PublishTimeout)
	if d, ok := parent.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	ctx, cancel := context.WithDeadline(context.WithoutCancel(parent), deadline)
	defer cancel()

	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("outbox: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, r.idleSQL); err != nil {
		return 0, false, fmt.Errorf("outbox: %w", err)
	}
	rows, full, err := r.read(ctx, tx)
	if err != nil || len(rows) == 0 {
		return 0, false, err
	}

	recs := make([]*kgo.Record, len(rows))
	byRec := make(map[*kgo.Record]*row, len(rows))
	for i, rw := range rows {
		recs[i] = rw.rec
		byRec[rw.rec] = rw
	}
	for _, res := range r.client.ProduceSync(ctx, recs...) {
		byRec[res.Record].err = res.Err
	}
	// Kafka fails every record buffered for a partition when it refuses one batch of it: publish
	// the refused ones again, one at a time, to tell the guilty from the innocent.
	for _, rw := range rows {
		if isRefusal(rw.err) {
			rw.err = r.client.ProduceSync(ctx, rw.rec).FirstErr()
		}
	}

	var done []int64
	var failed error
	failedRows := 0
	for _, rw := range rows {
		switch {
		case rw.err == nil:
			done = append(done, rw.id)
		case isRefusal(rw.err):
			if err := r.refused(ctx, tx, rw); err != nil {
				return 0, false, err
			}
		default:
			failedRows++
			if failed == nil {
				failed = fmt.Errorf("outbox: publish to %s: %w", rw.msg.Topic, rw.err)
			}
		}
	}
	// Acknowledged by Kafka. If we die before this commit, the rows are published again later
	// (at least once).
	if len(done) > 0 {
		if _, err := tx.Exec(ctx, r.deleteSQL, done); err != nil {
			return 0, false, fmt.Errorf("outbox: delete published rows: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, false, fmt.Errorf("outbox: commit: %w", err)
	}
	if r.cfg.Published != nil {
		for _, rw := range rows {
			if rw.err == nil {
				r.cfg.Published(rw.msg.Topic)
			}
		}
	}
	if failed != nil {
		return len(done), false, fmt.Errorf("%d of %d records not published (will retry): %w", failedRows, len(rows), failed)
	}
	return len(done), full, nil
}

// read locks and reads up to BatchSize rows, and BatchBytes of their contents (at least one row).
// A row that cannot be read back into a record (edited by hand) is set aside. full says the limit
// was reached.
func (r *Relay) read(ctx context.Context, tx pgx.Tx) ([]*row, bool, error) {
	rs, err := tx.Query(ctx, r.selectSQL, r.cfg.Group, r.cfg.BatchSize)
	if err != nil {
		return nil, false, fmt.Errorf("outbox: select: %w", err)
	}
	defer rs.Close()
	var out []*row
	var bad []int64
	var badErr []error
	bytes, seen := 0, 0
	for rs.Next() {
		seen++
		rw := &row{}
		var keys, vals [][]byte
		if err := rs.Scan(&rw.id, &rw.msg.Topic, &rw.msg.Partition, &rw.msg.Key, &rw.msg.Value, &keys, &vals); err != nil {
			return nil, false, fmt.Errorf("outbox: scan: %w", err)
		}
		var err error
		if rw.msg.Headers, err = JoinHeaders(keys, vals); err != nil {
			bad, badErr = append(bad, rw.id), append(badErr, err)
			continue
		}
		rw.rec = &kgo.Record{Topic: rw.msg.Topic, Partition: rw.msg.Partition, Key: rw.msg.Key, Value: rw.msg.Value, Headers: rw.msg.Headers}
		out = append(out, rw)
		if bytes += rw.msg.size(); bytes >= r.cfg.BatchBytes {
			break // the rows read no further stay locked until commit, unpublished: the next batch takes them
		}
	}
	full := seen == r.cfg.BatchSize || bytes >= r.cfg.BatchBytes
	rs.Close()
	if err := rs.Err(); err != nil {
		return nil, false, fmt.Errorf("outbox: select: %w", err)
	}
	for i, id := range bad {
		r.cfg.Logger.Error("outbox row cannot be read back into a record; set aside", "id", id, "err", badErr[i])
		if err := r.setAside(ctx, tx, id, badErr[i]); err != nil {
			return nil, false, err
		}
	}
	return out, full, nil
}

// refused handles a row Kafka refused for good: its writer's Refused hook decides what replaces
// it; without one, or if the hook fails, the row is set aside.
func (r *Relay) refused(ctx context.Context, tx pgx.Tx, rw *row) error {
	if r.cfg.Refused != nil {
		var next *Message
		err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error { // a savepoint: a failed hook leaves tx usable
			var err error
			next, err = r.cfg.Refused(ctx, sp, rw.msg, rw.err)
			return err
		})
		if err == nil {
			if next != nil {
				keys, vals := SplitHeaders(next.Headers)
				if _, err := tx.Exec(ctx, r.insertSQL, r.cfg.Group, next.Topic, next.Partition, next.Key, next.Value, keys, vals); err != nil {
					return fmt.Errorf("outbox: store the replacement of refused row %d: %w", rw.id, err)
				}
			}
			if _, err := tx.Exec(ctx, r.deleteSQL, []int64{rw.id}); err != nil {
				return fmt.Errorf("outbox: delete refused row %d: %w", rw.id, err)
			}
			r.cfg.Logger.Warn("kafka refused an outbox record; its writer took it back", "id", rw.id, "topic", rw.msg.Topic, "refusal", rw.err,
				"replaced_by", replacement(next))
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("outbox: refused row %d: %w", rw.id, err)
		}
		rw.err = fmt.Errorf("%w; and its writer could not take it back: %w", rw.err, err)
	}
	r.cfg.Logger.Error("kafka refused an outbox record for good; set aside (outbox.refused_at), the others flow on", "id", rw.id, "topic", rw.msg.Topic, "err", rw.err)
	return r.setAside(ctx, tx, rw.id, rw.err)
}

func replacement(m *Message) string {
	if m == nil {
		return "nothing"
	}
	return m.Topic
}

func (r *Relay) setAside(ctx context.Context, tx pgx.Tx, id int64, why error) error {
	if _, err := tx.Exec(ctx, r.asideSQL, id, safetext.Text(why.Error(), 8<<10)); err != nil {
		return fmt.Errorf("outbox: set row %d aside: %w", id, err)
	}
	return nil
}

// isRefusal reports whether a produce error means Kafka will never take the record as it is:
// too large for the topic or the producer, or invalid. Retrying it can only fail the same way.
func isRefusal(err error) bool {
	for _, e := range []error{kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidRecord, kerr.CorruptMessage, kerr.InvalidTopicException, kerr.PolicyViolation} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
