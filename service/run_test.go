package service

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/promscrape"
	"github.com/kafkapg/kafkapg/internal/rig/faultproxy"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// get returns the status and body of GET url.
func get(url string) (int, string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

// TestRunWaitsForPostgres starts the service while Postgres is unreachable: it must serve
// /healthz, say on /readyz that it waits for Postgres, keep retrying, and become ready and
// process records once Postgres answers.
func TestRunWaitsForPostgres(t *testing.T) {
	pool, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	u, proxy := cutPostgres(t, dbURL)
	waitThenRecover(t, pool, k, u.String(), k.Brokers[0], proxy, "not ready: starting: waiting for postgres", "waiting for postgres")
}

// cutPostgres returns dbURL rewritten to go through a fault proxy, and the proxy, cut.
func cutPostgres(t *testing.T, dbURL string) (*url.URL, *faultproxy.Proxy) {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewProxy(t, u.Host)
	proxy.Cut()
	u.Host = proxy.Addr()
	return u, proxy
}

// TestRunWaitsForKafka starts the service while the broker refuses connections: it must keep
// retrying with a log line naming the brokers, answer /healthz, say on /readyz that it waits for
// Kafka (the brokers only in the log: /readyz answers anyone), and start processing once the
// broker is back.
func TestRunWaitsForKafka(t *testing.T) {
	pool, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	proxy := testenv.NewProxy(t, k.Brokers[0])
	proxy.Cut()
	waitThenRecover(t, pool, k, dbURL, proxy.Addr(), proxy,
		"not ready: kafka", "cannot check the topics on kafka yet")
}

// waitThenRecover runs the service against dbURL and broker while proxy (in front of one of
// them) is cut. While it is cut, /healthz must answer 200, /readyz 503 with a body containing
// readyzWaiting, the logs must contain logLine, and Run must keep going. Once proxy is restored
// the service must become ready and apply a record.
func waitThenRecover(t *testing.T, pool *pgxpool.Pool, k *testenv.Kafka, dbURL, broker string, proxy *faultproxy.Proxy, readyzWaiting, logLine string) {
	t.Helper()
	topic := k.CreateTopic(t, 2)
	svc := startService(t, map[string]string{
		"DATABASE_URL":  dbURL,
		"KAFKA_BROKERS": broker,
		"KAFKA_TOPICS":  topic,
	})
	svc.waitNotReady(readyzWaiting)
	time.Sleep(time.Second) // several retries while the service stays away
	svc.waitNotReady(readyzWaiting)
	if code, _, err := get("http://" + svc.httpAddr + "/healthz"); err != nil || code != http.StatusOK {
		t.Fatalf("/healthz = %d, %v; want 200 while waiting", code, err)
	}
	// The first failed attempt is logged when it ends: a client's retries against a refusing
	// broker take seconds on a loaded machine (CI: over 3 s), so wait for it, as for /readyz.
	testenv.Eventually(t, 20*time.Second, func() error {
		if !strings.Contains(svc.logs.String(), logLine) {
			return fmt.Errorf("no log line %q; logs:\n%s", logLine, svc.logs.String())
		}
		return nil
	})
	svc.waitNotReady(readyzWaiting)

	if got := svc.metric("kafkapg_ready"); got != 0 {
		t.Errorf("kafkapg_ready = %v while waiting, want 0", got)
	}

	proxy.Restore()
	svc.waitReady()
	if got := svc.metric("kafkapg_ready"); got != 1 {
		t.Errorf("kafkapg_ready = %v once ready, want 1", got)
	}
	svc.applyOne(pool, k, topic)
	svc.stop()
}

// metric returns the value (summed over series) of a counter or gauge on the service's /metrics.
func (s *service) metric(name string) float64 {
	s.t.Helper()
	sums, err := promscrape.Sums(context.Background(), "http://"+s.httpAddr+"/metrics")
	if err != nil {
		s.t.Fatal(err)
	}
	return sums[name]
}

// service is cmd/processor's Run, running in the test.
type service struct {
	t        *testing.T
	httpAddr string
	logs     *syncBuffer
	cancel   context.CancelFunc
	done     chan error
}

// startService runs the service with the ledger handler, short backoffs and vars (which must
// include DATABASE_URL, KAFKA_BROKERS and KAFKA_TOPICS). It logs as text into svc.logs.
func startService(t *testing.T, vars map[string]string) *service {
	t.Helper()
	svc := &service{t: t, httpAddr: testenv.FreeAddr(t), logs: &syncBuffer{}, done: make(chan error, 1)}
	all := map[string]string{
		"KAFKA_GROUP_ID":     "g",
		"HANDLER":            "ledger",
		"HTTP_ADDR":          svc.httpAddr,
		"RETRY_BACKOFF_BASE": "20ms",
		"RETRY_BACKOFF_MAX":  "200ms",
	}
	maps.Copy(all, vars)
	setEnv(t, all)
	e, err := loadEnv(builtins())
	if err != nil {
		t.Fatal(err)
	}
	var ctx context.Context
	ctx, svc.cancel = context.WithCancel(context.Background())
	go func() { svc.done <- serve(ctx, e, builtins(), slog.New(slog.NewTextHandler(svc.logs, nil))) }()
	t.Cleanup(svc.cancel)
	return svc
}

// waitNotReady waits until /readyz answers 503 with a body containing want, and checks that Run
// has not given up.
func (s *service) waitNotReady(want string) {
	s.t.Helper()
	testenv.Eventually(s.t, 20*time.Second, func() error {
		code, body, err := get("http://" + s.httpAddr + "/readyz")
		if err != nil {
			return err
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body, want) {
			return fmt.Errorf("/readyz = %d %q, want 503 %s", code, body, want)
		}
		return nil
	})
	select {
	case err := <-s.done:
		s.t.Fatalf("Run gave up while waiting: %v", err)
	default:
	}
}

// waitReady waits until /readyz answers 200.
func (s *service) waitReady() {
	s.t.Helper()
	testenv.Eventually(s.t, 30*time.Second, func() error { return localrun.Ready(s.httpAddr) })
}

// applyOne produces one ledger event to topic and waits until the service has applied it.
func (s *service) applyOne(pool *pgxpool.Pool, k *testenv.Kafka, topic string) {
	s.t.Helper()
	k.Produce(s.t, &kgo.Record{Topic: topic, Key: []byte("a"), Value: []byte(`{"event_id":"e1","account":"a","amount":5,"seq":1}`)})
	testenv.Eventually(s.t, 30*time.Second, func() error {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger_entries`).Scan(&n); err != nil {
			return err
		}
		if n != 1 {
			return fmt.Errorf("%d events applied, want 1", n)
		}
		return nil
	})
}

// stop cancels Run, which must return nil.
func (s *service) stop() {
	s.t.Helper()
	s.cancel()
	if err := <-s.done; err != nil {
		s.t.Fatalf("Run: %v", err)
	}
}

// syncBuffer is a bytes.Buffer safe for a logger and a test to share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestMainMigrate runs `processor migrate` against a real database.
func TestMainMigrate(t *testing.T) {
	pool, dbURL := testenv.Postgres(t)
	setEnv(t, map[string]string{"DATABASE_URL": dbURL, "DB_SCHEMA": "migrated"})
	var out strings.Builder
	if code := Run([]string{"migrate"}, &out, builtinHandlers...); code != 0 {
		t.Fatalf("migrate exited %d: %s", code, out.String())
	}
	for _, table := range []string{"migrated.offsets", "migrated.outbox", "migrated.schema_migrations"} {
		if _, err := pool.Exec(context.Background(), "SELECT 1 FROM "+table+" LIMIT 1"); err != nil {
			t.Errorf("after migrate, %s: %v", table, err)
		}
	}
	if code := Run([]string{"migrate"}, &out, builtinHandlers...); code != 0 {
		t.Fatalf("second migrate exited %d: %s", code, out.String())
	}
}

// TestDeployQueriesUseExportedMetrics scrapes /metrics from a running processor and checks that
// docs/operations.md documents every kafkapg metric it exports, and that every kafkapg metric the
// alert rules (deploy/kubernetes/prometheusrule.yaml) and the Grafana dashboard (deploy/grafana)
// query is one it exports. (deploy/validate checks that
// the queries are valid PromQL.)
func TestDeployQueriesUseExportedMetrics(t *testing.T) {
	pool, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 2)
	svc := startService(t, map[string]string{"DATABASE_URL": dbURL, "KAFKA_BROKERS": k.Brokers[0], "KAFKA_TOPICS": topic})
	svc.waitReady()
	svc.applyOne(pool, k, topic)
	_, body, err := get("http://" + svc.httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	exported := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^# TYPE (kafkapg_\w+) (\w+)`).FindAllStringSubmatch(body, -1) {
		exported[m[1]] = true
		if m[2] == "histogram" {
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				exported[m[1]+s] = true
			}
		}
	}
	svc.stop()
	// Series that exist only while their subject does: one per pause of the group (none here).
	for _, name := range []string{"kafkapg_partition_paused_seconds", "kafkapg_paused_partitions"} {
		exported[name] = true
	}
	if len(exported) < 20 {
		t.Fatalf("only %d kafkapg metrics exported:\n%s", len(exported), body)
	}
	// Every metric exported is documented, in its own row of the metrics table.
	ops, err := os.ReadFile("../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	for name := range exported {
		if strings.HasPrefix(name, "kafkapg_kafka_") || strings.HasSuffix(name, "_bucket") || strings.HasSuffix(name, "_sum") || strings.HasSuffix(name, "_count") {
			continue // franz-go's client metrics are documented as a family; histogram series with their histogram
		}
		if !regexp.MustCompile("\\| `"+name+`(\{[a-z,]*\})?`+"` ").Match(ops) && !strings.Contains(string(ops), "`"+name+"` / ") && !strings.Contains(string(ops), " / `"+name+"`") {
			t.Errorf("docs/operations.md has no row for the metric %s", name)
		}
	}
	for _, f := range []string{"../deploy/kubernetes/prometheusrule.yaml", "../deploy/grafana/kafkapg-dashboard.json"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		used := regexp.MustCompile(`kafkapg_\w+`).FindAllString(string(b), -1)
		if len(used) == 0 {
			t.Errorf("%s queries no kafkapg metric", f)
		}
		for _, name := range used {
			if !exported[name] {
				t.Errorf("%s queries %s, which the processor does not export", f, name)
			}
		}
	}
}

// TestSecretsStayOutOfLogs puts a password in DATABASE_URL: neither a malformed URL's error nor
// the logs and /readyz of a service waiting for an unreachable Postgres may contain it.
func TestSecretsStayOutOfLogs(t *testing.T) {
	const password = "hunter2-do-not-log"
	setEnv(t, with("DATABASE_URL", "postgres://app:"+password+"@db.example:notaport/app"))
	e, err := loadEnv(builtins())
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := openPool(context.Background(), &e.dbEnv); err == nil {
		t.Fatal("openPool accepted a malformed DATABASE_URL")
	} else if strings.Contains(err.Error(), password) {
		t.Errorf("the error for a malformed DATABASE_URL shows the password: %v", err)
	} else {
		t.Logf("malformed DATABASE_URL: %v", err)
	}

	_, dbURL := testenv.Postgres(t)
	u, _ := cutPostgres(t, dbURL)
	u.User = url.UserPassword("app", password)
	k := testenv.NewKfake(t)
	svc := startService(t, map[string]string{"DATABASE_URL": u.String(), "KAFKA_BROKERS": k.Brokers[0], "KAFKA_TOPICS": k.CreateTopic(t, 1)})
	svc.waitNotReady("not ready: starting: waiting for postgres")
	time.Sleep(500 * time.Millisecond) // a few failed connection attempts, each logged
	_, body, _ := get("http://" + svc.httpAddr + "/readyz")
	svc.stop()
	logs := svc.logs.String()
	if !strings.Contains(logs, "waiting for postgres") {
		t.Fatalf("no log line about the unreachable Postgres:\n%s", logs)
	}
	for what, text := range map[string]string{"logs": logs, "/readyz": body} {
		if strings.Contains(text, password) {
			t.Errorf("the %s show the DATABASE_URL password:\n%s", what, text)
		}
	}
}

// TestConsoleServed: with CONSOLE_ADDR and CONSOLE_USERS the service serves the console on its
// own address, to its users only.
func TestConsoleServed(t *testing.T) {
	_, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	consoleAddr := testenv.FreeAddr(t)
	svc := startService(t, map[string]string{
		"DATABASE_URL": dbURL, "KAFKA_BROKERS": k.Brokers[0], "KAFKA_TOPICS": k.CreateTopic(t, 2),
		"KAFKA_GROUP_ID": "console-group",
		"CONSOLE_ADDR":   consoleAddr, "CONSOLE_USERS": "ann:viewer:ann-password-1",
	})
	svc.waitReady()
	if code, body, err := get("http://" + consoleAddr + "/"); err != nil || code != http.StatusUnauthorized || strings.Contains(body, "console-group") {
		t.Errorf("the console without credentials: %d %q %v, want 401 and nothing of the group", code, body, err)
	}
	req, _ := http.NewRequest("GET", "http://"+consoleAddr+"/", nil)
	req.SetBasicAuth("ann", "ann-password-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "console-group") || !strings.Contains(string(body), `id="partitions"`) {
		t.Errorf("the console's overview for ann: %d\n%s", resp.StatusCode, body)
	}
	if code, _, _ := get("http://" + svc.httpAddr + "/dead-letters"); code != http.StatusNotFound {
		t.Errorf("HTTP_ADDR serves the console's pages too (%d): it must only be on CONSOLE_ADDR", code)
	}
	svc.stop()
	if _, err := http.Get("http://" + consoleAddr + "/"); err == nil {
		t.Error("the console still answers after the service stopped")
	}
}

// TestIdleConnectionsAreClosed: a client that sends one request on a kept-alive connection and
// then nothing (2,000 of them held 2,000 file descriptors for good, on HTTP_ADDR and on
// CONSOLE_ADDR) is disconnected once the connection has been idle for the idle timeout.
func TestIdleConnectionsAreClosed(t *testing.T) {
	defer func(d time.Duration) { httpIdleTimeout = d }(httpIdleTimeout)
	httpIdleTimeout = 300 * time.Millisecond
	_, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	console := testenv.FreeAddr(t)
	svc := startService(t, map[string]string{
		"DATABASE_URL": dbURL, "KAFKA_BROKERS": k.Brokers[0], "KAFKA_TOPICS": k.CreateTopic(t, 1),
		"CONSOLE_ADDR": console, "CONSOLE_USERS": "ann:viewer:secret-password-1",
	})
	svc.waitReady()
	for _, addr := range []string{svc.httpAddr, console} {
		var conns []net.Conn
		for range 20 {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			conns = append(conns, c)
		}
		time.Sleep(time.Second)
		open := 0
		for _, c := range conns {
			c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
			if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
				open++
			}
		}
		if open > 0 {
			t.Errorf("%s: %d of %d idle connections still open a second after their last request", addr, open, len(conns))
		}
	}
	svc.stop()
}
