package sink_test

import (
	"context"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/sink"
)

func setup(t *testing.T) (*pgxpool.Pool, *sink.Sink, offsets.Position) {
	t.Helper()
	pool := testenv.Migrated(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (id int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	store := offsets.NewStore("kafkapg", "g")
	pos, err := store.Claim(ctx, pool, "test", []offsets.Partition{{Topic: "t", Partition: 0}})
	if err != nil {
		t.Fatal(err)
	}
	return pool, sink.New(pool, store, sink.Config{Schema: "kafkapg", TxIdleTimeout: time.Second}), pos[0]
}

func insert(id int) func(context.Context, pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, id)
		return err
	}
}

func count(t *testing.T, pool *pgxpool.Pool, table string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

var dead = []sink.Message{{Topic: "t.g.dlq", Key: []byte("k"), Value: []byte("v"),
	Headers: []kgo.RecordHeader{{Key: "h", Value: []byte("1")}, {Key: "null", Value: nil}}}}

func TestApplyCommitsEffectsOffsetAndOutboxTogether(t *testing.T) {
	t.Parallel()
	pool, s, pos := setup(t)
	ctx := context.Background()
	if err := s.Apply(ctx, pos, 10, insert(1), dead); err != nil {
		t.Fatal(err)
	}
	if got := count(t, pool, "effects"); got != 1 {
		t.Fatalf("effects: %d rows, want 1", got)
	}
	if got := count(t, pool, "kafkapg.outbox"); got != 1 {
		t.Fatalf("outbox: %d rows, want 1", got)
	}
	stored, _ := s.Offsets().Load(ctx, pool, pos.TP())
	if !stored.Known || stored.Next != 10 {
		t.Fatalf("stored offset %+v, want 10", stored)
	}
	var keys, vals [][]byte
	if err := pool.QueryRow(ctx, `SELECT header_keys, header_values FROM kafkapg.outbox`).Scan(&keys, &vals); err != nil {
		t.Fatal(err)
	}
	if len(keys) != 2 || string(keys[1]) != "null" || vals[1] != nil || string(vals[0]) != "1" {
		t.Fatalf("headers stored as %q %q", keys, vals)
	}
}

func TestApplyRollsBackEverythingOnHandlerError(t *testing.T) {
	t.Parallel()
	pool, s, pos := setup(t)
	ctx := context.Background()
	boom := errors.New("boom")
	err := s.Apply(ctx, pos, 10, func(ctx context.Context, tx pgx.Tx) error {
		if err := insert(1)(ctx, tx); err != nil {
			return err
		}
		return boom
	}, dead)
	var herr *sink.HandlerError
	if !errors.As(err, &herr) || !errors.Is(err, boom) {
		t.Fatalf("err = %v, want a HandlerError wrapping boom", err)
	}
	if count(t, pool, "effects") != 0 || count(t, pool, "kafkapg.outbox") != 0 {
		t.Fatal("a failed Apply left effects or outbox rows behind")
	}
	if stored, _ := s.Offsets().Load(ctx, pool, pos.TP()); stored.Known {
		t.Fatalf("a failed Apply moved the offset to %d", stored.Next)
	}
}

func TestApplyRetriedAfterUnknownCommitDoesNotReapply(t *testing.T) {
	t.Parallel()
	pool, s, pos := setup(t)
	ctx := context.Background()
	if err := s.Apply(ctx, pos, 10, insert(1), nil); err != nil {
		t.Fatal(err)
	}
	// The worker did not hear back from COMMIT and retries with the same arguments.
	ran := false
	err := s.Apply(ctx, pos, 10, func(context.Context, pgx.Tx) error { ran = true; return nil }, dead)
	if !errors.Is(err, offsets.ErrAlreadyAdvanced) {
		t.Fatalf("retried Apply: err = %v, want ErrAlreadyAdvanced", err)
	}
	if ran {
		t.Fatal("the handler ran again for a batch that was already committed")
	}
	if count(t, pool, "kafkapg.outbox") != 0 {
		t.Fatal("the retried Apply stored outbox rows")
	}
}

func TestApplyReportsLostConnection(t *testing.T) {
	t.Parallel()
	pool, _, pos := setup(t)
	ctx := context.Background()
	// The sink's connections go through a proxy the test cuts while the handler runs: the
	// handler's next statement fails with a network error, not with anything the server said.
	u, err := url.Parse(pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewProxy(t, u.Host)
	u.Host = proxy.Addr()
	cut, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer cut.Close()
	s := sink.New(cut, offsets.NewStore("kafkapg", "g"), sink.Config{Schema: "kafkapg"})
	err = s.Apply(ctx, pos, 10, func(ctx context.Context, tx pgx.Tx) error {
		proxy.Cut()
		return insert(1)(ctx, tx)
	}, nil)
	if !errors.Is(err, sink.ErrConnLost) {
		t.Fatalf("err = %v, want ErrConnLost", err)
	}
	if count(t, pool, "effects") != 0 {
		t.Fatal("effects committed although the connection died")
	}
}

func TestApplyReportsWhatTheServerSaid(t *testing.T) {
	t.Parallel()
	pool, s, pos := setup(t)
	ctx := context.Background()
	err := s.Apply(ctx, pos, 10, func(ctx context.Context, tx pgx.Tx) error {
		// Another session ends ours, as an operator or a failover would; the server says so.
		if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, tx.Conn().PgConn().PID()); err != nil {
			return err
		}
		return insert(1)(ctx, tx)
	}, nil)
	var herr *sink.HandlerError
	var pgErr *pgconn.PgError
	if !errors.As(err, &herr) || !errors.As(err, &pgErr) || pgErr.Code != "57P01" {
		t.Fatalf("err = %v, want a HandlerError carrying the server's 57P01 (admin shutdown)", err)
	}
	if count(t, pool, "effects") != 0 {
		t.Fatal("effects committed although the session was terminated")
	}
}

func TestApplyIdleTimeoutEndsStalledTransaction(t *testing.T) {
	t.Parallel()
	pool, s, pos := setup(t)
	ctx := context.Background()
	err := s.Apply(ctx, pos, 10, func(ctx context.Context, tx pgx.Tx) error {
		time.Sleep(1500 * time.Millisecond) // longer than TxIdleTimeout (1s)
		return insert(1)(ctx, tx)
	}, nil)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "25P03" {
		t.Fatalf("err = %v, want the server's 25P03 (idle in transaction timeout)", err)
	}
	if count(t, pool, "effects") != 0 {
		t.Fatal("effects committed by a transaction Postgres had ended")
	}
}
