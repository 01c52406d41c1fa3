package schema_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

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

// releaseBefore is the check the release before (f433fb8) makes before it runs: it refuses a
// schema whose schema_migrations holds a version newer than it knows (PreviousSchema).
func releaseBeforeRuns(t *testing.T, pool schema.Querier) bool {
	t.Helper()
	var v int
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(max(version), 0) FROM kp.schema_migrations`).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v <= schema.PreviousSchema
}

// TestWindowKeepsTheReleaseBeforeRunning (issue 40): upgrading a schema of the release before
// records the migrations it does not know as pending, so it still runs on the schema (beside
// this release, or after a rollback) until the upgrade is finalized; it refused at once before.
func TestWindowKeepsTheReleaseBeforeRunning(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	ms, err := schema.Migrations()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := schema.MigrateTo(ctx, pool, "kp", schema.PreviousSchema); err != nil {
		t.Fatal(err)
	}
	r, err := schema.MigrateReport(ctx, pool, "kp")
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Applied) != len(ms)-schema.PreviousSchema || !r.Open() || r.Finalized != schema.PreviousSchema || len(r.Pending) != len(ms)-schema.PreviousSchema {
		t.Fatalf("the upgrade applied %d migrations, finalized %d, pending %v; want %d applied, all pending past %d",
			len(r.Applied), r.Finalized, r.Pending, len(ms)-schema.PreviousSchema, schema.PreviousSchema)
	}
	if !releaseBeforeRuns(t, pool) {
		t.Fatal("the release before refuses the schema while the window is open")
	}
	if again, err := schema.Migrate(ctx, pool, "kp"); err != nil || len(again) != 0 {
		t.Fatalf("Migrate again = %v, %v; want nothing applied", again, err)
	}
	moved, err := schema.Finalize(ctx, pool, "kp")
	if err != nil || len(moved) != len(ms)-schema.PreviousSchema {
		t.Fatalf("Finalize = %v, %v; want the %d pending migrations finalized", moved, err, len(ms)-schema.PreviousSchema)
	}
	if releaseBeforeRuns(t, pool) {
		t.Fatal("the release before still runs on a finalized schema")
	}
	if fin, pending, err := schema.Window(ctx, pool, "kp"); err != nil || fin != len(ms) || len(pending) != 0 {
		t.Fatalf("Window after Finalize = %d, %v, %v; want %d, none", fin, pending, err, len(ms))
	}
	if again, err := schema.Finalize(ctx, pool, "kp"); err != nil || len(again) != 0 {
		t.Fatalf("Finalize again = %v, %v; want nothing", again, err)
	}
}

// TestWindowOpensForABuildBefore: a schema a build before the window migrated (every version in
// schema_migrations, no pending table) has its versions past PreviousSchema recorded as pending
// by this release's first migration: no release finalized them, and the release before runs
// again.
func TestWindowOpensForABuildBefore(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, pool, "kp", schema.PreviousSchema); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Finalize(ctx, pool, "kp"); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, pool, "kp"); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Finalize(ctx, pool, "kp"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `DROP TABLE kp.schema_migrations_pending`); err != nil { // as a build before left it
		t.Fatal(err)
	}
	r, err := schema.MigrateReport(ctx, pool, "kp")
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Converted) == 0 || r.Converted[0] != schema.PreviousSchema+1 || !r.Open() || len(r.Applied) != 0 {
		t.Fatalf("a build before's schema: converted %v, pending %v, applied %d; want the versions past %d pending, none applied", r.Converted, r.Pending, len(r.Applied), schema.PreviousSchema)
	}
	if !releaseBeforeRuns(t, pool) {
		t.Fatal("the release before refuses a schema a build before migrated")
	}
}

// TestWindowOfANewerRelease: this release runs on a schema with a newer release's migration
// pending (it is the release before, in that one's window), and does not finalize it; it
// refuses one finalized.
func TestWindowOfANewerRelease(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := schema.Migrate(ctx, pool, "kp"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kp.schema_migrations_pending (version, name) VALUES (9999, 'a newer release''s')`); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, pool, "kp"); err != nil {
		t.Fatalf("this release refuses a schema with a newer release's migration pending: %v", err)
	}
	if _, err := schema.Finalize(ctx, pool, "kp"); err == nil || !strings.Contains(err.Error(), "finalize with the release that applied it") {
		t.Fatalf("Finalize of a newer release's migration: %v", err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kp.schema_migrations SELECT * FROM kp.schema_migrations_pending; DELETE FROM kp.schema_migrations_pending`); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, pool, "kp"); err == nil || !strings.Contains(err.Error(), "finalized for a newer release") {
		t.Fatalf("Migrate on a schema finalized for a newer release: %v", err)
	}
}

// TestMigrationGivesWayToARunningTransaction (issue 40): a migration that needs a table's lock a
// running processor's transaction holds (a batch of the release before, during an upgrade) gives
// up after LockTimeout and tries again, instead of queueing every other statement on the table
// behind it for as long as that transaction lasts; it completes once the transaction ends.
func TestMigrationGivesWayToARunningTransaction(t *testing.T) {
	was := schema.LockTimeout
	schema.LockTimeout = 300 * time.Millisecond
	defer func() { schema.LockTimeout = was }()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, pool, "kp", schema.PreviousSchema); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kp.offsets (consumer_group, topic, partition, next_offset) VALUES ('g', 't', 0, 0), ('g', 't', 1, 0)`); err != nil {
		t.Fatal(err)
	}
	batch, err := pool.Begin(ctx) // a long batch of the release before on partition 0
	if err != nil {
		t.Fatal(err)
	}
	defer batch.Rollback(ctx)
	if _, err := batch.Exec(ctx, `UPDATE kp.offsets SET next_offset = 1 WHERE partition = 0`); err != nil {
		t.Fatal(err)
	}
	migrated := make(chan error, 1)
	go func() { _, err := schema.Migrate(ctx, pool, "kp"); migrated <- err }()
	time.Sleep(100 * time.Millisecond) // the migration waits for the batch's lock
	other := make(chan error, 1)       // another partition's batch
	go func() {
		_, err := pool.Exec(ctx, `UPDATE kp.offsets SET next_offset = 1 WHERE partition = 1`)
		other <- err
	}()
	select {
	case err := <-other:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("another partition's position update waited behind the migration for as long as the open batch (10 s)")
	}
	select {
	case err := <-migrated:
		t.Fatalf("the migration ended (%v) while the batch holding its lock was open", err)
	default:
	}
	if err := batch.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-migrated; err != nil {
		t.Fatalf("the migration, once the batch ended: %v", err)
	}
}
