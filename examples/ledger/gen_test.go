package ledger_test

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/processor"
)

var mixed = ledger.GenConfig{
	Events:            2000,
	Accounts:          17,
	PoisonPerMille:    50,
	MalformedPerMille: 30,
	FlakyPerMille:     100,
	MaxFailAttempts:   3,
	Seed:              42,
	Prefix:            "t",
}

func TestGenerateDeterministic(t *testing.T) {
	t.Parallel()
	a, b := ledger.Generate(mixed), ledger.Generate(mixed)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("two runs with the same config produced different items")
	}
	other := mixed
	other.Seed++
	if reflect.DeepEqual(a, ledger.Generate(other)) {
		t.Fatal("seeds 42 and 43 produced the same items")
	}
}

func TestGenerateEmptyAndDefaults(t *testing.T) {
	t.Parallel()
	if got := ledger.Generate(ledger.GenConfig{Seed: 1}); len(got) != 0 {
		t.Fatalf("Events: 0 produced %d items", len(got))
	}
	// Accounts 0 means one account, MaxFailAttempts 0 means 1, Prefix "" means "e".
	items := ledger.Generate(ledger.GenConfig{Events: 300, FlakyPerMille: 1000, Seed: 3})
	if len(items) != 300 {
		t.Fatalf("got %d items, want 300", len(items))
	}
	for i, it := range items {
		if string(it.Key) != "acct-0" {
			t.Fatalf("item %d has key %q, want acct-0 (a single account)", i, it.Key)
		}
		if it.Kind != ledger.KindFlaky || it.Event.FailAttempts != 1 {
			t.Fatalf("item %d: kind %v, fail_attempts %d; want flaky with 1", i, it.Kind, it.Event.FailAttempts)
		}
		if want := fmt.Sprintf("e-%d", i); it.Event.EventID != want {
			t.Fatalf("item %d has event id %q, want %q", i, it.Event.EventID, want)
		}
	}
}

// TestGenerateProperties checks, for several seeds, what Generate promises and what
// CheckDeadLetters and Verify rely on.
func TestGenerateProperties(t *testing.T) {
	t.Parallel()
	for seed := range uint64(5) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			t.Parallel()
			cfg := mixed
			cfg.Seed = seed
			items := ledger.Generate(cfg)
			if len(items) != cfg.Events {
				t.Fatalf("got %d items, want %d", len(items), cfg.Events)
			}
			ids := map[string]int{}
			values := map[string]int{}
			seq := map[string]int64{} // records produced so far per account
			for i, it := range items {
				account := string(it.Key)
				var n int
				if _, err := fmt.Sscanf(account, "acct-%d", &n); err != nil || n < 0 || n >= cfg.Accounts {
					t.Fatalf("item %d: key %q is not acct-0..acct-%d", i, it.Key, cfg.Accounts-1)
				}
				// CheckDeadLetters finds items by value.
				if j, dup := values[string(it.Value)]; dup {
					t.Fatalf("items %d and %d have the same value %q", j, i, it.Value)
				}
				values[string(it.Value)] = i
				seq[account]++

				ev, err := ledger.Parse(it.Value)
				if it.Kind == ledger.KindMalformed {
					if it.Event != (ledger.Event{}) {
						t.Errorf("malformed item %d carries event %+v, want the zero Event", i, it.Event)
					}
					if err == nil || !processor.IsPermanent(err) {
						t.Errorf("malformed item %d (%q): Parse error %v, want a permanent one", i, it.Value, err)
					}
					continue
				}
				if j, dup := ids[it.Event.EventID]; dup {
					t.Fatalf("items %d and %d share event id %q", j, i, it.Event.EventID)
				}
				ids[it.Event.EventID] = i
				if !strings.HasPrefix(it.Event.EventID, cfg.Prefix+"-") {
					t.Errorf("item %d: event id %q lacks prefix %q", i, it.Event.EventID, cfg.Prefix)
				}
				if it.Event.Account != account {
					t.Errorf("item %d: account %q but key %q", i, it.Event.Account, account)
				}
				// Each account's seq counts every record of the account, malformed ones included.
				if it.Event.Seq != seq[account] {
					t.Fatalf("item %d: %s has seq %d, want %d", i, account, it.Event.Seq, seq[account])
				}
				if it.Event.Amount < -500 || it.Event.Amount >= 1500 {
					t.Errorf("item %d: amount %d outside [-500, 1500)", i, it.Event.Amount)
				}

				switch it.Kind {
				case ledger.KindPoison:
					if !errors.Is(err, ledger.ErrPoison) || !it.Event.Poison || it.Event.FailAttempts != 0 {
						t.Errorf("poison item %d (%q): Parse error %v", i, it.Value, err)
					}
				case ledger.KindFlaky:
					if err != nil || ev != it.Event {
						t.Errorf("flaky item %d (%q) parses to %+v, %v; want %+v", i, it.Value, ev, err, it.Event)
					}
					if it.Event.FailAttempts < 1 || it.Event.FailAttempts > cfg.MaxFailAttempts {
						t.Errorf("flaky item %d: fail_attempts %d outside 1..%d", i, it.Event.FailAttempts, cfg.MaxFailAttempts)
					}
				case ledger.KindOK:
					if err != nil || ev != it.Event {
						t.Errorf("ok item %d (%q) parses to %+v, %v; want %+v", i, it.Value, ev, err, it.Event)
					}
					if it.Event.FailAttempts != 0 || it.Event.Poison {
						t.Errorf("ok item %d is not plain: %+v", i, it.Event)
					}
				default:
					t.Errorf("item %d has kind %d", i, it.Kind)
				}
			}
			if len(seq) != cfg.Accounts {
				t.Errorf("%d accounts used, want all %d", len(seq), cfg.Accounts)
			}
		})
	}
}

