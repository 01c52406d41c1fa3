package processortest_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/processortest"
	"github.com/kafkapg/kafkapg/sink"
)

// batchFunc is a BatchHandler from a function.
type batchFunc func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error

func (f batchFunc) Handle(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
	return f(ctx, tx, []*processor.Record{r})
}
func (f batchFunc) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	return f(ctx, tx, recs)
}

// classified is a handler with its own ErrorClassifier: everything it fails with is permanent.
type classified struct{}

func (classified) Handle(context.Context, pgx.Tx, *processor.Record) error { return errors.New("no") }
func (classified) ClassifyError(error) processor.ErrorClass                { return processor.ClassPermanent }

func TestRunReportsWhatTheProcessorWouldDo(t *testing.T) {
	pool, _ := testenv.Postgres(t)
	if _, err := pool.Exec(context.Background(), `CREATE TABLE orders (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	insert := processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
		_, err := tx.Exec(ctx, `INSERT INTO orders VALUES ($1)`, string(r.Key))
		return err
	})
	rec := processortest.NewRecord("orders", "o-1", "{}")
	for _, tt := range []struct {
		name    string
		h       processor.Handler
		recs    []*processor.Record
		class   processor.ErrorClass
		applied bool
		index   int
		errIs   error
		errHas  string
	}{
		{name: "applied", h: insert, recs: []*processor.Record{rec}, applied: true, index: -1},
		{name: "a plain error is retryable", h: processor.HandlerFunc(func(context.Context, pgx.Tx, *processor.Record) error {
			return errors.New("payment API says 503")
		}), recs: []*processor.Record{rec}, class: processor.ClassRetryable, errHas: "503"},
		{name: "Permanent", h: processor.HandlerFunc(func(context.Context, pgx.Tx, *processor.Record) error {
			return processor.Permanent(errors.New("bad JSON"))
		}), recs: []*processor.Record{rec}, class: processor.ClassPermanent, errHas: "bad JSON"},
		{name: "Infrastructure", h: processor.HandlerFunc(func(context.Context, pgx.Tx, *processor.Record) error {
			return processor.Infrastructure(errors.New("cache down"))
		}), recs: []*processor.Record{rec}, class: processor.ClassInfrastructure},
		{name: "a duplicate key, not caught", h: processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
			tx.Exec(ctx, `INSERT INTO orders VALUES ('dup')`)
			tx.Exec(ctx, `INSERT INTO orders VALUES ('dup')`) // error swallowed
			return nil
		}), recs: []*processor.Record{rec}, class: processor.ClassRetryable, errIs: sink.ErrTxAborted},
		{name: "a panic", h: processor.HandlerFunc(func(context.Context, pgx.Tx, *processor.Record) error {
			panic("nil map")
		}), recs: []*processor.Record{rec}, class: processor.ClassRetryable, errHas: "handler panicked: nil map"},
		{name: "the handler's own timeout", h: processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
			ctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			defer cancel()
			_, err := tx.Exec(ctx, `SELECT pg_sleep(5)`)
			return err
		}), recs: []*processor.Record{rec}, class: processor.ClassRetryable, errIs: sink.ErrConnClosedByHandler},
		{name: "too large", h: insert, recs: []*processor.Record{processortest.NewRecord("orders", "big", strings.Repeat("x", 2<<20))},
			class: processor.ClassPermanent, errIs: processor.ErrRecordTooLarge},
		// MAX_RECORD_BYTES (1 MiB by default) bounds key, value and headers together: a small
		// value with 1.2 MB of headers is too large, 0.9 MB of them is not.
		{name: "too large by its headers", h: insert, recs: []*processor.Record{withHeaders(processortest.NewRecord("orders", "hdr", "{}"), 2, 600<<10)},
			class: processor.ClassPermanent, errIs: processor.ErrRecordTooLarge},
		{name: "headers within the bound", h: insert, recs: []*processor.Record{withHeaders(processortest.NewRecord("orders", "hdr", "{}"), 2, 450<<10)},
			applied: true},
		{name: "an ErrorClassifier decides", h: classified{}, recs: []*processor.Record{rec}, class: processor.ClassPermanent},
		{name: "a batch names its failing record", h: batchFunc(func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
			return processor.RecordFailed(1, processor.Permanent(errors.New("second is bad")))
		}), recs: []*processor.Record{rec, rec, rec}, index: 1, class: processor.ClassPermanent, errHas: "second is bad"},
		{name: "a batch fails as a whole", h: batchFunc(func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
			return errors.New("COPY failed")
		}), recs: []*processor.Record{rec, rec}, index: -1, class: processor.ClassRetryable, errHas: "COPY failed"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			res := processortest.Run(t, pool, tt.h, tt.recs...)
			if res.Applied() != tt.applied {
				t.Fatalf("Run = %v, applied want %v", res, tt.applied)
			}
			if tt.applied {
				return
			}
			if res.Class != tt.class {
				t.Errorf("Run = %v, want class %v", res, tt.class)
			}
			if res.Index != tt.index {
				t.Errorf("Run = %v, want index %d", res, tt.index)
			}
			if tt.errIs != nil && !errors.Is(res.Err, tt.errIs) {
				t.Errorf("Run = %v, want an error that is %v", res, tt.errIs)
			}
			if tt.errHas != "" && !strings.Contains(res.Err.Error(), tt.errHas) {
				t.Errorf("Run = %v, want an error containing %q", res, tt.errHas)
			}
		})
	}
	// Run rolled everything back.
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM orders`).Scan(&n); err != nil || n != 0 {
		t.Errorf("orders has %d rows (%v) after Run, want 0: Run must roll back", n, err)
	}
}

