package processor_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
)

// appliedOrder returns the applied events in the order they were applied, with their attempt.
func (h *harness) appliedOrder() []string {
	h.T.Helper()
	rows, err := h.Pool.Query(context.Background(), `SELECT event_id || '@' || attempt FROM ledger_entries ORDER BY applied_order`)
	if err != nil {
		h.T.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		h.T.Fatal(err)
	}
	return ids
}

// deadLetterStates returns each dead_letters row as "event:status:attempts:history".
func (h *harness) deadLetterStates() []string {
	h.T.Helper()
	rows, err := h.Pool.Query(context.Background(), `SELECT convert_from(value, 'UTF8')::json->>'event_id', status, attempts,
			(SELECT string_agg(event, ',' ORDER BY e.id) FROM kafkapg.dead_letter_events e WHERE e.dead_letter_id = d.id)
		FROM kafkapg.dead_letters d ORDER BY 1`)
	if err != nil {
		h.T.Fatal(err)
	}
	var out []string
	var id, status, history string
	var attempts int
	if _, err := pgx.ForEachRow(rows, []any{&id, &status, &attempts, &history}, func() error {
		out = append(out, fmt.Sprintf("%s:%s:%d:%s", id, status, attempts, history))
		return nil
	}); err != nil {
		h.T.Fatal(err)
	}
	return out
}

func before(order []string, a, b string) bool {
	ia := slices.IndexFunc(order, func(s string) bool { return strings.HasPrefix(s, a+"@") })
	ib := slices.IndexFunc(order, func(s string) bool { return strings.HasPrefix(s, b+"@") })
	return ia >= 0 && ib >= 0 && ia < ib
}

