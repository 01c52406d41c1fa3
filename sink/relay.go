package sink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/internal/tracing"
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
	// Published, if not nil, is called for every record published and acknowledged, with how long
	// it waited since it was written (about the time from its commit to Kafka's acknowledgement).
	Published func(m Message, waited time.Duration)
	// Listen, if not nil, is a connection configuration (a direct one: not through PgBouncer in
	// transaction mode, which does not pass notifications on) on which the relay LISTENs for the
	// commits of Outbox.Emit, in any process, to publish their records at once. Without it, or
	// while it is down, the relay finds them on its next poll (Interval).
	Listen *pgx.ConnConfig
	// MissingTopicGrace is how long a row whose topic does not exist (and that the client may
	// not create) is retried, counting from its write, before it is handled as refused for good:
	// long enough for a topic being created at the same time to appear. Defaults to 1m.
	MissingTopicGrace time.Duration
	// Retention, if positive, keeps published rows (published_at set) for that long instead of
	// deleting them at once; they are pruned in the background, in small batches.
	Retention time.Duration
	// Refused, if not nil, is called inside the relay's transaction for a message Kafka refuses
	// for good (too large, invalid; see isRefusal), published alone: it may write what the
	// message's fate means for its writer, and return a message to publish in its place (nil:
	// none). The refused row is then deleted. A message Refused gives up on (it returns an
	// error), or every refused message when Refused is nil, stays in the outbox set aside
	// (refused_at, refused_error) for an operator, and the rest flows on.
	Refused func(ctx context.Context, tx pgx.Tx, m Message, refusal error) (*Message, error)
	// TracerProvider, if not nil, receives a "send {topic}" span for each record published, a
	// child of the trace context the row's headers carry; the record carries the send span's
	// context instead (see package processor, Config.TracerProvider).
	TracerProvider trace.TracerProvider
	// Propagator reads and writes that context in headers. Defaults to W3C Trace Context alone
	// (see processor.Config.Propagator).
	Propagator propagation.TextMapPropagator
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
	tracer    *tracing.Tracer // nil: tracing off
	pool      *pgxpool.Pool
	client    *kgo.Client
	notify    chan struct{}
	laneClass int32
	payload   string
	idleSQL   string
	lanesSQL  string
	selectSQL string
	doneSQL   string
	deleteSQL string
	insertSQL string
	asideSQL  string
	statsSQL  string
	pruneSQL  string

	contended atomic.Bool // the last pass found rows in lanes another relay held

	mu     sync.Mutex
	known  map[string]bool // topics found to exist (see checkTopics)
	warned map[string]bool // topics found missing, and logged: their rows wait apart (see Flush)
	// lookedMissing is when the rows of missing topics were last looked at (see Flush).
	lookedMissing time.Time
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
	if cfg.MissingTopicGrace <= 0 {
		cfg.MissingTopicGrace = time.Minute
	}
	if cfg.PublishTimeout <= 0 {
		cfg.PublishTimeout = cfg.TxIdleTimeout * 4 / 5
	}
	t := pgx.Identifier{cfg.Schema, "outbox"}.Sanitize()
	r := &Relay{
		cfg:       cfg,
		tracer:    tracing.New(cfg.TracerProvider, cfg.Propagator, cfg.Group),
		pool:      pool,
		client:    client,
		notify:    make(chan struct{}, 1),
		laneClass: laneLockClass(cfg.Schema, cfg.Group),
		payload:   notifyPayload(cfg.Schema, cfg.Group),
		known:     map[string]bool{},
		warned:    map[string]bool{},
		idleSQL:   fmt.Sprintf("SET LOCAL idle_in_transaction_session_timeout = %d", max(cfg.TxIdleTimeout.Milliseconds(), 1)),
		// The lanes with rows waiting that no other relay holds, locked until this transaction
		// ends. The rows are read by a later statement, whose snapshot is taken after the locks:
		// it sees what the lane's previous relay published as published.
		lanesSQL: fmt.Sprintf(`WITH waiting AS MATERIALIZED (
			SELECT l FROM generate_series(0, %d) AS l
			WHERE EXISTS (SELECT 1 FROM `+t+` o WHERE o.consumer_group = $1 AND o.lane = l AND o.published_at IS NULL AND o.refused_at IS NULL))
			SELECT l::int2, pg_try_advisory_xact_lock($2::int4, l) FROM waiting`, Lanes-1),
		// Each lane's first rows in id order, then the first of those overall: a prefix of every
		// lane, without sorting a whole backlog.
		// $4 are the topics found missing: $5 false reads the rows of every other topic, $5
		// true only theirs.
		selectSQL: `SELECT id, topic, coalesce(partition, -1), key, value, header_keys, header_values, created_at FROM unnest($2::int2[]) AS l,
			LATERAL (SELECT * FROM ` + t + ` o WHERE o.consumer_group = $1 AND o.lane = l AND o.published_at IS NULL AND o.refused_at IS NULL
				AND (o.topic = ANY($4::text[])) = $5::bool
				ORDER BY o.id LIMIT $3) AS o
			ORDER BY id LIMIT $3`,
		deleteSQL: `DELETE FROM ` + t + ` WHERE id = ANY($1)`,
		insertSQL: `INSERT INTO ` + t + ` (consumer_group, topic, partition, lane, key, value, header_keys, header_values, created_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, clock_timestamp())`,
		asideSQL: `UPDATE ` + t + ` SET refused_at = now(), refused_error = $2 WHERE id = $1`,
		statsSQL: `SELECT count(*) FILTER (WHERE refused_at IS NULL), count(*) FILTER (WHERE refused_at IS NOT NULL),
			coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE refused_at IS NULL)), 0)::float8
			FROM ` + t + ` WHERE consumer_group = $1 AND published_at IS NULL`,
		pruneSQL: `DELETE FROM ` + t + ` WHERE id IN (SELECT id FROM ` + t + `
			WHERE consumer_group = $1 AND published_at < now() - $2::interval LIMIT 1000 FOR UPDATE SKIP LOCKED)`,
	}
	r.doneSQL = r.deleteSQL
	if cfg.Retention > 0 {
		r.doneSQL = `UPDATE ` + t + ` SET published_at = now() WHERE id = ANY($1)`
	}
	return r
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
	if r.cfg.Listen != nil {
		listenCtx, stop := context.WithCancel(ctx)
		var listening sync.WaitGroup
		listening.Go(func() { r.listen(listenCtx) })
		defer listening.Wait()
		defer stop()
	}
	tick := time.NewTicker(r.cfg.Interval)
	defer tick.Stop()
	var pruned time.Time
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
		if r.cfg.Retention > 0 && time.Since(pruned) >= pruneInterval {
			pruned = time.Now()
			if n, err := r.Prune(ctx); err != nil && ctx.Err() == nil {
				r.cfg.Logger.Warn("cannot prune published outbox rows; will try again", "err", err, "pruned", n)
			}
		}
		var soon <-chan time.Time
		if r.contended.Load() {
			soon = time.After(min(contendedRetry, r.cfg.Interval))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-r.notify:
		case <-tick.C:
		case <-soon:
		}
	}
}

