package processor_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

func TestLedgerEndToEnd(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 4)
		items := mixed(3000, 1, "e2e")
		h.Produce(items)
		r := h.Start(h.Config(ledger.Handler{}))
		h.WaitSettled(items, 1, 60*time.Second)
		h.Verify(items, 1, false)

		// Kafka's committed offsets (advisory) catch up with Postgres.
		adm := kadm.NewClient(k.Client(t))
		store := offsets.NewStore("kafkapg", h.Group)
		testenv.Eventually(t, 20*time.Second, func() error {
			committed, err := adm.FetchOffsets(context.Background(), h.Group)
			if err != nil {
				return err
			}
			for p := range int32(4) {
				pos, err := store.Load(context.Background(), h.Pool, offsets.Partition{Topic: h.Topic, Partition: p})
				if err != nil {
					return err
				}
				c, ok := committed.Lookup(h.Topic, p)
				if !ok || c.At != pos.Next {
					return fmt.Errorf("partition %d: kafka committed %v, postgres %d", p, c.At, pos.Next)
				}
			}
			return nil
		})
		if got := r.Counter("kafkapg_records_dead_lettered_total"); got == 0 {
			t.Error("dead-lettered metric stayed at zero")
		}
	})
}

// TestWaitsForSourceTopic starts the processor before its topic exists (pods and topics are
// often created in any order): it must wait, then process once the topic appears.
func TestWaitsForSourceTopic(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		h.Topic = k.TopicName(t) // not created yet
		r := h.Start(h.Config(ledger.Handler{}))
		time.Sleep(time.Second)
		select {
		case <-r.Done:
			t.Fatalf("Run returned before the topic existed: %v", r.Err)
		default:
		}

		k.CreateTopicNamed(t, h.Topic, 3)
		items := mixed(300, 9, "late")
		h.Produce(items)
		h.WaitSettled(items, 1, 60*time.Second)
		h.Verify(items, 1, false)
	})
}

func TestDeadLetterHeaders(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		origHeaders := []kgo.RecordHeader{{Key: "trace-id", Value: []byte("abc")}}
		k.Produce(t,
			&kgo.Record{Topic: h.Topic, Key: []byte("acct-1"), Value: []byte(`{"event_id":"p1","account":"acct-1","amount":1,"seq":1,"poison":true}`), Headers: origHeaders},
			&kgo.Record{Topic: h.Topic, Key: []byte("acct-1"), Value: []byte(`{"event_id":"f1","account":"acct-1","amount":1,"seq":2,"fail_attempts":1}`)},
			&kgo.Record{Topic: h.Topic, Key: []byte("acct-1"), Value: []byte(`{"event_id":"ok1","account":"acct-1","amount":5,"seq":3}`)},
		)
		h.Start(h.Config(ledger.Handler{}))
		h.WaitApplied(1, 30*time.Second)
		var dlq []*kgo.Record
		testenv.Eventually(t, 30*time.Second, func() error {
			if dlq = k.ReadAll(t, h.DLQ()); len(dlq) < 2 {
				return fmt.Errorf("%d dead letters", len(dlq))
			}
			return nil
		})
		if len(dlq) != 2 {
			t.Fatalf("%d dead letters, want 2", len(dlq))
		}
		tests := []struct {
			name      string
			rec       *kgo.Record
			offset    int64
			class     string
			tries     int
			errSubstr string
		}{
			{name: "poison", rec: dlq[0], offset: 0, class: "permanent", tries: 1, errSubstr: "poison event"},
			{name: "flaky", rec: dlq[1], offset: 1, class: "retryable", tries: 3, errSubstr: "simulated transient failure"},
		}
		for _, tt := range tests {
			f, err := retrytopics.ParseFailure(tt.rec.Headers)
			if err != nil {
				t.Fatalf("%s: %v", tt.name, err)
			}
			if f.Topic != h.Topic || f.Partition != 0 || f.Offset != tt.offset || f.Group != h.Group ||
				f.Class != tt.class || f.Tries != tt.tries || f.Attempt != 1 || f.FailedAt.IsZero() || f.Timestamp.IsZero() {
				t.Errorf("%s: failure headers = %+v", tt.name, f)
			}
			if !strings.Contains(f.Message, tt.errSubstr) {
				t.Errorf("%s: error message %q does not mention %q", tt.name, f.Message, tt.errSubstr)
			}
			if string(tt.rec.Key) != "acct-1" {
				t.Errorf("%s: key %q, want the original", tt.name, tt.rec.Key)
			}
		}
		if h := dlq[0].Headers[0]; h.Key != "trace-id" || string(h.Value) != "abc" {
			t.Errorf("original header not kept first: %+v", dlq[0].Headers)
		}
	})
}

