package servicetest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/service"
	"github.com/kafkapg/kafkapg/service/servicetest"
	"github.com/kafkapg/kafkapg/sink"
)

// notes is the handler of these tests: it records each note of the notes topic in applied, in
// the order it applies them, and emits it to note-events; a note whose id the test put in
// failing fails as it says there (permanent, or retryable), until the test removes it.
var notes = service.Handler{
	Name: "notes",
	Setup: service.SetupSQL(`
		CREATE TABLE applied (seq bigserial, id text PRIMARY KEY, key text);
		CREATE TABLE failing (id text PRIMARY KEY, class text NOT NULL)`),
	IdempotencyKey: processor.KeyFromJSON("id"),
	Handler: processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
		var n struct {
			ID string `json:"id"`
		}
		if err := json.Unmarshal(rec.Value, &n); err != nil {
			return processor.Permanent(err)
		}
		var class string
		switch err := tx.QueryRow(ctx, `SELECT class FROM failing WHERE id = $1`, n.ID).Scan(&class); {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			return err
		case class == "permanent":
			return processor.Permanent(fmt.Errorf("note %s fails for good", n.ID))
		default:
			return fmt.Errorf("note %s fails for now", n.ID)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO applied (id, key) VALUES ($1, $2)`, n.ID, string(rec.Key)); err != nil {
			return err
		}
		return rec.Emit(ctx, tx, sink.Event{Topic: "note-events", Key: rec.Key, Value: rec.Value})
	}),
}

func note(id string) string { return fmt.Sprintf(`{"id":%q}`, id) }

// fail makes the notes of ids fail with class (permanent or retryable); "" makes them pass.
func fail(t *testing.T, db *pgxpool.Pool, class string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		q := `INSERT INTO failing VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET class = $2`
		args := []any{id, class}
		if class == "" {
			q, args = `DELETE FROM failing WHERE id = $1`, []any{id}
		}
		if _, err := db.Exec(context.Background(), q, args...); err != nil {
			t.Fatal(err)
		}
	}
}

// appliedIDs returns the ids of the notes applied, in the order they were.
func appliedIDs(t *testing.T, db *pgxpool.Pool) string {
	t.Helper()
	var ids string
	if err := db.QueryRow(context.Background(), `SELECT coalesce(string_agg(id, ',' ORDER BY seq), '') FROM applied`).Scan(&ids); err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestAppliedEmittedDuplicateDeadLetterReplay runs a note through the service (applied, and its
// event published), a copy of it (skipped by its idempotency key), and a note that fails for
// good: dead-lettered, then, once it would pass, replayed and applied.
func TestAppliedEmittedDuplicateDeadLetterReplay(t *testing.T) {
	t.Parallel()
	start := time.Now()
	svc := servicetest.Start(t, servicetest.Options{Topics: []string{"note-events"}, Env: map[string]string{"KAFKA_TOPICS": "notes"}}, notes)
	t.Logf("started in %v", time.Since(start).Round(time.Millisecond))

	svc.Produce("notes", "a", note("n-1"))
	svc.WaitQuery("n-1", `SELECT string_agg(id, ',') FROM applied`)
	if ev := svc.WaitRecords("note-events", 1); string(ev[0].Value) != note("n-1") || string(ev[0].Key) != "a" {
		t.Fatalf("event %q %q, want the note n-1 keyed a", ev[0].Key, ev[0].Value)
	}

	fail(t, svc.DB, "permanent", "n-2")
	svc.Produce("notes", "a", note("n-1")) // a copy: skipped
	svc.Produce("notes", "b", note("n-2"))
	dls := svc.WaitDeadLetters("notes", 1)
	if len(dls) != 1 || string(dls[0].Key) != "b" || dls[0].Class != "permanent" || !strings.Contains(dls[0].Error, "n-2 fails for good") || dls[0].Status != "new" {
		t.Fatalf("dead letters %+v, want n-2's, permanent, new", dls)
	}
	if dlq := svc.WaitRecords(svc.DeadLetterTopic("notes"), 1); len(dlq) != 1 || string(dlq[0].Value) != note("n-2") {
		t.Fatalf("%s holds %d records, want n-2's", svc.DeadLetterTopic("notes"), len(dlq))
	}
	// The copy of n-1 came before n-2 in the partition: it has been skipped by now.
	if got := appliedIDs(t, svc.DB); got != "n-1" {
		t.Fatalf("applied %q, want n-1 once", got)
	}

	fail(t, svc.DB, "", "n-2")
	if out := svc.ReplayDeadLetters("notes"); !strings.Contains(out, "replay") {
		t.Errorf("replay said %q", out)
	}
	svc.WaitQuery("n-1,n-2", `SELECT string_agg(id, ',' ORDER BY seq) FROM applied`)
	ev := svc.WaitRecords("note-events", 2)
	if len(ev) != 2 || string(ev[1].Value) != note("n-2") {
		t.Fatalf("%d events, want n-1's and n-2's", len(ev))
	}
	svc.WaitQuery("replayed", `SELECT status FROM kafkapg.dead_letters`)
}

// TestAdvanceTriesATierAgain: a note that fails for now goes to a retry tier of an hour, and the
// next note of its key waits behind it; once it would pass, Advance makes it due, and both are
// applied, in order, without the test waiting an hour. The tiers and local attempts come from
// the environment, as in a Deployment.
func TestAdvanceTriesATierAgain(t *testing.T) {
	t.Parallel()
	svc := servicetest.Start(t, servicetest.Options{Topics: []string{"note-events"}, Timeout: 15 * time.Second, Env: map[string]string{
		"KAFKA_TOPICS":               "notes",
		"TOPIC_NOTES_RETRY_TIERS":    "1h,5h",
		"RETRY_LOCAL_ATTEMPTS":       "1",
		"KAFKA_GROUP_ID":             "notebook",
		"TOPIC_NOTES_CONCURRENCY":    "1",
		"IDEMPOTENCY_RETENTION":      "1h",
		"BATCH_MAX_RECORDS":          "100",
		"KAFKA_CREATE_TOPICS":        "true",
		"OUTBOX_POLL_INTERVAL":       "100ms",
		"TOPIC_NOTES_ON_DEAD_LETTER": "skip",
	}}, notes)
	if svc.Group != "notebook" || svc.RetryTopic("notes", 1) != "notes.notebook.retry.1" {
		t.Fatalf("group %q, tier 1 %q", svc.Group, svc.RetryTopic("notes", 1))
	}
	fail(t, svc.DB, "retryable", "n-1")
	svc.Produce("notes", "k", note("n-1"))
	svc.Produce("notes", "k", note("n-2")) // held behind n-1
	svc.Produce("notes", "other", note("n-3"))
	svc.WaitRecords(svc.RetryTopic("notes", 1), 1)
	svc.WaitQuery("n-3", `SELECT string_agg(id, ',' ORDER BY seq) FROM applied`)
	if out, err := svc.Command("keys", "list"); err != nil || !strings.Contains(out, "retrying") {
		t.Fatalf("keys list: %v\n%s\nwant key k retrying", err, out)
	}

	fail(t, svc.DB, "", "n-1")
	time.Sleep(200 * time.Millisecond) // not due yet: nothing moves
	if got := appliedIDs(t, svc.DB); got != "n-3" {
		t.Fatalf("applied %q before the clock moved, want n-3 alone", got)
	}
	svc.Advance(time.Hour + 7*time.Minute) // the tier's hour and its jitter (up to 10%)
	svc.WaitQuery("n-3,n-1,n-2", `SELECT string_agg(id, ',' ORDER BY seq) FROM applied`)
}

// TestReleaseKey: with ON_DEAD_LETTER=block, a dead letter holds the later notes of its key until
// an operator releases the key.
func TestReleaseKey(t *testing.T) {
	t.Parallel()
	svc := servicetest.Start(t, servicetest.Options{Topics: []string{"note-events"}, Env: map[string]string{"KAFKA_TOPICS": "notes", "ON_DEAD_LETTER": "block"}}, notes)
	fail(t, svc.DB, "permanent", "n-1")
	svc.Produce("notes", "k", note("n-1"))
	svc.Produce("notes", "k", note("n-2"))
	svc.Produce("notes", "other", note("n-3"))
	svc.WaitDeadLetters("notes", 1)
	svc.WaitQuery("n-3", `SELECT string_agg(id, ',' ORDER BY seq) FROM applied`)
	if got := appliedIDs(t, svc.DB); got != "n-3" {
		t.Fatalf("applied %q while k is blocked, want n-3 alone", got)
	}
	if out := svc.ReleaseKey("notes", "k"); !strings.Contains(out, "done (audited): release the blocked key") {
		t.Errorf("keys release said %q", out)
	}
	svc.WaitQuery("n-3,n-2", `SELECT string_agg(id, ',' ORDER BY seq) FROM applied`)
}

// TestEnvironmentIsTheOptions: the service reads Options.Env, not the test process's variables
// of the service: a KAFKA_TOPICS or a misspelt RETRY_TIER of the process changes nothing.
func TestEnvironmentIsTheOptions(t *testing.T) {
	t.Setenv("KAFKA_TOPICS", "elsewhere")
	t.Setenv("RETRY_TIER", "5s") // would be refused as a misspelt RETRY_TIERS
	t.Setenv("TOPIC_NOTES_RETRY_TIERS", "bogus")
	svc := servicetest.Start(t, servicetest.Options{Topics: []string{"note-events"}, Env: map[string]string{"KAFKA_TOPICS": "notes", "BATCH_MAX_RECORDS": "7"}}, notes)
	out, err := svc.Command("config")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"KAFKA_TOPICS", "notes", "BATCH_MAX_RECORDS", "7"} {
		if !strings.Contains(out, want) {
			t.Errorf("config lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "elsewhere") {
		t.Errorf("config shows the process's KAFKA_TOPICS:\n%s", out)
	}
	svc.Produce("notes", "a", note("n-1"))
	svc.WaitQuery("n-1", `SELECT string_agg(id, ',') FROM applied`)
}

// TestExample runs the package example's test.
func TestExample(t *testing.T) {
	t.Parallel()
	testPayments(t)
}

// TestTwoReplicas: a second Service started with the first's environment joins its group, on its
// broker and database; once the first stops, the second applies every record.
func TestTwoReplicas(t *testing.T) {
	t.Parallel()
	a := servicetest.Start(t, servicetest.Options{Partitions: 4, Topics: []string{"payments.credited"},
		Env: map[string]string{"KAFKA_TOPICS": "payments"}}, payments)
	b := servicetest.Start(t, servicetest.Options{Env: a.Env()}, payments)
	if b.Group != a.Group || b.Brokers[0] != a.Brokers[0] {
		t.Fatalf("b in group %q on %v, want a's %q on %v", b.Group, b.Brokers, a.Group, a.Brokers)
	}
	for i := range 8 {
		a.Produce("payments", fmt.Sprintf("acct-%d", i), fmt.Sprintf(`{"payment_id":"p-%d","account":"all","cents":1}`, i))
	}
	b.WaitQuery(8, `SELECT cents FROM balances WHERE account = 'all'`)
	a.Stop()
	for i := range 8 {
		b.Produce("payments", fmt.Sprintf("acct-%d", i), fmt.Sprintf(`{"payment_id":"q-%d","account":"all","cents":1}`, i))
	}
	b.WaitQuery(16, `SELECT cents FROM balances WHERE account = 'all'`)
	if got := len(b.WaitRecords("payments.credited", 16)); got != 16 {
		t.Fatalf("%d events, want 16", got)
	}
}

// slowPreparer is a handler whose Prepare takes 100ms and counts how many run at once.
type slowPreparer struct {
	running, most atomic.Int32
}

func (h *slowPreparer) Prepare(ctx context.Context, rec *processor.Record) error {
	n := h.running.Add(1)
	defer h.running.Add(-1)
	for m := h.most.Load(); n > m && !h.most.CompareAndSwap(m, n); m = h.most.Load() {
	}
	time.Sleep(100 * time.Millisecond)
	return nil
}

func (h *slowPreparer) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	_, err := tx.Exec(ctx, `INSERT INTO prepared VALUES ($1)`, string(rec.Key))
	return err
}

// TestConcurrencyFromTheEnvironment: TOPIC_<topic>_CONCURRENCY, as in a Deployment, has a
// Preparer's records of one partition prepared side by side.
func TestConcurrencyFromTheEnvironment(t *testing.T) {
	t.Parallel()
	h := &slowPreparer{}
	svc := servicetest.Start(t, servicetest.Options{Env: map[string]string{"KAFKA_TOPICS": "slow", "TOPIC_SLOW_CONCURRENCY": "8"}},
		service.Handler{Name: "slow", Handler: h, Setup: service.SetupSQL(`CREATE TABLE prepared (key text PRIMARY KEY)`)})
	var recs []*kgo.Record
	for i := range 16 {
		recs = append(recs, &kgo.Record{Topic: "slow", Key: fmt.Appendf(nil, "k-%d", i)})
	}
	svc.ProduceRecords(recs...)
	svc.WaitQuery(16, `SELECT count(*) FROM prepared`)
	if most := h.most.Load(); most < 4 {
		t.Fatalf("at most %d Prepare calls at once, want up to 8", most)
	}
}