// contendedRetry is how soon Run looks again when it found rows in lanes another relay held.
const contendedRetry = 20 * time.Millisecond

// pruneInterval is how often Run prunes published rows past RelayConfig.Retention.
const pruneInterval = time.Minute

// Prune deletes the group's published rows older than RelayConfig.Retention, a thousand per
// statement, and returns how many it deleted.
func (r *Relay) Prune(ctx context.Context) (int64, error) {
	var total int64
	for ctx.Err() == nil {
		tag, err := r.pool.Exec(ctx, r.pruneSQL, r.cfg.Group, r.cfg.Retention)
		if err != nil {
			return total, fmt.Errorf("outbox: prune: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < 1000 {
			return total, nil
		}
	}
	return total, ctx.Err()
}

// listen keeps a connection LISTENing for the commits of Outbox.Emit, and wakes the relay on
// each of its outbox, until ctx is done. It reconnects with backoff when the connection fails.
func (r *Relay) listen(ctx context.Context) {
	for failures := 0; ctx.Err() == nil; {
		err := r.listenOnce(ctx, func() { failures = 0 })
		if ctx.Err() != nil {
			return
		}
		failures++
		d := backoff.Policy{Base: r.cfg.BackoffBase, Max: r.cfg.BackoffMax}.Delay(failures)
		if failures == 1 || failures%10 == 0 {
			r.cfg.Logger.Warn("outbox LISTEN connection failed; polling meanwhile", "err", err, "retry_in", d, "poll_interval", r.cfg.Interval)
		}
		if !backoff.Sleep(ctx, nil, d) {
			return
		}
	}
}

func (r *Relay) listenOnce(ctx context.Context, listening func()) error {
	conn, err := pgx.ConnectConfig(ctx, r.cfg.Listen.Copy())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+notifyChannel); err != nil {
		return err
	}
	listening()
	r.Notify() // what committed while it was not listening
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Payload == r.payload {
			r.Notify()
		}
	}
}