func TestRestartResumesFromPostgres(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 3)
		all := mixed(3000, 2, "r")
		first, second := all[:2000], all[2000:]
		h.Produce(first)
		cfg := h.Config(ledger.Handler{})
		cfg.BatchMaxRecords = 50
		r := h.Start(cfg)
		h.WaitApplied(300, 30*time.Second)
		r.Stop(t)

		h.Produce(second)
		h.Start(h.Config(ledger.Handler{}))
		h.WaitSettled(all, 1, 60*time.Second)
		h.Verify(all, 1, false)
	})
}

// TestRebalancesExactlyOnce runs three processors in one group, starting and stopping them while
// records keep arriving, so partitions move between members mid-stream.
func TestRebalancesExactlyOnce(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 6)
		items := mixed(6000, 4, "rb")
		produced := make(chan struct{})
		go func() {
			defer close(produced)
			for i := 0; i < len(items); i += 500 {
				h.Produce(items[i:min(i+500, len(items))])
				time.Sleep(150 * time.Millisecond)
			}
		}()
		cfg := func() *processor.Config {
			c := h.Config(ledger.Handler{})
			c.BatchMaxRecords = 100
			return c
		}
		a := h.Start(cfg())
		h.WaitApplied(200, 30*time.Second)
		b := h.Start(cfg())
		c := h.Start(cfg())
		time.Sleep(time.Second)
		a.Stop(t)
		time.Sleep(time.Second)
		h.Start(cfg()) // a comes back; it runs until the test ends
		b.Stop(t)
		<-produced
		time.Sleep(500 * time.Millisecond)
		c.Stop(t)
		h.WaitSettled(items, 1, 90*time.Second)
		h.Verify(items, 1, false)
	})
}

// gate blocks the handler, ignoring its context (like a stuck call or a long GC pause), until
// open is called. Each stalled handler call reports its partition on stalled.
type gate struct {
	inner   processor.Handler
	closed  atomic.Bool
	stalled chan offsets.Partition
	release chan struct{}
	once    sync.Once
}

// newGate returns a closed gate in front of the ledger handler for up to n stalled calls. The
// test's cleanup opens it, so that a failing test does not leave handler goroutines stuck.
func newGate(t *testing.T, n int) *gate {
	g := &gate{inner: ledger.Handler{}, stalled: make(chan offsets.Partition, n), release: make(chan struct{})}
	g.closed.Store(true)
	t.Cleanup(g.open)
	return g
}

func (g *gate) open() {
	g.once.Do(func() { g.closed.Store(false); close(g.release) })
}

// waitStalled waits until the handler is stalled on n different partitions.
func (g *gate) waitStalled(t *testing.T, n int) {
	t.Helper()
	stalled := map[offsets.Partition]bool{}
	timeout := time.After(30 * time.Second)
	for len(stalled) < n {
		select {
		case tp := <-g.stalled:
			stalled[tp] = true
		case <-timeout:
			t.Fatalf("handler stalled on %d partitions, want %d", len(stalled), n)
		}
	}
}

func (g *gate) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	if g.closed.Load() {
		g.stalled <- offsets.Partition{Topic: rec.Topic, Partition: rec.Partition}
		<-g.release
	}
	return g.inner.Handle(ctx, tx, rec)
}

