package processortest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/processortest"
	"github.com/kafkapg/kafkapg/service"
	"github.com/kafkapg/kafkapg/sink"
)

// reserve is an inventory handler as a team writes one: stock per SKU, an order reserves
// stock, too little stock is permanent, a lock timeout is retryable, an event emitted.
func reserve(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	var o struct {
		OrderID string `json:"order_id"`
		SKU     string `json:"sku"`
		Qty     int    `json:"qty"`
	}
	if err := json.Unmarshal(rec.Value, &o); err != nil {
		return processor.Permanent(err)
	}
	if o.SKU == "locked" {
		return errors.New("canceling statement due to lock timeout")
	}
	if o.SKU == "db-down" {
		return processor.Infrastructure(errors.New("connection refused"))
	}
	tag, err := tx.Exec(ctx, `UPDATE stock SET qty = qty - $2 WHERE sku = $1 AND qty >= $2`, o.SKU, o.Qty)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return processor.Permanent(fmt.Errorf("order %s: not enough %s in stock", o.OrderID, o.SKU))
	}
	return rec.Emit(ctx, tx, sink.Event{Topic: "inventory.reserved", Key: []byte(o.OrderID), Value: rec.Value})
}

var inventory = service.Handler{
	Name:           "inventory",
	Handler:        processor.HandlerFunc(reserve),
	Setup:          service.SetupSQL(`CREATE TABLE IF NOT EXISTS stock (sku text PRIMARY KEY, qty int NOT NULL); INSERT INTO stock VALUES ('apple', 5) ON CONFLICT DO NOTHING`),
	IdempotencyKey: processor.KeyFromJSON("order_id"),
	RetryTiers:     []time.Duration{time.Second, time.Minute},
}

// TestServiceRunsWhatTheServiceWould: the idempotency key skips a producer's second copy (a
// new offset, the same order), a run's effects are committed, and each class of failure has
// its path under the handler's policy.
func TestServiceRunsWhatTheServiceWould(t *testing.T) {
	db := processortest.DB(t)
	svc := processortest.NewService(t, db, inventory)
	svc.Group = "inventory-svc"
	order := func(offset int64, v string) *processor.Record {
		r := processortest.NewRecord("orders", "o-1", v)
		r.Offset = offset
		return r
	}
	stock := func() int {
		var n int
		if err := db.QueryRow(context.Background(), `SELECT qty FROM stock WHERE sku = 'apple'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	res := svc.Run(order(0, `{"order_id":"o-1","sku":"apple","qty":2}`))
	if !res.Applied() || len(res.Emitted) != 1 || res.Emitted[0].Topic != "inventory.reserved" || len(res.Duplicates) != 0 {
		t.Fatalf("first order: %v, emitted %+v", res, res.Emitted)
	}
	res = svc.Run(order(1, `{"order_id":"o-1","sku":"apple","qty":2}`), order(2, `{"order_id":"o-2","sku":"apple","qty":1}`))
	if !res.Applied() || !reflect.DeepEqual(res.Duplicates, []int{0}) || len(res.Emitted) != 1 {
		t.Fatalf("a copy of o-1 and o-2: %v (duplicates %v, emitted %d); want o-1 skipped", res, res.Duplicates, len(res.Emitted))
	}
	if got := stock(); got != 2 {
		t.Fatalf("stock = %d, want 5 - 2 - 1 (the copy skipped)", got)
	}

	for _, tt := range []struct {
		name, value string
		class       processor.ErrorClass
		next        string
	}{
		{"not enough stock", `{"order_id":"o-3","sku":"apple","qty":9}`, processor.ClassPermanent,
			"dead-lettered at once to orders.inventory-svc.dlq"},
		{"bad JSON", `{"order_id":`, processor.ClassPermanent, "dead-lettered at once to orders.inventory-svc.dlq"},
		{"no idempotency key", `{"sku":"apple","qty":1}`, processor.ClassPermanent, "dead-lettered at once to orders.inventory-svc.dlq"},
		{"lock timeout", `{"order_id":"o-4","sku":"locked","qty":1}`, processor.ClassRetryable,
			"tried 3 times, then orders.inventory-svc.retry.1 (after 1s, tried 3 times), then orders.inventory-svc.retry.2 (after 1m0s, tried 3 times), then dead-lettered to orders.inventory-svc.dlq"},
		{"database down", `{"order_id":"o-5","sku":"db-down","qty":1}`, processor.ClassInfrastructure, "retried in place until it passes"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			res := svc.Run(order(10, tt.value))
			if res.Applied() || res.Class != tt.class || res.Index != 0 || !strings.Contains(res.Next.String(), tt.next) {
				t.Errorf("%v\nwant class %v, next %q", res, tt.class, tt.next)
			}
		})
	}
	if got := stock(); got != 2 {
		t.Errorf("stock = %d after the failures, want 2: a failure is rolled back", got)
	}

	// The test's Policy overrides the handler's, as TOPIC_<topic>_* does.
	svc.Policy = processor.TopicPolicy{RetryTiers: []time.Duration{}, OnDeadLetter: processor.OnDeadLetterBlock}
	res = svc.Run(order(11, `{"order_id":"o-6","sku":"locked","qty":1}`))
	if want := "tried 3 times, then dead-lettered to orders.inventory-svc.dlq; later records of its key wait for an operator"; res.Next.String() != want {
		t.Errorf("with no tiers and block: %q, want %q", res.Next, want)
	}
}

// TestDBWithoutTestDatabaseURL: with TEST_DATABASE_URL unset, DB starts a throwaway server
// from the PostgreSQL binaries and gives each test a database of its own. The server asks for a
// password: another local user may not log in as its superuser while the tests run.
func TestDBWithoutTestDatabaseURL(t *testing.T) {
	t.Setenv("TEST_DATABASE_URL", "")
	a := processortest.DB(t)
	var name, port string
	if err := a.QueryRow(context.Background(), `SELECT current_database(), current_setting('port')`).Scan(&name, &port); err != nil {
		t.Fatal(err)
	}
	cc := a.Config().ConnConfig
	if cc.Password == "" {
		t.Errorf("DB's pool connects without a password")
	}
	anyone := fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable&connect_timeout=5", net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port))))
	if conn, err := pgx.Connect(context.Background(), anyone); err == nil {
		conn.Close(context.Background())
		t.Errorf("another local user logged in to the throwaway server as postgres without a password")
	} else if !strings.Contains(err.Error(), "password") {
		t.Errorf("a login without a password failed, but not for the want of one: %v", err)
	}
	t.Run("another test", func(t *testing.T) {
		b := processortest.DB(t)
		var other, otherPort string
		if err := b.QueryRow(context.Background(), `SELECT current_database(), current_setting('port')`).Scan(&other, &otherPort); err != nil {
			t.Fatal(err)
		}
		if other == name || otherPort != port {
			t.Errorf("databases %s on port %s and %s on %s: want two databases of one server", name, port, other, otherPort)
		}
	})
}
