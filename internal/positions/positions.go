// Package positions decides what a partition's owner does about operators' pauses and positions
// (issue 43), with no I/O: the rule an advance must pass, which offsets.Store's advance runs in
// SQL, and what the processor's control loop does with what it reads each second. The property
// test drives these decisions through random histories of owners, zombies, rebalances, crashes,
// pauses, rewinds and skips, against a model of the offsets row.
package positions

// Owner is an owner's view of its partition.
type Owner struct {
	Token  int64 // the token of its claim
	Next   int64 // the stored next offset as it last wrote or read it
	Change int64 // the row's position_change as it read it at its claim (0: none)
	Paused bool  // it takes no batch: its control view has a pause of the partition's source
}

// Row is what Postgres holds for the partition: the offsets row and whether a pause row covers it
// (a pause of its source topic or of its partition; a retry tier's same partition's included).
type Row struct {
	Token  int64
	Next   int64
	Change int64
	Paused bool
}

// Verdict is the outcome of an advance.
type Verdict int

const (
	// Advanced: the transaction goes on and applies its batch.
	Advanced Verdict = iota
	// Fenced: another owner claimed the partition (a higher token); the owner stops.
	Fenced
	// Moved: the stored position is not the owner's (an operator set it, or the database lost
	// commits); the owner starts again from the stored position.
	Moved
	// Paused: the partition is paused; nothing is applied, the owner keeps its place and waits.
	Paused
)

var verdicts = [...]string{"advanced", "fenced", "moved", "paused"}

func (v Verdict) String() string { return verdicts[v] }

// Advance is the rule an advance must pass, in one statement that locks the row (so a position
// set, which locks it too, is wholly before or wholly after it): the owner's token, the owner's
// next offset, and no pause. Only a token above the owner's is another owner's.
func Advance(o Owner, r Row) Verdict {
	switch {
	case r.Token > o.Token:
		return Fenced
	case r.Token < o.Token || r.Next != o.Next:
		return Moved
	case r.Paused:
		return Paused
	}
	return Advanced
}

// Action is what the control loop does for an owned partition.
type Action int

const (
	// Nothing: the owner goes on as it is.
	Nothing Action = iota
	// Pause: the owner stops fetching and taking batches, keeping its place and queue.
	Pause
	// Resume: the owner fetches and takes batches again.
	Resume
	// Restart: the owner starts again from the stored position (Start), idle or not.
	Restart
	// Stop: another owner claimed the partition.
	Stop
)

var actions = [...]string{"nothing", "pause", "resume", "restart", "stop"}

func (a Action) String() string { return actions[a] }

// Control decides what the control loop does, given the owner's view and the row it read. A
// position set since the owner's claim (a larger position_change) restarts it even where the
// stored next offset happens to equal its own: the owner's fetched records and held keys are of
// the position it had.
func Control(o Owner, r Row) Action {
	switch {
	case r.Token > o.Token:
		return Stop
	case r.Token < o.Token || r.Change > o.Change || r.Next != o.Next:
		return Restart
	case r.Paused != o.Paused && r.Paused:
		return Pause
	case r.Paused != o.Paused:
		return Resume
	}
	return Nothing
}

// Start is the view of an owner that starts (again) from the stored position.
func Start(r Row) Owner {
	return Owner{Token: r.Token, Next: r.Next, Change: r.Change, Paused: r.Paused}
}
