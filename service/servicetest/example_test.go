package servicetest_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/service"
	"github.com/kafkapg/kafkapg/service/servicetest"
	"github.com/kafkapg/kafkapg/sink"
)

// payments is the service's handler: it credits each payment to its account and announces it.
var payments = service.Handler{
	Name: "payments",
	Setup: service.SetupSQL(`
		CREATE TABLE IF NOT EXISTS balances (account text PRIMARY KEY, cents bigint NOT NULL)`),
	IdempotencyKey: processor.KeyFromJSON("payment_id"),
	RetryTiers:     []time.Duration{time.Second, 30 * time.Second, 5 * time.Minute},
	Handler: processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
		var p struct {
			Account string `json:"account"`
			Cents   int64  `json:"cents"`
		}
		if err := json.Unmarshal(rec.Value, &p); err != nil {
			return processor.Permanent(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO balances VALUES ($1, $2)
			ON CONFLICT (account) DO UPDATE SET cents = balances.cents + $2`, p.Account, p.Cents); err != nil {
			return err
		}
		return rec.Emit(ctx, tx, sink.Event{Topic: "payments.credited", Key: rec.Key, Value: rec.Value})
	}),
}

// testPayments is a test of the payments service, end to end: in a package of yours, a
// `func TestPayments(t *testing.T)`.
func testPayments(t *testing.T) {
	svc := servicetest.Start(t, servicetest.Options{
		Env:    map[string]string{"KAFKA_TOPICS": "payments", "KAFKA_GROUP_ID": "billing"},
		Topics: []string{"payments.credited"},
	}, payments)

	svc.Produce("payments", "acct-1", `{"payment_id":"p-1","account":"acct-1","cents":500}`)
	svc.Produce("payments", "acct-1", `{"payment_id":"p-1","account":"acct-1","cents":500}`) // a copy: skipped
	svc.Produce("payments", "acct-1", `{"payment_id":"p-2","account":"acct-1","cents":250}`)
	svc.WaitQuery(750, `SELECT cents FROM balances WHERE account = $1`, "acct-1")
	if events := svc.WaitRecords("payments.credited", 2); len(events) != 2 {
		t.Fatalf("%d events, want 2", len(events))
	}

	svc.Produce("payments", "acct-2", `not json`) // dead-lettered at once
	if dead := svc.WaitDeadLetters("payments", 1); dead[0].Class != "permanent" {
		t.Fatalf("dead letter %+v, want a permanent failure", dead[0])
	}
}

// Start runs the service of the payments handler, as it runs in production, for a test; see
// testPayments.
func Example() {}
