package processor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kafkapg/kafkapg/internal/handlertest"
	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

func init() {
	handlertest.Try = func(ctx context.Context, tx pgx.Tx, h any, recs any) (int, int, any, error) {
		var emitted []sink.Event
		i, class, err := try(ctx, tx, h.(Handler), recs.([]*Record), &emitted)
		return i, int(class), emitted, err
	}
	handlertest.TryTopic = func(ctx context.Context, tx pgx.Tx, cfg any, topic string, recs any) handlertest.Outcome {
		return tryTopic(ctx, tx, cfg.(*Config), topic, recs.([]*Record))
	}
}

// tryTopic runs recs of topic in tx as a processor configured by cfg runs a batch, for package
// processortest: the record bound, the idempotency key (recorded in tx) and the handler.
func tryTopic(ctx context.Context, tx pgx.Tx, cfg *Config, topic string, recs []*Record) handlertest.Outcome {
	c := cfg.withDefaults()
	pol := c.policy(topic)
	out := handlertest.Outcome{Index: -1, LocalAttempts: pol.localAttempts, TierDelays: pol.tiers,
		DLQTopic: retrytopics.DLQTopic(topic, c.Group), Block: pol.onDeadLetter == OnDeadLetterBlock}
	for n := range pol.tiers {
		out.TierTopics = append(out.TierTopics, retrytopics.TierTopic(topic, c.Group, n+1))
	}
	m, err := newMetrics(prometheus.NewRegistry())
	if err != nil {
		out.Class, out.Err = int(ClassInfrastructure), err
		return out
	}
	var emitted []sink.Event
	p := &Processor{cfg: c, log: slog.New(slog.DiscardHandler), metrics: m, policies: map[string]*policy{topic: pol},
		captured: &emitted, keys: keyring.New(c.Schema), streamSQL: newStreamSQL(c.Schema), retry: retrytopics.NewStore(c.Schema, c.Group)}
	err = p.handle(ctx, tx, topic, recs)
	for i, r := range recs {
		if r.duplicate != nil {
			out.Duplicates = append(out.Duplicates, i)
		}
	}
	if err == nil {
		out.Emitted = emitted
		return out
	}
	index, cause := failedRecord(err, len(recs))
	var pgErr *pgconn.PgError
	if tx.Conn().IsClosed() && !errors.As(cause, &pgErr) {
		cause = fmt.Errorf("%w: %w", sink.ErrConnClosedByHandler, cause)
	}
	out.Index, out.Class, out.Err, out.Duplicates = index, int(p.classify(topic, cause)), cause, nil
	return out
}

// try runs h over recs in tx the way a partition's batch runs (handle), for package
// processortest, and says how the processor would take the outcome.
func try(ctx context.Context, tx pgx.Tx, h Handler, recs []*Record, emitted *[]sink.Event) (index int, class ErrorClass, err error) {
	c := (&Config{Topics: []string{"test"}, Handler: h}).withDefaults()
	m, merr := newMetrics(prometheus.NewRegistry())
	if merr != nil {
		return -1, ClassInfrastructure, merr
	}
	// Record.Emit's events are kept aside: the test's database need not have kafkapg's tables.
	p := &Processor{cfg: c, log: slog.New(slog.DiscardHandler), metrics: m, policies: map[string]*policy{"test": c.policy("test")},
		captured: emitted}
	err = p.handle(ctx, tx, "test", recs)
	if err == nil {
		return -1, 0, nil
	}
	index, cause := failedRecord(err, len(recs))
	var pgErr *pgconn.PgError
	if tx.Conn().IsClosed() && !errors.As(cause, &pgErr) {
		// Postgres is up (this is a test): what closed the connection was the handler, or a
		// context of its own, as sink.Apply would find.
		cause = fmt.Errorf("%w: %w", sink.ErrConnClosedByHandler, cause)
	}
	return index, p.classify("test", cause), cause
}