// Flush publishes every row of the group's outbox that no other relay holds, and returns how
// many it published. It stops between batches when ctx is done. Rows that fail to publish for a
// reason that may pass are left for a later call, which its error reports.
//
// The rows of a topic found missing wait apart: the batches leave them out, so that however many
// there are they never hold up the others, and they are looked at on their own, once every
// missingRecheck: published if their topic exists by then, set aside once they have waited
// MissingTopicGrace, left waiting otherwise (which is no error of the relay's: it was logged
// when the topic was found missing, and they are in the outbox's backlog).
func (r *Relay) Flush(ctx context.Context) (int, error) {
	total := 0
	for ctx.Err() == nil {
		n, full, err := r.publishBatch(ctx, false)
		total += n
		if err != nil {
			return total, err
		}
		if !full {
			break
		}
	}
	r.mu.Lock()
	look := len(r.warned) > 0 && time.Since(r.lookedMissing) >= missingRecheck
	if look {
		r.lookedMissing = time.Now()
	}
	r.mu.Unlock()
	if !look || ctx.Err() != nil {
		return total, ctx.Err()
	}
	n, _, err := r.publishBatch(ctx, true)
	return total + n, err
}

// missingRecheck is how often Flush looks at the rows of topics found missing.
const missingRecheck = time.Second

// missingTopics returns the topics found missing.
func (r *Relay) missingTopics() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := []string{} // not nil: the statement's array must not be NULL
	for t := range r.warned {
		out = append(out, t)
	}
	slices.Sort(out)
	return out
}

// row is an outbox row being published.
type row struct {
	id      int64
	msg     Message
	created time.Time
	rec     *kgo.Record
	err     error      // its produce result
	span    trace.Span // its send span; nil if tracing is off
}

