package processor_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// TestBatchMaxWaitOnlyWhileEveryConnectionIsBusy: BATCH_MAX_WAIT is the longest a partition waits
// for its batch to fill, and it waits only while every pool connection is in use
// (docs/configuration.md); otherwise what arrived is applied at once. With a wait of a minute
// and an idle pool, each of three records, produced one by one, is applied within seconds: a
// partition that waited for its batch would take the minute.
func TestBatchMaxWaitOnlyWhileEveryConnectionIsBusy(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		cfg := h.Config(processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger_entries (event_id, account, amount, seq) VALUES ($1, 'a', 0, 0)`, string(rec.Value))
			return err
		}))
		cfg.BatchMaxWait = time.Minute
		cfg.BatchMaxRecords = 100
		h.Start(cfg)
		for i, id := range []string{"e1", "e2", "e3"} {
			began := time.Now()
			h.K.Produce(t, &kgo.Record{Topic: h.Topic, Key: []byte("k"), Value: []byte(id)})
			h.WaitApplied(i+1, 50*time.Second)
			took := time.Since(began)
			t.Logf("%s applied %v after it was produced (BATCH_MAX_WAIT %v, the pool idle)", id, took.Round(time.Millisecond), cfg.BatchMaxWait)
			if took > 20*time.Second {
				t.Fatalf("%s applied %v after it was produced: the partition waited for its batch with connections free", id, took)
			}
		}
	})
}
