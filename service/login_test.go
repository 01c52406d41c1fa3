package service

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"github.com/kafkapg/kafkapg/internal/loginlimit"
	"github.com/kafkapg/kafkapg/internal/ops"
)

// TestOperatorAPILimitsFailedSignIns: past loginlimit.Burst wrong tokens from one address, that
// address gets 429 with Retry-After, even with the right token; a right token does not count, and
// another address is not affected.
func TestOperatorAPILimitsFailedSignIns(t *testing.T) {
	pool := dlqDB(t) // sets the environment: not parallel
	const token = "0123456789abcdef-token"
	a := newAPI(t.Context(), ops.New(pool, "kafkapg", "dg"), token, nil, slog.New(slog.DiscardHandler))
	h := a.handler()
	call := func(from, bearer string) *httptest.ResponseRecorder {
		r := httptest.NewRequest("GET", "/api/v1/tasks", nil)
		r.RemoteAddr = from
		if bearer != "" {
			r.Header.Set("Authorization", "Bearer "+bearer)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		return rec
	}
	const attacker, other = "198.51.100.7:40000", "[2001:db8::7]:40000"
	for i := range loginlimit.Burst {
		if rec := call(attacker, token); rec.Code != http.StatusOK {
			t.Fatalf("the right token after %d failures: %d, want 200", i, rec.Code)
		}
		if rec := call(attacker, ""); rec.Code != http.StatusUnauthorized {
			t.Fatalf("no token after %d failures: %d, want 401", i, rec.Code)
		}
		if rec := call(attacker, "guess-"+strconv.Itoa(i)); rec.Code != http.StatusUnauthorized {
			t.Fatalf("failure %d: %d, want 401", i+1, rec.Code)
		}
	}
	for _, tok := range []string{"guess-again", token} {
		rec := call(attacker, tok)
		if rec.Code != http.StatusTooManyRequests {
			t.Errorf("token %q after %d failures: %d, want 429", tok, loginlimit.Burst, rec.Code)
		}
		if ra, err := strconv.Atoi(rec.Header().Get("Retry-After")); err != nil || ra < 1 {
			t.Errorf("token %q: Retry-After %q, want seconds", tok, rec.Header().Get("Retry-After"))
		}
	}
	if rec := call(other, token); rec.Code != http.StatusOK {
		t.Errorf("another address with the right token: %d, want 200", rec.Code)
	}
}
