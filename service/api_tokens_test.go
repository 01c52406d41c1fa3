package service

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/ops"
)

// TestOperatorAPINamedTokens: with OPERATOR_TOKENS, the audit names the token's holder, not a
// name the request claims (a claim of another is refused); a viewer's token reads and does not
// act; with OPERATOR_TOKEN, which anyone who holds it sends, a claimed name is marked claimed.
func TestOperatorAPINamedTokens(t *testing.T) {
	pool := dlqDB(t) // sets the environment: not parallel
	const shared, alice, bob = "0123456789abcdef-shared", "0123456789abcdef-alice", "0123456789abcdef-bob"
	tokens, err := console.ParseTokens("alice:operator:" + alice + ",bob:viewer:" + bob)
	if err != nil {
		t.Fatal(err)
	}
	a := newAPI(t.Context(), ops.New(pool, "kafkapg", "dg"), shared, tokens, slog.New(slog.DiscardHandler))
	h := a.handler()
	call := func(method, path, bearer, body string) (int, string) {
		t.Helper()
		r := httptest.NewRequest(method, path, strings.NewReader(body))
		r.Header.Set("Authorization", "Bearer "+bearer)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		return rec.Code, rec.Body.String()
	}
	purge := func(bearer, actor string) (int, string) {
		b, _ := json.Marshal(map[string]any{"older_than": "720h", "execute": true, "reason": "tidy", "actor": actor})
		return call("POST", "/api/v1/dead-letters/purge", bearer, string(b))
	}

	if code, body := purge(alice, "mallory"); code != http.StatusBadRequest || !strings.Contains(body, `this token is \"alice\"'s`) {
		t.Errorf("alice claiming to be mallory: %d %s, want 400", code, body)
	}
	if code, body := purge(bob, ""); code != http.StatusForbidden {
		t.Errorf("bob, a viewer, purging: %d %s, want 403", code, body)
	}
	if code, body := call("GET", "/api/v1/tasks", bob, ""); code != http.StatusOK {
		t.Errorf("bob, a viewer, reading: %d %s, want 200", code, body)
	}
	for _, p := range []struct{ bearer, actor string }{{alice, ""}, {alice, "alice"}, {shared, "mallory"}, {shared, ""}} {
		if code, body := purge(p.bearer, p.actor); code != http.StatusOK {
			t.Fatalf("purge as %q: %d %s", p.actor, code, body)
		}
	}
	rows, err := pool.Query(t.Context(), `SELECT actor FROM kafkapg.audit WHERE action = 'purge' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		got = append(got, s)
	}
	if want := "api:alice|api:alice|api:mallory (claimed)|api:anonymous"; strings.Join(got, "|") != want {
		t.Errorf("audit actors %q, want %s", got, want)
	}

	// A token two entries share is no one's.
	twice, _ := console.ParseTokens("carol:operator:" + shared)
	b := newAPI(t.Context(), ops.New(pool, "kafkapg", "dg"), shared, twice, slog.New(slog.DiscardHandler)).handler()
	r := httptest.NewRequest("GET", "/api/v1/tasks", nil)
	r.Header.Set("Authorization", "Bearer "+shared)
	rec := httptest.NewRecorder()
	b.ServeHTTP(rec, r)
	if rec.Code != http.StatusUnauthorized {
		t.Errorf("a token of OPERATOR_TOKEN and of OPERATOR_TOKENS: %d, want 401", rec.Code)
	}
}
