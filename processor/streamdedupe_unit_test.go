package processor

import (
	"math/rand/v2"
	"testing"
)

// TestStreamStateModel: a stream's state (high and the missing numbers) against a set of the
// numbers applied, over random orders with copies: a number is applied exactly when the set lacks
// it, and the state's text form reads back to the same state.
func TestStreamStateModel(t *testing.T) {
	t.Parallel()
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	for round := range 200 {
		s := &streamState{}
		applied := map[int64]bool{}
		n := int64(1 + rng.IntN(60))
		for range 3 * n {
			// A batch of a few numbers, some of them copies, in any order.
			var batch []int64
			for range 1 + rng.IntN(5) {
				batch = append(batch, 1+rng.Int64N(n))
			}
			var done []int64
			seen := map[int64]bool{}
			for _, q := range batch {
				if got, want := s.applied(q) || seen[q], applied[q] || seen[q]; got != want {
					t.Fatalf("round %d: number %d applied: state says %v, want %v (state high %d missing %s)", round, q, got, want, s.high, s.missing)
				}
				if !applied[q] && !seen[q] {
					seen[q] = true
					done = append(done, q)
				}
			}
			s.apply(done)
			for _, q := range done {
				applied[q] = true
			}
			back, err := parseSpans(s.missing.String())
			if err != nil || back.String() != s.missing.String() {
				t.Fatalf("round %d: %s reads back as %s (%v)", round, s.missing, back, err)
			}
			for i := 1; i < len(s.missing); i++ {
				if s.missing[i-1].hi >= s.missing[i].lo {
					t.Fatalf("round %d: missing %s is not sorted, disjoint and apart", round, s.missing)
				}
			}
		}
	}
}

func TestParseSpansRejects(t *testing.T) {
	t.Parallel()
	for _, in := range []string{"", "{", "[1,2)", "{[1,2]}", "{(1,2)}", "{[2,1)}", "{[1,x)}", "{[1,2),}"} {
		if got, err := parseSpans(in); err == nil {
			t.Errorf("parseSpans(%q) = %s, want an error", in, got)
		}
	}
	if got, err := parseSpans("{}"); err != nil || len(got) != 0 {
		t.Errorf("parseSpans({}) = %v, %v", got, err)
	}
}

// TestMayRepeat: which records a successor may repeat.
func TestMayRepeat(t *testing.T) {
	t.Parallel()
	x := &streamState{id: [16]byte{1}, firstOffset: 0}                                     // created afresh
	y := &streamState{id: [16]byte{2}, parent: x.id, forkSeq: 4, successor: true}          // a fork of x at 4
	r2 := &streamState{id: [16]byte{3}, firstOffset: 100, successor: true}                 // created again
	z := &streamState{id: [16]byte{4}, parent: y.id, forkSeq: 2, successor: true}          // a fork of y at 2
	plain := &streamState{id: [16]byte{5}, firstOffset: 200, successor: false, forkSeq: 0} // not a successor
	for _, tc := range []struct {
		name string
		c, s *streamState
		seq  int64
		want bool
	}{
		{"x past the fork", y, x, 5, true},
		{"x up to the fork: the database kept it", y, x, 4, false},
		{"y's own records are not repeats of y", y, y, 9, false},
		{"created again: every record of the first", r2, x, 1, true},
		{"created again: not a fork's", r2, y, 1, false},
		{"a fork of the fork: its parent past 2", z, y, 3, true},
		{"a fork of the fork: not its grandparent (y's horizon covers it)", z, x, 5, false},
		{"not a successor", plain, x, 1, false},
	} {
		if got := tc.c.mayRepeat(tc.s, tc.seq); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
