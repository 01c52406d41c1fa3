// Package streams is the deciding half of the deduplication protocol of numbered events (the
// argument is in package sink, "Streams"): what a consumer that deduplicates on the message id
// does with an event a kafkapg service numbered — apply it, skip it as a copy, decide it by its
// key as well, or wait for a read back — and what it keeps, per lineage of streams, to decide.
// It does no I/O: the processor loads a lineage's rows, calls these functions in the transaction
// that applies the records, and writes the rows back; it reads Kafka for a read back when told.
// TestProtocol drives it, with a model of the upstream database, its relays and Kafka, through
// random histories of lost commits, restores, late publishes, retries, dead letters and
// replays.
//
// The rules, which the functions below carry out:
//
//   - Every numbered record of a partition is observed by the partition's worker, in offset
//     order, in the transaction that moves the partition's position past it (Observe), whatever
//     becomes of it (applied, a copy, held, sent to a retry tier, dead-lettered). A stream
//     observed for the first time is registered first, in a transaction of its own (Register):
//     the streams of a lineage are therefore known in the order they appear in the partition,
//     and every record before the position was observed.
//   - A stream's numbers are dense and each is taken once in a database history, so within a
//     stream a number is an event: an event whose number was applied is a copy (Decide: Copy).
//   - A database that loses commits takes numbers again: it forks its streams (a new stream
//     names its parent and the last number of the parent it kept), or, if it lost a stream's
//     row entirely, creates it again under the same root. The events a newer stream may repeat
//     are those of older streams that its own history does not keep (keptBound). Both sides of
//     such a pair are decided by key as well (tainted): an older stream's event that a newer
//     stream may repeat; a newer stream's event from a source offset at or below its horizon
//     (the highest source offset among the older streams' events it may repeat that were
//     observed, raised by each one observed later: a late publish, or a parent registered after
//     its fork); and a number below the first one observed (Floor: events applied by a release
//     before this protocol, by key).
//   - An event decided by number before a newer stream could repeat it was not keyed: the
//     newer stream's registration reads those events back from Kafka (ReadBack) and records the
//     keys of the ones applied, before any of its records is decided.
package streams

import (
	"math"
	"slices"
	"time"

	"github.com/google/uuid"
)

// Skew is the difference allowed between the clock of the database that numbers events and the
// timestamps Kafka gives them, when a read back finds the first record published after a time.
const Skew = 5 * time.Minute

// NoneKeyed is a stream's KeyedAbove before any of its events had to be keyed.
const NoneKeyed = math.MaxInt64

// ID is a stream's (or a root's) UUID.
type ID [16]byte

// MarshalText writes id as a UUID.
func (id ID) MarshalText() ([]byte, error) { return []byte(uuid.UUID(id).String()), nil }

// UnmarshalText reads a UUID.
func (id *ID) UnmarshalText(b []byte) error {
	u, err := uuid.ParseBytes(b)
	*id = ID(u)
	return err
}

func (id ID) String() string { return uuid.UUID(id).String() }

// Header is what an event's stream header says.
type Header struct {
	Stream  ID
	Seq     int64 // 1, 2, 3, ... in the order the emitting transactions committed
	Root    ID    // the lineage: every stream the upstream numbered for one source and destination partition
	Src     int64 // the offset of the source record whose handling emitted the event
	Parent  ID    // a fork's parent; zero for a stream created afresh
	ForkSeq int64 // the last number of Parent the fork's database kept; 0 for a stream created afresh
	// Since is, for a fork, a time before which no event of its parent that the fork's database
	// lost was published (by the database's clock): the latest time a number was taken under the
	// parent's database identity, among the rows the database kept.
	Since time.Time
	// Keyed says the event was numbered while a process of the upstream's release before may
	// have emitted it unnumbered (the upstream schema's upgrade window open, or finalized less
	// than a retention ago): that copy, lost with a commit of the upstream's database and emitted
	// again by this release, is one no stream knows. Such an event is decided by key as well.
	Keyed bool
}

// IsFork reports whether h's stream replaces another.
func (h Header) IsFork() bool { return h.ForkSeq > 0 }

// Event is a numbered record of the partition a lineage's events go to.
type Event struct {
	Header
	Offset int64 // in the partition (a retried or dead-lettered record's original offset)
}

