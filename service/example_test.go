package service_test

import (
	"context"
	"encoding/json"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/service"
)

func handleOrder(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	var o struct {
		OrderID string `json:"order_id"`
		Amount  int64  `json:"amount"`
	}
	if err := json.Unmarshal(rec.Value, &o); err != nil {
		return processor.Permanent(err)
	}
	_, err := tx.Exec(ctx, `INSERT INTO orders (order_id, amount) VALUES ($1, $2)`, o.OrderID, o.Amount)
	return err
}

// The main of a service: build it, then run it with KAFKA_BROKERS, KAFKA_GROUP_ID, KAFKA_TOPICS
// and DATABASE_URL set.
func ExampleMain() {
	service.Main(service.Handler{
		Name:    "orders",
		Handler: processor.HandlerFunc(handleOrder),
		Setup:   service.SetupSQL(`CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY, amount bigint NOT NULL)`),
	})
}
