package processor_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// TestBufferedBytesWithinBudgetAndOnePoll drains a deep backlog on 64 partitions with the least
// MaxBufferedBytes (1 MiB) and watches the processor's own account of the records it holds
// (kafkapg_buffered_bytes): it must reach the budget (the backlog is 24 times it) and never
// exceed it by more than one poll, as docs/guarantees.md (Memory) says. A poll hands out at most
// what franz-go fetched, one fetch per broker of at most max(budget/32, 1 MiB) on the wire; the
// values are random bytes, so no compression makes a fetch hold more records than their size.
// Without the poll loop's wait for the budget, each partition would fetch up to its own share
// (64 KiB, 64 of them) and more: several times the bound. Each record carries two headers, which
// the account counts as their bytes and 56 each; and a cluster of three brokers (kfake's) gives
// three fetches to a poll, one per broker, which the bound must allow and no more.
func TestBufferedBytesWithinBudgetAndOnePoll(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		drainWithinBudget(t, k, 1)
	})
	t.Run("kfake-3-brokers", func(t *testing.T) {
		t.Parallel()
		drainWithinBudget(t, testenv.NewKfake(t, kfake.NumBrokers(3)), 3)
	})
}

// drainWithinBudget is TestBufferedBytesWithinBudgetAndOnePoll on k, a cluster of brokers brokers
// (the partitions' leaders spread over them).
func drainWithinBudget(t *testing.T, k *testenv.Kafka, brokers int) {
	const partitions, perPartition, valueSize = 64, 200, 2048
	const budget = 1 << 20
	h := newHarness(t, k, partitions)

	cl := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.ProducerBatchCompression(kgo.NoCompression()))
	var recs []*kgo.Record
	for p := range int32(partitions) {
		for i := range perPartition {
			value := make([]byte, valueSize)
			rand.Read(value)
			recs = append(recs, &kgo.Record{Topic: h.Topic, Partition: p, Key: fmt.Appendf(nil, "k%02d-%03d", p, i), Value: value,
				Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte(traceparent)}, {Key: "source", Value: []byte("membound")}}})
		}
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}

	cfg := h.Config(processor.BatchHandlerFunc(func(ctx context.Context, _ pgx.Tx, _ []*processor.Record) error {
		time.Sleep(50 * time.Millisecond) // a handler slower than the fetching: the backlog waits in memory
		return nil
	}))
	cfg.MaxBufferedBytes = budget
	r := h.Start(cfg)

	// One poll: a fetch of 1 MiB (budget/32 is less) from each broker, each holding at most
	// 1 MiB / (key + value + headers) records, each counted as those bytes, 448 more and 56
	// a header (processor/buffer.go).
	const keySize, fetch = 7, max(budget/32, 1<<20)
	const headerBytes = len("traceparent") + len(traceparent) + len("source") + len("membound")
	const size = keySize + valueSize + headerBytes
	onePoll := brokers * fetch / size * (size + 448 + 2*56)

	var most float64
	var mu sync.Mutex
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			v := r.Gauge("kafkapg_buffered_bytes")
			mu.Lock()
			most = max(most, v)
			mu.Unlock()
		}
	}()
	total := partitions * perPartition
	testenv.Eventually(t, 2*time.Minute, func() error {
		if n := r.Counter("kafkapg_records_applied_total"); n < float64(total) {
			return fmt.Errorf("%.0f of %d records applied", n, total)
		}
		return nil
	})
	close(stop)
	<-sampled

	t.Logf("buffered at most %.0f bytes: budget %d, one poll %d (%d brokers)", most, budget, onePoll, brokers)
	if most < budget/2 {
		t.Errorf("buffered at most %.0f bytes of a backlog of %d records of %d bytes: the budget (%d) was never approached, so the test checks nothing",
			most, total, valueSize, budget)
	}
	if most > float64(budget+onePoll) {
		t.Errorf("buffered %.0f bytes: over MaxBufferedBytes (%d) and one poll (%d)", most, budget, onePoll)
	}
}

const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
