package console_test

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/loginlimit"
)

// TestConsoleLimitsFailedSignIns: an address that keeps failing to sign in (a wrong password, a
// wrong token) gets 429 with Retry-After past loginlimit.Burst failures, even with the right
// password then (a different answer would tell a right guess); sign-ins that succeed and
// requests without credentials (a browser's first) do not count; another address is not affected.
func TestConsoleLimitsFailedSignIns(t *testing.T) {
	t.Parallel()
	users, err := console.ParseUsers("alice:operator:" + operatorPassword)
	if err != nil {
		t.Fatal(err)
	}
	tokens, err := console.ParseTokens("otto:operator:" + operatorToken)
	if err != nil {
		t.Fatal(err)
	}
	c, err := console.New(console.Config{Users: users, Tokens: tokens, Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	h := c.Handler()
	get := func(from, user, password, bearer string) *httptest.ResponseRecorder {
		t.Helper()
		r := httptest.NewRequest("GET", "/static/console.css", nil)
		r.RemoteAddr = from
		if user != "" {
			r.SetBasicAuth(user, password)
		}
		if bearer != "" {
			r.Header.Set("Authorization", "Bearer "+bearer)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		return rec
	}
	const attacker, other = "198.51.100.7:40000", "203.0.113.9:40000"
	for i := range loginlimit.Burst {
		if rec := get(attacker, "", "", ""); rec.Code != http.StatusUnauthorized {
			t.Fatalf("no credentials after %d failures: %d, want 401", i, rec.Code)
		}
		if rec := get(attacker, "alice", operatorPassword, ""); rec.Code != http.StatusOK {
			t.Fatalf("the right password after %d failures: %d, want 200", i, rec.Code)
		}
		var rec *httptest.ResponseRecorder
		if i%2 == 0 {
			rec = get(attacker, "alice", "guess-"+strconv.Itoa(i), "")
		} else {
			rec = get(attacker, "", "", "guess-token-"+strconv.Itoa(i))
		}
		if rec.Code != http.StatusUnauthorized {
			t.Fatalf("failure %d: %d, want 401", i+1, rec.Code)
		}
	}
	for _, tt := range []struct{ name, user, password, bearer string }{
		{name: "a wrong password", user: "alice", password: "guess-again"},
		{name: "the right password", user: "alice", password: operatorPassword},
		{name: "the right token", bearer: operatorToken},
		{name: "no credentials"},
	} {
		rec := get(attacker, tt.user, tt.password, tt.bearer)
		if rec.Code != http.StatusTooManyRequests {
			t.Errorf("%s after %d failures: %d, want 429", tt.name, loginlimit.Burst, rec.Code)
		}
		if ra, err := strconv.Atoi(rec.Header().Get("Retry-After")); err != nil || ra < 1 || ra > int(loginlimit.Every.Seconds()) {
			t.Errorf("%s: Retry-After %q, want 1 to %v seconds", tt.name, rec.Header().Get("Retry-After"), loginlimit.Every.Seconds())
		}
	}
	if rec := get(other, "alice", operatorPassword, ""); rec.Code != http.StatusOK {
		t.Errorf("another address with the right password: %d, want 200", rec.Code)
	}
}
