package service

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// dlqDB returns a migrated database with three new dead letters of topic orders in group dg:
// ids 1..3, keys k1..k3, value "secret-value-<n>", classes retryable, permanent, retryable; and
// sets the environment an operator command of that group reads.
func dlqDB(t *testing.T) *pgxpool.Pool {
	pool, url := testenv.Postgres(t)
	ctx := context.Background()
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	_, err := pool.Exec(ctx, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ('dg', 'orders', 0, 10);
		WITH d AS (
			INSERT INTO kafkapg.dead_letters (consumer_group, topic, partition, "offset", key, value, "timestamp", error_class, error_message, attempts, first_failed_at)
			SELECT 'dg', 'orders', 0, i, convert_to('k' || i, 'UTF8'), convert_to('secret-value-' || i, 'UTF8'), 0,
				CASE WHEN i = 2 THEN 'permanent' ELSE 'retryable' END, 'boom ' || i, 3, now()
			FROM generate_series(1, 3) AS i ORDER BY i
			RETURNING id, attempts, error_class, error_message)
		INSERT INTO kafkapg.dead_letter_events (dead_letter_id, event, attempt, error_class, error_message)
			SELECT id, 'dead_lettered', attempts, error_class, error_message FROM d`)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{"DATABASE_URL": url, "KAFKA_BROKERS": "127.0.0.1:1", "KAFKA_GROUP_ID": "dg",
		"KAFKA_TOPICS": "orders", "HANDLER": "ledger"} {
		t.Setenv(k, v)
	}
	return pool
}

// cli runs the service's command line with args and returns its exit status, stdout and stderr.
func cli(args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	code := run(args, &out, &errOut, builtinHandlers...)
	return code, out.String(), errOut.String()
}

func statuses(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	if err := pool.QueryRow(context.Background(), `SELECT string_agg(id || ':' || status, ' ' ORDER BY id) FROM kafkapg.dead_letters`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestDlqCommands: the dlq commands as an operator types them: list and show read; replay and
// discard are dry runs without --execute and refuse --execute without a reason; a replay queues
// each row once and a second one is refused; everything that changed is audited.
func TestDlqCommands(t *testing.T) {
	pool := dlqDB(t)
	check := func(wantCode int, want string, args ...string) string {
		t.Helper()
		code, out, errOut := cli(args...)
		if code != wantCode || !strings.Contains(out+errOut, want) {
			t.Fatalf("%q: exit %d, stdout:\n%s\nstderr:\n%s\nwant exit %d and %q", args, code, out, errOut, wantCode, want)
		}
		return out
	}
	out := check(0, "k3", "dlq", "list")
	if !strings.Contains(out, "permanent") || strings.Count(out, "\n") != 4 {
		t.Errorf("dlq list:\n%s\nwant a header and three rows", out)
	}
	check(0, "orders  permanent  new     1", "dlq", "list", "--summary")
	check(0, "no dead letters match", "dlq", "list", "--class", "lost")
	out = check(0, `"key": "azI="`, "dlq", "list", "--key", "k2", "--json")
	if strings.Contains(out, "k1") || strings.Contains(out, "azE=") {
		t.Errorf("dlq list --key k2 --json:\n%s\nwant only k2", out)
	}
	check(0, "value:      secret-value-2", "dlq", "show", "2")
	check(0, "dead_lettered (attempt 3): permanent: boom 2", "dlq", "show", "2")
	// A handler's processor.Permanent error reads "permanent: …": the class is shown once.
	if _, err := pool.Exec(context.Background(), `UPDATE kafkapg.dead_letters SET error_message = 'permanent: boom 2' WHERE id = 2;
		UPDATE kafkapg.dead_letter_events SET error_message = 'permanent: boom 2' WHERE dead_letter_id = 2`); err != nil {
		t.Fatal(err)
	}
	if out := check(0, "error:      permanent: boom 2", "dlq", "show", "2"); strings.Contains(out, "permanent: permanent") {
		t.Errorf("dlq show prints the class twice:\n%s", out)
	}
	check(1, "not found", "dlq", "show", "99")
	check(2, "takes one dead letter id", "dlq", "show")
	check(2, "--since \"yesterday\"", "dlq", "list", "--since", "yesterday")
	check(2, `status "bogus"`, "dlq", "list", "--status", "bogus")

	check(0, "dry run: replay would act on 2 new dead letters; nothing changed", "dlq", "replay", "--class", "retryable")
	t.Setenv("KAFKA_TOPICS", "payments")
	check(0, "topic orders is not in this service's KAFKA_TOPICS", "dlq", "replay")
	t.Setenv("KAFKA_TOPICS", "orders")
	if got := statuses(t, pool); got != "1:new 2:new 3:new" {
		t.Fatalf("after a dry run: %s", got)
	}
	check(2, "--execute needs --reason", "dlq", "replay", "--execute")
	check(0, "2 matched, 2 done", "dlq", "replay", "--class", "retryable", "--execute", "--reason", "fixed", "--actor", "ops-1", "--wait", "0")
	if got := statuses(t, pool); got != "1:replaying 2:new 3:replaying" {
		t.Fatalf("after the replay: %s", got)
	}
	// The same replay again is safe: nothing new, said, and a success; a filter that matches no
	// dead letter at all is a mistake (a typo).
	out = check(0, "nothing to replay: 2 matching dead letters were already replayed or discarded (2 of them still being replayed)",
		"dlq", "replay", "--id", "1,3", "--execute", "--reason", "again")
	if code, out, errOut := cli("dlq", "replay", "--id", "1,3", "--execute", "--reason", "again"); strings.Contains(out+errOut, "refused") || strings.Contains(out+errOut, "task ") {
		t.Errorf("a replay that finds nothing new (exit %d) says more than that:\n%s%s", code, out, errOut)
	}
	check(0, `"nothing_new": true`, "dlq", "replay", "--id", "1,3", "--execute", "--reason", "again", "--json")
	check(2, "no dead letter matches the filter", "dlq", "replay", "--id", "99", "--execute", "--reason", "typo")
	check(2, "no dead letter matches the filter", "dlq", "replay", "--topic", "ordres", "--execute", "--reason", "typo")
	check(0, "dry run: discard would act on 1 new dead letters", "dlq", "discard")
	check(0, "1 matched, 1 done", "dlq", "discard", "--id", "2", "--execute", "--reason", "poison")
	if got := statuses(t, pool); got != "1:replaying 2:discarded 3:replaying" {
		t.Fatalf("after the discard: %s", got)
	}
	// --status takes several statuses, repeated or comma-separated.
	for _, args := range [][]string{{"--status", "discarded,replaying"}, {"--status", "discarded", "--status", "replaying"}} {
		if out := check(0, "discarded", append([]string{"dlq", "list"}, args...)...); strings.Count(out, "\n") != 4 {
			t.Errorf("dlq list %q:\n%s\nwant a header and three rows", args, out)
		}
	}
	if out := check(0, "discarded", "dlq", "list", "--status", "discarded"); strings.Count(out, "\n") != 2 {
		t.Errorf("dlq list --status discarded:\n%s\nwant a header and one row", out)
	}
	check(2, "only new dead letters can be replayed", "dlq", "replay", "--status", "new,discarded")
	out = check(0, "ops-1", "dlq", "tasks")
	if !strings.Contains(out, "discard  done") || !strings.Contains(out, "replay   done") {
		t.Errorf("dlq tasks:\n%s", out)
	}
	check(2, "task 1 is done: nothing to cancel", "dlq", "cancel", "1")
	check(0, "dry run: 0 replayed or discarded dead letters", "dlq", "purge", "--older-than", "1h")
	check(2, "--older-than is required", "dlq", "purge")

	var audits int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.audit WHERE (actor, action, reason) IN (('ops-1', 'replay', 'fixed'))`).Scan(&audits); err != nil || audits != 1 {
		t.Errorf("audit rows of the replay: %d, %v", audits, err)
	}
}