// TestGenerateSeqSkipsMalformed pins the documented choice that malformed records take a seq
// number of their account: the applied events of an account then have gaps in seq.
func TestGenerateSeqSkipsMalformed(t *testing.T) {
	t.Parallel()
	items := ledger.Generate(ledger.GenConfig{Events: 500, Accounts: 2, MalformedPerMille: 300, Seed: 9})
	gaps := 0
	last := map[string]int64{}
	for _, it := range items {
		if it.Kind == ledger.KindMalformed {
			continue
		}
		if it.Event.Seq > last[it.Event.Account]+1 {
			gaps++
		}
		last[it.Event.Account] = it.Event.Seq
	}
	if gaps == 0 {
		t.Fatal("no seq gaps among valid events although 30% of records are malformed")
	}
}

func TestGenerateShares(t *testing.T) {
	t.Parallel()
	const events = 10000
	tests := []struct {
		name                     string
		poison, malformed, flaky int
	}{
		{name: "mixed", poison: 50, malformed: 30, flaky: 100},
		{name: "none", poison: 0, malformed: 0, flaky: 0},
		{name: "half flaky", poison: 0, malformed: 0, flaky: 500},
		{name: "all malformed", poison: 0, malformed: 1000, flaky: 0},
		{name: "sum above 1000 per mille", poison: 600, malformed: 600, flaky: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			items := ledger.Generate(ledger.GenConfig{
				Events: events, Accounts: 10, Seed: 2024,
				PoisonPerMille: tt.poison, MalformedPerMille: tt.malformed, FlakyPerMille: tt.flaky,
			})
			count := map[ledger.Kind]int{}
			for _, it := range items {
				count[it.Kind]++
			}
			// Kinds are drawn in order malformed, poison, flaky from one roll in [0, 1000).
			malformed := min(tt.malformed, 1000)
			poison := min(tt.poison, 1000-malformed)
			flaky := min(tt.flaky, 1000-malformed-poison)
			want := map[ledger.Kind]int{
				ledger.KindMalformed: malformed,
				ledger.KindPoison:    poison,
				ledger.KindFlaky:     flaky,
				ledger.KindOK:        1000 - malformed - poison - flaky,
			}
			for kind, perMille := range want {
				p := float64(perMille) / 1000
				mean := p * events
				tol := 5 * math.Sqrt(events*p*(1-p)) // five standard deviations
				if got := float64(count[kind]); math.Abs(got-mean) > tol {
					t.Errorf("%v: %d of %d events, want %.0f ± %.0f", kind, count[kind], events, mean, tol)
				}
			}
		})
	}
}

func TestGenerateFailAttemptsSpread(t *testing.T) {
	t.Parallel()
	items := ledger.Generate(ledger.GenConfig{Events: 1000, FlakyPerMille: 1000, MaxFailAttempts: 4, Seed: 5})
	seen := map[int]int{}
	for _, it := range items {
		seen[it.Event.FailAttempts]++
	}
	for n := 1; n <= 4; n++ {
		if seen[n] == 0 {
			t.Errorf("no flaky event with fail_attempts %d among 1000 (spread %v)", n, seen)
		}
	}
	if len(seen) != 4 {
		t.Errorf("fail_attempts values %v, want exactly 1..4", seen)
	}
}

