// Package testenv gives tests the real services they run against: a fresh Postgres database per
// test (from TEST_DATABASE_URL) and a Kafka-protocol broker — an in-process kfake cluster always,
// and the real Apache Kafka broker at KAFKA_BROKERS when that is set (CI sets it).
//
// Nothing here mocks Postgres or Kafka. A test that needs Postgres fails (it is not skipped) when
// TEST_DATABASE_URL is unset: `make test` starts a throwaway server and sets it.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/schema"
)

// Postgres creates an empty database for the test, dropped when the test ends, and returns a
// pool on it and its URL.
func Postgres(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	base := os.Getenv("TEST_DATABASE_URL")
	if base == "" {
		t.Fatal("TEST_DATABASE_URL is not set. Run `make test` (it starts a throwaway Postgres), or set it to a " +
			"server where this user may CREATE DATABASE.")
	}
	return PostgresAt(t, base)
}

// PostgresAt is Postgres on the server of base, a URL whose user may CREATE DATABASE.
func PostgresAt(t testing.TB, base string) (*pgxpool.Pool, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	admin, err := pgx.Connect(ctx, base)
	if err != nil {
		t.Fatalf("connect to TEST_DATABASE_URL: %v", err)
	}
	defer admin.Close(ctx)
	name := "kt_" + Name(t, 30)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create test database: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin, err := pgx.Connect(ctx, base)
		if err != nil {
			t.Logf("drop test database %s: %v", name, err)
			return
		}
		defer admin.Close(ctx)
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Logf("drop test database %s: %v", name, err)
		}
	})

	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatalf("TEST_DATABASE_URL must be a postgres:// URL, got %q", base)
	}
	u.Path = "/" + name
	dbURL := u.String()
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, dbURL
}

var unsafeChars = regexp.MustCompile(`[^a-z0-9]+`)

// Name returns a name unique to this run, derived from the test's name and at most n characters
// long, made of [a-z0-9_].
func Name(t testing.TB, n int) string {
	b := make([]byte, 4)
	rand.Read(b)
	suffix := hex.EncodeToString(b)
	base := strings.Trim(unsafeChars.ReplaceAllString(strings.ToLower(t.Name()), "_"), "_")
	if keep := n - len(suffix) - 1; len(base) > keep {
		base = base[len(base)-keep:]
	}
	return strings.TrimLeft(base+"_"+suffix, "_")
}

// Eventually polls cond every 50ms until it returns nil or timeout passes, then fails the test
// with cond's last error.
func Eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met after %v: %v", timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Migrated is Postgres with kafkapg's tables created in schema "kafkapg".
func Migrated(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, _ := Postgres(t)
	if _, err := schema.Migrate(context.Background(), pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	return pool
}
