package service

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// roundTrip sends raw (a request, as written on the wire) to addr on a new connection and
// returns the answer's status.
func roundTrip(t *testing.T, addr string, raw []byte) int {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	go c.Write(raw) // the server may answer (and close) before it has read all of it
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("%s: %v", addr, err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// bigHeaders is a request with n bytes of headers.
func bigHeaders(path string, n int) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "GET %s HTTP/1.1\r\nHost: x\r\n", path)
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "X-Pad-%d: %s\r\n", i, strings.Repeat("a", 1000))
	}
	b.WriteString("Connection: close\r\n\r\n")
	return b.Bytes()
}

// bigBody is a POST to path with a body of n bytes, announced by Content-Length.
func bigBody(path string, n int) []byte {
	return fmt.Appendf(nil, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		path, n, strings.Repeat("a", n))
}

// TestEveryServerHasLimits: each port the service opens (HTTP_ADDR with the operator API,
// CONSOLE_ADDR, PPROF_ADDR) refuses 100 KB of headers with 431 (Go's default allows 1 MB: 800
// slow connections held 1.1 GB) and a body longer than the cap with 413, before anyone signed in.
func TestEveryServerHasLimits(t *testing.T) {
	_, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	consoleAddr, pprofAddr := testenv.FreeAddr(t), testenv.FreeAddr(t)
	svc := startService(t, map[string]string{
		"DATABASE_URL": dbURL, "KAFKA_BROKERS": k.Brokers[0], "KAFKA_TOPICS": k.CreateTopic(t, 1),
		"CONSOLE_ADDR": consoleAddr, "CONSOLE_USERS": "ann:operator:secret-password-1",
		"PPROF_ADDR": pprofAddr, "OPERATOR_TOKEN": "0123456789abcdef-token",
	})
	for _, s := range []struct{ addr, get, post string }{
		{svc.httpAddr, "/healthz", "/api/v1/dead-letters/replay"},
		{consoleAddr, "/", "/dead-letters/act"},
		{pprofAddr, "/debug/pprof/", "/debug/pprof/symbol"},
	} {
		testenv.Eventually(t, 20*time.Second, func() error {
			c, err := net.Dial("tcp", s.addr)
			if err == nil {
				c.Close()
			}
			return err
		})
		if code := roundTrip(t, s.addr, bigHeaders(s.get, 100<<10)); code != http.StatusRequestHeaderFieldsTooLarge {
			t.Errorf("%s: 100 KB of headers: %d, want 431", s.addr, code)
		}
		if code := roundTrip(t, s.addr, bigHeaders(s.get, 8<<10)); code == http.StatusRequestHeaderFieldsTooLarge {
			t.Errorf("%s: 8 KB of headers: 431, want them accepted", s.addr)
		}
		if code := roundTrip(t, s.addr, bigBody(s.post, int(httpMaxBodyBytes)+1)); code != http.StatusRequestEntityTooLarge {
			t.Errorf("POST %s%s with a body past the cap: %d, want 413", s.addr, s.post, code)
		}
	}
	svc.stop()
}

// countingListener counts the connections its Accept returned.
type countingListener struct {
	net.Listener
	accepted atomic.Int32
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.accepted.Add(1)
	}
	return c, err
}

