package sink_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/pgcluster"
	"github.com/kafkapg/kafkapg/internal/schema"
	"github.com/kafkapg/kafkapg/sink"
)

// TestStreamsForkAtEveryStart (issue 39, cases 1 and 2, suspicion 1): a database that loses
// commits without a new system identifier or timeline — a copy of its data directory started as
// it was — took the numbers past what it kept again, and nothing forked its streams unless a
// partition's worker happened to see its position go back: not a retry tier's worker (it asked to
// fork the tier's streams), not the held records' applier or a replay (they move no position), not
// a processor restarted with the database. The database's identity now includes the server's
// start: the first number taken after a restart or a restore forks the stream, whatever takes
// it, naming the last number kept and since when what was lost was published.
func TestStreamsForkAtEveryStart(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	pool, err := pgxpool.New(ctx, srv.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := schema.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	out, err := sink.NewOutbox(sink.OutboxConfig{Schema: "kafkapg", Group: "g", NoNotify: true,
		Partitions: func(context.Context, string) (int, error) { return 1, nil }})
	if err != nil {
		t.Fatal(err)
	}
	// emit numbers one event in a transaction of its own, as any path does, and returns its
	// stream header.
	offset := int64(0)
	emit := func() sink.Stream {
		t.Helper()
		offset++
		return emitNumbered(t, ctx, pool, out, "e"+string(rune('a'+offset)), offset)
	}
	reconnect := func() {
		t.Helper()
		pool.Reset()
		for range 100 {
			if err := pool.Ping(ctx); err == nil {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatal("the server does not come back")
	}

	one, two := emit(), emit()
	if one.ID != two.ID || two.Seq != 2 || !two.IsRoot() {
		t.Fatalf("two events of one database history: %+v, %+v; want numbers 1 and 2 of one stream", one, two)
	}
	// A plain restart: nothing lost, a fork all the same (it cannot be told from a copy started as
	// it was), at the last number taken.
	if err := srv.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(ctx); err != nil {
		t.Fatal(err)
	}
	reconnect()
	three := emit()
	if three.Parent != one.ID || three.ForkSeq != 2 || three.Seq != 1 || three.Since.IsZero() {
		t.Fatalf("after a restart: %+v; want a fork of %x at 2", three, one.ID)
	}
	// A copy of the data directory taken now, then three more numbers taken, then the copy
	// started in the server's place: the same system identifier and timeline, the last three
	// numbers lost. The next number forks the stream the copy kept at 1.
	snap, err := srv.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		emit()
	}
	if err := srv.Restore(ctx, snap); err != nil {
		t.Fatal(err)
	}
	reconnect()
	after := emit()
	if after.Parent != three.ID || after.ForkSeq != 1 || after.Seq != 1 {
		t.Fatalf("after a restore of a copy: %+v; want a fork of %x at 1 (what the copy kept)", after, three.ID)
	}
	if after.Since.Before(three.Since) {
		t.Errorf("the fork's Since %v is before its parent's own fork's (%v): what the copy lost was published after the copy", after.Since, three.Since)
	}
}

// emitNumbered emits one event (id, from source offset orders[0]@offset) in a transaction of its
// own, as any path does, and returns the stream header the outbox gave it.
func emitNumbered(t *testing.T, ctx context.Context, pool *pgxpool.Pool, out *sink.Outbox, id string, offset int64) sink.Stream {
	t.Helper()
	var st sink.Stream
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := out.Emit(ctx, tx, sink.Event{Topic: "events", Key: []byte("k"), ID: id,
			Source: &sink.Source{Topic: "orders", Partition: 0, Offset: offset}}); err != nil {
			return err
		}
		var keys, values [][]byte
		if err := tx.QueryRow(ctx, `SELECT header_keys, header_values FROM kafkapg.outbox ORDER BY id DESC LIMIT 1`).Scan(&keys, &values); err != nil {
			return err
		}
		var hs []kgo.RecordHeader
		for i := range keys {
			hs = append(hs, kgo.RecordHeader{Key: string(keys[i]), Value: values[i]})
		}
		var ok bool
		if st, ok = sink.ParseStream(hs); !ok {
			return fmt.Errorf("the event has no stream header: %v", hs)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return st
}
