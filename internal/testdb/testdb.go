// Package testdb gives a test a database of its own on a Postgres server: created empty, dropped
// when the test ends. processortest.DB (for a team's handler tests) and the rig's testenv both
// use it.
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// New creates an empty database for t on the server of base (a postgres:// URL whose user may
// CREATE DATABASE), dropped when t ends, and returns a pool on it (closed when t ends) and its
// URL. what names base in errors ("TEST_DATABASE_URL").
func New(t testing.TB, base, what string) (*pgxpool.Pool, string) {
	t.Helper()
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatalf("%s must be a postgres:// URL, got %q", what, base)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, base)
	if err != nil {
		t.Fatalf("connect to %s: %v", what, err)
	}
	defer admin.Close(ctx)
	name := "kt_" + Name(t, 30)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create a test database on %s: %v", what, err)
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