// TestStaleOwnerIsFenced stalls a partition's owner inside its transaction (a handler stuck on
// a call, a long GC pause) while a new owner claims the partition, as the next owner does on
// assignment after a rebalance the stalled one has not noticed. Postgres ends the stalled,
// idle transaction, which lets the claim through. When the old owner wakes up it retries its
// batch with its old token: that transaction must be fenced, and nothing applied.
func TestStaleOwnerIsFenced(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		items := ledger.Generate(ledger.GenConfig{Events: 50, Accounts: 5, Seed: 7, Prefix: "sp"})

		g := newGate(t, 1)
		cfg := h.Config(g)
		cfg.TxIdleTimeout = 2 * time.Second
		a := h.Start(cfg)
		h.Produce(items)
		g.waitStalled(t, 1)

		// The new owner's claim waits for the stalled transaction's row lock until Postgres ends
		// that transaction (TxIdleTimeout).
		store := offsets.NewStore("kafkapg", h.Group)
		tp := offsets.Partition{Topic: h.Topic, Partition: 0}
		start := time.Now()
		claimed, err := store.Claim(context.Background(), h.Pool, "new owner", []offsets.Partition{tp})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("claim went through after %v", time.Since(start).Round(time.Millisecond))

		g.open()
		testenv.Eventually(t, 30*time.Second, func() error {
			if a.Counter("kafkapg_fenced_transactions_total") < 1 {
				return fmt.Errorf("stale owner was not fenced")
			}
			return nil
		})
		if got := h.Applied(); got != 0 {
			t.Fatalf("%d events applied by the stale owner", got)
		}
		pos, err := store.Load(context.Background(), h.Pool, tp)
		if err != nil {
			t.Fatal(err)
		}
		if pos != claimed[0] {
			t.Fatalf("offsets row is %+v, want it as the new owner claimed it: %+v", pos, claimed[0])
		}
	})
}

// TestOwnerCutOffFromKafkaAppliesNothing makes A a zombie under a real rebalance: its handler
// stalls inside the transactions of both its partitions, and A is cut off from Kafka (not from
// Postgres), so the group expels it and gives its partitions to B. Postgres ends A's idle
// transactions, releasing the offsets rows for B's claims. When A's handler wakes up, none of
// its work may commit, and every record must be applied exactly once, by B.
func TestOwnerCutOffFromKafkaAppliesNothing(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 2)
		items := ledger.Generate(ledger.GenConfig{Events: 40, Accounts: 10, Seed: 5, Prefix: "st"})

		g := newGate(t, 2)
		net := testenv.NewNetFault()
		cfgA := h.Config(g)
		cfgA.TxIdleTimeout = 2 * time.Second
		cfgA.SessionTimeout = 2 * time.Second
		cfgA.ShutdownTimeout = 3 * time.Second
		cfgA.KafkaOptions = append(cfgA.KafkaOptions, kgo.Dialer(net.Dial))
		a := h.Start(cfgA)
		h.Produce(items)
		g.waitStalled(t, 2)

		net.Cut()
		b := h.Start(h.Config(ledger.Handler{}))
		h.WaitSettled(items, 1, 60*time.Second)

		g.open()
		time.Sleep(time.Second) // let A's workers try to commit
		if got := a.Counter("kafkapg_records_applied_total"); got != 0 {
			t.Errorf("zombie A applied %v records", got)
		}
		if got := b.Counter("kafkapg_records_applied_total"); got != float64(len(items)) {
			t.Errorf("new owner B applied %v records, want %d", got, len(items))
		}
		net.Restore()
		a.Stop(t)
		b.Stop(t)
		h.Verify(items, 1, false)
	})
}