// TestReplayBlockedKeysAppliesEachOnceInOrder: with ON_DEAD_LETTER=block, a replay of every dead
// letter, with the processor running, applies each recoverable one exactly once, before the
// records held behind it (which follow in order), as the attempt after its last; a poison one
// fails again and is back in its own row, its key blocked again; a record without a key is
// applied too. Replaying again changes nothing.
func TestReplayBlockedKeysAppliesEachOnceInOrder(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		cfg := h.Config(ledger.Handler{})
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond}
		cfg.LocalAttempts = 1
		cfg.OnDeadLetter = processor.OnDeadLetterBlock
		r := h.Start(cfg)

		keyless := testkit.Event("n1", "N", 1, 2, false)
		keyless.Key = nil
		items := []ledger.Item{
			testkit.Event("a1", "A", 1, 0, false),
			testkit.Event("a2", "A", 2, 2, false), // fails attempts 1 and 2 (tier 1): dead, blocks A; attempt 3 succeeds
			testkit.Event("b1", "B", 1, 0, true),  // poison: dead, blocks B; dead again when replayed
			testkit.Event("a3", "A", 3, 0, false),
			keyless,
			testkit.Event("b2", "B", 2, 0, false),
			testkit.Event("a4", "A", 4, 0, false),
			testkit.Event("c1", "C", 1, 0, false),
		}
		h.Produce(items)
		testenv.Eventually(t, 30*time.Second, func() error {
			got := h.deadLetterStates()
			want := "[a2:new:2:dead_lettered b1:new:1:dead_lettered n1:new:2:dead_lettered]"
			if fmt.Sprint(got) != want || !slices.Contains(h.appliedOrder(), "c1@1") {
				return fmt.Errorf("dead letters %v, applied %v; want %s and c1 applied", got, h.appliedOrder(), want)
			}
			return nil
		})

		o := ops.New(h.Pool, "kafkapg", h.Group)
		ctx := context.Background()
		p, err := o.Preview(ctx, ops.Replay, ops.Filter{}, 10)
		if err != nil {
			t.Fatal(err)
		}
		if p.Matched != 3 || p.BlockingKeys != 2 || len(p.Sample) != 3 {
			t.Fatalf("dry run: matched %d, blocking %d, sample %d; want 3, 2, 3", p.Matched, p.BlockingKeys, len(p.Sample))
		}
		if got := h.deadLetterStates(); !strings.Contains(fmt.Sprint(got), "a2:new") {
			t.Fatalf("the dry run changed something: %v", got)
		}
		task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, ops.Actor{Name: "tester", Reason: "fixed the flaky dependency"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		if task, err = o.RunTask(ctx, task.ID, "test", nil); err != nil || task.Status != "done" || task.Done != 3 {
			t.Fatalf("RunTask = %+v, %v; want done, 3 queued", task, err)
		}
		testenv.Eventually(t, 30*time.Second, func() error {
			got := fmt.Sprint(h.deadLetterStates())
			want := "[a2:replayed:2:dead_lettered,replay_queued,replayed b1:new:2:dead_lettered,replay_queued,dead_lettered n1:replayed:2:dead_lettered,replay_queued,replayed]"
			if got != want {
				return fmt.Errorf("dead letters %s, want %s", got, want)
			}
			order := h.appliedOrder()
			if !slices.Contains(order, "a4@1") {
				return fmt.Errorf("applied %v; want a3 and a4 after a2", order)
			}
			return nil
		})
		order := h.appliedOrder()
		for _, want := range []string{"a2@3", "n1@3", "a3@1", "a4@1"} {
			if !slices.Contains(order, want) {
				t.Errorf("applied %v; want %s (a replayed record is the attempt after its last)", order, want)
			}
		}
		if !before(order, "a1", "a2") || !before(order, "a2", "a3") || !before(order, "a3", "a4") {
			t.Errorf("applied %v; want A's events in order a1 a2 a3 a4", order)
		}
		if slices.ContainsFunc(order, func(s string) bool { return strings.HasPrefix(s, "b") }) {
			t.Errorf("applied %v; B's events must wait behind the poison b1, blocked again", order)
		}
		var blocked int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.held_keys WHERE state = 'blocked' AND key = 'B'`).Scan(&blocked); err != nil || blocked != 1 {
			t.Errorf("B blocked: %d, %v; want its key blocked again behind b1", blocked, err)
		}
		testenv.Eventually(t, 10*time.Second, func() error {
			tk, err := o.Task(ctx, task.ID)
			if err != nil {
				return err
			}
			if tk.Applied != 2 || tk.DeadAgain != 1 || tk.Pending != 0 {
				return fmt.Errorf("task outcomes applied %d, dead again %d, pending %d; want 2, 1, 0", tk.Applied, tk.DeadAgain, tk.Pending)
			}
			if got := r.Labeled("kafkapg_replayed_records_total", "outcome", "applied"); got != 2 {
				return fmt.Errorf("kafkapg_replayed_records_total{outcome=applied} = %v, want 2", got)
			}
			return nil
		})

		// Replaying the replayed ones again finds nothing new, and changes nothing.
		ids := h.deadLetterIDs(`status = 'replayed'`)
		var nothing *ops.NothingNewError
		if _, err := o.StartTask(ctx, ops.Replay, ops.Filter{IDs: ids}, ops.Actor{Name: "tester", Reason: "again"}, 0); !errors.As(err, &nothing) || nothing.NotNew != int64(len(ids)) {
			t.Errorf("replaying replayed rows: %v; want nothing new among %d", err, len(ids))
		}
		before := h.appliedOrder()
		time.Sleep(1500 * time.Millisecond)
		if after := h.appliedOrder(); len(after) != len(before) {
			t.Errorf("applied %v after the replay settled, was %v", after, before)
		}
		var audits int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.audit WHERE actor = 'tester' AND action = 'replay' AND reason = 'fixed the flaky dependency'`).Scan(&audits); err != nil || audits != 1 {
			t.Errorf("audit rows of the replay: %d, %v; want 1", audits, err)
		}
	})
}

// deadLetterIDs returns the ids of the dead_letters rows where cond holds.
func (h *harness) deadLetterIDs(cond string) []int64 {
	h.T.Helper()
	rows, err := h.Pool.Query(context.Background(), `SELECT id FROM kafkapg.dead_letters WHERE `+cond+` ORDER BY id`)
	if err != nil {
		h.T.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		h.T.Fatal(err)
	}
	return ids
}

