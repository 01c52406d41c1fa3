package offsets_test

import (
	"context"
	"errors"
	"testing"

	"github.com/kafkapg/kafkapg/offsets"
)

// TestReclaimFencesEveryEarlierOwner (issue 39, S2): after the database lost an owner's claim, the
// owner claims again above its own token, so that the previous owner, whose token the row holds
// again, stays fenced; a partition claimed by another owner since is left to it; a lost row is
// claimed again above the owner's token too.
func TestReclaimFencesEveryEarlierOwner(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	tp := []offsets.Partition{{Topic: "a", Partition: 0}}

	z, _ := s.Claim(ctx, pool, "Z", tp)
	if err := advance(t, pool, s, z[0], 10); err != nil {
		t.Fatal(err)
	}
	zombie := z[0].Advanced(10)
	a, _ := s.Claim(ctx, pool, "A", tp)
	mine := a[0]
	// The database loses A's claim (an asynchronous failover): the row is as Z left it.
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.offsets SET owner_token = $1`, zombie.Token); err != nil {
		t.Fatal(err)
	}
	if err := advance(t, pool, s, mine, 11); !errors.Is(err, offsets.ErrMoved) {
		t.Fatalf("A's advance after the lost claim: err = %v, want ErrMoved", err)
	}
	again, err := s.Reclaim(ctx, pool, "A", mine, 0)
	if err != nil {
		t.Fatal(err)
	}
	if again.Token <= mine.Token || !again.Known || again.Next != 10 {
		t.Fatalf("claimed again: %+v; want the stored next offset 10 and a token above A's %d", again, mine.Token)
	}
	if err := advance(t, pool, s, zombie, 11); !errors.Is(err, offsets.ErrFenced) {
		t.Fatalf("the zombie's advance after A claimed again: err = %v, want ErrFenced", err)
	}
	if err := advance(t, pool, s, again, 11); err != nil {
		t.Fatalf("A's advance with its new claim: %v", err)
	}

	// Another owner claimed it since: A's claim again fails, and leaves the row alone.
	b, _ := s.Claim(ctx, pool, "B", tp)
	if _, err := s.Reclaim(ctx, pool, "A", again.Advanced(11), 0); !errors.Is(err, offsets.ErrFenced) {
		t.Fatalf("claim again over another owner's claim: err = %v, want ErrFenced", err)
	}
	if got, err := s.Load(ctx, pool, tp[0]); err != nil || got.Token != b[0].Token {
		t.Fatalf("stored %+v, %v; want B's token %d", got, err, b[0].Token)
	}

	// The row lost: claimed again above B's token, at the floor if that is higher.
	if _, err := pool.Exec(ctx, `DELETE FROM kafkapg.offsets`); err != nil {
		t.Fatal(err)
	}
	got, err := s.Reclaim(ctx, pool, "B", b[0], offsets.TokenFloor(7))
	if err != nil {
		t.Fatal(err)
	}
	if got.Token != offsets.TokenFloor(7) || got.Known {
		t.Fatalf("claimed a lost row again: %+v; want token %d and no position", got, offsets.TokenFloor(7))
	}
}

// TestLaterGenerationsClaimAboveEarlierOnes (issue 39, S2): the walk-through of TokenFloor. A
// (generation 1) owned the partition and froze; B (generation 2) claimed it; the database then
// lost both claims. A, waking, finds its claim lost and claims again: its token stays below B's,
// so the two never share one. B then finds its own claim lost, claims again above A's, and A is
// fenced.
func TestLaterGenerationsClaimAboveEarlierOnes(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	ctx := context.Background()
	tp := []offsets.Partition{{Topic: "a", Partition: 0}}

	a, err := s.ClaimAbove(ctx, pool, "A", offsets.TokenFloor(1), tp)
	if err != nil {
		t.Fatal(err)
	}
	if a[0].Token != offsets.TokenFloor(1) {
		t.Fatalf("A's claim: token %d, want generation 1's floor %d", a[0].Token, offsets.TokenFloor(1))
	}
	b, _ := s.ClaimAbove(ctx, pool, "B", offsets.TokenFloor(2), tp)
	if b[0].Token != offsets.TokenFloor(2) {
		t.Fatalf("B's claim: token %d, want generation 2's floor %d", b[0].Token, offsets.TokenFloor(2))
	}
	// Both claims lost: the row holds a token from before them.
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.offsets SET owner_token = 5`); err != nil {
		t.Fatal(err)
	}
	aAgain, err := s.Reclaim(ctx, pool, "A", a[0], offsets.TokenFloor(1))
	if err != nil {
		t.Fatal(err)
	}
	if aAgain.Token >= b[0].Token {
		t.Fatalf("A (generation 1) claimed again with token %d, not below B's %d", aAgain.Token, b[0].Token)
	}
	if err := advance(t, pool, s, b[0], 3); !errors.Is(err, offsets.ErrMoved) {
		t.Fatalf("B's advance: err = %v, want ErrMoved (its claim lost)", err)
	}
	bAgain, err := s.Reclaim(ctx, pool, "B", b[0], offsets.TokenFloor(2))
	if err != nil {
		t.Fatal(err)
	}
	if err := advance(t, pool, s, aAgain, 3); !errors.Is(err, offsets.ErrFenced) {
		t.Fatalf("A's advance after B claimed again: err = %v, want ErrFenced", err)
	}
	if err := advance(t, pool, s, bAgain, 3); err != nil {
		t.Fatalf("B's advance: %v", err)
	}
	// A claim never goes down: a lower floor than the stored token bumps it by one.
	c, _ := s.ClaimAbove(ctx, pool, "C", offsets.TokenFloor(1), tp)
	if c[0].Token != bAgain.Token+1 {
		t.Fatalf("claim with a floor below the stored token: token %d, want %d", c[0].Token, bAgain.Token+1)
	}
}
