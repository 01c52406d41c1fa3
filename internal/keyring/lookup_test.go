package keyring

import (
	"github.com/kafkapg/kafkapg/internal/rig/testenv"

	"context"
	"testing"
	"time"
)

// TestLookupFindsWithoutRecording: Lookup finds the keys recorded, in the current generation and
// compacted into runs after a turn, and records none of those it does not find.
func TestLookupFindsWithoutRecording(t *testing.T) {
	t.Parallel()
	pool := testenv.Migrated(t)
	ctx := context.Background()
	k := New("kafkapg")
	recordIn(t, pool, k, "a", "b")
	lookup := func(keys ...string) map[string]bool {
		t.Helper()
		hashes := make([][32]byte, len(keys))
		for i, key := range keys {
			hashes[i] = ringKey(key)
		}
		found, err := k.Lookup(ctx, pool, hashes)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]bool{}
		for _, key := range keys {
			out[key] = found[Short(ringKey(key))]
		}
		return out
	}
	if got := lookup("a", "b", "c"); !got["a"] || !got["b"] || got["c"] {
		t.Errorf("lookup: %v, want a and b found, c not", got)
	}
	if got := recordIn(t, pool, k, "c"); !got["c"] {
		t.Error("a key looked up and not found was recorded by the lookup")
	}
	dueNow(t, pool)
	if _, err := k.Keep(ctx, pool, "g", threeDays, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := k.Compact(ctx, pool, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := lookup("a", "d"); !got["a"] || got["d"] {
		t.Errorf("lookup after a turn and a compaction: %v, want a found, d not", got)
	}
}
