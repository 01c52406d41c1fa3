package processortest_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/processortest"
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
	var t *testing.T       // the test's
	var pool *pgxpool.Pool // on a test database with the handler's tables
	res := processortest.Run(t, pool, processor.HandlerFunc(handleOrder), processortest.NewRecord("orders", "o-1", "not json"))
	if res.Class != processor.ClassPermanent {
		t.Errorf("bad JSON: %v, want it dead-lettered at once", res)
	}
}