// TestDlqReplaySummaryCountsDuplicatesApart: dlq replay, waiting for its records, ends with a
// summary that counts those skipped as duplicates apart from the applied ones, and dlq tasks
// has them in a column of their own. The records are settled as the held-record applier settles
// them (retrytopics.Store: TakeHeld, then AppliedHeld, Rec.Duplicate said for the skipped one)
// while the command waits.
func TestDlqReplaySummaryCountsDuplicatesApart(t *testing.T) {
	pool := dlqDB(t)
	ctx := context.Background()
	store := retrytopics.NewStore("kafkapg", "dg")
	settle := func() error {
		for deadline := time.Now().Add(20 * time.Second); ; {
			var replaying int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.dead_letters WHERE status = 'replaying'`).Scan(&replaying); err != nil {
				return err
			}
			if replaying == 2 {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%d dead letters replaying after 20s, want 1 and 3", replaying)
			}
			time.Sleep(50 * time.Millisecond)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		for _, key := range []string{"k1", "k3"} {
			k := retrytopics.Key{Topic: "orders", Partition: 0, Key: []byte(key)}
			recs, err := store.TakeHeld(ctx, tx, k, 10, 1<<20)
			if err != nil || len(recs) != 1 {
				return fmt.Errorf("take the held record of %s: %d records, %v", key, len(recs), err)
			}
			recs[0].Duplicate = key == "k3" // a copy with its idempotency key was applied before
			if err := store.AppliedHeld(ctx, tx, k, recs); err != nil {
				return err
			}
		}
		return tx.Commit(ctx)
	}
	settled := make(chan error, 1)
	go func() { settled <- settle() }()
	code, out, errOut := cli("dlq", "replay", "--class", "retryable", "--execute", "--reason", "fixed", "--wait", "30s")
	if err := <-settled; err != nil {
		t.Fatal(err)
	}
	if want := "1 applied, 1 duplicate skipped (a copy with their idempotency key was applied before), 0 dead-lettered again, 0 still on their way"; code != 0 || !strings.Contains(out, want) {
		t.Errorf("dlq replay: exit %d, stdout:\n%s\nstderr:\n%s\nwant exit 0 and %q", code, out, errOut, want)
	}
	code, out, errOut = cli("dlq", "tasks")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != 0 || len(lines) != 2 {
		t.Fatalf("dlq tasks: exit %d, stdout:\n%s\nstderr:\n%s\nwant a header and one task", code, out, errOut)
	}
	head, row := strings.Fields(lines[0]), strings.Fields(lines[1])
	for col, want := range map[string]string{"APPLIED": "1", "SKIPPED-DUPLICATE": "1", "DEAD-AGAIN": "0", "PENDING": "0"} {
		if i := slices.Index(head, col); i < 0 || i >= len(row) || row[i] != want {
			t.Errorf("dlq tasks: column %s of\n%s\nwant %s", col, out, want)
		}
	}
}

// TestOperatorAPI: the API exists only with a token, answers nothing (values least of all)
// without it, and runs the same operations: a dry run changes nothing, an executed replay runs
// as a task to its end.
func TestOperatorAPI(t *testing.T) {
	pool := dlqDB(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const token = "0123456789abcdef-token"
	a := newAPI(ctx, ops.New(pool, "kafkapg", "dg"), token, nil, slog.New(slog.NewTextHandler(io.Discard, nil)))
	a.keys = keysRoutes(a, &env{KafkaGroupID: "dg", KafkaTopics: []string{"orders"}, StallTimeout: time.Minute}, nil)
	srv := httptest.NewServer(httpHandler(prometheus.NewRegistry(), func(context.Context) error { return nil },
		func(context.Context) error { return nil }, a.handler()))
	defer srv.Close()
	defer func() { cancel(); a.wait() }() // a task still running stops, then is waited for
	call := func(method, path, tok, body string) (int, string) {
		t.Helper()
		req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if tok != "" {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	const unauthorized = "a valid operator token is required (Authorization: Bearer <a token of OPERATOR_TOKEN or OPERATOR_TOKENS>)"
	for _, tok := range []string{"", "wrong-token-0123456789", token + "x"} {
		for _, p := range []string{"/api/v1/dead-letters", "/api/v1/dead-letters/1", "/api/v1/tasks"} {
			code, body := call("GET", p, tok, "")
			// Values and keys travel base64-encoded in JSON: the only answer is the error.
			var answer map[string]any
			if code != http.StatusUnauthorized || json.Unmarshal([]byte(body), &answer) != nil || len(answer) != 1 || answer["error"] != unauthorized {
				t.Errorf("GET %s with token %q: %d %s; want 401 and nothing but %s", p, tok, code, body, unauthorized)
			}
		}
		if code, _ := call("POST", "/api/v1/dead-letters/replay", tok, `{"execute": true, "reason": "x"}`); code != http.StatusUnauthorized {
			t.Errorf("POST replay with token %q: %d; want 401", tok, code)
		}
	}
	if got := statuses(t, pool); got != "1:new 2:new 3:new" {
		t.Fatalf("unauthorized calls changed something: %s", got)
	}
	// Text Postgres refuses is bad usage wherever it is sent, naming the field: never a 500.
	for _, c := range []struct{ method, path, body, want string }{
		{"GET", "/api/v1/trace?topic=a%00b&partition=0&offset=1", "", "topic: not valid text"},
		{"GET", "/api/v1/trace?topic=%ff&key=k", "", "topic: not valid text"},
		{"POST", "/api/v1/keys/release", `{"topic": "a\u0000b", "partition": 0, "key": "k"}`, "topic: not valid text"},
		{"POST", "/api/v1/dead-letters/replay", `{"execute": true, "reason": "r\u0000", "actor": "a"}`, "reason: not valid text"},
	} {
		if code, body := call(c.method, c.path, token, c.body); code != http.StatusBadRequest || !strings.Contains(body, c.want) {
			t.Errorf("%s %s %s: %d %s; want 400 saying %q", c.method, c.path, c.body, code, body, c.want)
		}
	}
	code, body := call("GET", "/api/v1/dead-letters/2", token, "")
	var dl ops.DeadLetter
	if code != 200 || json.Unmarshal([]byte(body), &dl) != nil || string(dl.Value) != "secret-value-2" || len(dl.Events) != 1 {
		t.Fatalf("GET dead letter 2: %d %s", code, body)
	}
	// A read for display reads what it shows: a prefix of the value, or none of it.
	for _, c := range []struct {
		query, value string
		truncated    bool
	}{{"?value_bytes=6", "secret", true}, {"?values=false", "", false}, {"?value_bytes=1000", "secret-value-2", false}} {
		code, body := call("GET", "/api/v1/dead-letters/2"+c.query, token, "")
		var dl ops.DeadLetter
		if code != 200 || json.Unmarshal([]byte(body), &dl) != nil || string(dl.Value) != c.value || dl.ValueSize != 14 || dl.ValueTruncated != c.truncated ||
			dl.ValueHidden != (c.query == "?values=false") {
			t.Errorf("GET dead letter 2%s: %d %s; want value %q of 14 bytes, truncated %v", c.query, code, body, c.value, c.truncated)
		}
	}
	for _, q := range []string{"?value_bytes=0", "?value_bytes=x", fmt.Sprintf("?value_bytes=%d", ops.MaxShownValueBytes+1)} {
		if code, body := call("GET", "/api/v1/dead-letters/2"+q, token, ""); code != http.StatusBadRequest || !strings.Contains(body, "value") {
			t.Errorf("GET dead letter 2%s: %d %s; want 400", q, code, body)
		}
	}
	// A trace reads only the group's topics (KAFKA_TOPICS, and those with positions).
	if code, body := call("GET", "/api/v1/trace?topic=hr.salaries&partition=0&offset=0", token, ""); code != http.StatusBadRequest ||
		!strings.Contains(body, `topic \"hr.salaries\" is not one of group dg's topics: only its source topics (orders)`) {
		t.Errorf("GET trace of another topic: %d %s; want 400 naming the group's topics", code, body)
	}
	// A copy skipped by its idempotency key is told as skipped, with its key and the copy
	// applied before (issue 42).
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ('dg', 'orders', 3, 10);
		INSERT INTO kafkapg.skipped_duplicates (consumer_group, topic, partition, "offset", skipped_at, idempotency_key, key_hash, first_partition, first_offset)
			VALUES ('dg', 'orders', 3, 7, now(), 'pay-7', '\x0123', 3, 5)`); err != nil {
		t.Fatal(err)
	}
	code, body = call("GET", "/api/v1/trace?topic=orders&partition=3&offset=7", token, "")
	var tr ops.TraceResult
	if err := json.Unmarshal([]byte(body), &tr); code != 200 || err != nil || len(tr.Records) != 1 || tr.Records[0].State != ops.TraceSkippedDuplicate ||
		len(tr.Records[0].Steps) != 1 || tr.Records[0].Steps[0].IdempotencyKey != "pay-7" || tr.Records[0].Steps[0].First == nil ||
		*tr.Records[0].Steps[0].First != (ops.TraceRef{Partition: 3, Offset: 5}) {
		t.Errorf("GET trace of a skipped copy: %d %s; want it skipped_duplicate, naming its key and the copy applied before", code, body)
	}
	if code, body := call("GET", "/api/v1/dead-letters?class=retryable&limit=1", token, ""); code != 200 || strings.Count(body, `"id"`) != 1 {
		t.Errorf("GET list with a filter and a limit: %d %s", code, body)
	}
	_, all := call("GET", "/api/v1/dead-letters", token, "")
	if code, body := call("GET", "/api/v1/dead-letters?since=24h", token, ""); code != 200 || strings.Count(body, `"id"`) != strings.Count(all, `"id"`) {
		t.Errorf("GET list since a duration ago: %d %s; want all %d", code, body, strings.Count(all, `"id"`))
	}
	if code, body := call("GET", "/api/v1/dead-letters?since=2099-01-01T00:00:00Z", token, ""); code != 200 || strings.Count(body, `"id"`) != 0 {
		t.Errorf("GET list since 2099: %d %s; want none", code, body)
	}
	if code, body := call("GET", "/api/v1/dead-letters?until=yesterday", token, ""); code != 400 || !strings.Contains(body, `until \"yesterday\"`) {
		t.Errorf("GET list with a bad time: %d %s; want 400 naming it", code, body)
	}
	if code, body := call("GET", "/api/v1/dead-letters?status=bogus", token, ""); code != 400 || !strings.Contains(body, "bogus") {
		t.Errorf("GET list with a bad status: %d %s; want 400 naming it", code, body)
	}
	if code, body := call("POST", "/api/v1/dead-letters/replay", token, `{"filter": {"class": "retryable"}}`); code != 200 || !strings.Contains(body, `"matched": 2`) {
		t.Errorf("dry run: %d %s", code, body)
	}
	if code, body := call("POST", "/api/v1/dead-letters/replay", token, `{"execute": true}`); code != 400 || !strings.Contains(body, "reason is required") {
		t.Errorf("execute without a reason: %d %s; want 400", code, body)
	}
	if code, body := call("POST", "/api/v1/dead-letters/replay", token, `{"bogus": 1}`); code != 400 {
		t.Errorf("unknown field: %d %s; want 400", code, body)
	}
	if got := statuses(t, pool); got != "1:new 2:new 3:new" {
		t.Fatalf("dry runs changed something: %s", got)
	}
	code, body = call("POST", "/api/v1/dead-letters/replay", token, `{"filter": {"ids": [1, 3]}, "execute": true, "reason": "dependency back", "actor": "alice"}`)
	var started struct{ Task ops.Task }
	if code != http.StatusAccepted || json.Unmarshal([]byte(body), &started) != nil || started.Task.Matched != 2 {
		t.Fatalf("execute: %d %s", code, body)
	}
	testenv.Eventually(t, 10*time.Second, func() error {
		code, body := call("GET", fmt.Sprintf("/api/v1/tasks/%d", started.Task.ID), token, "")
		var tk ops.Task
		if code != 200 || json.Unmarshal([]byte(body), &tk) != nil || tk.Status != "done" || tk.Done != 2 {
			return fmt.Errorf("task: %d %s", code, body)
		}
		return nil
	})
	if got := statuses(t, pool); got != "1:replaying 2:new 3:replaying" {
		t.Errorf("after the API's replay: %s", got)
	}
	// The same replay again: 200, nothing new, no task; a filter matching nothing is still 400.
	code, body = call("POST", "/api/v1/dead-letters/replay", token, `{"filter": {"ids": [1, 3]}, "execute": true, "reason": "again"}`)
	if code != http.StatusOK || !strings.Contains(body, `"nothing_new": true`) || !strings.Contains(body, "nothing to replay: 2 matching dead letters were already replayed or discarded") {
		t.Errorf("the same replay again: %d %s; want 200 saying nothing new", code, body)
	}
	if code, body := call("POST", "/api/v1/dead-letters/replay", token, `{"filter": {"ids": [99]}, "execute": true, "reason": "typo"}`); code != http.StatusBadRequest || !strings.Contains(body, "no dead letter matches the filter") {
		t.Errorf("a replay matching no dead letter: %d %s; want 400", code, body)
	}
	if code, body := call("GET", "/api/v1/audit", token, ""); code != 200 || !strings.Contains(body, `"actor": "api:alice (claimed)"`) || !strings.Contains(body, "dependency back") {
		t.Errorf("audit: %d %s; want the replay by api:alice (claimed): OPERATOR_TOKEN is anyone's who holds it", code, body)
	}

	// Without a token, there is no API at all.
	plain := httptest.NewServer(httpHandler(prometheus.NewRegistry(), func(context.Context) error { return nil }, func(context.Context) error { return nil }, nil))
	defer plain.Close()
	resp, err := http.Get(plain.URL + "/api/v1/dead-letters")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("without OPERATOR_TOKEN: %d; want 404", resp.StatusCode)
	}
}

