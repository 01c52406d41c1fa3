package processor_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// TestChainIsExactlyOnceEndToEnd is the two-stage pipeline: stage 1 applies ledger events and
// emits a posting per event through the outbox; its producer sent a tenth of the events twice;
// stage 2 inserts the postings into a table without a unique constraint. Stage 1 deduplicates on
// the event id, stage 2 on the message id. Both stages run two processors; one of each is stopped
// and replaced midway (a rebalance), and stage 1's relay then publishes a quarter of its postings
// a second time, as a relay that died between Kafka's acknowledgement and its delete would.
// Every event must be posted exactly once, each account's postings in seq order.
func TestChainIsExactlyOnceEndToEnd(t *testing.T) {
	t.Parallel()
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		h := newHarness(t, k, 4)
		ctx := context.Background()
		if _, err := h.Pool.Exec(ctx, ledger.ChainSchema); err != nil {
			t.Fatal(err)
		}
		postings := k.CreateTopic(t, 3)
		originals := ledger.Generate(ledger.GenConfig{Events: 600, Accounts: 12, FlakyPerMille: 60, PoisonPerMille: 15, Seed: 13, Prefix: "c"})
		items := ledger.Duplicate(originals, 100, 7)

		stageOne := func() *processor.Config {
			cfg := h.Config(ledger.Forward{Topic: postings})
			cfg.RetryTiers = []time.Duration{50 * time.Millisecond}
			cfg.TopicPolicies = map[string]processor.TopicPolicy{h.Topic: {IdempotencyKey: ledger.StageOneKey}}
			cfg.OutboxRetention = time.Hour // published postings are kept: the test publishes some again
			cfg.OutboxPollInterval = 100 * time.Millisecond
			return cfg
		}
		stageTwo := func() *processor.Config {
			cfg := h.Config(ledger.Post{})
			cfg.Group = h.Group + "-post"
			cfg.Topics = []string{postings}
			cfg.TopicPolicies = map[string]processor.TopicPolicy{postings: {IdempotencyKey: ledger.StageTwoKey}}
			return cfg
		}
		one := []*running{h.Start(stageOne()), h.Start(stageOne())}
		two := []*running{h.Start(stageTwo()), h.Start(stageTwo())}

		h.Produce(items[:len(items)/2])
		h.WaitApplied(len(originals)/5, 30*time.Second)
		one[0].Stop(t) // its partitions move to the other; a new member joins
		two[0].Stop(t)
		one[0], two[0] = h.Start(stageOne()), h.Start(stageTwo())
		h.Produce(items[len(items)/2:])
		h.WaitSettled(items, 2, 60*time.Second)

		// The relay died after Kafka acknowledged a quarter of the postings and before it
		// marked them published: they are published again.
		tag, err := h.Pool.Exec(ctx, `UPDATE kafkapg.outbox SET published_at = NULL WHERE consumer_group = $1 AND topic = $2 AND id % 4 = 0`, h.Group, postings)
		if err != nil {
			t.Fatal(err)
		}
		republished := int(tag.RowsAffected())

		skipped := func(rs []*running) float64 {
			n := 0.0
			for _, r := range rs {
				n += r.Counter("kafkapg_duplicate_keys_skipped_total")
			}
			return n
		}
		// Stage 2 is done when it has consumed every posting published.
		testenv.Eventually(t, 60*time.Second, func() error {
			n := len(k.ReadAll(t, postings))
			if n < postingsWant(items)+republished {
				return fmt.Errorf("%d postings published, want %d", n, postingsWant(items)+republished)
			}
			var consumed int
			if err := h.Pool.QueryRow(ctx, `SELECT coalesce(sum(next_offset), 0) FROM kafkapg.offsets WHERE consumer_group = $1`, h.Group+"-post").Scan(&consumed); err != nil {
				return err
			}
			if consumed < n {
				return fmt.Errorf("stage 2 consumed %d of %d postings", consumed, n)
			}
			return nil
		})
		posted, err := ledger.VerifyChain(ctx, h.Pool, items, 2)
		if err != nil {
			t.Fatal(err)
		}
		if got := skipped(two); got != float64(republished) {
			t.Errorf("stage 2 skipped %v duplicates, want %d (the republished postings)", got, republished)
		}
		h.Verify(originals, 2, true)
		// A copy of an applied event reaching the handler would fail its primary key and be
		// dead-lettered: stage 1's dead letters are exactly the dead events and their copies.
		if _, dead := ledger.Expect(items, 2); h.Progress().DeadRows != dead {
			t.Errorf("stage 1 has %d dead_letters rows, want %d: copies of applied events reached the handler", h.Progress().DeadRows, dead)
		}
		// Stage 1 keeps a key per event; stage 2 a few: the postings are numbered in streams, and
		// it keeps a few numbers per stream, and a key only for the numbers below the first one
		// it observed of a stream (the relay publishes a stream's keys in any order). Its numbers
		// and those keys count exactly the postings it applied.
		keys := ringKeys(t, h.Pool)
		streams, done := streamState(t, h.Pool, h.Group+"-post")
		if keys < posted || done+keys-posted != posted || streams == 0 || streams > 4*3 {
			t.Errorf("stage 2's streams (%d) say %d postings applied, and the stages recorded %d keys (one per event stage 1 applied: %d; the rest stage 2's); want %d postings in at most 12 streams (4 source partitions x 3 posting partitions)",
				streams, done, keys, posted, posted)
		}
		t.Logf("%d events (%d sent twice), %d posted once each; %d postings published twice, all skipped by stage 2", len(originals), len(items)-len(originals), posted, republished)
	})
}

