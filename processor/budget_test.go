package processor_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// TestStuckPartitionLeavesBudget fills the buffer budget from one partition whose handler then
// hangs (a downstream that stopped answering), before the other partitions have any records: the
// others must still be applied, at full speed, while it hangs. A partition holds at most a
// quarter of the budget, however few partitions hold records; without that bound the hung
// partition keeps the whole budget and nothing else is fetched.
func TestStuckPartitionLeavesBudget(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 4)
		const budget = 1 << 20 // the least MaxBufferedBytes
		value := bytes.Repeat([]byte("v"), 1024)
		if _, err := h.Pool.Exec(context.Background(), `CREATE TABLE budget_applied (partition int, "offset" bigint, PRIMARY KEY (partition, "offset"))`); err != nil {
			t.Fatal(err)
		}
		hung := make(chan struct{}, 1)
		release := make(chan struct{})
		t.Cleanup(func() { close(release) })
		handler := processor.BatchHandlerFunc(func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
			if recs[0].Partition == 0 {
				select {
				case hung <- struct{}{}:
				default:
				}
				select {
				case <-release:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			rows := make([][]any, len(recs))
			for i, r := range recs {
				rows[i] = []any{r.Partition, r.Offset}
			}
			_, err := tx.CopyFrom(ctx, pgx.Identifier{"budget_applied"}, []string{"partition", "offset"}, pgx.CopyFromRows(rows))
			return err
		})

		produce := func(partition int32, n int) {
			cl := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
			recs := make([]*kgo.Record, n)
			for i := range recs {
				recs[i] = &kgo.Record{Topic: h.Topic, Partition: partition, Key: fmt.Appendf(nil, "k%d", i), Value: value}
			}
			if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
				t.Fatal(err)
			}
		}
		// Partition 0 alone has records, four times the budget.
		produce(0, 4*budget/len(value))

		cfg := h.Config(handler)
		cfg.MaxBufferedBytes = budget
		cfg.BatchMaxRecords = 10
		r := h.Start(cfg)
		select {
		case <-hung:
		case <-time.After(30 * time.Second):
			t.Fatal("partition 0's handler was never called")
		}
		// Let partition 0 fetch what it may while it is the only partition with records.
		testenv.Eventually(t, 10*time.Second, func() error {
			if got := r.Gauge("kafkapg_buffered_bytes"); got < budget/4 {
				return fmt.Errorf("buffered %.0f bytes, want partition 0 to hold its share (%d)", got, budget/4)
			}
			return nil
		})
		time.Sleep(300 * time.Millisecond) // more fetches, were it not paused

		const others = 300
		for p := int32(1); p < 4; p++ {
			produce(p, others)
		}
		testenv.Eventually(t, 30*time.Second, func() error {
			var n int
			if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM budget_applied WHERE partition > 0`).Scan(&n); err != nil {
				return err
			}
			if n < 3*others {
				return fmt.Errorf("%d of the other partitions' %d records applied while partition 0 hangs (buffered: %.0f of %d bytes)",
					n, 3*others, r.Gauge("kafkapg_buffered_bytes"), budget)
			}
			return nil
		})
		// What partition 0 holds: its share, plus at most the fetch that arrived as it filled it.
		if got := r.Gauge("kafkapg_buffered_bytes"); got > budget/2 {
			t.Errorf("the hung partition holds %.0f bytes of a %d-byte budget; want at most half", got, budget)
		}
		var applied int
		if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM budget_applied WHERE partition = 0`).Scan(&applied); err != nil {
			t.Fatal(err)
		}
		if applied != 0 {
			t.Errorf("%d records of the hung partition applied", applied)
		}
	})
}

// TestWaitingTierRecordsDoNotStarveSources: after a restart, each retry-tier partition with a
// backlog whose first record is due in an hour received a whole fetch, kept it (paused, waiting
// for the due time) and counted it against the budget: a few of them filled MAX_BUFFERED_BYTES
// (it held about three times its size), the poll loop waited in the budget, and no source
// partition was fetched until the tier's records came due: 0 of 160 fresh records were applied
// in 30 s. Records that are not due must never keep due ones from being fetched, and the budget
// must hold (overshot by one poll at most).
func TestWaitingTierRecordsDoNotStarveSources(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		const partitions, budget = 8, 1 << 20
		h := newHarness(t, k, partitions)
		if _, err := h.Pool.Exec(context.Background(), `CREATE TABLE budget_applied (partition int, "offset" bigint, PRIMARY KEY (partition, "offset"))`); err != nil {
			t.Fatal(err)
		}
		handler := processor.BatchHandlerFunc(func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
			for i, r := range recs {
				if bytes.HasPrefix(r.Value, []byte("later")) {
					return processor.RecordFailed(i, errors.New("not now"))
				}
			}
			rows := make([][]any, len(recs))
			for i, r := range recs {
				rows[i] = []any{r.Partition, r.Offset}
			}
			_, err := tx.CopyFrom(ctx, pgx.Identifier{"budget_applied"}, []string{"partition", "offset"}, pgx.CopyFromRows(rows))
			return err
		})
		config := func() *processor.Config {
			cfg := h.Config(handler)
			cfg.MaxBufferedBytes = budget
			cfg.RetryTiers = []time.Duration{time.Hour}
			cfg.LocalAttempts = 1
			cfg.BreakerDisabled = true
			return cfg
		}
		produce := func(prefix string, perPartition int) {
			cl := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
			var recs []*kgo.Record
			for p := range int32(partitions) {
				for i := range perPartition {
					recs = append(recs, &kgo.Record{Topic: h.Topic, Partition: p, Key: fmt.Appendf(nil, "%s-%d-%d", prefix, p, i),
						Value: append([]byte(prefix), bytes.Repeat([]byte("v"), 2048)...)})
				}
			}
			if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
				t.Fatal(err)
			}
		}
		// Twice the budget waits in the tier, for an hour.
		produce("later", 2*budget/2048/partitions)
		a := h.Start(config())
		want := 2 * budget / 2048 / partitions * partitions
		testenv.Eventually(t, 60*time.Second, func() error {
			var n int
			if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.retries WHERE consumer_group = $1`, h.Group).Scan(&n); err != nil {
				return err
			}
			if n < want {
				return fmt.Errorf("%d of %d records in the tier", n, want)
			}
			return nil
		})
		a.Stop(t) // a deploy

		b := h.Start(config())
		time.Sleep(2 * time.Second) // the tier's partitions are fetched, and wait
		produce("fresh", 20)
		var most float64
		testenv.Eventually(t, 30*time.Second, func() error {
			most = max(most, b.Gauge("kafkapg_buffered_bytes"))
			var n int
			if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM budget_applied`).Scan(&n); err != nil {
				return err
			}
			if n < 20*partitions {
				return fmt.Errorf("%d of %d fresh records applied, %.0f bytes buffered", n, 20*partitions, b.Gauge("kafkapg_buffered_bytes"))
			}
			return nil
		})
		if most > 2*budget {
			t.Errorf("buffered up to %.0f bytes with MaxBufferedBytes %d", most, budget)
		}
		t.Logf("the most buffered while the fresh records were applied: %.0f bytes (budget %d)", most, budget)
	})
}
