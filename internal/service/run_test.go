package service

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/faultproxy"
	"github.com/kafkapg/kafkapg/internal/testenv"
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

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// TestRunWaitsForPostgres starts the service while Postgres is unreachable: it must serve
// /healthz, say on /readyz that it waits for Postgres, keep retrying, and become ready and
// process records once Postgres answers.
func TestRunWaitsForPostgres(t *testing.T) {
	pool, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewProxy(t, u.Host)
	proxy.Cut()
	u.Host = proxy.Addr()
	waitThenRecover(t, pool, k, u.String(), k.Brokers[0], proxy, "waiting for postgres", "waiting for postgres")
}

// TestRunWaitsForKafka starts the service while the broker refuses connections: it must keep
// retrying with a log line naming the brokers, answer /healthz, say on /readyz that it waits for
// Kafka, and start processing once the broker is back.
func TestRunWaitsForKafka(t *testing.T) {
	pool, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	proxy := testenv.NewProxy(t, k.Brokers[0])
	proxy.Cut()
	waitThenRecover(t, pool, k, dbURL, proxy.Addr(), proxy,
		"waiting for kafka (brokers "+proxy.Addr()+")", "cannot check the topics on kafka yet")
}

// waitThenRecover runs the service against dbURL and broker while proxy (in front of one of
// them) is cut. While it is cut, /healthz must answer 200, /readyz 503 with a body containing
// readyzWaiting, the logs must contain logLine, and Run must keep going. Once proxy is restored
// the service must become ready and apply a record.
func waitThenRecover(t *testing.T, pool *pgxpool.Pool, k *testenv.Kafka, dbURL, broker string, proxy *faultproxy.Proxy, readyzWaiting, logLine string) {
	t.Helper()
	topic := k.CreateTopic(t, 2)
	httpAddr := freeAddr(t)
	setEnv(t, map[string]string{
		"DATABASE_URL":       dbURL,
		"KAFKA_BROKERS":      broker,
		"KAFKA_GROUP_ID":     "g",
		"KAFKA_TOPICS":       topic,
		"HANDLER":            "ledger",
		"HTTP_ADDR":          httpAddr,
		"RETRY_BACKOFF_BASE": "20ms",
		"RETRY_BACKOFF_MAX":  "200ms",
	})
	env, err := LoadEnv()
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, env, slog.New(slog.NewTextHandler(&logs, nil))) }()

	readyz := "http://" + httpAddr + "/readyz"
	testenv.Eventually(t, 20*time.Second, func() error {
		code, body, err := get(readyz)
		if err != nil {
			return err
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body, readyzWaiting) {
			return fmt.Errorf("/readyz = %d %q, want 503 %s", code, body, readyzWaiting)
		}
		return nil
	})
	time.Sleep(time.Second) // several retries while the service stays away
	if code, body, _ := get(readyz); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d %q while the service is unreachable", code, body)
	}
	if code, _, err := get("http://" + httpAddr + "/healthz"); err != nil || code != http.StatusOK {
		t.Fatalf("/healthz = %d, %v; want 200 while waiting", code, err)
	}
	if !strings.Contains(logs.String(), logLine) {
		t.Errorf("no log line %q; logs:\n%s", logLine, logs.String())
	}
	select {
	case err := <-done:
		t.Fatalf("Run gave up while the service was unreachable: %v", err)
	default:
	}

	proxy.Restore()
	testenv.Eventually(t, 30*time.Second, func() error {
		if code, body, err := get(readyz); err != nil || code != http.StatusOK {
			return fmt.Errorf("/readyz = %d %q %v", code, body, err)
		}
		return nil
	})
	k.Produce(t, &kgo.Record{Topic: topic, Key: []byte("a"), Value: []byte(`{"event_id":"e1","account":"a","amount":5,"seq":1}`)})
	testenv.Eventually(t, 30*time.Second, func() error {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(&n); err != nil {
			return err
		}
		if n != 1 {
			return fmt.Errorf("%d events applied, want 1", n)
		}
		return nil
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
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
	if code := Main([]string{"migrate"}, &out); code != 0 {
		t.Fatalf("migrate exited %d: %s", code, out.String())
	}
	for _, table := range []string{"migrated.offsets", "migrated.outbox", "migrated.schema_migrations"} {
		if _, err := pool.Exec(context.Background(), "SELECT 1 FROM "+table+" LIMIT 1"); err != nil {
			t.Errorf("after migrate, %s: %v", table, err)
		}
	}
	if code := Main([]string{"migrate"}, &out); code != 0 {
		t.Fatalf("second migrate exited %d: %s", code, out.String())
	}
}