// TestReplayedRecordGoesBeforeTheKeysLaterRecords: with ON_DEAD_LETTER=skip the key's later
// records were applied; a replayed dead letter is applied after them, and the key's records that
// arrive after the replay wait behind it (the partition's owner learns of the key a replay
// holds through the keys epoch). Two tasks replaying the same rows at once queue each once.
func TestReplayedRecordGoesBeforeTheKeysLaterRecords(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		cfg := h.Config(ledger.Handler{})
		cfg.RetryTiers = []time.Duration{} // dead at once, its key never held: the owner must learn of it
		cfg.LocalAttempts = 1
		h.Start(cfg)

		first := []ledger.Item{
			testkit.Event("a1", "A", 1, 0, false),
			testkit.Event("a2", "A", 2, 1, false), // dead (skip): a3 goes on
			testkit.Event("a3", "A", 3, 0, false),
			testkit.Event("b1", "B", 1, 1, false),
		}
		h.Produce(first)
		testenv.Eventually(t, 30*time.Second, func() error {
			if got := fmt.Sprint(h.deadLetterStates()); got != "[a2:new:1:dead_lettered b1:new:1:dead_lettered]" || !before(h.appliedOrder(), "a1", "a3") {
				return fmt.Errorf("dead letters %s, applied %v", got, h.appliedOrder())
			}
			return nil
		})

		o := ops.New(h.Pool, "kafkapg", h.Group)
		ctx := context.Background()
		a := ops.Actor{Name: "tester", Reason: "dependency fixed"}
		t1, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, a, 0)
		if err != nil {
			t.Fatal(err)
		}
		t2, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, a, 0)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		done := make([]int64, 2)
		for i, id := range []int64{t1.ID, t2.ID} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				tk, err := o.RunTask(ctx, id, fmt.Sprint("runner-", i), nil)
				if err != nil {
					t.Errorf("task %d: %v", id, err)
				}
				done[i] = tk.Done
			}()
		}
		wg.Wait()
		if done[0]+done[1] != 2 {
			t.Fatalf("two tasks queued %v dead letters; want 2 in all (each row once)", done)
		}
		// Produced right after the replay: it must wait behind the replayed a2.
		later := []ledger.Item{testkit.Event("a4", "A", 4, 0, false)}
		h.Produce(later)
		testenv.Eventually(t, 30*time.Second, func() error {
			order := h.appliedOrder()
			if !slices.Contains(order, "a4@1") || !slices.Contains(order, "a2@2") || !slices.Contains(order, "b1@2") {
				return fmt.Errorf("applied %v; want a2 and b1 replayed (attempt 2) and a4", order)
			}
			return nil
		})
		order := h.appliedOrder()
		if !before(order, "a3", "a2") || !before(order, "a2", "a4") {
			t.Errorf("applied %v; want a3 (applied before the replay), then the replayed a2, then a4 (produced after it)", order)
		}
		if got := fmt.Sprint(h.deadLetterStates()); got != "[a2:replayed:1:dead_lettered,replay_queued,replayed b1:replayed:1:dead_lettered,replay_queued,replayed]" {
			t.Errorf("dead letters %s; want both replayed once", got)
		}
	})
}

// batchCalls is a BatchHandler around the ledger's that records, for each HandleBatch call, the
// partition and offset of its records.
type batchCalls struct {
	mu    sync.Mutex
	calls [][][2]int64
}

func (b *batchCalls) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	return b.HandleBatch(ctx, tx, []*processor.Record{rec})
}

func (b *batchCalls) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	call := make([][2]int64, len(recs))
	for i, r := range recs {
		call[i] = [2]int64{int64(r.Partition), r.Offset}
	}
	b.mu.Lock()
	b.calls = append(b.calls, call)
	b.mu.Unlock()
	return ledger.Handler{}.HandleBatch(ctx, tx, recs)
}