// TestOperatorOutputEscapesControls: a header key, an error text, an actor and a reason that
// carry terminal commands (a new window title, a cleared screen, colours; C1 and bidirectional
// controls) reach the operator's terminal escaped, in every command that prints them, and the
// JSON output stays JSON.
func TestOperatorOutputEscapesControls(t *testing.T) {
	pool := dlqDB(t)
	ctx := context.Background()
	hostile := "h\x1b]0;TITLE\x07\x1b[2J\u009b31m\u202e"
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.dead_letters SET header_keys = ARRAY[$1::bytea], header_values = ARRAY['v'::bytea],
		error_message = 'boom ' || $2 WHERE id = 1`, []byte(hostile), hostile); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.dead_letter_events SET error_message = 'boom ' || $1 WHERE dead_letter_id = 1`, hostile); err != nil {
		t.Fatal(err)
	}
	var all strings.Builder
	for _, args := range [][]string{
		{"dlq", "list"},
		{"dlq", "show", "1"},
		{"dlq", "replay", "--id", "1"},
		{"dlq", "discard", "--id", "1", "--execute", "--reason", "r " + hostile, "--actor", "a " + hostile},
		{"dlq", "tasks"},
		{"dlq", "show", "1", "--json"},
		{"dlq", "list", "--json"},
	} {
		code, out, errOut := cli(args...)
		if code != 0 {
			t.Errorf("%q: exit %d: %s%s", args, code, out, errOut)
		}
		all.WriteString(out + errOut)
		if strings.ContainsAny(out+errOut, "\x1b\x07\u009b\u202e") {
			t.Errorf("%q printed control characters raw:\n%q", args, out+errOut)
		}
		if slices.Contains(args, "--json") && !json.Valid([]byte(out)) {
			t.Errorf("%q: not JSON:\n%s", args, out)
		}
	}
	if !strings.Contains(all.String(), `h\x1b]0;TITLE\x07\x1b[2J\x9b31m\u202e`) {
		t.Errorf("the header key is not shown, escaped; output:\n%s", all.String())
	}
}

