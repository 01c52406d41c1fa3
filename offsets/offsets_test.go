package offsets_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/offsets"
)

func setup(t testing.TB) (*pgxpool.Pool, *offsets.Store) {
	t.Helper()
	return testenv.Migrated(t), offsets.NewStore("kafkapg", "g1")
}

func advance(t *testing.T, pool *pgxpool.Pool, s *offsets.Store, pos offsets.Position, next int64) error {
	t.Helper()
	return pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		return s.Advance(context.Background(), tx, pos, next)
	})
}

func TestClaimBumpsTokenAndKeepsOffset(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	parts := []offsets.Partition{{Topic: "a", Partition: 1}, {Topic: "a", Partition: 0}}

	first, err := s.Claim(ctx, pool, "A", parts)
	if err != nil {
		t.Fatal(err)
	}
	for i, pos := range first {
		if pos.Known || pos.Token != 1 || pos.TP() != parts[i] {
			t.Fatalf("first claim %d = %+v, want unknown position, token 1, %v", i, pos, parts[i])
		}
	}
	if err := advance(t, pool, s, first[0], 42); err != nil {
		t.Fatal(err)
	}

	second, err := s.Claim(ctx, pool, "B", parts[:1])
	if err != nil {
		t.Fatal(err)
	}
	if got := second[0]; !got.Known || got.Next != 42 || got.Token != 2 {
		t.Fatalf("second claim = %+v, want next 42, token 2", got)
	}
}

func TestAdvanceFencesStaleOwner(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	tp := []offsets.Partition{{Topic: "a", Partition: 0}}

	a, _ := s.Claim(ctx, pool, "A", tp)
	if err := advance(t, pool, s, a[0], 10); err != nil {
		t.Fatal(err)
	}
	posA := a[0].Advanced(10)
	b, _ := s.Claim(ctx, pool, "B", tp)

	// A is now a zombie: its next transaction must fail and leave the row as B found it.
	if err := advance(t, pool, s, posA, 20); !errors.Is(err, offsets.ErrFenced) {
		t.Fatalf("stale owner's advance: err = %v, want ErrFenced", err)
	}
	if err := advance(t, pool, s, b[0], 15); err != nil {
		t.Fatalf("new owner's advance: %v", err)
	}
	got, err := s.Load(ctx, pool, tp[0])
	if err != nil || got.Next != 15 || got.Token != b[0].Token {
		t.Fatalf("stored %+v, %v; want next 15 with B's token", got, err)
	}
}

func TestAdvanceResolvesUnknownCommit(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	pos, _ := s.Claim(ctx, pool, "A", []offsets.Partition{{Topic: "a", Partition: 0}})
	if err := advance(t, pool, s, pos[0], 5); err != nil {
		t.Fatal(err)
	}
	// The worker did not learn that the commit above succeeded and retries the same advance.
	if err := advance(t, pool, s, pos[0], 5); !errors.Is(err, offsets.ErrAlreadyAdvanced) {
		t.Fatalf("retried advance: err = %v, want ErrAlreadyAdvanced", err)
	}
	// A different target from a stale position: the stored position moved under its owner.
	if err := advance(t, pool, s, pos[0], 7); !errors.Is(err, offsets.ErrMoved) || errors.Is(err, offsets.ErrFenced) {
		t.Fatalf("advance from a stale position: err = %v, want ErrMoved", err)
	}
}

// TestAdvanceTellsALostClaimFromAnotherOwner: a database that lost an owner's claim (a lower
// token) or the partition's row moved under the owner (ErrMoved: it starts again from the stored
// position); only a higher token is another owner's claim (ErrFenced).
func TestAdvanceTellsALostClaimFromAnotherOwner(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	parts := []offsets.Partition{{Topic: "a", Partition: 0}}
	s.Claim(ctx, pool, "A", parts)
	pos, _ := s.Claim(ctx, pool, "A", parts) // token 2
	if err := advance(t, pool, s, pos[0], 5); err != nil {
		t.Fatal(err)
	}
	mine := pos[0].Advanced(5)
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.offsets SET owner_token = 1`); err != nil {
		t.Fatal(err)
	}
	if err := advance(t, pool, s, mine, 6); !errors.Is(err, offsets.ErrMoved) {
		t.Errorf("a lost claim: err = %v, want ErrMoved", err)
	}
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.offsets SET owner_token = 3`); err != nil {
		t.Fatal(err)
	}
	if err := advance(t, pool, s, mine, 6); !errors.Is(err, offsets.ErrFenced) {
		t.Errorf("another owner's claim: err = %v, want ErrFenced", err)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM kafkapg.offsets`); err != nil {
		t.Fatal(err)
	}
	if err := advance(t, pool, s, mine, 6); !errors.Is(err, offsets.ErrMoved) {
		t.Errorf("a lost row: err = %v, want ErrMoved", err)
	}
}

// TestClaimWaitsForInFlightTransaction walks through the race in the package doc: the old
// owner's transaction holds the row; the new owner's claim waits for it and then sees its commit.
func TestClaimWaitsForInFlightTransaction(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	tp := []offsets.Partition{{Topic: "a", Partition: 0}}
	a, _ := s.Claim(ctx, pool, "A", tp)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Advance(ctx, tx, a[0], 100); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var claimed []offsets.Position
	var claimErr error
	wg.Go(func() { claimed, claimErr = s.Claim(ctx, pool, "B", tp) })

	// The claim cannot finish while A's transaction is open.
	testenv.Eventually(t, 10e9, func() error {
		var waiting bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO%offsets%')`).Scan(&waiting)
		if err != nil {
			return err
		}
		if !waiting {
			return fmt.Errorf("claim is not waiting on the row lock yet")
		}
		return nil
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if claimErr != nil {
		t.Fatal(claimErr)
	}
	if !claimed[0].Known || claimed[0].Next != 100 {
		t.Fatalf("claim after A's commit = %+v, want next 100", claimed[0])
	}
}
