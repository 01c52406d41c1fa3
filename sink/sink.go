package sink

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/offsets"
)

// Message is a record to publish to Kafka once the transaction that stored it commits.
type Message struct {
	Topic string
	// Partition is the partition to publish to, modulo the topic's partition count; a negative
	// one publishes by key, as Kafka's own producers do (see Partitioner).
	Partition int32
	Key       []byte
	Value     []byte
	Headers   []kgo.RecordHeader
}

// size is what the message weighs in a produce batch: key, value and headers.
func (m Message) size() int {
	n := len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

// partition is the message's partition as the outbox stores it: NULL for "by key".
func (m Message) partition() *int32 {
	if m.Partition < 0 {
		return nil
	}
	return &m.Partition
}

// Partitioner is the kgo partitioner a Relay's client must use: it publishes each message to its
// Partition modulo the topic's partition count, and a message with a negative Partition (an Event)
// where Kafka's default partitioner would: murmur2 of the key, or any partition without a key.
func Partitioner() kgo.Partitioner {
	return kgo.BasicConsistentPartitioner(func(topic string) func(*kgo.Record, int) int {
		byKey := kgo.StickyKeyPartitioner(nil).ForTopic(topic)
		var next atomic.Uint32
		return func(r *kgo.Record, n int) int {
			switch {
			case r.Partition >= 0:
				return int(uint32(r.Partition) % uint32(n))
			case r.Key != nil:
				return byKey.Partition(r, n)
			}
			return int(next.Add(1) % uint32(n))
		}
	})
}

// HandlerError is returned by Apply when the function applying the effects failed (or Postgres
// rejected those effects at COMMIT). The transaction was rolled back; nothing was applied.
type HandlerError struct {
	Err error
}

func (e *HandlerError) Error() string { return e.Err.Error() }
func (e *HandlerError) Unwrap() error { return e.Err }

// ErrConnLost wraps a handler error that happened while the connection to Postgres was lost:
// the failure was Postgres's, not the record's.
var ErrConnLost = errors.New("connection to postgres lost during the transaction")

// ErrCommitUnknown wraps a failed COMMIT whose outcome is unknown. Retry the same Apply: it
// resolves to nil or offsets.ErrAlreadyAdvanced.
var ErrCommitUnknown = errors.New("commit outcome unknown")

// ErrTxAborted is the error of an apply function that returned nil although one of its statements
// failed: Postgres has aborted the transaction, which can only roll back. It is the record's
// failure (a handler that swallowed an error), returned inside a HandlerError.
var ErrTxAborted = errors.New("a statement failed but the handler returned nil: the transaction is aborted and cannot commit " +
	"(to carry on after an expected error, run the statement in a savepoint (tx.Begin) or use ON CONFLICT)")

// ErrConnClosedByHandler is the error of an apply function during which the connection closed
// while Postgres stayed up because of the handler itself: a statement it ran under a context of
// its own (a timeout) was interrupted, and pgx closes the connection when that happens. It is the
// record's failure, returned inside a HandlerError.
var ErrConnClosedByHandler = errors.New("the transaction's connection was closed during the handler while postgres stayed up " +
	"(a statement interrupted by a context of the handler's own, such as a timeout)")

// ErrNilOnClosedConn is what an apply function returns when the function it ran (a handler)
// returned nil although the transaction's connection had closed under it: it dropped the error
// that closed it. Apply judges it as it judges a context error of the handler's own.
var ErrNilOnClosedConn = errors.New("the handler returned nil, but the transaction's connection closed under it")

// Sink applies batches transactionally for one consumer group.
type Sink struct {
	pool      *pgxpool.Pool
	offsets   *offsets.Store
	outboxSQL string
	idleSQL   string
	written   func()
}

// Config configures a Sink.
type Config struct {
	// Schema holds kafkapg's tables. Required.
	Schema string
	// TxIdleTimeout is set as the transactions' idle_in_transaction_session_timeout: Postgres
	// ends a transaction whose client has sent nothing for that long, releasing its locks. It
	// bounds how long a stalled owner (a paused process, a stuck handler) can make the
	// partition's next owner wait for the offsets row. Zero leaves the server's setting.
	TxIdleTimeout time.Duration
	// Written, if not nil, is called after every commit that stored outbox messages (to wake a
	// Relay).
	Written func()
}

// New returns a Sink that advances offsets in store.
func New(pool *pgxpool.Pool, store *offsets.Store, cfg Config) *Sink {
	s := &Sink{
		pool:    pool,
		offsets: store,
		outboxSQL: `INSERT INTO ` + pgx.Identifier{cfg.Schema, "outbox"}.Sanitize() +
			` (consumer_group, topic, partition, lane, key, value, header_keys, header_values, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, clock_timestamp())`,
		written: cfg.Written,
	}
	if ms := cfg.TxIdleTimeout.Milliseconds(); ms > 0 {
		s.idleSQL = fmt.Sprintf("SET LOCAL idle_in_transaction_session_timeout = %d", ms)
	}
	return s
}

// Offsets returns the offset store the sink advances.
func (s *Sink) Offsets() *offsets.Store { return s.offsets }

// Apply runs one transaction that advances pos to next, runs apply (if not nil) and stores msgs in
// the outbox, then commits. BEGIN, the offset advance and the outbox inserts travel in one round
// trip; apply's own statements follow, then COMMIT.
func (s *Sink) Apply(ctx context.Context, pos offsets.Position, next int64, apply func(context.Context, pgx.Tx) error, msgs []Message) error {
	return s.apply(ctx, &pos, next, apply, msgs)
}

// Transact is Apply without an offset advance, for work that is not consumed from a partition
// (records held in Postgres): whatever makes it happen once must be in apply.
func (s *Sink) Transact(ctx context.Context, apply func(context.Context, pgx.Tx) error, msgs []Message) error {
	return s.apply(ctx, nil, 0, apply, msgs)
}

func (s *Sink) apply(ctx context.Context, pos *offsets.Position, next int64, apply func(context.Context, pgx.Tx) error, msgs []Message) (err error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	if s.idleSQL != "" {
		b.Queue(s.idleSQL)
	}
	var adv *pgx.QueuedQuery
	var paused bool
	if pos != nil {
		adv = s.offsets.QueueAdvance(b, *pos, next)
		s.offsets.QueuePauseCheck(b, *pos, &paused)
	}
	for _, m := range msgs {
		keys, vals := SplitHeaders(m.Headers)
		b.Queue(s.outboxSQL, s.offsets.Group(), m.Topic, m.partition(), lane(m.Topic, m.Key), m.Key, m.Value, keys, vals)
	}

	br := s.pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer func() {
		if err != nil {
			// The rollback must run even when ctx is what failed the transaction.
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	var advanced int64
	if adv != nil {
		adv.Exec(func(tag pgconn.CommandTag) error {
			advanced = tag.RowsAffected()
			return nil
		})
	}
	if err := br.Close(); err != nil {
		if pos == nil {
			return fmt.Errorf("begin, store %d outbox messages: %w", len(msgs), err)
		}
		return fmt.Errorf("begin, advance %s to %d, store %d outbox messages: %w", pos.TP(), next, len(msgs), err)
	}
	if pos != nil {
		if err := s.offsets.CheckAdvance(ctx, tx, *pos, next, advanced); err != nil {
			return err
		}
		if err := s.offsets.CheckPaused(*pos, paused); err != nil {
			return err
		}
	}

	if apply != nil {
		if err := s.applied(ctx, tx, apply(ctx, tx)); err != nil {
			return err
		}
	}

	if err := tx.Commit(ctx); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) || errors.Is(err, pgx.ErrTxCommitRollback) {
			// The server answered: the transaction did not commit. A deferred constraint or a
			// serialization failure; classification decides whose fault it is.
			return &HandlerError{Err: fmt.Errorf("commit: %w", err)}
		}
		return fmt.Errorf("%w: %w", ErrCommitUnknown, err)
	}
	if len(msgs) > 0 && s.written != nil {
		s.written()
	}
	return nil
}

// applied judges how apply's run inside tx ended, err being what it returned: nil if the
// transaction may commit, a *HandlerError if it failed by the records' (the handler's) fault, an
// error wrapping ErrConnLost if Postgres failed under it.
func (s *Sink) applied(ctx context.Context, tx pgx.Tx, err error) error {
	var pgErr *pgconn.PgError
	switch {
	case !tx.Conn().IsClosed():
		if err != nil {
			return &HandlerError{Err: err}
		}
		if tx.Conn().PgConn().TxStatus() == 'E' {
			return &HandlerError{Err: ErrTxAborted}
		}
		return nil
	case errors.As(err, &pgErr):
		// The server sent the error (pgx closes the connection after a FATAL one, such as the
		// idle-in-transaction timeout): classification judges it.
		return &HandlerError{Err: err}
	}
	// The connection is gone. A context of the handler's own that ended (a timeout it set) closes
	// it, and so does an error the handler dropped; if then the transaction's own context is fine
	// and Postgres answers a fresh connection, nothing outside the handler broke it, and retrying
	// in place would fail the same way for ever: it is the record's failure. Anything else (the
	// connection reset, Postgres gone) is Postgres's.
	own := errors.Is(err, ErrNilOnClosedConn) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
	if own && ctx.Err() == nil && s.answers(ctx) {
		return &HandlerError{Err: fmt.Errorf("%w: %w", ErrConnClosedByHandler, err)}
	}
	if err == nil {
		err = errors.New("the apply function returned nil")
	}
	return fmt.Errorf("%w: %w", ErrConnLost, err)
}

// answerTimeout bounds the check that Postgres answers a fresh connection.
const answerTimeout = 3 * time.Second

// answers reports whether Postgres answers a fresh connection (not one of the pool's, which may
// all be busy) within answerTimeout.
func (s *Sink) answers(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, answerTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, s.pool.Config().ConnConfig.Copy())
	if err != nil {
		return false
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.Ping(ctx) == nil
}
