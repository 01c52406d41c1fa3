package pooler_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/internal/pgcluster"
	"github.com/kafkapg/kafkapg/internal/pooler"
)

// TestDetect runs the probe against Postgres itself and through PgBouncer in each of its modes,
// with a pool of several server sessions and of one.
func TestDetect(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)

	detect := func(t *testing.T, url string) (pooler.Found, error) {
		t.Helper()
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		return pooler.Detect(ctx, cfg)
	}
	t.Run("direct", func(t *testing.T) {
		if found, err := detect(t, srv.URL("postgres")); err != nil || found.Kind != pooler.Direct {
			t.Errorf("Detect = %+v, %v; want direct", found, err)
		}
	})
	for _, tc := range []struct {
		mode     string
		poolSize int
		want     pooler.Kind
		wantErr  error
	}{
		{"transaction", 20, pooler.Transaction, nil},
		{"transaction", 1, pooler.Transaction, nil},
		{"session", 20, pooler.Pooler, nil},
		{"statement", 20, pooler.Statement, pooler.ErrStatementMode},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			b, err := pgcluster.StartBouncer(ctx, pgcluster.BouncerOptions{Backend: srv.Addr(), PoolMode: tc.mode, DefaultPoolSize: tc.poolSize})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(b.Close)
			start := time.Now()
			found, err := detect(t, b.URL("postgres"))
			// PgBouncer 1.18 (Debian 12's) does not keep prepared statements in transaction
			// mode (1.21 does, with max_prepared_statements).
			if found.Kind != tc.want || found.PreparedStatements || !errors.Is(err, tc.wantErr) {
				t.Errorf("Detect through PgBouncer (%s mode, pool of %d) = %+v, %v; want %v without prepared statements, %v", tc.mode, tc.poolSize, found, err, tc.want, tc.wantErr)
			}
			t.Logf("%s mode, pool of %d: %+v in %v", tc.mode, tc.poolSize, found, time.Since(start).Round(time.Millisecond))
		})
	}
}

// TestDetectUnderLoad: through PgBouncer in transaction mode with other clients keeping its few
// server sessions busy, the probe's transactions may never be seen to change sessions (a chaos
// run's service took the pooler for a direct connection, and its processor, probing again, did
// not: it refused the pool). A pooler is never taken for Postgres itself.
func TestDetectUnderLoad(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	b, err := pgcluster.StartBouncer(ctx, pgcluster.BouncerOptions{Backend: srv.Addr(), PoolMode: "transaction", DefaultPoolSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	load, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range 12 {
		wg.Go(func() {
			conn, err := pgx.Connect(load, b.URL("postgres")+"&default_query_exec_mode=simple_protocol")
			if err != nil {
				return
			}
			defer conn.Close(context.Background())
			for load.Err() == nil {
				conn.Exec(load, "SELECT pg_sleep(0.002)")
			}
		})
	}
	defer func() { stop(); wg.Wait() }()
	cfg, err := pgx.ParseConfig(b.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[pooler.Kind]int{}
	for range 10 {
		found, err := pooler.Detect(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		kinds[found.Kind]++
		if !found.Pooled() {
			t.Errorf("Detect under load = %+v: not pooled", found)
		}
	}
	t.Logf("10 probes under load: %v", kinds)
}
