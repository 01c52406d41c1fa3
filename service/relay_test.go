package service

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/sink"
)

// TestRelayOnly runs the service with RELAY_ONLY=true for the outbox of an application's
// transactions (no topics, no handler): what the application emits is published, what it rolled
// back is not, and the relay's metrics are served.
func TestRelayOnly(t *testing.T) {
	pool, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 2)
	svc := startService(t, map[string]string{
		"DATABASE_URL":   dbURL,
		"KAFKA_BROKERS":  k.Brokers[0],
		"KAFKA_GROUP_ID": "orders-api",
		"RELAY_ONLY":     "true",
		"HANDLER":        "",
	})
	svc.waitReady()

	ctx := context.Background()
	out, err := sink.NewOutbox(sink.OutboxConfig{Schema: "kafkapg", Group: "orders-api"})
	if err != nil {
		t.Fatal(err)
	}
	for i, commit := range []bool{true, false, true} {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := out.Emit(ctx, tx, sink.Event{Topic: topic, Key: []byte("order-1"), Value: fmt.Appendf(nil, "placed-%d", i)}); err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 20*time.Second, func() error {
		if n := len(k.ReadAll(t, topic)); n != 2 {
			return fmt.Errorf("%d records published, want 2", n)
		}
		return nil
	})
	var got []string
	for _, r := range k.ReadAll(t, topic) {
		got = append(got, string(r.Value))
	}
	if fmt.Sprint(got) != "[placed-0 placed-2]" {
		t.Errorf("published %v, want [placed-0 placed-2] (the rolled-back emit never)", got)
	}
	if n := svc.metric("kafkapg_outbox_published_total"); n != 2 {
		t.Errorf("kafkapg_outbox_published_total = %v, want 2", n)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.outbox`).Scan(&left); err != nil || left != 0 {
		t.Errorf("%d outbox rows left (%v), want 0", left, err)
	}
	svc.stop()
}
