package schema_test

import (
	"context"
	"sync"
	"testing"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
)

func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	ms, err := schema.Migrations()
	if err != nil {
		t.Fatal(err)
	}

	// Many replicas starting at once: exactly one applies each migration, none fails.
	const n = 8
	var wg sync.WaitGroup
	applied := make([][]int, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { applied[i], errs[i] = schema.Migrate(ctx, pool, "kp") })
	}
	wg.Wait()
	total := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("migrator %d: %v", i, errs[i])
		}
		total += len(applied[i])
	}
	if total != len(ms) {
		t.Fatalf("%d migrations applied in all, want %d (each exactly once)", total, len(ms))
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM kp.schema_migrations`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != len(ms) {
		t.Fatalf("schema_migrations has %d rows, want %d", rows, len(ms))
	}
	for _, table := range []string{"kp.offsets", "kp.outbox"} {
		if _, err := pool.Exec(ctx, "SELECT 1 FROM "+table+" LIMIT 1"); err != nil {
			t.Errorf("table %s: %v", table, err)
		}
	}

	// Idempotent afterwards.
	again, err := schema.Migrate(ctx, pool, "kp")
	if err != nil || len(again) != 0 {
		t.Fatalf("second Migrate = %v, %v; want nothing applied", again, err)
	}
}

func TestMigrateRefusesNewerSchema(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := schema.Migrate(ctx, pool, "kp"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kp.schema_migrations (version, name) VALUES (9999, 'from the future')`); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, pool, "kp"); err == nil {
		t.Fatal("Migrate accepted a schema newer than the binary")
	}
}
