// Command quickstart is the smallest useful service built on kafkapg: it applies "order placed"
// events to a Postgres table, exactly once. The README shows it; configure it with the same
// environment variables as cmd/processor (docs/configuration.md).
package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/service"
)

func main() {
	service.Main(service.Handler{
		Name:    "orders",
		Handler: processor.HandlerFunc(handleOrder),
		Setup:   service.SetupSQL(`CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY, amount bigint NOT NULL)`),
	})
}

// OrderPlaced is the JSON value of a record.
type OrderPlaced struct {
	OrderID string `json:"order_id"`
	Amount  int64  `json:"amount"`
}

// handleOrder runs inside the transaction that also advances the partition's offset: its
// writes take effect exactly once.
func handleOrder(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	var o OrderPlaced
	if err := json.Unmarshal(rec.Value, &o); err != nil {
		return processor.Permanent(fmt.Errorf("bad order JSON: %w", err)) // straight to the DLQ
	}
	_, err := tx.Exec(ctx, `INSERT INTO orders (order_id, amount) VALUES ($1, $2)`, o.OrderID, o.Amount)
	return err // any other error is retried, then dead-lettered
}
