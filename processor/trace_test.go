package processor_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
)

// traceOf traces the record at partition 0, offset of h's topic, with Kafka.
func traceOf(t *testing.T, h *harness, k *testenv.Kafka, offset int64) ops.RecordTrace {
	t.Helper()
	res, err := ops.New(h.Pool, "kafkapg", h.Group).Trace(context.Background(), ops.TraceQuery{Topic: h.Topic, Partition: 0, Offset: offset}, k.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Records) != 1 || len(res.Notes) != 0 {
		t.Fatalf("trace of offset %d: %+v, want one record and no notes", offset, res)
	}
	return res.Records[0]
}

// stepLines writes a trace's steps, one a line, with their kind and time.
func stepLines(r ops.RecordTrace) string {
	var b strings.Builder
	for _, s := range r.Steps {
		fmt.Fprintf(&b, "\n  %s  %s: %s", s.At.Format(time.RFC3339Nano), s.Kind, s.What)
	}
	return b.String()
}

// inTimeOrder reports whether a trace's steps are in time order.
func inTimeOrder(r ops.RecordTrace) bool {
	return slices.IsSortedFunc(r.Steps, func(a, b ops.TraceStep) int { return a.At.Compare(b.At) })
}

// TestTraceTellsASkippedDuplicate: a copy skipped by its idempotency key (consumed as usual, not
// replayed) was traced "applied", like the copy applied: an operator could not tell them apart
// (issue 42). Two copies of a payment in one batch, and a third later: the trace says the first
// applied, the others skipped as duplicates by the key, the second naming the first (its batch
// knew it), the third saying the copy applied before is not known.
func TestTraceTellsASkippedDuplicate(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		cfg := h.Config(ledger.Handler{})
		cfg.TopicPolicies = map[string]processor.TopicPolicy{h.Topic: {IdempotencyKey: processor.KeyFromJSON("event_id")}}
		r := h.Start(cfg)
		pay := testkit.Event("pay-17", "A", 1, 0, false)
		skipped := func(n float64) {
			t.Helper()
			testenv.Eventually(t, 30*time.Second, func() error {
				if got := r.Counter("kafkapg_duplicate_keys_skipped_total"); got != n {
					return fmt.Errorf("%v duplicates skipped, want %v", got, n)
				}
				return nil
			})
		}
		h.Produce([]ledger.Item{pay, pay})
		skipped(1)
		h.Produce([]ledger.Item{pay})
		skipped(2)
		if n := h.Applied(); n != 1 {
			t.Fatalf("%d entries applied, want 1", n)
		}

		first := traceOf(t, h, k, 0)
		if first.State != ops.TraceApplied || !strings.HasPrefix(first.Now, "applied (the partition's position passed it") {
			t.Errorf("the copy applied: %s %q, want applied%s", first.State, first.Now, stepLines(first))
		}
		second := traceOf(t, h, k, 1)
		want := fmt.Sprintf(`skipped as a duplicate by its idempotency key "pay-17" (idempotency key hash `)
		byFirst := fmt.Sprintf(": the copy at %s[0]@0 was applied before it", h.Topic)
		if second.State != ops.TraceSkippedDuplicate || !strings.HasPrefix(second.Now, want) || !strings.Contains(second.Now, byFirst) {
			t.Errorf("the second copy: %s %q, want %s %q…%q%s", second.State, second.Now, ops.TraceSkippedDuplicate, want, byFirst, stepLines(second))
		}
		i := slices.IndexFunc(second.Steps, func(s ops.TraceStep) bool { return s.Kind == ops.StepSkippedDuplicate })
		if i < 0 || second.Steps[i].IdempotencyKey != "pay-17" || second.Steps[i].First == nil || *second.Steps[i].First != (ops.TraceRef{Partition: 0, Offset: 0}) {
			t.Errorf("the second copy's steps name neither its key nor the first copy:%s", stepLines(second))
		}
		third := traceOf(t, h, k, 2)
		if third.State != ops.TraceSkippedDuplicate || !strings.HasPrefix(third.Now, want) || !strings.Contains(third.Now, "which one is not known") {
			t.Errorf("the third copy: %s %q, want %s, the copy applied before not known%s", third.State, third.Now, ops.TraceSkippedDuplicate, stepLines(third))
		}
		for _, rt := range []ops.RecordTrace{first, second, third} {
			if !inTimeOrder(rt) {
				t.Errorf("offset %d: steps out of time order:%s", rt.Offset, stepLines(rt))
			}
		}
		t.Logf("second copy: %s%s", second.Now, stepLines(second))
	})
}