// TestOperatorCommandsNeedOnlyWhatTheyUse: with DATABASE_URL and KAFKA_GROUP_ID alone (an
// operator's laptop, not the service's pod), the commands that read Postgres run, in a binary
// of several handlers; the group's topics come from Postgres; a command that reads Kafka names
// KAFKA_BROKERS; without the group, the error says what it is for.
func TestOperatorCommandsNeedOnlyWhatTheyUse(t *testing.T) {
	dlqDB(t)
	for _, k := range []string{"KAFKA_BROKERS", "KAFKA_TOPICS", "HANDLER"} {
		t.Setenv(k, "")
	}
	if len(builtinHandlers) < 2 {
		t.Fatalf("the test wants a binary of several handlers; builtinHandlers has %d", len(builtinHandlers))
	}
	for _, tt := range []struct {
		code int
		want string
		args []string
	}{
		{0, "k3", []string{"dlq", "list"}},
		{0, "orders  permanent  new     1", []string{"dlq", "list", "--summary"}},
		{0, "value:      secret-value-2", []string{"dlq", "show", "2"}},
		{0, "dry run: replay would act on 3 new dead letters", []string{"dlq", "replay"}},
		{0, "", []string{"keys", "list"}},
		{2, "KAFKA_BROKERS is required for this command: it reads records from Kafka", []string{"trace", "--topic", "orders", "--partition", "0", "--offset", "1"}},
	} {
		code, out, errOut := cli(tt.args...)
		if code != tt.code || !strings.Contains(out+errOut, tt.want) {
			t.Errorf("%q: exit %d, stdout:\n%s\nstderr:\n%s\nwant exit %d and %q", tt.args, code, out, errOut, tt.code, tt.want)
		}
	}
	t.Setenv("KAFKA_GROUP_ID", "")
	if code, _, errOut := cli("dlq", "list"); code != 2 || !strings.Contains(errOut, "KAFKA_GROUP_ID is required: the commands act on that group's records") {
		t.Errorf("dlq list without the group: exit %d, %s", code, errOut)
	}
}