// publishBatch publishes one batch of rows in one transaction: of the topics found missing if
// missing is set, of the others otherwise. full says the batch was as large as allowed (more rows
// may be waiting).
func (r *Relay) publishBatch(parent context.Context, missing bool) (n int, full bool, err error) {
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
	lanes, err := r.lanes(ctx, tx)
	if err != nil || len(lanes) == 0 {
		return 0, false, err
	}
	rows, full, err := r.read(ctx, tx, lanes, r.missingTopics(), missing)
	if err != nil || len(rows) == 0 {
		return 0, false, err
	}

	// Rows of a topic that does not exist are not produced (see checkTopics).
	stillMissing := r.checkTopics(ctx, rows)
	recs := make([]*kgo.Record, 0, len(rows))
	byRec := make(map[*kgo.Record]*row, len(rows))
	for _, rw := range rows {
		if why, ok := stillMissing[rw.msg.Topic]; ok {
			rw.err = why
			continue
		}
		r.startSend(rw)
		recs = append(recs, rw.rec)
		byRec[rw.rec] = rw
	}
	for _, res := range r.client.ProduceSync(ctx, recs...) {
		byRec[res.Record].err = res.Err
		if errors.Is(res.Err, kerr.UnknownTopicOrPartition) {
			r.setMissing(res.Record.Topic)
		}
	}
	// Kafka fails every record buffered for a partition when it refuses one batch of it: publish
	// the refused ones again, one at a time, to tell the guilty from the innocent.
	for _, rw := range rows {
		if isRefusal(rw.err) {
			rw.err = r.client.ProduceSync(ctx, rw.rec).FirstErr()
		}
	}

	for _, rw := range rows {
		tracing.End(rw.span, rw.err, produceErrorType(rw.err))
	}

	var done []int64
	var failed error
	failedRows := 0
	for _, rw := range rows {
		switch {
		case rw.err == nil:
			done = append(done, rw.id)
		case isRefusal(rw.err) || (errors.Is(rw.err, kerr.UnknownTopicOrPartition) && time.Since(rw.created) > r.cfg.MissingTopicGrace):
			if err := r.refused(ctx, tx, rw); err != nil {
				return 0, false, err
			}
		case errors.Is(rw.err, kerr.UnknownTopicOrPartition) && r.isMissing(rw.msg.Topic):
			// Waits apart (see Flush): not a failure of the relay's.
		default:
			failedRows++
			if failed == nil {
				failed = fmt.Errorf("outbox: publish to %s: %w", rw.msg.Topic, rw.err)
			}
		}
	}
	acked := time.Now()
	// Acknowledged by Kafka. If we die before this commit, the rows are published again later
	// (at least once).
	if len(done) > 0 {
		if _, err := tx.Exec(ctx, r.doneSQL, done); err != nil {
			return 0, false, fmt.Errorf("outbox: delete published rows: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, false, fmt.Errorf("outbox: commit: %w", err)
	}
	if r.cfg.Published != nil {
		for _, rw := range rows {
			if rw.err == nil {
				r.cfg.Published(rw.msg, acked.Sub(rw.created))
			}
		}
	}
	if failed != nil {
		return len(done), false, fmt.Errorf("%d of %d records not published (will retry): %w", failedRows, len(rows), failed)
	}
	return len(done), full, nil
}

// startSend starts rw's send span, if tracing is on, and puts its context in the record's headers
// in place of the context the row carries (the transaction's that wrote it). The row keeps its
// headers: published again, the record gets the context of its new send span.
func (r *Relay) startSend(rw *row) {
	if r.tracer == nil {
		return
	}
	var id string
	for _, h := range rw.msg.Headers {
		if h.Key == HeaderMessageID {
			id = string(h.Value)
		}
	}
	ctx, span := r.tracer.StartSend(rw.msg.Headers, rw.msg.Topic, rw.msg.Partition, id)
	rw.span = span
	rw.rec.Headers = r.tracer.Inject(ctx, rw.msg.Headers)
}

// produceErrorType names a produce failure for a span's error.type: Kafka's error code name, or
// the Go type of other errors.
func produceErrorType(err error) string {
	var ke *kerr.Error
	if errors.As(err, &ke) {
		return ke.Message
	}
	if err == nil {
		return ""
	}
	return fmt.Sprintf("%T", err)
}

// setMissing notes that topic does not exist (it was deleted): its rows are not produced until
// checkTopics finds it again.
func (r *Relay) setMissing(topic string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.known, topic)
}

// isMissing reports whether topic was found missing.
func (r *Relay) isMissing(topic string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.warned[topic]
}

// checkTopics asks the broker, in one metadata request, whether the topics of rows not known to
// exist exist, and returns, for each that does not, the error its rows fail with (they are not
// produced: a produce to a missing topic waits out franz-go's metadata retries, for tens of
// seconds, holding up the batch).
func (r *Relay) checkTopics(ctx context.Context, rows []*row) map[string]error {
	r.mu.Lock()
	var topics []string
	for _, rw := range rows {
		if !r.known[rw.msg.Topic] && !slices.Contains(topics, rw.msg.Topic) {
			topics = append(topics, rw.msg.Topic)
		}
	}
	r.mu.Unlock()
	if len(topics) == 0 {
		return nil
	}
	out := map[string]error{}
	exists, err := r.topicsExist(ctx, topics)
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, t := range topics {
		switch e, ok := exists[t]; {
		case err != nil:
			out[t] = fmt.Errorf("cannot ask the broker whether topic %s exists: %w", t, err)
		case ok && e != nil && !errors.Is(e, kerr.UnknownTopicOrPartition):
			// It may well exist (a leader being elected, no authorization to describe it):
			// retried, never set aside as missing.
			out[t] = fmt.Errorf("cannot tell whether topic %s exists: %w", t, e)
		case !ok || e != nil:
			out[t] = fmt.Errorf("%w: topic %s does not exist", kerr.UnknownTopicOrPartition, t)
			if !r.warned[t] {
				r.cfg.Logger.Warn("outbox records are for a topic that does not exist; they wait for it, and are set aside after the grace",
					"topic", t, "grace", r.cfg.MissingTopicGrace)
				r.warned[t] = true
			}
		default:
			r.known[t] = true
			if r.warned[t] {
				r.cfg.Logger.Info("a topic that was missing exists now; its outbox records are published", "topic", t)
				delete(r.warned, t)
			}
		}
	}
	return out
}

// topicsExist asks the broker about topics, with a metadata request of its own: kadm answers
// from the client's metadata cache, which said for seconds after a topic was created that it did
// not exist (rows past the grace would have been set aside). It returns, for each topic it heard
// of, nil if it exists and its error otherwise.
func (r *Relay) topicsExist(ctx context.Context, topics []string) (map[string]error, error) {
	req := kmsg.NewPtrMetadataRequest()
	req.AllowAutoTopicCreation = false // asking is not creating
	for _, t := range topics {
		rt := kmsg.NewMetadataRequestTopic()
		rt.Topic = kmsg.StringPtr(t)
		req.Topics = append(req.Topics, rt)
	}
	resp, err := req.RequestWith(ctx, r.client)
	if err != nil {
		return nil, err
	}
	out := map[string]error{}
	for _, t := range resp.Topics {
		if t.Topic != nil {
			out[*t.Topic] = kerr.ErrorForCode(t.ErrorCode)
		}
	}
	return out, nil
}

// lanes sets the transaction's idle timeout and locks, for the transaction, the lanes that have
// rows waiting and that no other relay holds. One relay at a time publishes a lane, in id order:
// that keeps the records of a key in the order they were written (see Outbox.Emit). A relay takes
// every lane it can; another relay takes over a lane when the transaction that held it ends.
func (r *Relay) lanes(ctx context.Context, tx pgx.Tx) ([]int16, error) {
	b := &pgx.Batch{}
	b.Queue(r.idleSQL)
	// The relay's commit need not wait for its WAL flush: a commit lost in a crash of Postgres
	// leaves rows Kafka has, which are published again (at least once, as when the relay dies
	// before its commit), together with everything else the transaction did with them.
	b.Queue("SET LOCAL synchronous_commit = off")
	var lanes []int16
	held := false
	b.Queue(r.lanesSQL, r.cfg.Group, r.laneClass).Query(func(rows pgx.Rows) error {
		var lane int16
		var locked bool
		_, err := pgx.ForEachRow(rows, []any{&lane, &locked}, func() error {
			if locked {
				lanes = append(lanes, lane)
			} else {
				held = true
			}
			return nil
		})
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("outbox: lock lanes: %w", err)
	}
	// Rows waited in lanes another relay held: it may not have been woken for them (they were
	// written in this process, which wakes only its own relay). Look again soon.
	r.contended.Store(held)
	return lanes, nil
}

// read reads up to BatchSize rows of lanes, and BatchBytes of their contents (at least one row),
// a prefix of each lane in id order. A row that cannot be read back into a record (edited by
// hand) is set aside. full says the limit was reached.
func (r *Relay) read(ctx context.Context, tx pgx.Tx, lanes []int16, missingTopics []string, missing bool) ([]*row, bool, error) {
	rs, err := tx.Query(ctx, r.selectSQL, r.cfg.Group, lanes, r.cfg.BatchSize, missingTopics, missing)
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
		if err := rs.Scan(&rw.id, &rw.msg.Topic, &rw.msg.Partition, &rw.msg.Key, &rw.msg.Value, &keys, &vals, &rw.created); err != nil {
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
			break // the rows read no further stay unpublished, in their lanes' order: the next batch takes them
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
				if _, err := tx.Exec(ctx, r.insertSQL, r.cfg.Group, next.Topic, next.partition(), lane(next.Topic, next.Key), next.Key, next.Value, keys, vals); err != nil {
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
