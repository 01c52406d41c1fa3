package processor_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/sink"
)

// A processor in a program of your own: migrate kafkapg's tables, create the handler's, and run
// until SIGTERM. (The service package does all this, and more, from environment variables.)
func ExampleNew() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (order_id text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	p, err := processor.New(pool, &processor.Config{
		Brokers: []string{"localhost:9092"},
		Group:   "orders-to-postgres",
		Topics:  []string{"orders", "refunds"},
		Handler: processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			var o struct {
				OrderID string `json:"order_id"`
				Amount  int64  `json:"amount"`
			}
			if err := json.Unmarshal(rec.Value, &o); err != nil {
				return processor.Permanent(err) // straight to the dead letters
			}
			_, err := tx.Exec(ctx, `INSERT INTO orders (order_id, amount) VALUES ($1, $2)`, o.OrderID, o.Amount)
			return err // retried, then through the retry tiers
		}),
		// Refunds are urgent and cheap to retry: faster tiers than the default 1s, 10s, 1m.
		TopicPolicies: map[string]processor.TopicPolicy{
			"refunds": {RetryTiers: []time.Duration{200 * time.Millisecond, time.Second}},
		},
	})
	if err != nil {
		log.Fatal(err) // a *processor.ConfigError names the field at fault
	}
	if err := p.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

// pageViews counts page views with one COPY per batch: the fastest way into Postgres. A
// BatchHandlerFunc needs no Handle of its own.
var pageViews = processor.BatchHandlerFunc(func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	rows := make([][]any, len(recs))
	for i, r := range recs {
		rows[i] = []any{r.Topic, r.Partition, r.Offset, string(r.Key)}
	}
	_, err := tx.CopyFrom(ctx, pgx.Identifier{"page_views"}, []string{"topic", "partition", "offset", "url"}, pgx.CopyFromRows(rows))
	// One row per record, in order: Postgres's "COPY page_views, line N" names the record that
	// failed, and the processor applies the others without splitting the batch.
	return processor.CopyFailed(err)
})

// A BatchHandler receives a partition's batch at once, in the transaction that commits its
// offset.
func ExampleBatchHandler() {
	var h processor.Handler = pageViews
	_, ok := h.(processor.BatchHandler)
	fmt.Println("batch handler:", ok)
	// Output: batch handler: true
}

// A handler that applies a payment and tells the next service, in one transaction: the
// PaymentSettled event reaches Kafka if and only if the payment's effects commit, with a
// message id that is the same however often the record is handled. The topic deduplicates
// payments its producer sent twice by their payment_id.
func ExampleRecord_Emit() {
	handler := processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
		var p struct {
			PaymentID string `json:"payment_id"`
			Account   string `json:"account"`
			Amount    int64  `json:"amount"`
		}
		if err := json.Unmarshal(rec.Value, &p); err != nil {
			return processor.Permanent(err)
		}
		if _, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1`, p.Account, p.Amount); err != nil {
			return err
		}
		settled, _ := json.Marshal(map[string]any{"payment_id": p.PaymentID, "account": p.Account})
		return rec.Emit(ctx, tx, sink.Event{Topic: "payments.settled", Key: []byte(p.Account), Value: settled})
	})
	cfg := &processor.Config{
		Brokers: []string{"localhost:9092"},
		Group:   "payments",
		Topics:  []string{"payments"},
		Handler: handler,
		TopicPolicies: map[string]processor.TopicPolicy{
			"payments": {IdempotencyKey: processor.KeyFromJSON("payment_id")},
		},
	}
	fmt.Println(cfg.Validate())
	// Output: <nil>
}

// A key is named as it was built, in the startup log and the service's config command; a
// function of your own is named as such, and not called to find out.
func ExampleIdempotencyKey_String() {
	mine := func(rec *processor.Record) ([]byte, error) { return rec.Key, nil }
	for _, k := range []processor.IdempotencyKey{processor.KeyFromJSON("payment_id"), processor.KeyFromHeader("x-id"), mine, nil} {
		fmt.Println(k)
	}
	// Output:
	// KeyFromJSON("payment_id")
	// KeyFromHeader("x-id")
	// a function of yours
	// none
}
