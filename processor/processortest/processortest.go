// Package processortest tests a processor.Handler (or processor.BatchHandler) without Kafka:
// it runs the handler on records the test builds, inside a real Postgres transaction, exactly as
// a processor runs a batch (panics recovered, records over the size bound refused, a swallowed
// statement error or a connection the handler closed caught), and reports what the processor
// would do with the outcome.
//
// DB gives a test its own database: on TEST_DATABASE_URL's server, or, when that is unset, on a
// throwaway server the test binary starts from the PostgreSQL binaries. So `go test ./...` needs
// no setup where they are installed.
//
//	func TestHandleOrder(t *testing.T) {
//		pool := processortest.DB(t)
//		// ... create the handler's tables ...
//		res := processortest.Run(t, pool, processor.HandlerFunc(handleOrder),
//			processortest.NewRecord("orders", "o-1", `{"order_id":"o-1","amount":42}`))
//		if !res.Applied() {
//			t.Fatal(res)
//		}
//	}
//
// Run rolls the transaction back; RunInTx runs in a transaction of the test's, to look at what
// the handler wrote before rolling back.
//
// A handler that is a processor.Preparer has its Prepare called as the processor calls it:
// before Handle, once for each record of the run, outside what Handle writes, with a failure of
// Prepare reported as Handle's would be. Run and RunInTx prepare the records one at a time, in
// order (Config.Concurrency 1); Service.Run prepares up to the handler's Concurrency of them at
// once, the records of one key one at a time, in order.
//
// Service runs a service.Handler as the service runs it for a topic, with what the service does
// around the handler: its Setup, its idempotency key (Result.Duplicates: a copy of a record
// applied before is skipped), and, for a failure, where the record would go under its policy
// (Result.Next: retried in place, through which retry tiers, to which dead-letter topic).
// It commits what succeeds, as the service does, so that a later Run sees it.
//
// To run the whole service on a broker instead — its consumer group, retry tiers, dead letters
// and published events — see package service/servicetest.
package processortest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/internal/handlertest"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/sink"
)

// Result is how a run of a handler ended, as the processor sees it.
type Result struct {
	// Err is the failure; nil means the records would be applied (and the offset advanced in
	// the same transaction).
	Err error
	// Class is the class the processor gives Err: processor.ClassRetryable records are retried
	// and go through the retry tiers, processor.ClassPermanent ones are dead-lettered at once,
	// and processor.ClassInfrastructure failures are retried in place without counting an
	// attempt. It is meaningless when Err is nil.
	Class processor.ErrorClass
	// Index is the index, among the records run, of the record that failed; -1 if Err is not one
	// record's (a batch handler's error without processor.RecordFailed: the processor then
	// bisects the batch to find it).
	Index int
	// Emitted are the events the handler emitted (Record.Emit), with their ids, in order: what
	// the processor would write to the outbox in the same transaction. Nil after a failure.
	Emitted []sink.Event
	// Duplicates are the indexes of the records skipped because their idempotency key was
	// applied before (Service.Run only): the processor advances their offsets without handing
	// them to the handler. Nil after a failure (the skips are rolled back with it).
	Duplicates []int
	// Next is where the failing record would go under its topic's policy (Service.Run only):
	// retried in place, through the retry tiers, or to the dead-letter topic.
	Next Path
}

// Applied reports whether the records would be applied.
func (r Result) Applied() bool { return r.Err == nil }

// String describes the result, for test failures.
func (r Result) String() string {
	if r.Err == nil && len(r.Duplicates) > 0 {
		return fmt.Sprintf("applied; records %v skipped as duplicates", r.Duplicates)
	}
	if r.Err == nil {
		return "applied"
	}
	next := ""
	if r.Next.InPlace || r.Next.DeadLetterTopic != "" {
		next = "; " + r.Next.String()
	}
	if r.Index < 0 {
		return fmt.Sprintf("failed (%v): %v%s", r.Class, r.Err, next)
	}
	return fmt.Sprintf("record %d failed (%v): %v%s", r.Index, r.Class, r.Err, next)
}

// Beginner starts transactions: a *pgxpool.Pool or a *pgx.Conn.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Run runs h on recs in a new transaction on db, which it then rolls back. A failure to begin the
// transaction fails the test.
func Run(t testing.TB, db Beginner, h processor.Handler, recs ...*processor.Record) Result {
	t.Helper()
	ctx := t.Context()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatalf("processortest: begin: %v", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	return RunInTx(ctx, tx, h, recs...)
}

// RunInTx runs h on recs in tx, as one batch of a partition. It leaves tx open: the caller can
// query what the handler wrote, then roll back. After a failure the processor would roll back
// too; tx may then be unusable.
func RunInTx(ctx context.Context, tx pgx.Tx, h processor.Handler, recs ...*processor.Record) Result {
	if len(recs) == 0 {
		return Result{Index: -1}
	}
	i, class, emitted, err := handlertest.Try(ctx, tx, h, recs)
	res := Result{Err: err, Class: processor.ErrorClass(class), Index: i}
	if err == nil {
		res.Emitted = emitted.([]sink.Event)
	}
	return res
}

// NewRecord returns a record of topic with key and value, as first delivered: partition 0,
// offset 0, attempt 1, timestamped now. Set other fields as the test needs.
func NewRecord(topic, key, value string) *processor.Record {
	r := &processor.Record{Topic: topic, Value: []byte(value), Attempt: 1, Timestamp: time.Now()}
	if key != "" {
		r.Key = []byte(key)
	}
	return r
}
