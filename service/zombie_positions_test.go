package service

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
)

// stuckOnceHandler (HANDLER=stuck-once, in the child processes only) records each record it
// applies in the table applications, and, the first time it meets the offset
// KAFKAPG_TEST_STUCK_OFFSET, touches the file KAFKAPG_TEST_STUCK_FILE and sleeps 8 s inside the
// transaction, without looking at its context.
var stuckOnceHandler = Handler{Name: "stuck-once", Handler: processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	if f := os.Getenv("KAFKAPG_TEST_STUCK_FILE"); f != "" && os.Getenv("KAFKAPG_TEST_STUCK_OFFSET") == strconv.FormatInt(rec.Offset, 10) {
		if _, err := os.Stat(f); errors.Is(err, os.ErrNotExist) {
			os.WriteFile(f, nil, 0o644)
			time.Sleep(8 * time.Second)
		}
	}
	_, err := tx.Exec(ctx, `INSERT INTO applications ("offset") VALUES ($1)`, rec.Offset)
	return err
})}

// TestPositionSetPastAFrozenOwner: an owner frozen (SIGSTOP) in the middle of a batch holds its
// partition's offsets row; an operator sets the position forward meanwhile. The set waits for
// the row until Postgres ends the frozen owner's transaction (DB_TX_IDLE_TIMEOUT), then commits;
// the owner, thawed, applies nothing of its batch (its transaction is gone, and its next try
// finds the position set) and goes on from the new position. The skipped offsets are never
// applied.
func TestPositionSetPastAFrozenOwner(t *testing.T) {
	ctx := context.Background()
	h := testkit.New(t, testenv.NewKfake(t), 1)
	if _, err := h.Pool.Exec(ctx, `CREATE TABLE applications (id bigserial PRIMARY KEY, "offset" bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	stuck := t.TempDir() + "/stuck"
	c := h.StartChild("HANDLER=stuck-once", "KAFKAPG_TEST_STUCK_OFFSET=5", "KAFKAPG_TEST_STUCK_FILE="+stuck,
		"DB_TX_IDLE_TIMEOUT=3s", "BATCH_MAX_RECORDS=1")
	c.WaitReady(t)
	recs := make([]*kgo.Record, 10)
	for i := range recs {
		recs[i] = &kgo.Record{Topic: h.Topic, Key: []byte{byte('a' + i)}, Value: []byte("v")}
	}
	h.K.Produce(t, recs...)
	testenv.Eventually(t, 30*time.Second, func() error {
		_, err := os.Stat(stuck)
		return err
	})
	c.Signal(syscall.SIGSTOP) // frozen inside offset 5's transaction, which holds the row

	kc := h.K.Client(t)
	o := ops.New(h.Pool, "kafkapg", h.Group)
	to := int64(8)
	start := time.Now()
	moves, err := o.SetPositions(ctx, kc, ops.PositionPlan{Topic: h.Topic, Partition: 0, Target: ops.Target{Offset: &to}}, true,
		ops.Actor{Name: "test", Reason: "skip past a frozen owner"})
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the set waited %v for the frozen owner's row", took.Round(time.Millisecond))
	if len(moves) != 1 || moves[0].From == nil || *moves[0].From != 5 || moves[0].Skipped != 3 {
		t.Fatalf("moves %+v: want 5 -> 8, 3 skipped (the frozen batch did not commit)", moves)
	}
	// The frozen transaction went idle when its handler began to sleep (the file's time); Postgres
	// ends it 3 s later, and the set cannot commit before.
	fi, err := os.Stat(stuck)
	if err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(fi.ModTime()) - time.Since(start.Add(took)); waited < 2500*time.Millisecond {
		t.Errorf("the set committed %v after the frozen owner's handler began to sleep: it cannot have waited for its transaction (DB_TX_IDLE_TIMEOUT=3s)", waited)
	}

	c.Signal(syscall.SIGCONT)
	applied := func() []int64 {
		rows, _ := h.Pool.Query(ctx, `SELECT "offset" FROM applications ORDER BY id`)
		out, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	want := []int64{0, 1, 2, 3, 4, 8, 9}
	testenv.Eventually(t, 30*time.Second, func() error {
		if got := applied(); !slices.Equal(got, want) {
			return fmt.Errorf("applied %v, want %v", got, want)
		}
		return nil
	})
	time.Sleep(2 * time.Second) // the thawed handler's sleep ends meanwhile: nothing more
	if got := applied(); !slices.Equal(got, want) {
		t.Fatalf("applied %v after the frozen owner's handler returned, want %v", got, want)
	}
}
