package service

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

func TestMainExitCodes(t *testing.T) {
	tests := []struct {
		name string
		args []string
		vars map[string]string
		want int
		// wantOut must all appear in what Main writes.
		wantOut []string
	}{
		{name: "unknown command", args: []string{"bogus"}, want: 2,
			wantOut: []string{`unknown command "bogus"`, "usage: service.test"}},
		{name: "too many arguments", args: []string{"run", "now"}, want: 2,
			wantOut: []string{"usage: service.test"}},
		{name: "help", args: []string{"help"}, want: 0, wantOut: []string{"usage: service.test", "migrate"}},
		{name: "-h", args: []string{"-h"}, want: 0, wantOut: []string{"usage: service.test"}},
		{name: "--help", args: []string{"--help"}, want: 0, wantOut: []string{"usage: service.test"}},
		{name: "run with nothing configured", args: []string{"run"}, want: 2,
			wantOut: []string{"service.test: configuration error: DATABASE_URL is required"}},
		{name: "no arguments means run", args: nil, want: 2,
			wantOut: []string{"service.test: configuration error: DATABASE_URL is required"}},
		{name: "run without brokers", args: []string{"run"}, vars: map[string]string{"DATABASE_URL": "postgres://a@b/c"}, want: 2,
			wantOut: []string{"service.test: configuration error: KAFKA_BROKERS is required"}},
		{name: "run with an unknown handler", args: []string{"run"}, vars: with("HANDLER", "nope"), want: 2,
			wantOut: []string{"configuration error", `HANDLER="nope"`}},
		{name: "run with a bad duration", args: []string{"run"}, vars: with("BATCH_MAX_WAIT", "soon"), want: 2,
			wantOut: []string{"configuration error", `BATCH_MAX_WAIT="soon"`}},
		// Postgres is not contacted before the HTTP listener is opened (the pool connects lazily).
		{name: "run with a bad HTTP address", args: []string{"run"}, vars: with("HTTP_ADDR", "not-an-address"), want: 2,
			wantOut: []string{"configuration error", `HTTP_ADDR="not-an-address"`}},
		{name: "run with a bad database URL", args: []string{"run"}, vars: with("DATABASE_URL", "postgres://%zz"), want: 2,
			wantOut: []string{"configuration error", "DATABASE_URL is not a valid connection string"}},
		{name: "migrate without a database", args: []string{"migrate"}, want: 2,
			wantOut: []string{"service.test: configuration error: DATABASE_URL is required"}},
		{name: "migrate needs no Kafka settings, but a valid URL", args: []string{"migrate"},
			vars: map[string]string{"DATABASE_URL": "postgres://%zz"}, want: 2,
			wantOut: []string{"DATABASE_URL is not a valid connection string"}},
		{name: "migrate with Postgres unreachable", args: []string{"migrate"},
			vars: map[string]string{"DATABASE_URL": "postgres://kafkapg@127.0.0.1:1/kafkapg?sslmode=disable&connect_timeout=2"}, want: 1,
			wantOut: []string{"service.test: "}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			setEnv(t, tt.vars)
			var out bytes.Buffer
			got := Run(tt.args, &out, builtinHandlers...)
			if got != tt.want {
				t.Errorf("Main(%q) = %d, want %d; output:\n%s", tt.args, got, tt.want, out.String())
			}
			for _, w := range tt.wantOut {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output does not contain %q:\n%s", w, out.String())
				}
			}
		})
	}
}

// TestMainConfigErrorOnOneLine: several configuration errors are reported on one line, so that
// log collectors keep them together.
func TestMainConfigErrorOnOneLine(t *testing.T) {
	setEnv(t, with("HANDLER", "nope", "LOG_FORMAT", "xml"))
	var out bytes.Buffer
	if code := Run([]string{"run"}, &out, builtinHandlers...); code != 2 {
		t.Fatalf("Main = %d, want 2", code)
	}
	s := out.String()
	if strings.Count(s, "\n") != 1 || !strings.HasSuffix(s, "\n") {
		t.Fatalf("output is not one line: %q", s)
	}
	if !strings.Contains(s, "HANDLER") || !strings.Contains(s, "; LOG_FORMAT") {
		t.Fatalf("output does not list both errors separated by \"; \": %q", s)
	}
}

func newTestRegistry(t *testing.T) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "kafkapg_test_events_total", Help: "Events seen by the test."})
	reg.MustRegister(c)
	c.Add(3)
	return reg
}