// TestRunInTxShowsTheEffects: in the test's own transaction, the handler's writes can be read
// before rolling back.
func TestRunInTxShowsTheEffects(t *testing.T) {
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE totals (account text PRIMARY KEY, amount bigint)`); err != nil {
		t.Fatal(err)
	}
	add := processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
		_, err := tx.Exec(ctx, `INSERT INTO totals VALUES ($1, length($2)) ON CONFLICT (account) DO UPDATE SET amount = totals.amount + excluded.amount`,
			string(r.Key), string(r.Value))
		return err
	})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	res := processortest.RunInTx(ctx, tx, add, processortest.NewRecord("t", "a", "xx"), processortest.NewRecord("t", "a", "xxx"))
	if !res.Applied() {
		t.Fatal(res)
	}
	var amount int
	if err := tx.QueryRow(ctx, `SELECT amount FROM totals WHERE account = 'a'`).Scan(&amount); err != nil || amount != 5 {
		t.Fatalf("amount = %d (%v), want 5", amount, err)
	}
}

// TestRunShowsTheEmittedEvents: what a handler emits is in the result, with the ids the processor
// would give them (the same on every run), and nothing after a failure.
func TestRunShowsTheEmittedEvents(t *testing.T) {
	pool, _ := testenv.Postgres(t)
	forward := processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
		if string(r.Value) == "bad" {
			_ = r.Emit(ctx, tx, sink.Event{Topic: "out", Value: []byte("never")})
			return processor.Permanent(errors.New("bad"))
		}
		return r.Emit(ctx, tx, sink.Event{Topic: "out", Key: r.Key, Value: r.Value}, sink.Event{Topic: "audit", Value: r.Value})
	})
	rec := processortest.NewRecord("in", "k", "v")
	rec.Offset = 7
	res := processortest.Run(t, pool, forward, rec)
	if !res.Applied() || len(res.Emitted) != 2 || res.Emitted[0].Topic != "out" || res.Emitted[1].Topic != "audit" {
		t.Fatalf("%v, emitted %+v; want two events", res, res.Emitted)
	}
	again := processortest.Run(t, pool, forward, rec)
	if again.Emitted[0].ID != res.Emitted[0].ID || res.Emitted[0].ID == res.Emitted[1].ID || len(res.Emitted[0].ID) != 36 {
		t.Fatalf("ids %q then %q: want stable, distinct UUIDs", []string{res.Emitted[0].ID, res.Emitted[1].ID}, again.Emitted[0].ID)
	}
	if res := processortest.Run(t, pool, forward, processortest.NewRecord("in", "k", "bad")); res.Applied() || res.Emitted != nil {
		t.Fatalf("%v, emitted %+v; want a failure and nothing emitted", res, res.Emitted)
	}
}

// TestCopyFailedNamesTheRecord: a COPY of one row per record that Postgres rejects at one row is
// that record's failure (processor.CopyFailed reads the line from the error), so the processor
// applies the others without splitting the batch; an error of no row stays the batch's.
func TestCopyFailedNamesTheRecord(t *testing.T) {
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE views (url text NOT NULL CHECK (url <> 'bad'))`); err != nil {
		t.Fatal(err)
	}
	copyViews := processor.BatchHandlerFunc(func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
		rows := make([][]any, len(recs))
		for i, r := range recs {
			rows[i] = []any{string(r.Value)}
		}
		_, err := tx.CopyFrom(ctx, pgx.Identifier{"views"}, []string{"url"}, pgx.CopyFromRows(rows))
		return processor.CopyFailed(err)
	})
	var recs []*processor.Record
	for i := range 2000 {
		v := fmt.Sprintf("/page/%d", i)
		if i == 1234 {
			v = "bad"
		}
		recs = append(recs, processortest.NewRecord("views", "", v))
	}
	res := processortest.Run(t, pool, copyViews, recs...)
	if res.Index != 1234 {
		t.Fatalf("%v; want record 1234 named as the failure", res)
	}
	if err := processor.CopyFailed(errors.New("not a COPY error")); err.Error() != "not a COPY error" {
		t.Errorf("CopyFailed changed an error that names no row: %v", err)
	}
	// A batch of one (a record retried alone) works through Handle.
	if res := processortest.Run(t, pool, copyViews, processortest.NewRecord("views", "", "/ok")); !res.Applied() {
		t.Fatal(res)
	}
}

// withHeaders gives r n headers of size bytes each.
func withHeaders(r *processor.Record, n, size int) *processor.Record {
	for i := range n {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: fmt.Sprintf("h%d", i), Value: []byte(strings.Repeat("h", size))})
	}
	return r
}