// postingsWant is the number of postings stage 1 emits: one per event it applies.
func postingsWant(items []ledger.Item) int {
	n, _ := ledger.Expect(items, 2)
	return n
}

// TestIdempotencyKeys: a copy of an applied record is skipped, counted, and advances the offset;
// a record without its key is dead-lettered with an error that says so; a replayed dead letter
// whose key was never applied is applied, and one whose copy was applied meanwhile is skipped;
// after the retention, keys are pruned and a late copy is applied again.
func TestIdempotencyKeys(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h := newHarness(t, k, 1)
	ctx := context.Background()
	cfg := h.Config(ledger.Handler{})
	cfg.TopicPolicies = map[string]processor.TopicPolicy{h.Topic: {IdempotencyKey: processor.KeyFromHeader("idem")}}
	cfg.IdempotencyRetention = 6 * time.Second
	var logs syncBuffer
	cfg.Logger = slog.New(slog.NewJSONHandler(&logs, nil))
	r := h.Start(cfg)
	// The cost is said at startup, where the user decides: bytes per key and the formula.
	testenv.Eventually(t, 10*time.Second, func() error {
		for _, w := range []string{`idempotency keys are on: each key takes about 85 bytes of Postgres while its generation is current and 18 once compacted, kept for IDEMPOTENCY_RETENTION (6s) to 4/3 of it (of the longest retention among the schema's groups, if another's is longer): at 1,000 keyed records/s that is up to 276 kB`,
			`size it as records/s x retention x 46 bytes`, `"bytes_per_key":46`} {
			if !strings.Contains(logs.String(), w) {
				return fmt.Errorf("the logs do not say %q:\n%s", w, logs.String())
			}
		}
		return nil
	})

	rec := func(id string, idem string) *kgo.Record {
		v := fmt.Appendf(nil, `{"event_id":%q,"account":"a","amount":1,"seq":1}`, id)
		out := &kgo.Record{Topic: h.Topic, Key: []byte("a"), Value: v}
		if idem != "" {
			out.Headers = []kgo.RecordHeader{{Key: "idem", Value: []byte(idem)}}
		}
		return out
	}
	// e1 applied; its copy (another event id: a plain INSERT would apply it) skipped; no key:
	// dead-lettered.
	k.Produce(t, rec("e1", "K1"), rec("e1-copy", "K1"), rec("e2", ""), rec("e3", "K3"))
	testenv.Eventually(t, 20*time.Second, func() error {
		if n := h.Applied(); n != 2 {
			return fmt.Errorf("%d applied, want e1 and e3", n)
		}
		if r.Counter("kafkapg_duplicate_keys_skipped_total") != 1 {
			return errors.New("the copy is not counted as a duplicate yet")
		}
		return nil
	})
	// The state's size is published: the two keys (as rows of the current generation, or, once
	// the ring turned, which it does every 2 s here, counted as a compacted row of up to 120), and
	// at least three pages (a heap, its primary key's metapage and leaf). Postgres's statistics of
	// a table lag its writes by up to the recording backend's next flush.
	testenv.Eventually(t, 30*time.Second, func() error {
		if rows, b := r.Gauge("kafkapg_idempotency_keys_rows"), r.Gauge("kafkapg_idempotency_keys_bytes"); rows < 2 || b < 3*8192 {
			return fmt.Errorf("kafkapg_idempotency_keys_rows %v, _bytes %v: want at least 2 and at least 24576", rows, b)
		}
		return nil
	})
	var class, msg string
	if err := h.Pool.QueryRow(ctx, `SELECT error_class, error_message FROM kafkapg.dead_letters WHERE consumer_group = $1`, h.Group).Scan(&class, &msg); err != nil {
		t.Fatal(err)
	}
	if class != "permanent" || !strings.Contains(msg, `no header "idem"`) {
		t.Errorf("dead letter %s: %q; want permanent, naming the missing header", class, msg)
	}
	var next int64
	if err := h.Pool.QueryRow(ctx, `SELECT next_offset FROM kafkapg.offsets WHERE consumer_group = $1`, h.Group).Scan(&next); err != nil || next != 4 {
		t.Fatalf("next_offset %d (%v), want 4: the duplicate advances the offset", next, err)
	}

	// Replays. f1 and g1 fail their only delivery (no tiers) and are dead-lettered; a fixed copy
	// of g1 (another event id, the same key) is applied meanwhile. Replayed, f1 was never
	// applied, so its key does not stop it: it is applied; g1's key was applied by its copy: it
	// is skipped as a duplicate, and its dead letter counts as replayed.
	flaky := func(id, idem string) *kgo.Record {
		r := rec(id, idem)
		r.Value = fmt.Appendf(nil, `{"event_id":%q,"account":"a","amount":1,"seq":1,"fail_attempts":1}`, id)
		return r
	}
	k.Produce(t, flaky("f1", "KF"), flaky("g1", "KG"), rec("g1-fixed", "KG"))
	h.WaitApplied(3, 20*time.Second)
	o := ops.New(h.Pool, "kafkapg", h.Group)
	task, err := o.StartTask(ctx, ops.Replay, ops.Filter{Status: "new", Error: "simulated"}, ops.Actor{Name: "tester", Reason: "dependency fixed"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task, err = o.RunTask(ctx, task.ID, "test", nil); err != nil || task.Done != 2 {
		t.Fatalf("RunTask = %+v, %v; want 2 queued", task, err)
	}
	testenv.Eventually(t, 20*time.Second, func() error {
		var replayed int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.dead_letters WHERE consumer_group = $1 AND status = 'replayed'`, h.Group).Scan(&replayed); err != nil {
			return err
		}
		if replayed != 2 {
			return fmt.Errorf("%d dead letters replayed, want 2", replayed)
		}
		return nil
	})
	var entries []string
	rows, _ := h.Pool.Query(ctx, `SELECT event_id FROM ledger_entries ORDER BY applied_order`)
	entries, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"e1", "e3", "g1-fixed", "f1"}; !slices.Equal(entries, want) {
		t.Fatalf("applied %q, want %q (g1 skipped when replayed: its copy was applied)", entries, want)
	}
	// Counted once the transaction that skipped it has committed, after the row says replayed.
	testenv.Eventually(t, 10*time.Second, func() error {
		if got := r.Counter("kafkapg_duplicate_keys_skipped_total"); got != 2 {
			return fmt.Errorf("kafkapg_duplicate_keys_skipped_total = %v, want 2 (e1's copy, replayed g1)", got)
		}
		return nil
	})
	// What the replay says it did is what it did: f1 applied, g1 skipped as a duplicate — in the
	// task's outcomes, the metric, g1's history and its trace.
	if got := r.Labeled("kafkapg_replayed_records_total", "outcome", "applied"); got != 1 {
		t.Errorf("kafkapg_replayed_records_total{outcome=applied} = %v, want 1 (f1)", got)
	}
	if got := r.Labeled("kafkapg_replayed_records_total", "outcome", "skipped_duplicate"); got != 1 {
		t.Errorf("kafkapg_replayed_records_total{outcome=skipped_duplicate} = %v, want 1 (g1)", got)
	}
	if tk, err := o.Task(ctx, task.ID); err != nil || tk.Applied != 1 || tk.SkippedDuplicate != 1 || tk.DeadAgain != 0 || tk.Pending != 0 {
		t.Errorf("task outcomes %+v, %v; want 1 applied, 1 skipped as a duplicate", tk, err)
	}
	var g1Offset int64
	var history string
	if err := h.Pool.QueryRow(ctx, `SELECT "offset", (SELECT string_agg(event, ',' ORDER BY e.id) FROM kafkapg.dead_letter_events e WHERE e.dead_letter_id = d.id)
		FROM kafkapg.dead_letters d WHERE consumer_group = $1 AND convert_from(value, 'UTF8')::json->>'event_id' = 'g1'`, h.Group).Scan(&g1Offset, &history); err != nil {
		t.Fatal(err)
	}
	if history != "dead_lettered,replay_queued,skipped_duplicate" {
		t.Errorf("g1's history %s; want it skipped as a duplicate, not replayed", history)
	}
	tr, err := o.Trace(ctx, ops.TraceQuery{Topic: h.Topic, Offset: g1Offset}, nil)
	if err != nil || len(tr.Records) != 1 {
		t.Fatalf("trace of g1: %+v, %v", tr, err)
	}
	g1 := tr.Records[0]
	i := slices.IndexFunc(g1.Steps, func(s ops.TraceStep) bool { return s.Kind == ops.StepSkippedDuplicate })
	if g1.State != ops.TraceSkippedDuplicate || !strings.HasPrefix(g1.Now, "skipped as a duplicate by a replay of dead letter #") || i < 0 ||
		!strings.Contains(g1.Steps[i].What, "skipped as a duplicate by the replay by task") || !strings.Contains(g1.Steps[i].What, "idempotency key hash ") ||
		slices.ContainsFunc(g1.Steps, func(s ops.TraceStep) bool { return s.Kind == ops.StepReplayed }) {
		t.Errorf("trace of g1: %s: %s, steps %+v; want it skipped as a duplicate, naming its key's hash, and not applied", g1.State, g1.Now, g1.Steps)
	}

	// After the retention the keys are pruned, and a late copy is applied again.
	testenv.Eventually(t, 30*time.Second, func() error {
		if n := ringKeys(t, h.Pool); n > 0 {
			return fmt.Errorf("%d keys not pruned yet", n)
		}
		return nil
	})
	k.Produce(t, rec("e1-late", "K1"))
	h.WaitApplied(5, 20*time.Second)
	if got := r.Counter("kafkapg_idempotency_keys_pruned_total"); got < 4 {
		t.Errorf("kafkapg_idempotency_keys_pruned_total = %v, want at least 4 (K1, K3, KF, KG)", got)
	}
}

// TestReplaySkipsADuplicateFromATier: a replayed dead letter that fails again goes round the retry
// tiers; when a copy with its idempotency key is applied meanwhile, the tier's worker skips it as a
// duplicate (settle, then retrytopics.Store.Applied), and the replay says so as it does when the
// held-record applier skips one (TestIdempotencyKeys): its history ends skipped_duplicate, the
// task counts it skipped, kafkapg_replayed_records_total says skipped_duplicate, and its trace
// says skipped, not applied.
func TestReplaySkipsADuplicateFromATier(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h := newHarness(t, k, 1)
	ctx := context.Background()
	cfg := h.Config(failsAfterItsFirst{"g1"})
	cfg.TopicPolicies = map[string]processor.TopicPolicy{h.Topic: {IdempotencyKey: processor.KeyFromHeader("idem")}}
	// Time enough, in the tiers, for the copy to be applied before g1 is tried for the last time.
	cfg.RetryTiers = []time.Duration{200 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second, 4 * time.Second}
	cfg.LocalAttempts = 1
	cfg.BreakerDisabled = true // g1 fails at every try: not an outage
	r := h.Start(cfg)
	rec := func(id, key string) *kgo.Record {
		return &kgo.Record{Topic: h.Topic, Key: []byte(key), Headers: []kgo.RecordHeader{{Key: "idem", Value: []byte("KG")}},
			Value: fmt.Appendf(nil, `{"event_id":%q,"account":"a","amount":1,"seq":1}`, id)}
	}
	// g1 fails for good at its first delivery: dead at once, before any tier.
	k.Produce(t, rec("g1", "a"))
	testenv.Eventually(t, 20*time.Second, func() error {
		if got := fmt.Sprint(h.deadLetterStates()); got != "[g1:new:1:dead_lettered]" {
			return fmt.Errorf("dead letters %s, want g1 dead", got)
		}
		return nil
	})
	o := ops.New(h.Pool, "kafkapg", h.Group)
	task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, ops.Actor{Name: "tester", Reason: "fixed"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task, err = o.RunTask(ctx, task.ID, "test", nil); err != nil || task.Done != 1 {
		t.Fatalf("RunTask = %+v, %v; want 1 queued", task, err)
	}
	// Replayed, g1 fails again (attempt 2) and leaves held_records for the tiers, its dead letter
	// still replaying.
	testenv.Eventually(t, 20*time.Second, func() error {
		var inTiers int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.retries WHERE consumer_group = $1 AND dead_letter_id IS NOT NULL`, h.Group).Scan(&inTiers); err != nil {
			return err
		}
		if inTiers != 1 {
			return fmt.Errorf("%d replayed records in the retry tiers, want g1", inTiers)
		}
		return nil
	})
	// Its fixed copy carries the same idempotency key under another record key: under g1's own,
	// held while g1 is in the tiers, it would wait behind g1 and be the one skipped.
	k.Produce(t, rec("g1-fixed", "b"))
	testenv.Eventually(t, 30*time.Second, func() error {
		if got := fmt.Sprint(h.deadLetterStates()); strings.Contains(got, ":replaying:") {
			return fmt.Errorf("dead letters %s, want g1 settled", got)
		}
		return nil
	})
	if got := fmt.Sprint(h.deadLetterStates()); got != "[g1:replayed:1:dead_lettered,replay_queued,skipped_duplicate]" {
		t.Errorf("dead letters %s, want g1 replayed, skipped as a duplicate", got)
	}
	if got := h.appliedOrder(); !slices.Equal(got, []string{"g1-fixed@1"}) {
		t.Errorf("applied %q, want only g1-fixed: g1 is its copy", got)
	}
	var retrying, held int
	if err := h.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM kafkapg.retries WHERE consumer_group = $1), (SELECT count(*) FROM kafkapg.held_keys WHERE consumer_group = $1)`,
		h.Group).Scan(&retrying, &held); err != nil || retrying != 0 || held != 0 {
		t.Errorf("%d records in the retry path, %d keys held (%v); want g1 out of the tiers and its key released", retrying, held, err)
	}
	// Counted once the transaction that skipped it has committed, after the row says replayed.
	testenv.Eventually(t, 10*time.Second, func() error {
		if got := r.Labeled("kafkapg_replayed_records_total", "outcome", "skipped_duplicate"); got != 1 {
			return fmt.Errorf("kafkapg_replayed_records_total{outcome=skipped_duplicate} = %v, want 1 (g1)", got)
		}
		return nil
	})
	if got := r.Labeled("kafkapg_replayed_records_total", "outcome", "applied"); got != 0 {
		t.Errorf("kafkapg_replayed_records_total{outcome=applied} = %v, want 0", got)
	}
	if got := r.Counter("kafkapg_duplicate_keys_skipped_total"); got != 1 {
		t.Errorf("kafkapg_duplicate_keys_skipped_total = %v, want 1 (g1, from its tier)", got)
	}
	if tk, err := o.Task(ctx, task.ID); err != nil || tk.Applied != 0 || tk.SkippedDuplicate != 1 || tk.DeadAgain != 0 || tk.Pending != 0 {
		t.Errorf("task outcomes %+v, %v; want 1 skipped as a duplicate, nothing else", tk, err)
	}
	tr, err := o.Trace(ctx, ops.TraceQuery{Topic: h.Topic, Offset: 0}, nil)
	if err != nil || len(tr.Records) != 1 {
		t.Fatalf("trace of g1: %+v, %v", tr, err)
	}
	if g1 := tr.Records[0]; g1.State != ops.TraceSkippedDuplicate || slices.ContainsFunc(g1.Steps, func(s ops.TraceStep) bool { return s.Kind == ops.StepReplayed }) {
		t.Errorf("trace of g1: %s: %s, steps %+v; want it skipped as a duplicate, not applied", g1.State, g1.Now, g1.Steps)
	}
}

// failsAfterItsFirst is the ledger's handler, but the event id fails for good at its first
// delivery and transiently at each one after: only a skip as a duplicate settles it.
type failsAfterItsFirst struct{ id string }

func (f failsAfterItsFirst) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	ev, err := ledger.Parse(rec.Value)
	switch {
	case err != nil || ev.EventID != f.id:
	case rec.Attempt == 1:
		return processor.Permanent(fmt.Errorf("ledger event %s: refused at its first delivery", ev.EventID))
	default:
		return fmt.Errorf("ledger event %s: still failing (attempt %d)", ev.EventID, rec.Attempt)
	}
	return ledger.Handler{}.Handle(ctx, tx, rec)
}

// TestReplayAfterTheRetentionSkipsAnAppliedCopy: a dead letter whose copy (its idempotency key)
// was applied is skipped when replayed, also when the replay comes later than
// IDEMPOTENCY_RETENTION: the copy's key was pruned by age while the dead letter still referred to
// it, and the replay applied the event a second time.
func TestReplayAfterTheRetentionSkipsAnAppliedCopy(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	h := newHarness(t, k, 1)
	ctx := context.Background()
	cfg := h.Config(ledger.Handler{})
	cfg.TopicPolicies = map[string]processor.TopicPolicy{h.Topic: {IdempotencyKey: processor.KeyFromHeader("idem")}}
	cfg.IdempotencyRetention = 2 * time.Second
	r := h.Start(cfg)
	rec := func(id, idem string, fail int) *kgo.Record {
		return &kgo.Record{Topic: h.Topic, Key: []byte("a"), Headers: []kgo.RecordHeader{{Key: "idem", Value: []byte(idem)}},
			Value: fmt.Appendf(nil, `{"event_id":%q,"account":"a","amount":1,"seq":1,"fail_attempts":%d}`, id, fail)}
	}
	// g1 fails its only delivery and is dead-lettered; its fixed copy, with the same key, is applied.
	k.Produce(t, rec("g1", "KG", 1), rec("g1-fixed", "KG", 0), rec("other", "KO", 0))
	h.WaitApplied(2, 20*time.Second)
	// Well past the retention: other keys are pruned meanwhile, not the one the dead letter shares.
	testenv.Eventually(t, 30*time.Second, func() error {
		if got := r.Counter("kafkapg_idempotency_keys_pruned_total"); got < 1 {
			return fmt.Errorf("%v keys pruned", got)
		}
		return nil
	})
	time.Sleep(3 * time.Second)
	o := ops.New(h.Pool, "kafkapg", h.Group)
	task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, ops.Actor{Name: "tester", Reason: "fixed"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := o.RunTask(ctx, task.ID, "test", nil); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 20*time.Second, func() error {
		var replayed int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.dead_letters WHERE consumer_group = $1 AND status = 'replayed'`, h.Group).Scan(&replayed); err != nil {
			return err
		}
		if replayed != 1 {
			return fmt.Errorf("%d dead letters replayed, want 1", replayed)
		}
		return nil
	})
	rows, _ := h.Pool.Query(ctx, `SELECT event_id FROM ledger_entries ORDER BY applied_order`)
	entries, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"g1-fixed", "other"}; !slices.Equal(entries, want) {
		t.Errorf("applied %q, want %q: the replayed g1 is a copy of g1-fixed, applied", entries, want)
	}
	// Once the dead letter is replayed, its key ages out like any other.
	testenv.Eventually(t, 30*time.Second, func() error {
		if n := ringKeys(t, h.Pool); n > 0 {
			return fmt.Errorf("%d keys not pruned yet", n)
		}
		return nil
	})
}

