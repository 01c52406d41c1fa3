package keyring

import "fmt"

// The ring's state machine, with no I/O: which tables a recorder of each state inserts into and
// looks up, and the moves from one state to the next, each an increment of the ring's epoch.
// Ring runs it against Postgres; TestRingProtocol against a model of Postgres.
//
// The protocol, in which nothing waits in a queue:
//
//   - A recorder (Ring.Record) takes the epoch E1 it believes current, takes
//     pg_try_advisory_xact_lock_shared on it, then reads the ring's epoch afresh (a statement
//     after the lock: a newer snapshot), and fails with ErrMoved if the lock was refused or the
//     epoch is E1+2 or more (Stale). Only then does it look keys up and insert them, with E1's
//     View, in a later statement.
//   - The turner moves the ring to epoch E only if pg_try_advisory_xact_lock(E-2) succeeds
//     (Guard): no recorder of E-2 is alive, and none can enter E-2 any more. So the recorders
//     alive at any moment are of two consecutive epochs, E-1 and E.
//   - Any two consecutive states insert into a common table of keys (Compatible): two recorders
//     of one key, one in each, meet on that table's primary key, the second waiting for the first
//     and finding its row. A key committed earlier is found by the lookups of every later state,
//     within the retention.
//   - A move empties (TRUNCATE) only tables that neither the state before it nor the new one
//     references: no recorder ever asks for a lock on them again, so the TRUNCATE's lock stalls
//     no lookup; it is taken NOWAIT and fails only while a recorder of an older state, which
//     Guard already excluded, or a reader of sizes, holds it.

// Step is where the ring is in a turn from its current generation c to the next one, n (c+1, the
// oldest).
type Step int16

const (
	// Steady: keys are inserted into c, looked up in c's table of keys and in the other
	// generations' runs.
	Steady Step = iota
	// Retired: n is no longer looked up; the keys of it that dead letters share were copied into c.
	Retired
	// Emptied: n's tables were emptied.
	Emptied
	// Turning: keys are inserted into both c and n, and looked up in both.
	Turning
	// Switched: keys are inserted into n only; c is still looked up by its table of keys.
	Switched
	// Frozen: no recorder inserts into c any more: c is compacted (copied into its runs).
	Frozen
	// Compacted: c is looked up by its runs; the move to Steady of n empties c's table of keys.
	Compacted
	// Upgrade is the state migration 10 leaves a ring the release before it used: every table is
	// looked up, keys inserted into c; the generations past are compacted.
	Upgrade
	// Upgraded: the generations past are looked up by their runs; the move to Steady empties their
	// tables of keys.
	Upgraded
)

var stepNames = [...]string{"steady", "retired", "emptied", "turning", "switched", "frozen", "compacted", "upgrade", "upgraded"}

func (s Step) String() string {
	if s >= 0 && int(s) < len(stepNames) {
		return stepNames[s]
	}
	return fmt.Sprintf("step(%d)", int16(s))
}

// LegacyStep is where the table before migration 8 (idempotency_keys) is.
type LegacyStep int16

const (
	LegacyLooked LegacyStep = iota // looked up (by the full hash)
	LegacyOff                      // no longer looked up: the keys dead letters share were copied into the ring
	LegacyGone                     // emptied
)

// State is the ring's state: the idempotency_ring row.
type State struct {
	Epoch  int64
	Gen    int // c, the current generation, the one a turn starts from
	Step   Step
	Legacy LegacyStep
}

func (s State) String() string {
	return fmt.Sprintf("epoch %d: generation %d %s, legacy %d", s.Epoch, s.Gen, s.Step, s.Legacy)
}

// View is what a recorder of a state references: bit g of a mask is generation g.
type View struct {
	Insert uint8 // tables of keys inserted into (and looked up)
	Keys   uint8 // tables of keys looked up
	Runs   uint8 // runs (compacted generations) looked up
	Legacy bool  // the table before migration 8 looked up
	// LegacyInsert: the keys recorded go into the table before migration 8 as well, for the
	// release before to find (the upgrade window is open: Ring.SetWindow). Only with Legacy.
	LegacyInsert bool
}

const allGens = 1<<Generations - 1

func bit(g int) uint8 { return 1 << (((g % Generations) + Generations) % Generations) }

// View is what a recorder of s references.
func (s State) View() View {
	c, n := bit(s.Gen), bit(s.Gen+1)
	past := uint8(allGens) &^ c
	v := View{Legacy: s.Legacy == LegacyLooked}
	switch s.Step {
	case Steady, Upgraded:
		v.Insert, v.Keys, v.Runs = c, c, past
	case Retired, Emptied:
		v.Insert, v.Keys, v.Runs = c, c, past&^n
	case Turning:
		v.Insert, v.Keys, v.Runs = c|n, c|n, past&^n
	case Switched, Frozen:
		v.Insert, v.Keys, v.Runs = n, c|n, past&^n
	case Compacted:
		v.Insert, v.Keys, v.Runs = n, n, allGens&^n
	case Upgrade:
		v.Insert, v.Keys, v.Runs = c, allGens, allGens
	}
	return v
}