func TestItemDead(t *testing.T) {
	t.Parallel()
	flaky := func(n int) ledger.Item {
		return ledger.Item{Kind: ledger.KindFlaky, Event: ledger.Event{EventID: "e", Account: "a", FailAttempts: n}}
	}
	tests := []struct {
		name       string
		item       ledger.Item
		maxAttempt int
		want       bool
	}{
		{name: "ok", item: ledger.Item{Kind: ledger.KindOK}, maxAttempt: 1, want: false},
		{name: "ok with retry tiers", item: ledger.Item{Kind: ledger.KindOK}, maxAttempt: 5, want: false},
		{name: "poison", item: ledger.Item{Kind: ledger.KindPoison}, maxAttempt: 1, want: true},
		{name: "poison with retry tiers", item: ledger.Item{Kind: ledger.KindPoison}, maxAttempt: 10, want: true},
		{name: "malformed", item: ledger.Item{Kind: ledger.KindMalformed}, maxAttempt: 1, want: true},
		{name: "malformed with retry tiers", item: ledger.Item{Kind: ledger.KindMalformed}, maxAttempt: 10, want: true},
		{name: "flaky 1, one attempt", item: flaky(1), maxAttempt: 1, want: true},
		{name: "flaky 1, two attempts", item: flaky(1), maxAttempt: 2, want: false},
		{name: "flaky 3, three attempts", item: flaky(3), maxAttempt: 3, want: true},
		{name: "flaky 3, four attempts", item: flaky(3), maxAttempt: 4, want: false},
		{name: "flaky 3, one attempt", item: flaky(3), maxAttempt: 1, want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := tt.item.Dead(tt.maxAttempt); got != tt.want {
				t.Errorf("Dead(%d) = %v, want %v", tt.maxAttempt, got, tt.want)
			}
		})
	}
}

func TestItemRecord(t *testing.T) {
	t.Parallel()
	items := ledger.Generate(ledger.GenConfig{Events: 5, Accounts: 2, MalformedPerMille: 500, Seed: 11})
	for i, it := range items {
		r := it.Record("ledger")
		if r.Topic != "ledger" || string(r.Key) != string(it.Key) || string(r.Value) != string(it.Value) {
			t.Errorf("item %d: Record = {%s %q %q}, want {ledger %q %q}", i, r.Topic, r.Key, r.Value, it.Key, it.Value)
		}
	}
}

func TestKindString(t *testing.T) {
	t.Parallel()
	tests := []struct {
		kind ledger.Kind
		want string
	}{
		{ledger.KindOK, "ok"},
		{ledger.KindFlaky, "flaky"},
		{ledger.KindPoison, "poison"},
		{ledger.KindMalformed, "malformed"},
	}
	for _, tt := range tests {
		if got := tt.kind.String(); got != tt.want {
			t.Errorf("Kind(%d).String() = %q, want %q", int(tt.kind), got, tt.want)
		}
	}
}

func ExampleGenerate() {
	items := ledger.Generate(ledger.GenConfig{
		Events: 6, Accounts: 2, PoisonPerMille: 200, MalformedPerMille: 200, FlakyPerMille: 200, Seed: 1,
	})
	for _, it := range items {
		fmt.Printf("%-9s %s seq=%d dead=%v\n", it.Kind, it.Key, it.Event.Seq, it.Dead(1))
	}
	// Output:
	// malformed acct-1 seq=0 dead=true
	// ok        acct-0 seq=1 dead=false
	// ok        acct-0 seq=2 dead=false
	// flaky     acct-0 seq=3 dead=true
	// ok        acct-0 seq=4 dead=false
	// flaky     acct-1 seq=2 dead=true
}

// TestGenerateMistakesAndOversized: with Mistakes, flaky events carry every kind of mistake (and
// some none); oversized ones are under a mebibyte, of distinct sizes (their DLQ copies are matched
// by size), and dead at their first failure.
func TestGenerateMistakesAndOversized(t *testing.T) {
	t.Parallel()
	cfg := mixed
	cfg.Events, cfg.FlakyPerMille, cfg.Mistakes, cfg.OversizedPerMille = 4000, 300, true, 20
	mistakes := map[string]int{}
	sizes := map[int]bool{}
	for _, it := range ledger.Generate(cfg) {
		if it.Kind != ledger.KindFlaky {
			continue
		}
		mistakes[it.Event.Mistake]++
		if it.Oversized() {
			if n := len(it.Value); n < 999_500 || n >= 1<<20 || sizes[n] {
				t.Errorf("oversized value of %d bytes: want 999,500 up to 1 MiB, each size once", n)
			}
			sizes[len(it.Value)] = true
			if !it.Dead(100) {
				t.Error("an oversized flaky event is not expected to be dead-lettered")
			}
		}
	}
	for _, m := range append(ledger.Mistakes, "") {
		if mistakes[m] == 0 {
			t.Errorf("no flaky event with mistake %q among %v", m, mistakes)
		}
	}
	if len(sizes) == 0 {
		t.Error("no oversized event")
	}
}