// TestTraceKeepsTheWaitBehindAKey: a record held behind an earlier record of its key lost that
// wait from its trace once it was applied, and a record applied from a retry tier was traced
// with "the partition's position passed it" (the offsets row's last update, later) before
// "applied from retry tier 1" (issue 42). B waits behind A, which fails once and goes to tier 1
// for a second: B's trace keeps the wait (behind offset 0, for about the tier's delay) after B
// is applied, and every trace is in time order.
func TestTraceKeepsTheWaitBehindAKey(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		cfg := h.Config(ledger.Handler{})
		cfg.RetryTiers = []time.Duration{time.Second}
		cfg.LocalAttempts = 1
		h.Start(cfg)
		h.Produce([]ledger.Item{testkit.Event("a", "K", 1, 1, false), testkit.Event("b", "K", 2, 0, false)})
		h.WaitApplied(2, 30*time.Second)
		// A later record moves the partition's position on: its row's time is later than when A
		// was applied from its tier.
		time.Sleep(50 * time.Millisecond)
		h.Produce([]ledger.Item{testkit.Event("c", "L", 1, 0, false)})
		h.WaitApplied(3, 30*time.Second)

		b := traceOf(t, h, k, 1)
		i := slices.IndexFunc(b.Steps, func(s ops.TraceStep) bool { return s.Kind == ops.StepHeld })
		if b.State != ops.TraceApplied || i < 0 {
			t.Fatalf("B: %s %q, want applied with a held step%s", b.State, b.Now, stepLines(b))
		}
		held := b.Steps[i]
		if held.Behind == nil || *held.Behind != 0 || held.Until == nil || held.Until.Sub(held.At) < 800*time.Millisecond ||
			!strings.HasPrefix(held.What, "held behind the record at offset 0 of its key for ") {
			t.Errorf("B's held step: %+v, want behind offset 0, for about a second (tier 1's delay)", held)
		}
		a := traceOf(t, h, k, 0)
		if a.State != ops.TraceApplied || !strings.HasPrefix(a.Now, "applied from retry tier 1") ||
			!slices.ContainsFunc(a.Steps, func(s ops.TraceStep) bool { return strings.HasPrefix(s.What, "applied from retry tier 1") }) {
			t.Errorf("A: %s %q, want applied from retry tier 1%s", a.State, a.Now, stepLines(a))
		}
		for _, rt := range []ops.RecordTrace{a, b} {
			if !inTimeOrder(rt) {
				t.Errorf("offset %d: steps out of time order:%s", rt.Offset, stepLines(rt))
			}
		}
		t.Logf("A: %s%s\nB: %s%s", a.Now, stepLines(a), b.Now, stepLines(b))
	})
}

// TestRecordHistoryIsPruned: what a trace tells of skipped duplicates and past waits
// (skipped_duplicates, held_history) is kept for IdempotencyRetention, the group's own rows only:
// a processor deletes the older ones at its start, and every minute after.
func TestRecordHistoryIsPruned(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h := newHarness(t, k, 1)
	ctx := context.Background()
	for _, row := range []struct {
		group  string
		offset int64
		age    time.Duration
	}{{h.Group, 1, 2 * time.Hour}, {h.Group, 2, 30 * time.Minute}, {"another", 3, 2 * time.Hour}} {
		if _, err := h.Pool.Exec(ctx, `INSERT INTO kafkapg.held_history (consumer_group, topic, partition, key_hash, first_offset, offsets, held_at, behind, until)
			VALUES ($1, $2, 0, sha256('k'), $3, ARRAY[$3::bigint], ARRAY[now() - $4::interval], ARRAY[0::bigint], now() - $4::interval)`,
			row.group, h.Topic, row.offset, row.age.String()); err != nil {
			t.Fatal(err)
		}
		if _, err := h.Pool.Exec(ctx, `INSERT INTO kafkapg.skipped_duplicates (consumer_group, topic, partition, "offset", skipped_at)
			VALUES ($1, $2, 0, $3, now() - $4::interval)`, row.group, h.Topic, row.offset, row.age.String()); err != nil {
			t.Fatal(err)
		}
	}
	cfg := h.Config(ledger.Handler{})
	cfg.IdempotencyRetention = time.Hour
	h.Start(cfg)
	testenv.Eventually(t, 20*time.Second, func() error {
		var kept string
		if err := h.Pool.QueryRow(ctx, `SELECT string_agg(t || ':' || consumer_group || '@' || o, ' ' ORDER BY t, o) FROM (
				SELECT 'held' AS t, consumer_group, first_offset AS o FROM kafkapg.held_history
				UNION ALL SELECT 'skipped', consumer_group, "offset" FROM kafkapg.skipped_duplicates) x`).Scan(&kept); err != nil {
			return err
		}
		if want := fmt.Sprintf("held:%[1]s@2 held:another@3 skipped:%[1]s@2 skipped:another@3", h.Group); kept != want {
			return fmt.Errorf("the tables keep %s, want %s", kept, want)
		}
		return nil
	})
}
