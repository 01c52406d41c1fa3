package processortest_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/processortest"
	"github.com/kafkapg/kafkapg/service"
)

func handleOrder(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	var o struct{ OrderID string }
	if err := json.Unmarshal(rec.Value, &o); err != nil {
		return processor.Permanent(err)
	}
	_, err := tx.Exec(ctx, `INSERT INTO orders (order_id) VALUES ($1)`, o.OrderID)
	return err
}

// In a test of your handler: a record with bad JSON must be dead-lettered at once, not retried.
func ExampleRun() {
	var t *testing.T // the test's
	pool := processortest.DB(t)
	if _, err := pool.Exec(t.Context(), `CREATE TABLE orders (order_id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	res := processortest.Run(t, pool, processor.HandlerFunc(handleOrder), processortest.NewRecord("orders", "o-1", "not json"))
	if res.Class != processor.ClassPermanent {
		t.Errorf("bad JSON: %v, want it dead-lettered at once", res)
	}
}

// In a test of your service's handler, with what the service does around it: its idempotency
// key skips a producer's second copy of an order, and a failure's path follows its policy.
func ExampleService() {
	var t *testing.T // the test's
	orders := service.Handler{
		Name:           "orders",
		Handler:        processor.HandlerFunc(handleOrder),
		Setup:          service.SetupSQL(`CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY)`),
		IdempotencyKey: processor.KeyFromJSON("OrderID"),
	}
	svc := processortest.NewService(t, processortest.DB(t), orders) // runs Setup
	first := processortest.NewRecord("orders", "o-1", `{"OrderID":"o-1"}`)
	copied := processortest.NewRecord("orders", "o-1", `{"OrderID":"o-1"}`)
	copied.Offset = 1
	if res := svc.Run(first); !res.Applied() {
		t.Fatal(res)
	}
	if res := svc.Run(copied); !res.Applied() || len(res.Duplicates) != 1 {
		t.Errorf("a copy of o-1: %v, want it skipped as a duplicate", res)
	}
	res := svc.Run(processortest.NewRecord("orders", "o-2", "not json"))
	if res.Next.DeadLetterTopic != "orders.test.dlq" || res.Next.LocalAttempts != 0 {
		t.Errorf("bad JSON goes: %v; want the DLQ at once", res.Next)
	}
}