// Refs reports whether a recorder of v references t (takes a lock on it).
func (v View) Refs(t Table) bool {
	switch {
	case t.Legacy:
		return v.Legacy
	case t.Runs:
		return v.Runs&bit(t.Gen) != 0
	default:
		return (v.Keys|v.Insert)&bit(t.Gen) != 0
	}
}

// Table is one of the ring's tables: a generation's table of keys or its runs, or the legacy one.
type Table struct {
	Gen    int
	Runs   bool
	Legacy bool
}

func keysOf(g int) Table { return Table{Gen: g % Generations} }
func runsOf(g int) Table { return Table{Gen: g % Generations, Runs: true} }

var legacyTable = Table{Legacy: true}

// Move is a change of the ring's state, from an epoch to the next.
type Move struct {
	To State
	// Carry: before the move, the keys of these tables that dead letters which may still be
	// replayed share are copied into generation Into's table of keys.
	Carry []Table
	Into  int
	// Empty: the tables the move empties (TRUNCATE). Kept: their keys are in the generations'
	// runs (the move drops nothing).
	Empty []Table
	Kept  bool
	// Compact: the generations whose table of keys must be wholly in their runs before the move.
	Compact uint8
	// Stamp: the move sets rotated_at (the generation it freezes takes no more keys: the
	// retention of its keys counts from here).
	Stamp bool
	// Rotated: the move makes the new generation the only one inserted into.
	Rotated bool
}

// Next is the move due from s, if any: due says the ring is due to turn (its last turn froze a
// generation a third of the longest retention ago), legacyDue that the table before migration 8
// may go. Moves are taken one at a time, in this order.
func (s State) Next(due, legacyDue bool) (Move, bool) {
	to := s
	to.Epoch++
	c, n := s.Gen, (s.Gen+1)%Generations
	switch {
	case s.Legacy == LegacyOff:
		to.Legacy = LegacyGone
		return Move{To: to, Empty: []Table{legacyTable}}, true
	case s.Legacy == LegacyLooked && legacyDue:
		to.Legacy = LegacyOff
		return Move{To: to, Carry: []Table{legacyTable}, Into: s.newest()}, true
	}
	m := Move{To: to}
	switch s.Step {
	case Steady:
		if !due {
			return Move{}, false
		}
		m.To.Step, m.Carry, m.Into = Retired, []Table{runsOf(n), keysOf(n)}, c
	case Retired:
		m.To.Step, m.Empty = Emptied, []Table{keysOf(n), runsOf(n)}
	case Emptied:
		m.To.Step = Turning
	case Turning:
		m.To.Step, m.Rotated = Switched, true
	case Switched:
		m.To.Step, m.Stamp = Frozen, true
	case Frozen:
		m.To.Step, m.Compact = Compacted, bit(c)
	case Compacted:
		m.To.Step, m.To.Gen, m.Empty, m.Kept = Steady, n, []Table{keysOf(c)}, true
	case Upgrade:
		m.To.Step, m.Compact = Upgraded, allGens&^bit(c)
	case Upgraded:
		m.To.Step, m.Empty, m.Kept = Steady, []Table{runsOf(c)}, true
		for g := range Generations {
			if g != c {
				m.Empty = append(m.Empty, keysOf(g))
			}
		}
	default:
		return Move{}, false
	}
	return m, true
}

// newest is the generation a key copied into the ring in state s goes to: the one that stays
// inserted into longest.
func (s State) newest() int {
	switch s.Step {
	case Turning, Switched, Frozen, Compacted:
		return (s.Gen + 1) % Generations
	}
	return s.Gen
}

// Compacting is the generations whose keys are copied into their runs in state s.
func (s State) Compacting() uint8 {
	switch s.Step {
	case Frozen:
		return bit(s.Gen)
	case Upgrade:
		return allGens &^ bit(s.Gen)
	}
	return 0
}

// Guard is the epoch whose recorders must all have ended before the ring moves to epoch to: the
// turner takes pg_try_advisory_xact_lock on it, and gives up (until the next keep) if refused.
func Guard(to int64) int64 { return to - 2 }

// Stale reports whether a recorder that took the shared lock on epoch seen, then read epoch
// current, must fail (ErrMoved): the ring may have moved past a state compatible with seen's.
func Stale(seen, current int64) bool { return current >= seen+2 }

// Compatible reports why a recorder of a and one of b, a state the ring moved to from a, could
// both take one key for new, or nil: they must insert into a common table of keys, and b must
// look up every table a inserts into.
func Compatible(a, b View) error {
	if a.Insert&b.Insert == 0 {
		return fmt.Errorf("no common table of keys inserted into (%04b, %04b)", a.Insert, b.Insert)
	}
	if a.Insert&^(b.Keys|b.Insert) != 0 {
		return fmt.Errorf("tables of keys inserted into before are not looked up after (%04b, %04b)", a.Insert, b.Keys)
	}
	return nil
}

// lockKey is the second key of the advisory lock on epoch e (the first is the ring's namespace),
// as the function idempotency_ring_enter (migration 10) computes it.
func lockKey(e int64) int32 { return int32(e & 0x7fffffff) }
