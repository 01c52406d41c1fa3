package sink_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
	"github.com/kafkapg/kafkapg/sink"
)

// TestEventsAreKeyedWhileTheReleaseBeforeMayHaveEmitted: a process of the release before emits
// events unnumbered; if its database loses that commit, this release emits the event again,
// numbered, in a stream no consumer saw it in. So events are numbered Keyed (decided by key as
// well downstream) while the schema's upgrade window is open, and for a retention after it is
// finalized (the group's window of keys), and not otherwise.
func TestEventsAreKeyedWhileTheReleaseBeforeMayHaveEmitted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.Migrated(t)
	out, err := sink.NewOutbox(sink.OutboxConfig{Schema: "kafkapg", Group: "g", NoNotify: true,
		Partitions: func(context.Context, string) (int, error) { return 1, nil }})
	if err != nil {
		t.Fatal(err)
	}
	offset := int64(0)
	keyed := func() bool {
		t.Helper()
		offset++
		return emitNumbered(t, ctx, pool, out, fmt.Sprint("e", offset), offset).Keyed
	}
	exec := func(sql string) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}

	if keyed() {
		t.Error("an event of a schema created by this release (no window, no release before) is Keyed")
	}
	// The window open: the newest migration pending, as if the release before had run.
	exec(`WITH m AS (DELETE FROM kafkapg.schema_migrations WHERE version = (SELECT max(version) FROM kafkapg.schema_migrations) RETURNING *)
		INSERT INTO kafkapg.schema_migrations_pending SELECT * FROM m`)
	if !keyed() {
		t.Error("an event numbered while the upgrade window is open is not Keyed")
	}
	if _, err := schema.Finalize(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	if !keyed() {
		t.Error("an event numbered right after finalizing is not Keyed (the release before's copies may still come for a retention)")
	}
	exec(`UPDATE kafkapg.idempotency_groups SET keys_all_until = now() - interval '1 second' WHERE consumer_group = 'g'`)
	if keyed() {
		t.Error("an event numbered a retention after finalizing is Keyed")
	}
	exec(`UPDATE kafkapg.idempotency_groups SET keys_all_until = now() + interval '1 hour' WHERE consumer_group = 'other'`)
	if keyed() {
		t.Error("another group's window of keys made this group's events Keyed")
	}
}
