package schema_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
)

// TestUpgradeKeepsRecordContent: rows written by a release before migration 3 keep their header
// keys, timestamps and keys when the tables change types.
func TestUpgradeKeepsRecordContent(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := schema.MigrateTo(ctx, pool, "kp", 2); err != nil {
		t.Fatal(err)
	}
	ts := time.Date(2026, 11, 30, 12, 0, 0, 123_000_000, time.UTC)
	if _, err := pool.Exec(ctx, `
		INSERT INTO kp.outbox (consumer_group, topic, key, value, header_keys, header_values) VALUES ('g', 't', 'k', 'v', '{a,b}', '{1,2}');
		INSERT INTO kp.held_keys (consumer_group, topic, partition, key, state, head_offset) VALUES ('g', 't', 0, 'k', 'retrying', 1);
		INSERT INTO kp.held_records (consumer_group, topic, partition, "offset", key, value, header_keys, header_values, "timestamp")
			VALUES ('g', 't', 0, 2, 'k', 'v', '{h}', '{x}', '2026-11-30 12:00:00.123+00');
		INSERT INTO kp.dead_letters (consumer_group, topic, partition, "offset", key, value, header_keys, header_values, "timestamp", error_class, error_message, attempts, first_failed_at)
			VALUES ('g', 't', 0, 3, 'k', 'v', '{h}', '{x}', '2026-11-30 12:00:00.123+00', 'permanent', 'm', 1, now())`); err != nil {
		t.Fatal(err)
	}
	if applied, err := schema.Migrate(ctx, pool, "kp"); err != nil || len(applied) == 0 {
		t.Fatalf("upgrade applied %v, %v", applied, err)
	}
	for _, table := range []string{"outbox", "held_records", "dead_letters"} {
		var keys [][]byte
		if err := pool.QueryRow(ctx, `SELECT header_keys FROM kp.`+table).Scan(&keys); err != nil {
			t.Fatalf("%s: %v", table, err)
		}
		if len(keys) == 0 || (string(keys[0]) != "a" && string(keys[0]) != "h") {
			t.Errorf("%s header keys after the upgrade: %q", table, keys)
		}
	}
	for _, table := range []string{"held_records", "dead_letters"} {
		var ms int64
		if err := pool.QueryRow(ctx, `SELECT "timestamp" FROM kp.`+table).Scan(&ms); err != nil {
			t.Fatalf("%s: %v", table, err)
		}
		if ms != ts.UnixMilli() {
			t.Errorf("%s timestamp after the upgrade: %d ms, want %d", table, ms, ts.UnixMilli())
		}
	}
	var hash []byte
	if err := pool.QueryRow(ctx, `SELECT key_hash FROM kp.held_keys`).Scan(&hash); err != nil {
		t.Fatal(err)
	}
	if want := sha256.Sum256([]byte("k")); !bytes.Equal(hash, want[:]) {
		t.Errorf("held_keys.key_hash is %x, want the SHA-256 of the key", hash)
	}
	// A key too long for a btree entry fits now.
	long := bytes.Repeat([]byte{0xab, 0x01, 0x7f}, 100_000)
	if _, err := pool.Exec(ctx, `INSERT INTO kp.held_keys (consumer_group, topic, partition, key, state) VALUES ('g', 't', 0, $1, 'retrying')`, long); err != nil {
		t.Errorf("held key of %d bytes: %v", len(long), err)
	}
}
