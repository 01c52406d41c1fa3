// Command quickstart is the smallest useful program built on kafkapg: it applies "order placed"
// events from the topic "orders" to a Postgres table, exactly once. The README shows it.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/processor"
)

// OrderPlaced is the JSON value of a record on "orders".
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

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		return err
	}
	p, err := processor.New(pool, &processor.Config{
		Brokers: []string{os.Getenv("KAFKA_BROKERS")},
		Group:   "orders-to-postgres",
		Topics:  []string{"orders"},
		Handler: processor.HandlerFunc(handleOrder),
		Logger:  slog.New(slog.NewJSONHandler(os.Stderr, nil)),
	})
	if err != nil {
		return err
	}
	return p.Run(ctx) // until SIGTERM; then drains, commits and leaves the group
}