// ringKeys counts the idempotency keys kept in pool's schema kafkapg: in the ring's four
// generations (their tables of keys and their compacted runs) and the table of the layout before.
func ringKeys(t testing.TB, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM kafkapg.idempotency_keys_0) + (SELECT count(*) FROM kafkapg.idempotency_keys_1)
		+ (SELECT count(*) FROM kafkapg.idempotency_keys_2) + (SELECT count(*) FROM kafkapg.idempotency_keys_3) + (SELECT count(*) FROM kafkapg.idempotency_keys)
		+ (SELECT coalesce(sum(cardinality(keys)), 0) FROM (SELECT keys FROM kafkapg.idempotency_runs_0 UNION ALL SELECT keys FROM kafkapg.idempotency_runs_1
			UNION ALL SELECT keys FROM kafkapg.idempotency_runs_2 UNION ALL SELECT keys FROM kafkapg.idempotency_runs_3) r)`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// streamState returns how many streams group keeps the state of, and how many numbers they say
// were applied (each stream's high minus its missing numbers).
func streamState(t testing.TB, pool *pgxpool.Pool, group string) (streams, applied int) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT count(*), coalesce(sum((x.s->>'high')::int8 - (x.s->>'floor')::int8 + 1
			- (SELECT coalesce(sum(upper(r) - lower(r)), 0) FROM unnest((x.s->>'missing')::int8multirange) AS r)), 0)
		FROM kafkapg.idempotency_lineages l, jsonb_array_elements(l.state->'streams') AS x(s) WHERE l.consumer_group = $1`, group).Scan(&streams, &applied); err != nil {
		t.Fatal(err)
	}
	return streams, applied
}
