package processor_test

import (
	"context"
	"crypto/sha256"
	encbinary "encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/sink"
)

// releaseBefore is what a processor of the release before (f433fb8) does with a record's
// idempotency key: it records it in idempotency_keys, the only place it looks, and applies the
// record if no one recorded it before (its dedupeSQL, verbatim but for the schema).
func releaseBefore(t *testing.T, h *harness, topic, key string) (applies bool) {
	t.Helper()
	sum := sha256.New()
	for _, s := range []string{h.Group, topic} {
		sum.Write(encbinary.AppendUvarint(nil, uint64(len(s))))
		sum.Write([]byte(s))
	}
	sum.Write([]byte(key))
	rows, err := h.Pool.Query(context.Background(), `INSERT INTO kafkapg.idempotency_keys (key_hash, consumer_group, topic, partition, "offset")
		SELECT k, $1, $2, p, o FROM unnest($3::bytea[], $4::int4[], $5::int8[]) AS u(k, p, o)
		ON CONFLICT DO NOTHING RETURNING key_hash`, h.Group, topic, [][]byte{sum.Sum(nil)}, []int32{0}, []int64{0})
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	applies = rows.Next()
	if rows.Close(); rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	return applies
}

// openWindow puts h's schema where an upgrade from the release before leaves it: the
// migrations past schema.PreviousSchema pending.
func openWindow(t *testing.T, h *harness) {
	t.Helper()
	if _, err := h.Pool.Exec(context.Background(), `
		WITH moved AS (DELETE FROM kafkapg.schema_migrations WHERE version > $1 RETURNING version, name, applied_at)
		INSERT INTO kafkapg.schema_migrations_pending SELECT * FROM moved`, schema.PreviousSchema); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(context.Background(), h.Pool, "kafkapg"); err != nil { // as the first new processor does
		t.Fatal(err)
	}
}

// TestUpgradeWindowSharesKeysWithTheReleaseBefore (issue 40, case 1): in a rolling upgrade a
// partition moves between processors of the two releases. The release before looks keys up in
// idempotency_keys only; this release recorded them in its key ring only, so a copy of a record
// this release applied was applied again by the release before. While the window is open this
// release records its keys (numbered events' too: they are decided by key) in the release
// before's table as well, and finds the keys the release before recorded; once finalized, it
// stops writing there.
func TestUpgradeWindowSharesKeysWithTheReleaseBefore(t *testing.T) {
	t.Cleanup(processor.SetWindowEvery(200 * time.Millisecond)) // after the processor stops (cleanups run last first)
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, midRecorder{})
	openWindow(t, h)
	r := h.Start(cfg)
	ctx := context.Background()
	plain := func(mid string) *kgo.Record {
		return &kgo.Record{Topic: h.Topic, Partition: 0, Key: []byte(mid), Value: []byte("ok"), Headers: []kgo.RecordHeader{{Key: sink.HeaderMessageID, Value: []byte(mid)}}}
	}
	since := ""
	k.Produce(t, plain("new1"), streamRec(h.Topic, streamA, 1, rootR, 10, since, "num1", "ok"))
	waitConsumed(t, h, 2)
	if got := r.Gauge("kafkapg_upgrade_window_open"); got != 1 {
		t.Errorf("kafkapg_upgrade_window_open = %v with the window open", got)
	}
	for _, mid := range []string{"new1", "num1"} {
		if releaseBefore(t, h, h.Topic, mid) {
			t.Errorf("the release before applies a copy of %s, which this release applied in the window", mid)
		}
	}
	// The release before applies old1 (the partition was its for a while); a copy reaches this release.
	if !releaseBefore(t, h, h.Topic, "old1") {
		t.Fatal("old1 was recorded before")
	}
	k.Produce(t, plain("old1"))
	waitConsumed(t, h, 3)
	if got := appliedMids(t, h); got["old1"] != 0 || got["new1"] != 1 || got["num1"] != 1 {
		t.Errorf("applied %v: a copy of what the release before applied was applied here", got)
	}
	testenv.Eventually(t, 10*time.Second, func() error { // the member says its release, for `upgrade finalize`
		var rel string
		if err := h.Pool.QueryRow(ctx, `SELECT release FROM kafkapg.group_members WHERE consumer_group = $1`, h.Group).Scan(&rel); err != nil || rel != processor.Release {
			return fmt.Errorf("group_members says %q (%v), want %s", rel, err, processor.Release)
		}
		return nil
	})
	if _, err := schema.Finalize(ctx, h.Pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() error {
		if got := r.Gauge("kafkapg_upgrade_window_open"); got != 0 {
			return fmt.Errorf("kafkapg_upgrade_window_open = %v after the window was finalized", got)
		}
		return nil
	})
	k.Produce(t, plain("new2"))
	waitConsumed(t, h, 4)
	var n int
	if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.idempotency_keys WHERE consumer_group = $1`, h.Group).Scan(&n); err != nil || n != 3 {
		t.Errorf("idempotency_keys holds %d keys of the group (%v), want 3 (new1, num1, old1): none written after the window was finalized", n, err)
	}
}