// Stream is what a consumer group keeps of one stream.
type Stream struct {
	ID       ID        `json:"id"`
	Parent   ID        `json:"parent"`
	ForkSeq  int64     `json:"fork_seq"`
	Since    time.Time `json:"since"`
	First    int64     `json:"first"`     // the offset it was first observed at
	SeenHigh int64     `json:"seen_high"` // the highest number observed
	MaxSrc   int64     `json:"max_src"`   // the highest source offset observed; -1 before any
	// The numbers applied: from Floor (the first number observed) to High, less Missing. Numbers
	// below Floor are decided by key.
	Floor   int64 `json:"floor"`
	High    int64 `json:"high"`
	Missing Spans `json:"missing"`
	// KeyedAbove: every number above it that was applied here was keyed too (a read back
	// recorded its key, or it was decided by key). NoneKeyed until a newer stream needs it; raised
	// again by a number applied without its key above it (a stream registered later lengthened a
	// chain of parents: what a newer stream keeps grew).
	KeyedAbove int64 `json:"keyed_above"`
	// Horizon: for a successor, the highest source offset among the observed events of older
	// streams it may repeat; its records from source offsets up to it are decided by key too.
	Horizon int64 `json:"horizon"`
	// Touched is when a record of it was last met (observed, prepared, applied, decided by key),
	// in Unix seconds; Forget drops a stream not met for the retention.
	Touched int64 `json:"touched,omitempty"`
}

// Applied reports whether number n of s was applied (decided by number).
func (s *Stream) Applied(n int64) bool { return n >= s.Floor && n <= s.High && !s.Missing.Has(n) }

// ReadBack is a lineage's pending read back: the records of the partition from From up to (not
// including) To are to be given to ReadBackRecord; Cursor is how far it got.
type ReadBack struct {
	From    int64 `json:"from"`
	To      int64 `json:"to"`
	Cursor  int64 `json:"cursor"`
	Targets []ID  `json:"targets"` // the streams whose registration asked for it
}

// Lineage is what a consumer group keeps of one root's streams in one partition.
type Lineage struct {
	Root    ID        `json:"-"`
	Streams []*Stream `json:"streams"` // oldest first: in the order they were observed
	Pending *ReadBack `json:"pending,omitempty"`
	// Unobserved: streams whose records another path met (a retry or a dead letter of a
	// release before this protocol) that the partition's worker never observed.
	Unobserved map[ID]*Unobserved `json:"unobserved,omitempty"`

	met map[ID]bool // the streams met since Forget last stamped them
}

// Unobserved is what a lineage keeps of a stream the partition's worker never observed.
type Unobserved struct {
	SeenHigh int64 `json:"seen_high"` // as a Stream's
	MaxSrc   int64 `json:"max_src"`
	Keyed    int64 `json:"keyed"`             // the highest number decided (by key); when the worker observes the stream, numbers up to it stay decided by key
	Touched  int64 `json:"touched,omitempty"` // as a Stream's
}

// Stream returns the stream id of l, or nil.
func (l *Lineage) Stream(id ID) *Stream {
	if i := l.index(id); i >= 0 {
		return l.Streams[i]
	}
	return nil
}

func (l *Lineage) index(id ID) int {
	return slices.IndexFunc(l.Streams, func(s *Stream) bool { return s.ID == id })
}

// keptBound is the highest number of stream s that z's database history keeps: every number for
// z itself; for an ancestor, the last number its child on z's chain of parents forked at; -1 for
// any other stream (z may repeat every event of it). A chain whose link the group never observed
// ends there: the ancestors past it count as not kept, which decides more by key, never less.
func (l *Lineage) keptBound(z *Stream, s ID) int64 {
	if z.ID == s {
		return math.MaxInt64
	}
	cur := z
	for range len(l.Streams) + 1 {
		if cur.ForkSeq <= 0 {
			return -1
		}
		if cur.Parent == s {
			return cur.ForkSeq
		}
		if cur = l.Stream(cur.Parent); cur == nil {
			return -1
		}
	}
	return -1 // a cycle of parents cannot come from an upstream; count nothing as kept
}

// appliedIn reports whether s applied a number in (lo, hi].
func (s *Stream) appliedIn(lo, hi int64) bool {
	lo, hi = max(lo, s.Floor-1), min(hi, s.High)
	if lo >= hi {
		return false
	}
	var missing int64
	for _, m := range s.Missing {
		a, b := max(m.Lo, lo+1), min(m.Hi, hi+1)
		if a < b {
			missing += b - a
		}
	}
	return hi-lo > missing
}

