package processor_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// The bad-input cases of docs/guarantees.md's table, one test each.

// TestHugeRecordIsDeadLettered: a record larger than MaxRecordBytes never reaches the handler;
// it is dead-lettered with the reason, its DLQ copy without the value (the broker may refuse it),
// its dead_letters row with it. The records around it are applied.
func TestHugeRecordIsDeadLettered(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		cfg := h.Config(ledger.Handler{})
		cfg.MaxRecordBytes = 2000
		h.Start(cfg)
		ok := func(id string, seq int64) ledger.Item {
			ev := ledger.Event{EventID: id, Account: "A", Amount: 1, Seq: seq}
			v, _ := json.Marshal(ev)
			return ledger.Item{Kind: ledger.KindOK, Event: ev, Key: []byte("A"), Value: v}
		}
		huge := ledger.Item{Kind: ledger.KindMalformed, Key: []byte("A"), Value: []byte(`{"pad":"` + strings.Repeat("x", 5000) + `"}`)}
		items := []ledger.Item{ok("h1", 1), huge, ok("h2", 3)}
		h.Produce(items)
		h.WaitSettled(items, 1, 30*time.Second)
		// The ledger and the dead_letters rows as usual (the DLQ copy lacks its value, so the
		// DLQ topic is checked by hand below).
		if _, err := ledger.Verify(context.Background(), h.Pool, items, 1); err != nil {
			t.Fatalf("ledger verification failed:\n%v", err)
		}
		h.CheckDeadLetterRows(items, 1)
		dlq := k.ReadAll(t, h.DLQ())
		if len(dlq) != 1 {
			t.Fatalf("%d dead letters, want 1", len(dlq))
		}
		f, err := retrytopics.ParseFailure(dlq[0].Headers)
		if err != nil {
			t.Fatal(err)
		}
		if f.Class != "permanent" || !strings.Contains(f.Message, "MaxRecordBytes (2000)") || !strings.Contains(f.Message, "5011 bytes") {
			t.Errorf("dead letter says %s: %q; want permanent, naming the size and MaxRecordBytes", f.Class, f.Message)
		}
		var omitted string
		for _, hd := range dlq[0].Headers {
			if hd.Key == retrytopics.HeaderValueOmitted {
				omitted = string(hd.Value)
			}
		}
		if len(dlq[0].Value) != 0 || omitted != "5010" {
			t.Errorf("DLQ copy has a %d-byte value and %s=%q; want no value and the size 5010", len(dlq[0].Value), retrytopics.HeaderValueOmitted, omitted)
		}
		var stored []byte
		if err := h.Pool.QueryRow(context.Background(), `SELECT value FROM kafkapg.dead_letters`).Scan(&stored); err != nil {
			t.Fatal(err)
		}
		if string(stored) != string(huge.Value) {
			t.Errorf("dead_letters keeps %d bytes, want the whole %d-byte value", len(stored), len(huge.Value))
		}
	})
}

// TestInvalidUTF8Keys: keys are bytes, not text. Records whose keys are not valid UTF-8 are
// applied, held behind their key, and dead-lettered like any other.
func TestInvalidUTF8Keys(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 2)
		cfg := h.Config(ledger.Handler{})
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond}
		cfg.LocalAttempts = 1
		h.Start(cfg)
		var items []ledger.Item
		keys := [][]byte{{0xff, 0xfe, 0x00}, {0xc3, 0x28}, {}, {0xed, 0xa0, 0x80}}
		for i := range 40 {
			key := keys[i%len(keys)]
			ev := ledger.Event{EventID: fmt.Sprintf("u-%d", i), Account: fmt.Sprintf("acct-%x", key), Amount: int64(i), Seq: int64(i/len(keys) + 1)}
			kind := ledger.KindOK
			switch i % 7 {
			case 3:
				ev.FailAttempts, kind = 1, ledger.KindFlaky // recovers in the tier; later records of its key wait
			case 5:
				ev.FailAttempts, kind = 3, ledger.KindFlaky // outlasts the tier
			}
			v, _ := json.Marshal(ev)
			items = append(items, ledger.Item{Kind: kind, Event: ev, Key: key, Value: v})
		}
		h.Produce(items)
		h.WaitSettled(items, 2, 60*time.Second)
		h.Verify(items, 2, false)
	})
}

// TestGarbledRetryRecordIsAFreshRecord: a record in a retry tier without kafkapg's headers (not
// written by kafkapg, or mangled) is handled as a fresh attempt-1 record, with a warning.
func TestGarbledRetryRecordIsAFreshRecord(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		var mu sync.Mutex
		var seen []string
		handler := processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			mu.Lock()
			seen = append(seen, fmt.Sprintf("%s@%s attempt %d", rec.Value, rec.Topic, rec.Attempt))
			mu.Unlock()
			if string(rec.Value) == "failing" {
				return errors.New("a retryable failure")
			}
			_, err := tx.Exec(ctx, `INSERT INTO ledger_entries (event_id, account, amount, seq) VALUES ($1, 'a', 0, $2)`, string(rec.Value), rec.Attempt)
			return err
		})
		cfg := h.Config(handler)
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond}
		h.Start(cfg)
		tier := retrytopics.TierTopic(h.Topic, h.Group, 1)
		testenv.Eventually(t, 30*time.Second, func() error { // the processor creates the tier topic
			_, err := k.Client(t).ProduceSync(context.Background(), &kgo.Record{Topic: tier, Key: []byte("k"), Value: []byte("none"),
				Headers: []kgo.RecordHeader{{Key: retrytopics.HeaderAttempt, Value: []byte("two")}}}).First()
			return err
		})
		h.K.Produce(t, &kgo.Record{Topic: tier, Key: []byte("k"), Value: []byte("plain")})
		h.WaitApplied(2, 30*time.Second)
		// One that fails: with no origin to retry, it is dead-lettered, not sent round tier 1.
		h.K.Produce(t, &kgo.Record{Topic: tier, Key: []byte("k"), Value: []byte("failing")})
		testenv.Eventually(t, 30*time.Second, func() error {
			if n := len(h.K.ReadAll(t, h.DLQ())); n != 1 {
				return fmt.Errorf("%d dead letters, want 1", n)
			}
			return nil
		})
		if p := h.Progress(); p.Tiers+p.HeldKeys+p.HeldRecords != 0 {
			t.Errorf("retry path not empty after the garbled record was dead-lettered: %s", p)
		}
		mu.Lock()
		defer mu.Unlock()
		want := fmt.Sprintf("[none@%s attempt 1 plain@%s attempt 1 failing@%s attempt 1 failing@%s attempt 1 failing@%s attempt 1]", tier, tier, tier, tier, tier)
		if fmt.Sprint(seen) != want {
			t.Errorf("handler saw %v, want %s", seen, want)
		}
	})
}
