package processor_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/pgcluster"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
)

// TestFailoverToALaggingStandby is the failover a team tries first, with an asynchronous standby
// that had received none of the group's work: the service applies a workload on the primary
// (its offsets then committed to Kafka), the primary dies, the standby is promoted, and the
// service, reaching Postgres by a multi-host URL that finds the primary, runs again. Everything
// the old primary had is gone, its first claims of the partitions included, while Kafka holds
// offsets past all of it. Before kafkapg stopped taking its own Kafka commits for a start, none
// of the events were applied on the new primary.
func TestFailoverToALaggingStandby(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		primary, err := pgcluster.Start(ctx, pgcluster.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(primary.Close)
		if err := primary.CreateDatabase(ctx, "app"); err != nil {
			t.Fatal(err)
		}
		pool := pgPool(t, primary.URL("app"))
		if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, ledger.Schema); err != nil {
			t.Fatal(err)
		}
		standby, err := primary.Standby(ctx, pgcluster.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(standby.Close)
		if err := standby.WaitReplayed(ctx, primary); err != nil {
			t.Fatal(err)
		}
		// The standby lags: it receives nothing of what follows.
		if err := standby.Stop(ctx); err != nil {
			t.Fatal(err)
		}

		multiHost := fmt.Sprintf("postgres://postgres@%s,%s/app?sslmode=disable&target_session_attrs=read-write", primary.Addr(), standby.Addr())
		h := &testkit.Harness{T: t, K: k, Pool: pgPool(t, multiHost), Topic: k.CreateTopic(t, 3), Group: k.Group(t)}
		items := testkit.FlakyMix(200, 7, "failover")
		cfg := h.Config(ledger.Handler{})
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond}
		r := h.Start(cfg)
		h.Produce(items)
		h.WaitSettled(items, testkit.TiersMaxAttempt, 90*time.Second)
		r.Stop(t) // offsets committed to Kafka

		if err := primary.Kill(ctx); err != nil {
			t.Fatal(err)
		}
		if err := standby.Start(ctx); err != nil {
			t.Fatal(err)
		}
		if err := standby.Promote(ctx); err != nil {
			t.Fatal(err)
		}
		h.Pool.Reset() // its connections were to the dead primary
		var n int
		testenv.Eventually(t, 30*time.Second, func() error {
			return h.Pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(&n)
		})
		if n != 0 {
			t.Fatalf("the promoted standby has %d applied events; the scenario needs it to have lost them all", n)
		}
		cfg2 := h.Config(ledger.Handler{})
		cfg2.RetryTiers = cfg.RetryTiers
		h.Start(cfg2)
		h.WaitSettled(items, testkit.TiersMaxAttempt, 90*time.Second)
		h.Verify(items, testkit.TiersMaxAttempt, true)
	})
}

// pgPool returns a pool on url, closed when the test ends.
func pgPool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
