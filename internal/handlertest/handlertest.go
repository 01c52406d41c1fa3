// Package handlertest connects package processortest to the processor's own way of running a
// handler, without making it part of the processor's API: the processor sets Try and TryTopic
// when it is initialised.
package handlertest

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// Try runs handler (a processor.Handler) over recs (a []*processor.Record) in tx as the
// processor does, and returns the index of the failing record (-1 if the failure is not one
// record's), the class (a processor.ErrorClass) the processor would give the failure, the events
// (a []sink.Event) the handler emitted (Record.Emit), which the processor would write to the
// outbox, and the failure, nil if the records would be applied.
var Try func(ctx context.Context, tx pgx.Tx, handler any, recs any) (index int, class int, emitted any, err error)

// TryTopic runs recs (a []*processor.Record of topic) in tx as a processor configured by cfg (a
// *processor.Config: its Group, Schema, Handler, TopicPolicies and defaults) runs a batch of
// topic: the record bound, the idempotency key (recorded in tx, in cfg.Schema's tables), the
// handler. It reports the outcome as Try does, and the path a failing record of it would take.
var TryTopic func(ctx context.Context, tx pgx.Tx, cfg any, topic string, recs any) Outcome

// Outcome is what TryTopic reports.
type Outcome struct {
	Index   int
	Class   int
	Emitted any
	Err     error
	// Duplicates are the indexes of the records skipped as duplicates of records applied before.
	Duplicates []int
	// The topic's policy, its defaults applied: the local attempts of a retryable failure, its
	// retry tiers (their topics and delays) and dead-letter topic, and whether a dead letter
	// blocks its key.
	LocalAttempts int
	TierTopics    []string
	TierDelays    []time.Duration
	DLQTopic      string
	Block         bool
}
