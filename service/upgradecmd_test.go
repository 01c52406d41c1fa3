package service

import (
	"context"
	"strings"
	"testing"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
)

// TestUpgradeCommand: `upgrade status` says the window and the schema's groups; `upgrade finalize`
// is a dry run without --execute, needs --reason with it, and KAFKA_BROKERS (to ask for members of
// the release before) unless --unchecked; then the release before's check refuses the schema.
// (The refusal while such a member runs: internal/upgrade's TestFinalizeWaitsForTheReleaseBefore.)
func TestUpgradeCommand(t *testing.T) {
	pool, url := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, pool, "kafkapg", schema.PreviousSchema); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ('ug', 'orders', 0, 1)`); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DATABASE_URL", url)
	t.Setenv("KAFKA_BROKERS", "")
	code, out, errOut := cli("upgrade", "status")
	if code != 0 || !strings.Contains(out, "version 5 final; upgrade window open: versions [6") || !strings.Contains(out, "groups: ug") {
		t.Fatalf("upgrade status = %d\n%s%s", code, out, errOut)
	}
	if code, _, errOut := cli("upgrade", "finalize"); code != 2 || !strings.Contains(errOut, "KAFKA_BROKERS is required for upgrade finalize") {
		t.Fatalf("upgrade finalize without KAFKA_BROKERS = %d: %s", code, errOut)
	}
	if code, _, errOut := cli("upgrade", "finalize", "--unchecked"); code != 0 || !strings.Contains(errOut, "dry run") {
		t.Fatalf("upgrade finalize --unchecked (a dry run) = %d: %s", code, errOut)
	}
	if code, _, errOut := cli("upgrade", "finalize", "--unchecked", "--execute"); code != 2 || !strings.Contains(errOut, "--execute needs --reason") {
		t.Fatalf("upgrade finalize --execute without a reason = %d: %s", code, errOut)
	}
	if _, pending, _ := schema.Window(ctx, pool, "kafkapg"); len(pending) == 0 {
		t.Fatal("a dry run or a refused finalize closed the window")
	}
	if code, _, errOut := cli("upgrade", "finalize", "--unchecked", "--execute", "--reason", "rolled out"); code != 0 || !strings.Contains(errOut, "finalized versions [6") {
		t.Fatalf("upgrade finalize --execute = %d: %s", code, errOut)
	}
	var v int
	if err := pool.QueryRow(ctx, `SELECT max(version) FROM kafkapg.schema_migrations`).Scan(&v); err != nil || v != schema.Version() {
		t.Fatalf("schema_migrations at %d (%v) after finalize, want %d: the release before refuses it", v, err, schema.Version())
	}
	if code, _, errOut := cli("upgrade", "bogus"); code != 2 || !strings.Contains(errOut, "want status or finalize") {
		t.Fatalf("upgrade bogus = %d: %s", code, errOut)
	}
}