func TestHTTPHandler(t *testing.T) {
	t.Parallel()
	notReady := errStarting
	tests := []struct {
		name       string
		method     string
		path       string
		ready      error
		unhealthy  error
		wantStatus int
		wantBody   []string
	}{
		{name: "healthz", method: "GET", path: "/healthz", wantStatus: 200, wantBody: []string{"ok\n"}},
		{name: "healthz while not ready", method: "GET", path: "/healthz", ready: notReady, wantStatus: 200, wantBody: []string{"ok\n"}},
		{name: "healthz deadlocked", method: "GET", path: "/healthz", unhealthy: errors.New("processor state lock not acquired in time: deadlocked?"),
			wantStatus: 503, wantBody: []string{"unhealthy: processor state lock not acquired"}},
		{name: "readyz ready", method: "GET", path: "/readyz", wantStatus: 200, wantBody: []string{"ready\n"}},
		{name: "readyz not ready", method: "GET", path: "/readyz", ready: notReady, wantStatus: 503,
			wantBody: []string{"not ready: starting: waiting for postgres\n"}},
		{name: "metrics", method: "GET", path: "/metrics", wantStatus: 200,
			wantBody: []string{"# HELP kafkapg_test_events_total Events seen by the test.", "# TYPE kafkapg_test_events_total counter", "kafkapg_test_events_total 3\n"}},
		{name: "metrics while not ready", method: "GET", path: "/metrics", ready: notReady, wantStatus: 200,
			wantBody: []string{"kafkapg_test_events_total 3\n"}},
		{name: "HEAD healthz", method: "HEAD", path: "/healthz", wantStatus: 200},
		{name: "POST healthz", method: "POST", path: "/healthz", wantStatus: 405},
		{name: "unknown path", method: "GET", path: "/", wantStatus: 404},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := httpHandler(newTestRegistry(t), func(context.Context) error { return tt.unhealthy }, func(context.Context) error { return tt.ready }, nil)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(tt.method, tt.path, nil))
			if rec.Code != tt.wantStatus {
				t.Errorf("%s %s: status %d, want %d; body %q", tt.method, tt.path, rec.Code, tt.wantStatus, rec.Body)
			}
			for _, w := range tt.wantBody {
				if !strings.Contains(rec.Body.String(), w) {
					t.Errorf("%s %s: body does not contain %q:\n%s", tt.method, tt.path, w, rec.Body)
				}
			}
		})
	}
}

func TestHTTPHandlerMetricsTextFormat(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(httpHandler(newTestRegistry(t), func(context.Context) error { return nil }, func(context.Context) error { return nil }, nil))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Errorf("Content-Type %q, want the Prometheus text format (text/plain)", ct)
	}
	if !strings.Contains(string(body), "kafkapg_test_events_total 3") {
		t.Errorf("body lacks the counter:\n%s", body)
	}
}

// TestHTTPHandlerReadyzDeadline: /readyz bounds the readiness check, so a hung check cannot hang
// the probe.
func TestHTTPHandlerReadyzDeadline(t *testing.T) {
	t.Parallel()
	var deadline time.Time
	var ok bool
	h := httpHandler(prometheus.NewRegistry(), func(context.Context) error { return nil }, func(ctx context.Context) error {
		deadline, ok = ctx.Deadline()
		<-ctx.Done()
		return ctx.Err()
	}, nil)
	start := time.Now()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if !ok || deadline.Sub(start) > 2*time.Second+100*time.Millisecond {
		t.Errorf("readiness check ran with deadline %v (set: %v), want at most 2s from now", deadline.Sub(start), ok)
	}
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), "did not end in time") {
		t.Errorf("hung check: status %d, body %q; want 503 saying it did not end in time", rec.Code, rec.Body)
	}
}

func TestNewLogger(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, format, level string
		wantPrefix          string
		wantInfo            bool
	}{
		{name: "json info", format: "json", level: "info", wantPrefix: "{", wantInfo: true},
		{name: "text info", format: "text", level: "info", wantPrefix: "time=", wantInfo: true},
		{name: "text warn hides info", format: "text", level: "warn", wantPrefix: "time=", wantInfo: false},
		{name: "json error hides info", format: "json", level: "error", wantPrefix: "{", wantInfo: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var buf bytes.Buffer
			log := newLogger(&env{LogFormat: tt.format, LogLevel: tt.level}, &buf)
			log.Info("info-line")
			log.Error("error-line")
			out := buf.String()
			if !strings.HasPrefix(out, tt.wantPrefix) {
				t.Errorf("output %q does not start with %q", out, tt.wantPrefix)
			}
			if strings.Contains(out, "info-line") != tt.wantInfo {
				t.Errorf("info logged = %v, want %v: %q", !tt.wantInfo, tt.wantInfo, out)
			}
			if !strings.Contains(out, "error-line") {
				t.Errorf("error not logged: %q", out)
			}
		})
	}
}

// TestSetupConcurrently: replicas start at the same time and all set up the handler's tables;
// none may fail (concurrent CREATE TABLE IF NOT EXISTS races in Postgres's catalog). Found by the
// chaos suite.
func TestSetupConcurrently(t *testing.T) {
	for round := range 5 {
		pool, _ := testenv.Postgres(t)
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- builtins().setup(context.Background(), pool, []string{"ledger"})
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("round %d: concurrent setup failed: %v", round, err)
			}
		}
	}
}