// NeedsPrepare reports whether e must be prepared (Prepare) before it is observed (by the
// partition's worker: observing) or decided (by any other path): on the worker, its stream is new
// here; on another path, the worker never observed e (a record of a release before this
// protocol) and its stream is new here; on either, e raises the horizon of a newer stream that
// may repeat it.
func (l *Lineage) NeedsPrepare(e Event, observing bool) bool {
	i := l.index(e.Stream)
	if i < 0 {
		u := l.Unobserved[e.Stream]
		return observing || u == nil || e.Seq > u.SeenHigh || e.Src > u.MaxSrc || l.raises(-1, e)
	}
	s := l.Streams[i]
	if !observing {
		if e.Offset >= s.First {
			return false // observed: it raised what it raises then
		}
		if e.Seq > s.SeenHigh || e.Src > s.MaxSrc { // before its first offset: never observed
			return true // counts in what a stream registered later may repeat
		}
	}
	return l.raises(i, e)
}

// raises reports whether e, of the stream at index i (-1: an unobserved one, older than all),
// raises the horizon of a newer stream that may repeat it.
func (l *Lineage) raises(i int, e Event) bool {
	for _, z := range l.Streams[i+1:] {
		if e.Seq > l.keptBound(z, e.Stream) && e.Src > z.Horizon {
			return true
		}
	}
	return false
}

// Prepare readies the lineage for e, in a transaction of its own before the one that observes or
// decides e. pos is where the partition's worker stands: every record before it was observed.
// On the worker (observing), when one record of a batch needs it all of the batch's records are
// prepared, in offset order, and each is observed.
//
// A stream the worker meets for the first time is registered: it is the newest of the lineage.
// Its horizon covers what it may repeat of the older streams' events observed; and the older
// streams' events it may repeat that were applied by number (their keys never recorded) are to
// be read back: a fork's parent's from sinceOffset (the first offset whose timestamp is at or
// after the fork's Since less Skew: the events of the parent its database lost were published
// after that), any other stream's from the first offset it was observed at.
//
// An event of an older stream that a newer one may repeat, and that raises the newer one's
// horizon (it comes after the newer one's first record: a late publish, a copy of the database
// restored after another; or from another path, never observed: a record of a release before
// this protocol), makes the newer stream's events applied by number from source offsets up to the
// new horizon candidates for a repeat: they are to be read back, from the newer stream's first
// offset.
//
// It returns whether a read back is pending: it must be done (ReadBackRecord over the records
// from l.Pending.Cursor up to l.Pending.To, recording the keys it asks for; then ReadBackDone)
// before records of the lineage are decided (Decide says Wait).
func (l *Lineage) Prepare(e Event, pos, sinceOffset int64, observing bool) (readBack bool) {
	l.meet(e.Stream)
	i := l.index(e.Stream)
	switch {
	case i < 0 && observing:
		l.register(e, pos, sinceOffset)
		l.Observe(e)
		i = l.index(e.Stream) // a parent registered after its fork: the newer streams may repeat e
	case i < 0:
		if l.Unobserved == nil {
			l.Unobserved = map[ID]*Unobserved{}
		}
		u := l.Unobserved[e.Stream]
		if u == nil {
			u = &Unobserved{MaxSrc: -1}
			l.Unobserved[e.Stream] = u
		}
		u.SeenHigh, u.MaxSrc = max(u.SeenHigh, e.Seq), max(u.MaxSrc, e.Src)
	case observing:
		l.Observe(e)
	default:
		s := l.Streams[i]
		s.SeenHigh, s.MaxSrc = max(s.SeenHigh, e.Seq), max(s.MaxSrc, e.Src)
	}
	for _, z := range l.Streams[i+1:] {
		if e.Seq <= l.keptBound(z, e.Stream) || e.Src <= z.Horizon {
			continue
		}
		if z.High >= z.Floor { // z applied numbers: some may repeat e
			l.readBack(z.First, pos, z.ID)
		}
		z.Horizon = e.Src
	}
	return l.Pending != nil
}