// TestServeHTTPLimitsConnections: past httpMaxConns connections on a listener, the others wait
// (in the kernel's accept queue, holding no memory of the process) until one ends: N+6 clients
// whose requests hang get N of them served at once, and all in the end.
func TestServeHTTPLimitsConnections(t *testing.T) {
	defer func(n int) { httpMaxConns = n }(httpMaxConns)
	httpMaxConns = 4
	const clients = 10
	var inFlight, most atomic.Int32
	release := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		<-release
		io.WriteString(w, "ok\n")
	})
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := &countingListener{Listener: inner}
	srv := serveHTTP(ln, h, 0)
	defer srv.Close()

	codes := make(chan int, clients)
	for range clients {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		go func() {
			c.SetDeadline(time.Now().Add(30 * time.Second))
			fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				codes <- 0
				return
			}
			resp.Body.Close()
			codes <- resp.StatusCode
		}()
	}
	testenv.Eventually(t, 10*time.Second, func() error {
		if n := inFlight.Load(); n != int32(httpMaxConns) {
			return fmt.Errorf("%d requests in flight, want %d", n, httpMaxConns)
		}
		return nil
	})
	time.Sleep(200 * time.Millisecond) // the others had time to be accepted, were there no limit
	if n, a := inFlight.Load(), ln.accepted.Load(); n != int32(httpMaxConns) || a != int32(httpMaxConns) {
		t.Errorf("%d clients: %d connections accepted, %d requests in flight; want %d of each", clients, a, n, httpMaxConns)
	}
	close(release)
	for i := range clients {
		if code := <-codes; code != http.StatusOK {
			t.Fatalf("client %d: status %d, want 200 once the others were served", i, code)
		}
	}
	if m := most.Load(); m != int32(httpMaxConns) {
		t.Errorf("at most %d requests in flight, want %d", m, httpMaxConns)
	}
}

// TestOperatorAPIBodyCap: a JSON body past httpMaxBodyBytes gets 413, whether it says its length
// or is sent in chunks (which only the decoder's read sees).
func TestOperatorAPIBodyCap(t *testing.T) {
	t.Parallel()
	const token = "0123456789abcdef-token"
	a := newAPI(t.Context(), ops.New(nil, "kafkapg", "g"), token, nil, slog.New(slog.DiscardHandler))
	srv := httptest.NewServer(limitBody(a.handler()))
	defer srv.Close()
	body := `{"reason": "` + strings.Repeat("a", int(httpMaxBodyBytes)) + `"}`
	for _, chunked := range []bool{false, true} {
		req, err := http.NewRequest("POST", srv.URL+"/api/v1/dead-letters/replay", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if chunked {
			req.ContentLength = -1
			req.Body = io.NopCloser(strings.NewReader(body)) // a reader of no known length: chunked
		}
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Errorf("a body of %d bytes (chunked %v): %d, want 413", len(body), chunked, resp.StatusCode)
		}
	}
}

// TestReadyzFloodPingsOnce: however many ask /readyz (and scrape kafkapg_ready) at once, the
// readiness check runs once, on one connection of the pool, and its result serves them all for
// readyFresh: an unauthenticated flood does not compete with the processor for DB_MAX_CONNS.
func TestReadyzFloodPingsOnce(t *testing.T) {
	t.Parallel()
	_, dbURL := testenv.Postgres(t)
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	var acquired, held, most atomic.Int32
	cfg.MaxConns = 20
	cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
		acquired.Add(1)
		n := held.Add(1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		return true, nil
	}
	cfg.AfterRelease = func(*pgx.Conn) bool { held.Add(-1); return true }
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	rd := &readiness{log: slog.New(slog.DiscardHandler), check: func(ctx context.Context) error {
		time.Sleep(50 * time.Millisecond) // a slow database: the callers overlap
		return pool.Ping(ctx)
	}}
	h := httpHandler(prometheus.NewRegistry(), func(context.Context) error { return nil }, rd.ready, nil)
	var wg sync.WaitGroup
	var notOK atomic.Int32
	for range 200 {
		wg.Go(func() {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
			if rec.Code != http.StatusOK {
				notOK.Add(1)
			}
		})
	}
	wg.Wait()
	if n := notOK.Load(); n > 0 {
		t.Errorf("%d of 200 /readyz not 200", n)
	}
	if m := most.Load(); m != 1 {
		t.Errorf("200 concurrent /readyz held up to %d connections at once, want 1", m)
	}
	// The callers all asked within readyFresh (a second) of the first check, unless the
	// machine is very slow: one or two checks.
	if n := acquired.Load(); n < 1 || n > 2 {
		t.Errorf("200 concurrent /readyz acquired %d connections, want 1 (2 on a slow machine)", n)
	}
}