// TestBatchHandlerGetsOnePartitionInOrder: the contract of BatchHandler is one partition's records,
// in offset order. The held-record applier bundles the ready keys of a topic into one
// transaction, and handed one HandleBatch records of several partitions, key after key; a replay
// of dead letters of many keys on four partitions made it do so.
func TestBatchHandlerGetsOnePartitionInOrder(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 4)
		bc := &batchCalls{}
		cfg := h.Config(bc)
		cfg.RetryTiers = []time.Duration{}
		cfg.LocalAttempts = 1
		cfg.BreakerDisabled = true // every record fails at first: not an outage
		var items []ledger.Item
		for i := range 40 {
			items = append(items, testkit.Event(fmt.Sprintf("e%d", i), fmt.Sprintf("acct-%d", i), 1, 1, false)) // dead at attempt 1, applied at 2
		}
		h.Start(cfg)
		h.Produce(items)
		testenv.Eventually(t, 30*time.Second, func() error {
			if n := len(h.deadLetterIDs("status = 'new'")); n != len(items) {
				return fmt.Errorf("%d of %d dead letters", n, len(items))
			}
			return nil
		})
		o := ops.New(h.Pool, "kafkapg", h.Group)
		ctx := context.Background()
		task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, ops.Actor{Name: "tester", Reason: "fixed"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := o.RunTask(ctx, task.ID, "test", nil); err != nil {
			t.Fatal(err)
		}
		h.WaitApplied(len(items), 30*time.Second)
		bc.mu.Lock()
		defer bc.mu.Unlock()
		multi := 0
		for _, call := range bc.calls {
			if len(call) > 1 {
				multi++
			}
			for i := 1; i < len(call); i++ {
				if call[i][0] != call[0][0] || call[i][1] <= call[i-1][1] {
					t.Fatalf("a HandleBatch call got %v (partition, offset): not one partition in offset order", call)
				}
			}
		}
		t.Logf("%d HandleBatch calls, %d with more than one record", len(bc.calls), multi)
	})
}

// TestTraceShowsTheWayThroughTheTiers: a record that failed twice and was applied from tier 2
// was traced as only "applied (the partition's position passed it by T)", T being when it left
// for tier 1: the tables forget the retry path of an applied record. Its copies in the tiers'
// topics keep it, and the trace reads them.
func TestTraceShowsTheWayThroughTheTiers(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		cfg := h.Config(ledger.Handler{})
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond, 200 * time.Millisecond}
		cfg.LocalAttempts = 1
		h.Start(cfg)
		h.Produce([]ledger.Item{testkit.Event("ok", "A", 1, 0, false), testkit.Event("twice", "B", 1, 2, false)})
		h.WaitApplied(2, 30*time.Second)
		o := ops.New(h.Pool, "kafkapg", h.Group)
		res, err := o.Trace(context.Background(), ops.TraceQuery{Topic: h.Topic, Partition: 0, Offset: 1}, k.Client(t))
		if err != nil {
			t.Fatal(err)
		}
		r := res.Records[0]
		var tiers []int
		var steps []string
		for _, s := range r.Steps {
			steps = append(steps, s.Kind+": "+s.What)
			if s.Kind == ops.StepTier {
				tiers = append(tiers, s.Tier)
			}
		}
		if r.State != ops.TraceApplied || !strings.HasPrefix(r.Now, "applied from retry tier 2") || !strings.Contains(r.Now, "at attempt 3") ||
			!slices.Equal(tiers, []int{1, 2}) || len(res.Notes) != 0 {
			t.Errorf("trace: %s %q, notes %q, steps:\n%s\nwant applied from tier 2 at attempt 3, through tiers 1 and 2", r.State, r.Now, res.Notes, strings.Join(steps, "\n"))
		}
		t.Logf("now: %s; steps:\n%s", r.Now, strings.Join(steps, "\n"))
		res, err = o.Trace(context.Background(), ops.TraceQuery{Topic: h.Topic, Partition: 0, Offset: 0}, k.Client(t))
		if err != nil || !strings.HasPrefix(res.Records[0].Now, "applied (the partition's position") {
			t.Errorf("a record applied at its first delivery: %+v, %v", res.Records, err)
		}
	})
}
