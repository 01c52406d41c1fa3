// Package testenv gives tests the real services they run against: a fresh Postgres database per
// test (from TEST_DATABASE_URL) and a Kafka-protocol broker — an in-process kfake cluster always,
// and the real Apache Kafka broker at KAFKA_BROKERS when that is set (CI sets it).
//
// Nothing here mocks Postgres or Kafka. A test that needs Postgres fails (it is not skipped) when
// TEST_DATABASE_URL is unset: `make test` starts a throwaway server and sets it.
package testenv

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/schema"
	"github.com/kafkapg/kafkapg/internal/testdb"
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
	return testdb.New(t, base, "TEST_DATABASE_URL")
}

// Name returns a name unique to this run, derived from the test's name and at most n characters
// long, made of [a-z0-9_].
func Name(t testing.TB, n int) string { return testdb.Name(t, n) }

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