// TestReadyzSaysNoDetail: /readyz answers anyone, so a not-ready answer names the dependency in
// general terms only, never the database's user and hosts or the brokers; the detail is logged,
// once per change, not once per request.
func TestReadyzSaysNoDetail(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		err      error
		want     string
		wantLogs bool
	}{
		{name: "starting", err: errStarting, want: "not ready: starting: waiting for postgres\n"},
		{name: "postgres down", err: fmt.Errorf("postgres: %w",
			errors.New("failed to connect to `user=orders_svc database=orders`: 10.1.2.3:5432 (db-primary.internal): dial error: connection refused")),
			want: "not ready: postgres\n", wantLogs: true},
		{name: "waiting for kafka", err: errors.New("not a member of the consumer group yet: waiting for kafka (brokers kafka-0.internal:9092): unable to dial"),
			want: "not ready: kafka: not a member of the consumer group yet\n", wantLogs: true},
		{name: "waiting for topics", err: errors.New("not a member of the consumer group yet: waiting for source topics to exist: hr.salaries"),
			want: "not ready: kafka: not a member of the consumer group yet\n", wantLogs: true},
		{name: "joining waits for postgres", err: errors.New("not a member of the consumer group yet: waiting for postgres: failed to connect to `user=orders_svc`"),
			want: "not ready: postgres\n", wantLogs: true},
		{name: "shutting down", err: errors.New("shutting down"), want: "not ready: shutting down\n", wantLogs: true},
		{name: "unknown", err: errors.New("something new at db-primary.internal"), want: "not ready: see the log\n", wantLogs: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			logs := &syncBuffer{}
			rd := &readiness{log: slog.New(slog.NewTextHandler(logs, nil)), check: func(context.Context) error { return tt.err }}
			h := httpHandler(prometheus.NewRegistry(), func(context.Context) error { return nil }, rd.ready, nil)
			for range 3 {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
				if rec.Code != http.StatusServiceUnavailable || rec.Body.String() != tt.want {
					t.Errorf("/readyz: %d %q, want 503 %q", rec.Code, rec.Body, tt.want)
				}
			}
			// The first check logs after it answered its callers: wait for its line.
			testenv.Eventually(t, 5*time.Second, func() error {
				if tt.wantLogs && !strings.Contains(logs.String(), strconv.Quote(tt.err.Error())) {
					return fmt.Errorf("the log lacks the detail %q:\n%s", tt.err, logs.String())
				}
				return nil
			})
			if n := strings.Count(logs.String(), "not ready"); tt.wantLogs && n != 1 {
				t.Errorf("%d log lines for one state, want 1:\n%s", n, logs.String())
			}
		})
	}
}

// TestPprofWarnsOffLoopback: PPROF_ADDR on an address others can reach (every interface) is
// served with a warning in the log; on a loopback address, without.
func TestPprofWarnsOffLoopback(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		addr     string
		wantWarn bool
	}{
		{"127.0.0.1:0", false},
		{"[::1]:0", false},
		{"localhost:0", false},
		{":0", true},
		{"0.0.0.0:0", true},
	} {
		var logs bytes.Buffer
		stop, err := servePprof(tt.addr, slog.New(slog.NewTextHandler(&logs, nil)))
		if err != nil {
			if strings.Contains(tt.addr, "::1") {
				continue // no IPv6 here
			}
			t.Fatal(err)
		}
		stop()
		if got := strings.Contains(logs.String(), "level=WARN msg=\"PPROF_ADDR is not a loopback address"); got != tt.wantWarn {
			t.Errorf("PPROF_ADDR=%s: warned %v, want %v; logs:\n%s", tt.addr, got, tt.wantWarn, logs.String())
		}
	}
}
