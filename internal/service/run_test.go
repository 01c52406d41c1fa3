package service

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

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
	topic := k.CreateTopic(t, 2)
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewProxy(t, u.Host)
	proxy.Cut()
	u.Host = proxy.Addr()
	httpAddr := freeAddr(t)
	setEnv(t, map[string]string{
		"DATABASE_URL":       u.String(),
		"KAFKA_BROKERS":      k.Brokers[0],
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
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, env, slog.New(slog.DiscardHandler)) }()

	readyz := "http://" + httpAddr + "/readyz"
	testenv.Eventually(t, 10*time.Second, func() error {
		code, body, err := get(readyz)
		if err != nil {
			return err
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "waiting for postgres") {
			return fmt.Errorf("/readyz = %d %q, want 503 waiting for postgres", code, body)
		}
		return nil
	})
	time.Sleep(time.Second) // several retries while Postgres stays away
	if code, body, _ := get(readyz); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d %q while postgres is unreachable", code, body)
	}
	if code, _, err := get("http://" + httpAddr + "/healthz"); err != nil || code != http.StatusOK {
		t.Fatalf("/healthz = %d, %v; want 200 while waiting", code, err)
	}
	select {
	case err := <-done:
		t.Fatalf("Run gave up while postgres was unreachable: %v", err)
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
