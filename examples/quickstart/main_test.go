package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/testenv"
)

// TestQuickstart runs the README's example program against real Postgres and kfake.
func TestQuickstart(t *testing.T) {
	pool, url := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	if _, err := kadm.NewClient(k.Client(t)).CreateTopic(context.Background(), 2, 1, nil, "orders"); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DATABASE_URL", url)
	t.Setenv("KAFKA_BROKERS", k.Brokers[0])
	k.Produce(t,
		&kgo.Record{Topic: "orders", Key: []byte("o-1"), Value: []byte(`{"order_id":"o-1","amount":42}`)},
		&kgo.Record{Topic: "orders", Key: []byte("o-2"), Value: []byte(`not json`)},
		&kgo.Record{Topic: "orders", Key: []byte("o-3"), Value: []byte(`{"order_id":"o-3","amount":7}`)},
	)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	testenv.Eventually(t, 30*time.Second, func() error {
		var n, sum int64
		if err := pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM orders`).Scan(&n, &sum); err != nil {
			return err
		}
		if n != 2 || sum != 49 {
			return fmt.Errorf("orders: %d rows, sum %d; want 2 rows, sum 49", n, sum)
		}
		return nil
	})
	testenv.Eventually(t, 30*time.Second, func() error {
		if got := len(k.ReadAll(t, "orders.orders-to-postgres.dlq")); got != 1 {
			return fmt.Errorf("%d dead letters, want 1 (the bad JSON)", got)
		}
		return nil
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
}
