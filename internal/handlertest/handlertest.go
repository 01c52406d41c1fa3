// Package handlertest connects package processortest to the processor's own way of running a
// handler, without making it part of the processor's API: the processor sets Try when it is
// initialised.
package handlertest

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// Try runs handler (a processor.Handler) over recs (a []*processor.Record) in tx as the
// processor does, and returns the index of the failing record (-1 if the failure is not one
// record's), the class (a processor.ErrorClass) the processor would give the failure, the events
// (a []sink.Event) the handler emitted (Record.Emit), which the processor would write to the
// outbox, and the failure, nil if the records would be applied.
var Try func(ctx context.Context, tx pgx.Tx, handler any, recs any) (index int, class int, emitted any, err error)
