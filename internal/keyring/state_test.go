package keyring

import (
	"flag"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// TestRingProtocol runs the ring's state machine (state.go) against a model of Postgres: tables
// with a primary key (a second insert of a key waits for the first transaction's end and then
// conflicts or not), snapshots per statement, table locks (ACCESS SHARE for a statement that names
// a table, ACCESS EXCLUSIVE NOWAIT for a TRUNCATE) and advisory locks. Random histories interleave
// recorders (several at once, of the same keys, each with a view of the ring possibly some moves
// old: enter, record, commit or abort, at any point), the turner's moves (each begun, then
// committed, other steps between), the compaction's chunks, and time passing. It checks:
//
//   - no two committed recorders take one key for new unless the second looked it up a retention
//     or more after the first committed (so also: a key committed less than the retention ago is
//     always found);
//   - nothing the turner does makes a recorder wait: no recorder's statement asks for a lock on a
//     table a move holds, and a recorder waits only for another recorder's row;
//   - a frozen generation takes no key while it is compacted;
//   - once the recorders end, every move due is made, and the turn completes.
//
// TestRingProtocolCatchesWeakenedRules shows that it fails with either rule of the protocol
// weakened.
func TestRingProtocol(t *testing.T) {
	setRapidDefaults(t)
	start := time.Now()
	var histories int
	rapid.Check(t, func(rt *rapid.T) {
		histories++
		runHistory(rt, rules{})
	})
	t.Logf("%d histories in %v: %.0f a second", histories, time.Since(start).Round(time.Millisecond), float64(histories)/time.Since(start).Seconds())
}

// checks is how many histories TestRingProtocol explores unless -rapid.checks says otherwise;
// steps the average length of one (-rapid.steps).
const (
	checks = 10000
	steps  = 100
)

func setRapidDefaults(t *testing.T) {
	for name, v := range map[string]int{"rapid.checks": checks, "rapid.steps": steps} {
		if f := flag.Lookup(name); f != nil && f.Value.String() == f.DefValue {
			f.Value.Set(fmt.Sprint(v))
			t.Cleanup(func() { f.Value.Set(f.DefValue) })
		}
	}
}

// TestRingProtocolCatchesWeakenedRules: the property test finds a key taken for new twice when
// the turner does not check that the recorders of the epoch two before the move have ended, and
// when a recorder does not fail on finding the ring two epochs past its own (each also makes a
// recorder wait for a move's lock, which the weakened runs let happen, as Postgres would).
func TestRingProtocolCatchesWeakenedRules(t *testing.T) {
	setRapidDefaults(t)
	// Up to 50,000 histories (it stops at the first failure), shrunk for 3 s at most, no fail file.
	for name, v := range map[string]string{"rapid.checks": "50000", "rapid.shrinktime": "3s", "rapid.nofailfile": "true"} {
		if f := flag.Lookup(name); f != nil {
			old := f.Value.String()
			f.Value.Set(v)
			t.Cleanup(func() { f.Value.Set(old) })
		}
	}
	for _, tc := range []struct {
		name string
		weak rules
	}{
		{"no try-lock on E-2", rules{noGuard: true, waits: true}},
		{"no check of E2 >= E1+2", rules{noStale: true, waits: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rec failures
			rapid.Check(&rec, func(rt *rapid.T) { runHistory(rt, tc.weak) })
			if !rec.failed {
				t.Fatalf("the property test passed with %s", tc.name)
			}
			if !strings.Contains(rec.first(), "taken for new") {
				t.Fatalf("with %s, the property test failed, but not on a key taken for new twice: %s", tc.name, rec.first())
			}
			t.Logf("found: %s", rec.first())
		})
	}
}

// rules weakens the protocol, to show the test fails.
type rules struct {
	noGuard bool // the turner moves without the try-lock on Guard(E)
	noStale bool // a recorder does not fail on Stale
	// waits: a recorder that asks for a table a move holds waits for the move's commit (as in
	// Postgres) instead of failing the test, and a key inserted into a frozen generation is not
	// reported, so that only a double application can fail it.
	waits bool
}

const (
	period    = 1          // ticks in a third of the retention
	retention = 3 * period // ticks
	legacyKey = 2          // in the legacy table from the start
)

// modelTx is a recorder.
type modelTx struct {
	id     int
	key    int
	seen   int64 // the epoch of its view
	view   View
	phase  int // 0 begun, 1 entered, 2 inserting, 3 statement done, 4 ended
	snap   clock
	shares []Table
	locked bool // holds the shared lock on seen
	ins    []int
	insAt  int
	all    bool // inserted into every table so far
	wait   *modelTx
}

// clock is a moment: ticks, and the order of events.
type clock struct{ tick, ev int }

func (a clock) before(b clock) bool { return a.tick < b.tick || a.tick == b.tick && a.ev < b.ev }

type modelRow struct {
	owner     *modelTx // nil: committed
	committed clock
}

type commitLog struct {
	tx   *modelTx
	at   clock
	snap clock
}

type world struct {
	rt      *rapid.T
	r       rules
	now     clock
	ring    State
	hist    map[int64]State // every epoch's state
	rotated int             // tick of the last freeze
	tables  map[Table]map[int]*modelRow
	txs     []*modelTx
	nextID  int
	pending *Move // a move begun: holds the exclusive lock on its guard and its tables to empty
	fresh   map[int][]commitLog
	log     []event
}

// event is a line of the history, formatted only if the test fails.
type event struct {
	at     clock
	format string
	args   []any
}

func newWorld(rt *rapid.T, r rules) *world {
	w := &world{rt: rt, r: r, ring: State{Legacy: LegacyLooked}, hist: map[int64]State{}, tables: map[Table]map[int]*modelRow{}, fresh: map[int][]commitLog{}}
	w.hist[0] = w.ring
	w.table(legacyTable)[legacyKey] = &modelRow{}
	w.fresh[legacyKey] = []commitLog{{}}
	return w
}

func (w *world) table(t Table) map[int]*modelRow {
	if w.tables[t] == nil {
		w.tables[t] = map[int]*modelRow{}
	}
	return w.tables[t]
}

func (w *world) event(format string, args ...any) {
	w.now.ev++
	w.log = append(w.log, event{w.now, format, args})
}

func (w *world) fail(format string, args ...any) {
	var h strings.Builder
	for _, e := range w.log {
		fmt.Fprintf(&h, "\n%d.%d %s", e.at.tick, e.at.ev, fmt.Sprintf(e.format, e.args...))
	}
	w.rt.Fatalf("%s\nhistory:%s", fmt.Sprintf(format, args...), h.String())
}

func runHistory(rt *rapid.T, r rules) {
	w := newWorld(rt, r)
	rt.Repeat(w.actions())
	w.quiesce()
}

func (w *world) alive() []*modelTx {
	var out []*modelTx
	for _, x := range w.txs {
		if x.phase < 4 {
			out = append(out, x)
		}
	}
	return out
}

func (w *world) pick(phase ...int) *modelTx {
	var c []*modelTx
	for _, x := range w.alive() {
		if slices.Contains(phase, x.phase) && x.wait == nil {
			c = append(c, x)
		}
	}
	if len(c) == 0 {
		w.rt.Skip("none")
	}
	return rapid.SampledFrom(c).Draw(w.rt, "tx")
}

func (w *world) actions() map[string]func(*rapid.T) {
	return map[string]func(*rapid.T){
		"begin": func(t *rapid.T) {
			if len(w.alive()) >= 4 {
				t.Skip("enough")
			}
			// Its view of the ring: the current state, or one up to three moves older.
			seen := max(0, w.ring.Epoch-int64(rapid.IntRange(0, 3).Draw(t, "behind")))
			x := &modelTx{id: w.nextID, key: rapid.IntRange(0, legacyKey).Draw(t, "key"), seen: seen, view: w.hist[seen].View()}
			w.nextID++
			w.txs = append(w.txs, x)
			w.event("tx%d begins, key %d, seen epoch %d (ring at %d)", x.id, x.key, seen, w.ring.Epoch)
		},
		"enter":  func(t *rapid.T) { w.enter(w.pick(0)) },
		"record": func(t *rapid.T) { w.record(w.pick(1)) },
		"insert": func(t *rapid.T) { w.insert(w.pick(2)) },
		"end": func(t *rapid.T) {
			// Mostly a commit of a recorder whose statement is done; sometimes an abort, at any point
			// (an error, the batch's handler failing).
			if rapid.IntRange(0, 4).Draw(t, "abort") > 0 {
				w.end(w.pick(3), true)
				return
			}
			c := w.alive()
			if len(c) == 0 {
				t.Skip("none")
			}
			w.end(rapid.SampledFrom(c).Draw(t, "tx"), false)
		},
		"tick": func(t *rapid.T) {
			w.now.tick++
			w.now.ev = 0
			w.event("tick")
		},
		"move begins":  func(t *rapid.T) { w.beginMove() },
		"move commits": func(t *rapid.T) { w.commitMove() },
		"move aborts": func(t *rapid.T) {
			if w.pending == nil {
				t.Skip("none")
			}
			w.event("the move to %s aborts", w.pending.To)
			w.pending = nil
		},
		"chunk": func(t *rapid.T) { w.chunk() },
	}
}

// enter is the recorder's first statement: the shared lock on its epoch, then the ring afresh.
func (w *world) enter(x *modelTx) {
	if w.pending != nil && Guard(w.pending.To.Epoch) == x.seen && !w.r.noGuard {
		w.event("tx%d: lock on epoch %d refused (a move to %d holds it): ErrMoved", x.id, x.seen, w.pending.To.Epoch)
		w.end(x, false)
		return
	}
	x.locked = true
	if Stale(x.seen, w.ring.Epoch) && !w.r.noStale {
		w.event("tx%d: the ring is at %d, two past %d: ErrMoved", x.id, w.ring.Epoch, x.seen)
		w.end(x, false)
		return
	}
	x.phase = 1
	w.event("tx%d enters epoch %d", x.id, x.seen)
}

// record is the recorder's second statement: its tables locked, then a snapshot, the lookups, and
// the inserts (insert).
func (w *world) record(x *modelTx) {
	for _, t := range w.allTables() {
		if !x.view.Refs(t) {
			continue
		}
		if w.pending != nil && slices.Contains(w.pending.Empty, t) && w.r.waits {
			w.event("tx%d waits for table %+v, which the move to %s holds", x.id, t, w.pending.To)
			w.commitMove()
		}
		if w.pending != nil && slices.Contains(w.pending.Empty, t) {
			w.fail("tx%d (epoch %d) waits for table %+v, which the move to %s holds to empty it", x.id, x.seen, t, w.pending.To)
		}
		x.shares = append(x.shares, t)
	}
	w.event("tx%d looks key %d up", x.id, x.key)
	x.snap = w.now
	found := false
	for _, t := range x.shares {
		if t.Legacy || t.Runs || x.view.Keys&bit(t.Gen) != 0 || x.view.Insert&bit(t.Gen) != 0 {
			if r := w.table(t)[x.key]; r != nil && r.owner == nil {
				found = true
			}
		}
	}
	if found {
		x.phase = 3
		return
	}
	for g := range Generations {
		if x.view.Insert&bit(g) != 0 {
			x.ins = append(x.ins, g)
		}
	}
	x.phase, x.all = 2, true
	w.insert(x)
}

// insert inserts the key into the recorder's next table: it waits if another recorder's row for
// it is uncommitted, and conflicts if one is committed.
func (w *world) insert(x *modelTx) {
	for x.insAt < len(x.ins) {
		t := w.table(keysOf(x.ins[x.insAt]))
		switch r := t[x.key]; {
		case r == nil:
			t[x.key] = &modelRow{owner: x}
			w.event("tx%d inserts key %d into generation %d", x.id, x.key, x.ins[x.insAt])
		case r.owner == x:
		case r.owner != nil:
			x.wait = r.owner
			w.event("tx%d waits for tx%d on key %d in generation %d", x.id, r.owner.id, x.key, x.ins[x.insAt])
			for y := r.owner; y != nil; y = y.wait {
				if y == x {
					w.event("tx%d: deadlock, aborted", x.id)
					w.end(x, false)
					return
				}
			}
			return
		default:
			x.all = false
			w.event("tx%d finds key %d in generation %d (conflict)", x.id, x.key, x.ins[x.insAt])
		}
		x.insAt++
	}
	x.phase = 3
}

// end commits or aborts x, and wakes the recorders that waited for it.
func (w *world) end(x *modelTx, commit bool) {
	fresh := commit && x.phase == 3 && x.all && len(x.ins) > 0
	for t, rows := range w.tables {
		for k, r := range rows {
			if r.owner == x {
				if commit {
					r.owner, r.committed = nil, w.now
				} else {
					delete(rows, k)
				}
				_ = t
			}
		}
	}
	x.phase, x.shares, x.locked, x.wait = 4, nil, false, nil
	w.event("tx%d %s (key %d new: %v)", x.id, map[bool]string{true: "commits", false: "aborts"}[commit], x.key, fresh)
	if fresh {
		for _, c := range w.fresh[x.key] {
			if x.snap.before(clock{c.at.tick + retention, c.at.ev}) {
				w.fail("key %d taken for new by tx%d (looked up at %d.%d) and before by tx%s (committed at %d.%d), less than the retention (%d ticks) before",
					x.key, x.id, x.snap.tick, x.snap.ev, txID(c.tx), c.at.tick, c.at.ev, retention)
			}
		}
		w.fresh[x.key] = append(w.fresh[x.key], commitLog{tx: x, at: w.now, snap: x.snap})
	}
	for _, y := range w.alive() {
		if y.wait == x {
			y.wait = nil
			w.insert(y)
		}
	}
}

func txID(x *modelTx) string {
	if x == nil {
		return "(the legacy table)"
	}
	return fmt.Sprint(x.id)
}

func (w *world) allTables() []Table {
	out := []Table{legacyTable}
	for g := range Generations {
		out = append(out, keysOf(g), runsOf(g))
	}
	return out
}

// due: the ring's last freeze was a third of the retention ago; the legacy table's keys (from
// tick 0) are a retention old.
func (w *world) due() (bool, bool) {
	return w.now.tick >= w.rotated+period, w.now.tick >= retention
}

// beginMove begins the move due, if its preconditions hold: the try-lock on its guard, the
// compaction done, NOWAIT locks on the tables to empty.
func (w *world) beginMove() {
	if w.pending != nil {
		w.rt.Skip("a move is under way")
	}
	m, ok := w.ring.Next(w.due())
	if !ok {
		w.rt.Skip("nothing due")
	}
	if busy := w.moveBusy(m); busy != "" {
		w.event("the move to %s is refused: %s", m.To, busy)
		return
	}
	for _, t := range m.Empty {
		if w.ring.View().Refs(t) || m.To.View().Refs(t) {
			w.fail("the move to %s empties %+v, which a recorder of an epoch alive may reference", m.To, t)
		}
	}
	// Carried keys: the model has no dead letters; the turner copies nothing.
	w.pending = &m
	w.event("the move to %s begins", m.To)
}

// moveBusy says why m cannot be made now, or "".
func (w *world) moveBusy(m Move) string {
	if !w.r.noGuard {
		for _, x := range w.alive() {
			if x.locked && x.seen == Guard(m.To.Epoch) {
				return fmt.Sprintf("tx%d of epoch %d is alive", x.id, x.seen)
			}
		}
	}
	for g := range Generations {
		if m.Compact&bit(g) != 0 && !w.compacted(g) {
			return fmt.Sprintf("generation %d is not compacted yet", g)
		}
	}
	for _, t := range m.Empty {
		for _, x := range w.alive() {
			if slices.Contains(x.shares, t) {
				return fmt.Sprintf("tx%d holds %+v", x.id, t)
			}
		}
	}
	return ""
}

func (w *world) commitMove() {
	if w.pending == nil {
		w.rt.Skip("none")
	}
	m := *w.pending
	w.pending = nil
	for _, t := range m.Empty {
		for k, r := range w.table(t) {
			if r.owner != nil {
				w.fail("the move to %s empties %+v, where tx%d's row is uncommitted", m.To, t, r.owner.id)
			}
			delete(w.table(t), k)
		}
	}
	if m.Stamp {
		w.rotated = w.now.tick
	}
	w.ring = m.To
	w.hist[m.To.Epoch] = m.To
	w.event("the ring moves to %s", m.To)
}

// compacted reports whether generation g's committed keys are all in its runs.
func (w *world) compacted(g int) bool {
	for k, r := range w.table(keysOf(g)) {
		if r.owner == nil && w.table(runsOf(g))[k] == nil {
			return false
		}
	}
	return true
}

// chunk copies the next key of a generation compacting (after the last one in its runs) into its
// runs.
func (w *world) chunk() {
	if w.pending != nil {
		w.rt.Skip("a move holds the ring's row")
	}
	for g := range Generations {
		if w.ring.Compacting()&bit(g) == 0 {
			continue
		}
		last := -1
		for k := range w.table(runsOf(g)) {
			last = max(last, k)
		}
		next := -1
		for k, r := range w.table(keysOf(g)) {
			if r.owner != nil && w.ring.Step == Frozen && !w.r.waits {
				w.fail("generation %d is frozen, and tx%d inserts key %d into it", g, r.owner.id, k)
			}
			if r.owner == nil && k > last && (next < 0 || k < next) {
				next = k
			}
		}
		if next >= 0 {
			w.table(runsOf(g))[next] = &modelRow{committed: w.table(keysOf(g))[next].committed}
			w.event("generation %d: key %d compacted", g, next)
			return
		}
	}
	w.rt.Skip("nothing to compact")
}

// quiesce ends every recorder, then makes the moves due until none is (time passing): each must be
// made at its first attempt, and the ring must come back to steady.
func (w *world) quiesce() {
	if w.pending != nil {
		w.commitMove()
	}
	for len(w.alive()) > 0 {
		for _, x := range w.alive() {
			if x.wait == nil {
				w.end(x, x.phase == 3)
			}
		}
	}
	for i := 0; ; i++ {
		if i > 100 {
			w.fail("the ring does not settle: at %s", w.ring)
		}
		m, ok := w.ring.Next(w.due())
		if !ok {
			break
		}
		for w.ring.Compacting() != 0 && !w.compactedAll() {
			w.chunk()
		}
		if busy := w.moveBusy(m); busy != "" {
			w.fail("with no recorder alive, the move to %s is refused: %s", m.To, busy)
		}
		w.pending = &m
		w.commitMove()
	}
	if w.ring.Step != Steady {
		w.fail("the ring stops at %s", w.ring)
	}
}

func (w *world) compactedAll() bool {
	for g := range Generations {
		if w.ring.Compacting()&bit(g) != 0 && !w.compacted(g) {
			return false
		}
	}
	return true
}

// TestStatesCompatible: every move's two states are compatible, and empties only tables neither
// references; a turn from each generation goes through every step back to steady.
func TestStatesCompatible(t *testing.T) {
	for _, start := range []State{{Gen: 0}, {Gen: 2, Step: Upgrade}, {Gen: 3, Legacy: LegacyLooked}} {
		s := start
		for range 20 {
			m, ok := s.Next(true, true)
			if !ok {
				t.Fatalf("no move from %s", s)
			}
			if m.To.Epoch != s.Epoch+1 {
				t.Fatalf("the move from %s to %s is not one epoch", s, m.To)
			}
			if err := Compatible(s.View(), m.To.View()); err != nil {
				t.Errorf("%s -> %s: %v", s, m.To, err)
			}
			for _, e := range m.Empty {
				if s.View().Refs(e) || m.To.View().Refs(e) {
					t.Errorf("%s -> %s empties %+v, which one of them references", s, m.To, e)
				}
			}
			s = m.To
		}
		if s.Gen == start.Gen {
			t.Errorf("from %s, 20 moves do not turn the ring", start)
		}
	}
}

// failures is a rapid.TB that records a failure instead of failing the test.
type failures struct {
	mu     sync.Mutex
	failed bool
	msgs   []string
}

func (f *failures) Helper()              {}
func (f *failures) Name() string         { return "weakened" }
func (f *failures) Logf(string, ...any)  {}
func (f *failures) Log(...any)           {}
func (f *failures) Skipf(string, ...any) {}
func (f *failures) Skip(...any)          {}
func (f *failures) SkipNow()             {}
func (f *failures) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failed = true
	f.msgs = append(f.msgs, fmt.Sprintf(format, args...))
}
func (f *failures) Error(args ...any)                 { f.Errorf("%s", fmt.Sprint(args...)) }
func (f *failures) Fatalf(format string, args ...any) { f.Errorf(format, args...) }
func (f *failures) Fatal(args ...any)                 { f.Error(args...) }
func (f *failures) FailNow()                          {}
func (f *failures) Fail()                             { f.Errorf("failed") }
func (f *failures) Failed() bool                      { return f.failed }

// first is the first line of the first failure (the shrunk counterexample's message).
func (f *failures) first() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, m := range f.msgs {
		for _, line := range strings.Split(m, "\n") {
			if strings.Contains(line, "taken for new") || strings.Contains(line, "waits for") || strings.Contains(line, "frozen") {
				return strings.TrimSpace(line)
			}
		}
	}
	if len(f.msgs) > 0 {
		return strings.SplitN(f.msgs[0], "\n", 2)[0]
	}
	return ""
}
