package streams

import (
	"testing"
	"time"
)

// The counterexamples TestProtocol found while the rules were written, shrunk, each as the calls
// of its history that matter; each failed before the rule it names.

func ev(stream, seq, src, offset int64, parent, forkSeq int64) Event {
	e := Event{Header: Header{Stream: ID{byte(stream)}, Seq: seq, Root: ID{0xee}, Src: src}, Offset: offset}
	if forkSeq > 0 {
		e.Parent, e.ForkSeq, e.Since = ID{byte(parent)}, forkSeq, time.UnixMilli(1)
	}
	return e
}

// observe has the partition's worker pass e as a batch of its own, preparing it if it must.
func observe(t *testing.T, l *Lineage, e Event, sinceOffset int64) (readBack bool) {
	t.Helper()
	if l.NeedsPrepare(e, true) {
		return l.Prepare(e, e.Offset, sinceOffset, true)
	}
	l.Observe(e)
	return false
}

func mustDecide(t *testing.T, l *Lineage, e Event, keyAll bool, want Verdict) {
	t.Helper()
	if got := l.Decide(e, keyAll); got != want {
		t.Fatalf("Decide(stream %d number %d) = %s, want %s", e.Stream[0], e.Seq, got, want)
	}
}

// TestRegressionResumedBranchReadsBackTheNewer: a copy of the database restored after another
// (an operator's second restore) publishes X's number 3 after Y, a fork of X at 2, applied its
// own 1 by number: both may be the same event. X's 3 raises Y's horizon, and Y's events applied
// by number up to it are read back for their keys before X's 3 is decided (by key, then: a copy).
func TestRegressionResumedBranchReadsBackTheNewer(t *testing.T) {
	l := &Lineage{Root: ID{0xee}}
	x1, x2 := ev(1, 1, 10, 0, 0, 0), ev(1, 2, 20, 1, 0, 0)
	for _, e := range []Event{x1, x2} {
		observe(t, l, e, 0)
		mustDecide(t, l, e, false, Apply)
		l.Done(e, false)
	}
	y1 := ev(2, 1, 30, 2, 1, 2) // nothing lost: Y forks X at its last number
	if observe(t, l, y1, 0) {
		t.Fatal("a fork at the parent's last number read back; nothing it may repeat was applied")
	}
	mustDecide(t, l, y1, false, Apply)
	l.Done(y1, false)
	x3 := ev(1, 3, 30, 3, 0, 0)
	if !l.NeedsPrepare(x3, true) || !l.Prepare(x3, 3, 0, true) {
		t.Fatal("X's 3, past what Y keeps of X, raised no read back of Y's applied events")
	}
	mustDecide(t, l, x3, false, Wait)
	if !l.ReadBackRecord(y1) {
		t.Fatal("the read back does not ask for the key of Y's 1, applied by number, from a source offset X's 3 has too")
	}
	l.ReadBackDone()
	mustDecide(t, l, x3, false, ByKey)
}

// TestRegressionUnobservedWaitsForTheReadBack: a dead letter of a release before, of a stream the
// worker never observed, must wait for a read back pending in its lineage like any other record:
// it was decided by key at once, before the read back recorded the key of its repeat.
func TestRegressionUnobservedWaitsForTheReadBack(t *testing.T) {
	l := &Lineage{Root: ID{0xee}}
	z1 := ev(5, 1, 0, 12, 0, 0)
	observe(t, l, z1, 0)
	mustDecide(t, l, z1, false, Apply)
	l.Done(z1, false)
	old := ev(1, 3, 0, 1, 0, 0) // never observed: offset 1, before the upgrade
	if !l.NeedsPrepare(old, false) || !l.Prepare(old, 13, 0, false) {
		t.Fatal("the unobserved event raised no read back of stream 5's, which may repeat it")
	}
	mustDecide(t, l, old, true, Wait)
}

// TestRegressionLongerChainRaisesKeyedAbove: a fork Z of Y registered before Y (Y's first record
// published late) counts X as not kept (-1): X's applied numbers are keyed from then on. Y's
// registration then lengthens Z's chain, X's 3 is kept again and applied by number, unkeyed: a
// stream W created again later must read it back.
func TestRegressionLongerChainRaisesKeyedAbove(t *testing.T) {
	l := &Lineage{Root: ID{0xee}}
	x1 := ev(1, 1, 10, 0, 0, 0)
	observe(t, l, x1, 0)
	l.Done(x1, false)
	if !observe(t, l, ev(3, 1, 20, 1, 2, 2), 0) { // Z, a fork of Y (unknown yet) at 2
		t.Fatal("Z may repeat X's 1 (its chain is unknown past Y), applied by number: no read back")
	}
	if !l.ReadBackRecord(x1) {
		t.Fatal("the read back does not ask for X's 1")
	}
	l.ReadBackDone()
	observe(t, l, ev(2, 1, 15, 2, 1, 4), 0) // Y, a fork of X at 4
	x3 := ev(1, 3, 30, 3, 0, 0)
	observe(t, l, x3, 0)
	mustDecide(t, l, x3, false, Apply)
	l.Done(x3, false)
	if !observe(t, l, ev(4, 1, 10, 4, 0, 0), 0) { // W, created again: it may repeat any of X's
		t.Fatal("W registered with no read back of X's 3, applied by number after X's numbers were said to be keyed")
	}
}