// TestPostgresOutage cuts the processor's Postgres connections mid-stream. Nothing may be
// dead-lettered for it, and processing must resume once Postgres is back.
func TestPostgresOutage(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 3)
		proxied, proxy, _ := proxiedPool(t, h.DBURL)

		items := ledger.Generate(ledger.GenConfig{Events: 4000, Accounts: 30, Seed: 6, Prefix: "po"})
		cfg := h.Config(ledger.Handler{})
		cfg.BatchMaxRecords = 50
		p, err := processor.New(proxied, cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- p.Run(ctx) }()
		go h.Produce(items)

		h.WaitApplied(500, 30*time.Second)
		proxy.Cut()
		// A COMMIT that reached Postgres just before the cut still completes there; count after
		// it has settled, then nothing more may be applied while Postgres is unreachable.
		time.Sleep(500 * time.Millisecond)
		before := h.Applied()
		time.Sleep(3 * time.Second)
		if got := h.Applied(); got != before {
			t.Fatalf("%d events applied while postgres was unreachable", got-before)
		}
		proxy.Restore()
		restored := time.Now()
		h.WaitApplied(before+1, 30*time.Second)
		t.Logf("processing resumed %v after postgres came back", time.Since(restored).Round(time.Millisecond))

		h.WaitSettled(items, 1, 60*time.Second)
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		h.Verify(items, 1, false)
		if dl := k.ReadAll(t, h.DLQ()); len(dl) != 0 {
			t.Fatalf("%d records dead-lettered during a postgres outage", len(dl))
		}
		// Connections cut mid-transaction are Postgres's failure, not kafkapg's own: no
		// KafkapgInternalErrors alert for an outage.
		mfs, err := cfg.Registerer.(*prometheus.Registry).Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "kafkapg_internal_errors_total" && mf.GetMetric()[0].GetCounter().GetValue() != 0 {
				t.Errorf("kafkapg_internal_errors_total = %v after a postgres outage, want 0", mf.GetMetric()[0].GetCounter().GetValue())
			}
		}
	})
}

// panicOnce panics the first time it sees a given event, then behaves.
type panicOnce struct {
	ledger.Handler
	seen atomic.Bool
}

func (p *panicOnce) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	for _, r := range recs {
		if string(r.Key) == "boom" && p.seen.CompareAndSwap(false, true) {
			panic("handler bug")
		}
	}
	return p.Handler.HandleBatch(ctx, tx, recs)
}

func TestHandlerPanicIsRetried(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		k.Produce(t,
			&kgo.Record{Topic: h.Topic, Key: []byte("a"), Value: []byte(`{"event_id":"1","account":"a","amount":1,"seq":1}`)},
			&kgo.Record{Topic: h.Topic, Key: []byte("boom"), Value: []byte(`{"event_id":"2","account":"boom","amount":1,"seq":1}`)},
			&kgo.Record{Topic: h.Topic, Key: []byte("a"), Value: []byte(`{"event_id":"3","account":"a","amount":1,"seq":2}`)},
		)
		r := h.Start(h.Config(&panicOnce{}))
		h.WaitApplied(3, 30*time.Second)
		if got := r.Counter("kafkapg_handler_panics_total"); got != 1 {
			t.Fatalf("panics counted: %v, want 1", got)
		}
	})
}

// failsWith fails any batch containing a bad record without saying which record failed.
type failsWith struct{ ledger.Handler }

func (f failsWith) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	for _, r := range recs {
		if string(r.Key) == "bad" {
			return errors.New("something in this batch is wrong")
		}
	}
	return f.Handler.HandleBatch(ctx, tx, recs)
}

func TestUnattributedBatchErrorIsIsolated(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		var recs []*kgo.Record
		for i := range 200 {
			key := "good"
			if i == 37 || i == 150 {
				key = "bad"
			}
			recs = append(recs, &kgo.Record{Topic: h.Topic, Key: []byte(key),
				Value: fmt.Appendf(nil, `{"event_id":"u-%d","account":"x","amount":1,"seq":%d}`, i, i+1)})
		}
		k.Produce(t, recs...)
		cfg := h.Config(failsWith{})
		cfg.BatchMaxRecords = 200
		cfg.BatchMaxWait = time.Second // one batch of 200
		h.Start(cfg)
		h.WaitApplied(198, 30*time.Second)
		testenv.Eventually(t, 30*time.Second, func() error {
			if n := len(k.ReadAll(t, h.DLQ())); n != 2 {
				return fmt.Errorf("%d dead letters, want 2", n)
			}
			return nil
		})
		rows, err := h.Pool.Query(context.Background(), `SELECT seq FROM ledger_entries ORDER BY applied_order`)
		if err != nil {
			t.Fatal(err)
		}
		order, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		for i := 1; i < len(order); i++ {
			if order[i] <= order[i-1] {
				t.Fatalf("applied out of order: seq %d after %d", order[i], order[i-1])
			}
		}
	})
}