// TestPrepareDatabaseWaitsThroughACutSetup: Postgres cut while a handler's tables are set up
// (the chain's chaos run on Kafka found a processor exiting 1 with "set up the tables of handler
// ledger-forward: conn closed") is waited for, as it is while the schema is migrated; a wrong
// statement in a Setup stops the service with its error; SIGTERM (ctx's end) during a Setup is a
// clean stop.
func TestPrepareDatabaseWaitsThroughACutSetup(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	noPooler := func(context.Context, *slog.Logger) error { return nil }
	policy := backoff.Policy{Base: 5 * time.Millisecond, Max: 20 * time.Millisecond}
	var calls atomic.Int32
	hs, err := newRegistry([]Handler{
		{Name: "cut", Handler: ledger.Handler{}, Setup: func(ctx context.Context, tx pgx.Tx) error {
			if calls.Add(1) == 1 { // the first time, Postgres goes away under it
				_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
				return err
			}
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS cut_setup (id int)`)
			return err
		}},
		{Name: "wrong", Handler: ledger.Handler{}, Setup: SetupSQL(`CREATE TABLE wrong (`)},
		{Name: "slow", Handler: ledger.Handler{}, Setup: SetupSQL(`SELECT pg_sleep(30)`)},
	})
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	if err := prepareDatabase(ctx, pool, noPooler, "kafkapg", hs, []string{"cut"}, policy, log); err != nil {
		t.Fatalf("a Setup whose connection was cut: %v, want it tried again", err)
	}
	if calls.Load() != 2 || !strings.Contains(logs.String(), "waiting for postgres") {
		t.Errorf("Setup ran %d times, logs %q; want twice, waiting for postgres between", calls.Load(), logs.String())
	}
	// The connection lost under a statement sent (io.ErrUnexpectedEOF: CI's chain chaos run saw a
	// restarted processor exit 1 with "migrate schema kafkapg_chaos: unexpected EOF" when a cut
	// met its migration): Classify calls it retryable, as the statement was sent, but it is
	// Postgres failing, and the transaction rolled back: waited out too.
	var lost atomic.Int32
	cutOnce := func(context.Context, *slog.Logger) error {
		if lost.Add(1) == 1 {
			return fmt.Errorf("migrate schema kafkapg: %w", io.ErrUnexpectedEOF)
		}
		return nil
	}
	if err := prepareDatabase(ctx, pool, cutOnce, "kafkapg", hs, []string{"cut"}, policy, log); err != nil {
		t.Fatalf("a connection lost mid-statement: %v, want it tried again", err)
	}
	if err := prepareDatabase(ctx, pool, noPooler, "kafkapg", hs, []string{"wrong"}, policy, log); err == nil || !strings.Contains(err.Error(), "set up the tables of handler wrong") {
		t.Errorf("a wrong statement in a Setup: %v, want the error", err)
	}
	stopped, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if err := prepareDatabase(stopped, pool, noPooler, "kafkapg", hs, []string{"slow"}, policy, log); err != nil {
		t.Errorf("SIGTERM during a Setup: %v, want a clean stop", err)
	}
}

// TestMissingVariableNamesTheDevEnvFile: when a variable the service requires is one that
// .kafkapg/env in the working directory sets (the dev loop runs there), the error says to source
// it; without the file, or for a variable it does not set, nothing is added.
func TestMissingVariableNamesTheDevEnvFile(t *testing.T) {
	hint := "source it first, `. .kafkapg/env`"
	for _, tt := range []struct {
		name     string
		file     string // .kafkapg/env's content; none if empty
		vars     map[string]string
		want     string
		wantNone bool
	}{
		{name: "no file", vars: nil, wantNone: true},
		{name: "the file sets both", file: "# kafkapg dev, pid 1: source it\nexport KAFKA_BROKERS='127.0.0.1:9092'\nexport DATABASE_URL='postgres://u:secret@h/d'\n",
			want: "(.kafkapg/env, which the dev loop wrote here, sets DATABASE_URL, KAFKA_BROKERS: " + hint + ")"},
		{name: "the file sets the one missing", file: "export KAFKA_BROKERS='127.0.0.1:9092'\nexport DATABASE_URL='postgres://u:secret@h/d'\n",
			vars: map[string]string{"DATABASE_URL": "postgres://a@b/c"}, want: "sets KAFKA_BROKERS: " + hint},
		{name: "the file does not set what is missing", file: "export KAFKA_BROKERS='127.0.0.1:9092'\n",
			vars: map[string]string{"DATABASE_URL": "postgres://a@b/c", "KAFKA_BROKERS": "k:9092", "KAFKA_TOPICS": "orders"}, wantNone: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			setEnv(t, tt.vars)
			t.Chdir(t.TempDir())
			if tt.file != "" {
				if err := os.Mkdir(".kafkapg", 0o700); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(".kafkapg/env", []byte(tt.file), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			var out bytes.Buffer
			if code := Run([]string{"run"}, &out, builtinHandlers...); code != 2 {
				t.Fatalf("Run = %d, want 2: %s", code, out.String())
			}
			s := out.String()
			if strings.Contains(s, "secret") {
				t.Errorf("the error shows what the file holds: %s", s)
			}
			if tt.wantNone && strings.Contains(s, ".kafkapg/env") || !tt.wantNone && !strings.Contains(s, tt.want) {
				t.Errorf("output:\n%s\nwant it to contain %q (none: %v)", s, tt.want, tt.wantNone)
			}
		})
	}
}