// TestRegressionUnobservedCountsInANewStreamsHorizon: a dead letter of a release before, of a
// stream the worker never observed, replayed (decided by key); then the database upstream, restored,
// creates the stream again and repeats it: the new stream's horizon must cover what the unobserved
// one was seen to carry, or the repeat is applied by number, a second time.
func TestRegressionUnobservedCountsInANewStreamsHorizon(t *testing.T) {
	l := &Lineage{Root: ID{0xee}}
	old := ev(1, 3, 0, 1, 0, 0)
	if l.NeedsPrepare(old, false) {
		l.Prepare(old, 2, 0, false)
	}
	mustDecide(t, l, old, true, ByKey)
	l.Done(old, true)
	again := ev(2, 1, 0, 5, 0, 0) // created again: the same source record
	observe(t, l, again, 0)
	mustDecide(t, l, again, false, ByKey)
}

// TestRegressionLateParentKeysItsFork: Y, a fork of X at 4, is observed first (X's numbers were
// all still in the restored outbox, or in a late relay's hands) and applies its 5 by number; then
// X's 5, lost by Y's database, is X's first record observed: the same source record. Registering
// X after its fork must raise Y's horizon and read Y's 5 back for its key before X's 5 is decided
// by key; it registered X and decided X's 5 by key against no recorded key: applied twice. Found
// reading the rules for the pruning of idle streams (a pruned parent is registered again the same
// way), not by TestProtocol, whose upstream rarely publishes a whole parent after its fork.
func TestRegressionLateParentKeysItsFork(t *testing.T) {
	l := &Lineage{Root: ID{0xee}}
	y5 := ev(2, 5, 10, 0, 1, 4)
	observe(t, l, y5, 0)
	mustDecide(t, l, y5, false, Apply)
	l.Done(y5, false)
	x5 := ev(1, 5, 10, 1, 0, 0)
	if !observe(t, l, x5, 0) {
		t.Fatal("X registered after Y with no read back of Y's 5, applied by number from the same source offset")
	}
	mustDecide(t, l, x5, false, Wait)
	if !l.ReadBackRecord(y5) {
		t.Fatal("the read back does not ask for Y's 5")
	}
	l.ReadBackDone()
	mustDecide(t, l, x5, false, ByKey)
}

// TestRegressionRegisteredUnobservedKeepsWhatWasSeen: X's 4 (source offset 2), never observed
// (a dead letter of a release before, or a retry of a stream forgotten), is decided by key; then
// the worker observes X's 2 and registers X. A stream created again after it that repeats X's
// events must count X's 4 in its horizon: registering X dropped what the other path had seen of
// it, and the repeat of source offset 2 was applied by number, a second time.
func TestRegressionRegisteredUnobservedKeepsWhatWasSeen(t *testing.T) {
	l := &Lineage{Root: ID{0xee}}
	x4 := ev(1, 4, 2, 0, 0, 0)
	if !l.NeedsPrepare(x4, false) {
		t.Fatal("an unobserved stream's record needs no preparing")
	}
	l.Prepare(x4, 1, 0, false)
	mustDecide(t, l, x4, false, ByKey)
	l.Done(x4, true)
	x2 := ev(1, 2, 1, 3, 0, 0)
	observe(t, l, x2, 0)
	again := ev(2, 3, 2, 5, 0, 0) // created again: X's source offset 2 once more
	observe(t, l, again, 0)
	mustDecide(t, l, again, false, ByKey)
}

// TestRegressionForgottenStreamBeforeItsFirst: X's 2 went to a retry tier; X was forgotten (a
// retention without a record of it met) and registered again from X's 1, published late at a
// later offset. The retry of X's 2 comes from before X's first offset now: no read back covers
// it, so it is decided by key (it was applied by number: a newer stream's read back, from X's
// first offset, missed it and its repeat was applied too).
func TestRegressionForgottenStreamBeforeItsFirst(t *testing.T) {
	l := &Lineage{Root: ID{0xee}}
	now := time.Unix(1_700_000_000, 0)
	x2 := ev(1, 2, 1, 0, 0, 0)
	observe(t, l, x2, 0) // then to a retry tier
	l.Forget(now, 24*time.Hour)
	if n := l.Forget(now.Add(25*time.Hour), 24*time.Hour); n != 1 || !l.Empty() {
		t.Fatalf("Forget dropped %d streams after a retention without a record; the lineage keeps %d", n, len(l.Streams))
	}
	observe(t, l, ev(1, 1, 0, 5, 0, 0), 0)
	mustDecide(t, l, x2, false, ByKey)
}