func (l *Lineage) register(e Event, pos, sinceOffset int64) {
	floor, seen, maxSrc := e.Seq, int64(0), int64(-1)
	if u := l.Unobserved[e.Stream]; u != nil { // what other paths met of it counts as seen
		floor, seen, maxSrc = max(floor, u.Keyed+1), u.SeenHigh, u.MaxSrc
		delete(l.Unobserved, e.Stream)
	}
	z := &Stream{
		ID: e.Stream, Parent: e.Parent, ForkSeq: e.ForkSeq, Since: e.Since,
		First: e.Offset, SeenHigh: seen, MaxSrc: maxSrc,
		Floor: floor, High: floor - 1, KeyedAbove: NoneKeyed, Horizon: -1,
	}
	if !e.IsFork() {
		z.Parent = ID{}
	}
	// A parent observed after its fork (its last events published late) is older all the same:
	// it goes before its first child.
	at := len(l.Streams)
	for j, c := range l.Streams {
		if c.ForkSeq > 0 && c.Parent == z.ID {
			at = j
			break
		}
	}
	from := int64(math.MaxInt64)
	for _, s := range l.Streams[:at] {
		b := l.keptBound(z, s.ID)
		if s.SeenHigh > b {
			z.Horizon = max(z.Horizon, s.MaxSrc)
		}
		if s.KeyedAbove > b && s.appliedIn(b, s.KeyedAbove) {
			f := s.First
			if s.ID == z.Parent && z.ForkSeq > 0 {
				f = sinceOffset
			}
			from = min(from, f)
		}
	}
	for id, u := range l.Unobserved { // decided by key: nothing to read back
		b := int64(-1)
		if id == z.Parent && z.ForkSeq > 0 {
			b = z.ForkSeq
		}
		if u.SeenHigh > b {
			z.Horizon = max(z.Horizon, u.MaxSrc)
		}
	}
	l.Streams = slices.Insert(l.Streams, at, z)
	if from == math.MaxInt64 {
		if l.Pending == nil {
			l.keyedAbove(z) // nothing to read back: nothing z may repeat was applied unkeyed
		} else {
			l.Pending.Targets = append(l.Pending.Targets, z.ID)
		}
		return
	}
	l.readBack(from, pos, z.ID)
}

// readBack adds [from, to) to the pending read back, for target.
func (l *Lineage) readBack(from, to int64, target ID) {
	p := l.Pending
	if p == nil {
		l.Pending = &ReadBack{From: from, To: to, Cursor: from, Targets: []ID{target}}
		if from >= to {
			l.ReadBackDone()
		}
		return
	}
	p.From, p.To, p.Cursor = min(p.From, from), max(p.To, to), min(p.Cursor, from)
	if !slices.Contains(p.Targets, target) {
		p.Targets = append(p.Targets, target)
	}
}

// keyedAbove lowers the KeyedAbove of every stream older than z to what z may repeat of it: from
// now on its events z may repeat are tainted, and those applied before were keyed.
func (l *Lineage) keyedAbove(z *Stream) {
	for _, s := range l.Streams {
		if s == z {
			return
		}
		s.KeyedAbove = min(s.KeyedAbove, l.keptBound(z, s.ID))
	}
}

// Observe is the partition's worker passing e, in offset order, in the transaction that moves
// the position past it (after NeedsPrepare said no, or Prepare).
func (l *Lineage) Observe(e Event) {
	l.meet(e.Stream)
	s := l.Stream(e.Stream)
	if s == nil {
		return
	}
	s.First = min(s.First, e.Offset)
	s.SeenHigh, s.MaxSrc = max(s.SeenHigh, e.Seq), max(s.MaxSrc, e.Src)
}

// Verdict is what Decide says of an event.
type Verdict int

const (
	// Apply: a new event; apply it and call Done.
	Apply Verdict = iota
	// Copy: its number was applied; skip it.
	Copy
	// ByKey: decide it by its key (look it up and record it): a copy if the key was recorded
	// before, else apply it; call Done either way.
	ByKey
	// Wait: a read back is pending; do it (or wait for it), then decide again.
	Wait
)

func (v Verdict) String() string {
	return [...]string{"apply", "copy", "by key", "wait"}[v]
}

// Decide says what to do with e, a record of the lineage met by any path (the partition's
// worker, a retry tier, the held records, a replay). A stream never observed here (a dead letter
// of a release before, replayed) is decided by key. keyAll decides by key every event whose
// number was not applied: a replay of a dead letter (a copy of it may have been applied by a
// release that kept keys only), and every event while the group's first retention under this
// protocol runs (copies applied by the release before were keyed, not numbered). An event the
// upstream numbered as Keyed is decided by key too.
func (l *Lineage) Decide(e Event, keyAll bool) Verdict {
	i := l.index(e.Stream)
	switch {
	case i >= 0 && l.Streams[i].Applied(e.Seq):
		return Copy
	case l.Pending != nil:
		return Wait
	case i < 0:
		return ByKey
	}
	if keyAll || e.Keyed || e.Offset < l.Streams[i].First || l.tainted(i, e) {
		return ByKey // before its first record observed (a stream forgotten and registered again): no read back covers it
	}
	return Apply
}