// TestForget: a stream met is stamped and kept; one not met for the retention is dropped (its
// fork still knows from its own header what it keeps of it); nothing is
// dropped while a read back is pending, nor with no retention; a row from before Touched counts
// from its first Forget.
func TestForget(t *testing.T) {
	day := 24 * time.Hour
	now := time.Unix(1_700_000_000, 0)
	l := &Lineage{Root: ID{0xee}}
	x1 := ev(1, 1, 10, 0, 0, 0)
	observe(t, l, x1, 0)
	l.Done(x1, false)
	l.Streams[0].Touched = 0 // written before Touched
	l.Forget(now, day)
	if got := l.Streams[0].Touched; got != now.Unix() {
		t.Fatalf("a stream without Touched was stamped %d, want %d", got, now.Unix())
	}
	y1 := ev(2, 1, 20, 1, 1, 1)
	observe(t, l, y1, 0)
	l.Done(y1, false)
	l.Forget(now.Add(12*time.Hour), day) // Y met: stamped half a day later
	if n := l.Forget(now.Add(day), 0); n != 0 {
		t.Fatalf("Forget with no retention dropped %d", n)
	}
	l.Pending = &ReadBack{From: 0, To: 1}
	if n := l.Forget(now.Add(day), day); n != 0 {
		t.Fatalf("Forget dropped %d streams while a read back was pending", n)
	}
	l.Pending = nil
	if n := l.Forget(now.Add(day), day); n != 1 || l.Stream(x1.Stream) != nil || l.Stream(y1.Stream) == nil {
		t.Fatalf("Forget a day later dropped %d; X kept %v, Y kept %v (want X dropped, Y kept)", n, l.Stream(x1.Stream) != nil, l.Stream(y1.Stream) != nil)
	}
	if b := l.keptBound(l.Stream(y1.Stream), x1.Stream); b != 1 {
		t.Fatalf("Y keeps up to %d of X, forgotten; want 1, what its own header says", b)
	}
	if n := l.Forget(now.Add(36*time.Hour), day); n != 1 || !l.Empty() {
		t.Fatalf("Forget a day after Y was met dropped %d; empty %v", n, l.Empty())
	}
}

// TestRegressionRecordBeforeTheFirstCountsAsSeen: X is registered from its 1 at offset 5 (forgotten
// and met again, or first met after an upgrade); a retry of X's 3 (source offset 2), from offset
// 1, is decided by key. A stream created again after that which repeats source offset 2 must
// count it in its horizon: the record, before X's first offset, was never observed, and what it
// carried was not counted as seen; the repeat was applied by number.
func TestRegressionRecordBeforeTheFirstCountsAsSeen(t *testing.T) {
	l := &Lineage{Root: ID{0xee}}
	observe(t, l, ev(1, 1, 0, 5, 0, 0), 0)
	x3 := ev(1, 3, 2, 1, 0, 0)
	if !l.NeedsPrepare(x3, false) {
		t.Fatal("a record from before its stream's first offset, carrying more than was seen, needs no preparing")
	}
	l.Prepare(x3, 6, 0, false)
	mustDecide(t, l, x3, false, ByKey)
	l.Done(x3, true)
	again := ev(2, 1, 2, 6, 0, 0)
	if observe(t, l, again, 0) { // from X's first offset: X's 1, not applied
		l.ReadBackDone()
	}
	mustDecide(t, l, again, false, ByKey)
}

// TestRegressionKeyedWhileTheReleaseBeforeMayHaveEmitted: the upstream's release before applied
// a source record in its upgrade window and emitted its event unnumbered (decided by key here);
// the upstream's database lost that commit, and this release applied the record again, numbering
// the event in a stream new to the consumer. Numbered while the window was open, it says Keyed,
// and is decided by key: a copy. Decided by number (the rule removed), it was applied twice.
func TestRegressionKeyedWhileTheReleaseBeforeMayHaveEmitted(t *testing.T) {
	l := &Lineage{Root: ID{0xee}}
	e := ev(1, 1, 0, 1, 0, 0) // offset 0 held the unnumbered copy, decided by key
	e.Keyed = true
	observe(t, l, e, 0)
	mustDecide(t, l, e, false, ByKey)
	e.Keyed = false
	mustDecide(t, l, e, false, Apply) // what the rule prevents
}