// tainted reports whether e, of the stream at index i, may share its key with an event of
// another stream of the lineage.
func (l *Lineage) tainted(i int, e Event) bool {
	s := l.Streams[i]
	if e.Seq < s.Floor {
		return true
	}
	for _, z := range l.Streams[i+1:] {
		if e.Seq > l.keptBound(z, s.ID) {
			return true
		}
	}
	return e.Src <= s.Horizon
}

// Done marks e's number done: applied (keyed: by key, its key recorded), or a copy found by its
// key, or a dead letter discarded.
func (l *Lineage) Done(e Event, keyed bool) {
	l.meet(e.Stream)
	s := l.Stream(e.Stream)
	if s == nil {
		if u := l.Unobserved[e.Stream]; u != nil {
			u.Keyed = max(u.Keyed, e.Seq)
		}
		return
	}
	if e.Seq < s.Floor {
		return // decided by key alone
	}
	if !keyed && e.Seq > s.KeyedAbove {
		s.KeyedAbove = e.Seq
	}
	if e.Seq > s.High {
		s.Missing = s.Missing.AddAbove(s.High+1, e.Seq)
		s.High = e.Seq
		return
	}
	s.Missing = s.Missing.Remove(e.Seq)
}

// ReadBackRecord gives the pending read back e, a record of the lineage read again from Kafka
// (between the read back's cursor and To); it reports whether e's key must be recorded: it was
// applied here by number, and another stream's event may share its key.
func (l *Lineage) ReadBackRecord(e Event) (record bool) {
	i := l.index(e.Stream)
	return i >= 0 && l.Streams[i].Applied(e.Seq) && l.tainted(i, e)
}

// ReadBackDone ends the pending read back: every record between its cursor and To was given to
// ReadBackRecord and the keys it asked for recorded.
func (l *Lineage) ReadBackDone() {
	p := l.Pending
	if p == nil {
		return
	}
	for _, t := range p.Targets {
		if z := l.Stream(t); z != nil {
			l.keyedAbove(z)
		}
	}
	l.Pending = nil
}

func (l *Lineage) meet(id ID) {
	if l.met == nil {
		l.met = map[ID]bool{}
	}
	l.met[id] = true
}

// Forget stamps the streams met since it last ran (Observe, Prepare, Done) as touched at now, and
// drops what the lineage keeps of every stream (and unobserved stream) not touched for keep (the
// group's retention of keys; 0 drops nothing), unless a read back is pending. It returns how many
// it dropped. Called before the lineage is written back.
//
// A stream dropped is one no record of which was met for keep: every event of it was applied
// more than keep ago. A record of it met later is of a stream new here, as if the group never
// saw it: the worker registers it again (in its place, before a fork of it the lineage keeps),
// numbers below the one observed decided by key, and a copy of an event applied before it was
// dropped may be applied again — a copy more than keep after its original, as with keys, whose
// ring keeps them for the same time. A newer stream's chain of parents through a stream dropped
// ends there: the streams past it count as not kept by the newer one, which decides more of their
// events by key, never fewer; what a read back recorded stays true, as no stream is dropped while
// one is pending.
func (l *Lineage) Forget(now time.Time, keep time.Duration) (dropped int) {
	at := now.Unix()
	for _, s := range l.Streams {
		if l.met[s.ID] || s.Touched == 0 { // a row written before Touched began counts from now
			s.Touched = at
		}
	}
	for id, u := range l.Unobserved {
		if l.met[id] || u.Touched == 0 {
			u.Touched = at
		}
	}
	l.met = nil
	if keep <= 0 || l.Pending != nil {
		return 0
	}
	cut := now.Add(-keep).Unix()
	n := len(l.Streams)
	l.Streams = slices.DeleteFunc(l.Streams, func(s *Stream) bool { return s.Touched <= cut })
	dropped = n - len(l.Streams)
	for id, u := range l.Unobserved {
		if u.Touched <= cut {
			delete(l.Unobserved, id)
			dropped++
		}
	}
	if len(l.Unobserved) == 0 {
		l.Unobserved = nil
	}
	return dropped
}

// Empty reports whether l keeps nothing.
func (l *Lineage) Empty() bool {
	return len(l.Streams) == 0 && len(l.Unobserved) == 0 && l.Pending == nil
}
