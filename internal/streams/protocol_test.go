package streams

import (
	"flag"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// The world TestProtocol drives the core through: an upstream processor numbering the events it
// emits into an outbox in its database (two source partitions, so two lineages), relays publishing
// them to one partition of Kafka (in any order, some twice, some late from a database that is
// gone), and a consumer group (this package's rules) deciding each record on every path: the
// partition's worker, retry tiers, dead letters replayed or discarded. The upstream's database
// loses commits at random — restored from a copy (same system identifier: its new start is its
// new identity), failed over, restarted without loss — and takes the numbers it lost again, for
// the same events or others. The consumer's database loses commits too (its effects with its
// state), and it may begin on a release that kept keys only.
//
// The invariant: an event (a message id) is never applied twice; and when everything has been
// published, retried and replayed, every event published is applied exactly once (one whose dead
// letter was discarded at most once). A stream's missing numbers are then only numbers never
// published. Failures print the shrunk history; a counterexample found becomes a test of its own
// (TestProtocolRegressions).

// checks is how many histories TestProtocol explores unless -rapid.checks says otherwise: at
// least 10,000 in every run of make test (a few seconds); `make protocol` runs far more.
const checks = 10000

// steps is the average length of a history (rapid's -rapid.steps): long enough for several
// losses, forks and read backs.
const steps = 100

const (
	model_W     = 2 * time.Minute // how late a relay of a database that is gone may still publish
	model_skew  = time.Minute     // relays' clocks against the database's
	keyAllSpan  = 6 * time.Hour   // the consumer's first retention under this protocol, after a release that kept keys
	model_keep  = 24 * time.Hour  // the retention after which Forget drops an idle stream, in histories that forget
	readBackMax = 3               // records a read back step reads
)

func TestProtocol(t *testing.T) {
	for name, v := range map[string]int{"rapid.checks": checks, "rapid.steps": steps} {
		if f := flag.Lookup(name); f != nil && f.Value.String() == f.DefValue {
			f.Value.Set(fmt.Sprint(v))
			defer f.Value.Set(f.DefValue)
		}
	}
	rapid.Check(t, func(rt *rapid.T) {
		w := newWorld(rt)
		rt.Repeat(w.actions())
		w.quiesce()
		w.checkEnd()
		w.checkForgets()
	})
}

type msgID struct{ part, src, idx int }

type srcRef struct{ part, off int }

type upRow struct {
	stream  ID
	seq     int64
	ident   int
	updated time.Time
	parent  ID
	forkSeq int64
	since   time.Time
}

type outRow struct {
	h   Header
	msg msgID
}

type upDB struct {
	ident    int
	pos      [2]int
	deferred []srcRef
	rows     [2]*upRow
	outbox   []outRow
	// The upstream's own release, in its database: before (the release before only: it emits
	// events unnumbered, decided by key), window (upgraded, the window open: either release may
	// apply a record; this one numbers its events Keyed), and after finalizing, keyedUntil (this
	// release numbers its events Keyed for a retention more).
	before, window bool
	keyedUntil     time.Time
	// Its history: the branches it descends from (a restore starts one), the writes done
	// (tick), and the tick of the copy each branch started from.
	path     []int
	tick     int
	forkTick []int
}

func (db *upDB) clone() *upDB {
	c := &upDB{ident: db.ident, pos: db.pos, deferred: slices.Clone(db.deferred), outbox: slices.Clone(db.outbox),
		before: db.before, window: db.window, keyedUntil: db.keyedUntil,
		path: slices.Clone(db.path), tick: db.tick, forkTick: slices.Clone(db.forkTick)}
	for i, r := range db.rows {
		if r != nil {
			cp := *r
			c.rows[i] = &cp
		}
	}
	return c
}

type late struct {
	row      outRow
	deadline time.Time
	skew     time.Duration
}

type logRec struct {
	h   Header
	msg msgID
	ts  time.Time
}

type downDB struct {
	pos         int
	lineages    map[ID]*Lineage
	keys        map[msgID]bool
	applied     map[msgID]int
	retry, dlq  []int // log offsets
	keyAllUntil time.Time
	oldRelease  bool // the release that kept keys only is the one acting
	// window: the upgrade window is open (its state is in this database): processes of the
	// release before may act beside this one's, which decides every numbered event by key too.
	window bool
	// What the checks need of this database's history (restored with it).
	decided map[ID]map[int64]bool // numbers decided under this protocol (by any verdict)
	firstIn map[msgID]ID          // the stream an event was first applied in (by number or key)
	firstAt map[msgID]time.Time   // and when
	lastAt  map[msgID]time.Time   // when it was last applied
}

func (d *downDB) clone() *downDB {
	c := &downDB{pos: d.pos, keys: maps.Clone(d.keys), applied: maps.Clone(d.applied), retry: slices.Clone(d.retry),
		dlq: slices.Clone(d.dlq), keyAllUntil: d.keyAllUntil, oldRelease: d.oldRelease, window: d.window, lineages: map[ID]*Lineage{},
		firstIn: maps.Clone(d.firstIn), firstAt: maps.Clone(d.firstAt), lastAt: maps.Clone(d.lastAt), decided: map[ID]map[int64]bool{}}
	for k, v := range d.decided {
		c.decided[k] = maps.Clone(v)
	}
	for k, l := range d.lineages {
		c.lineages[k] = cloneLineage(l)
	}
	return c
}

func cloneLineage(l *Lineage) *Lineage {
	c := &Lineage{Root: l.Root}
	for _, s := range l.Streams {
		cp := *s
		cp.Missing = slices.Clone(s.Missing)
		c.Streams = append(c.Streams, &cp)
	}
	if l.Pending != nil {
		p := *l.Pending
		p.Targets = slices.Clone(l.Pending.Targets)
		c.Pending = &p
	}
	if l.Unobserved != nil {
		c.Unobserved = map[ID]*Unobserved{}
		for k, u := range l.Unobserved {
			cp := *u
			c.Unobserved[k] = &cp
		}
	}
	return c
}

type world struct {
	t       *rapid.T
	now     time.Time
	ids     byte
	idents  int
	srcs    [2]int // source records produced per source partition
	up      *upDB
	upSnaps []*upDB
	lates   []late
	skew    time.Duration // the current relays' clock against the database's
	log     []logRec
	down    *downDB
	dnSnaps []*downDB
	// What the checks need, outside any database.
	oldApplied map[msgID]bool // applied by the release that kept keys only
	excused    map[msgID]bool // applied again after the first retention under this protocol, its other copy by the release before; or, forgetting, more than model_keep after its other copy
	keep       time.Duration  // Forget's retention: 0 in histories that never forget (no double excused for it)
	discarded  map[msgID]bool
	history    []string
	// crossedLate: the upstream's database was restored across its upgrade more than a
	// retention after finalizing; from then on, an event applied once unnumbered (by key) and
	// once by number is excused (see upRestore).
	crossedLate bool
	branches    int             // the upstream's histories started by restores
	unnumbered  map[msgID]bool  // applied from an unnumbered copy
	byNumber    map[msgID]bool  // applied from a numbered copy decided by number
	pubs        map[msgID][]pub // when its copies were published, numbered or not
}

type pub struct {
	at       time.Time
	numbered bool
}

func newWorld(t *rapid.T) *world {
	w := &world{t: t, now: time.UnixMilli(1_700_000_000_000), oldApplied: map[msgID]bool{}, excused: map[msgID]bool{}, discarded: map[msgID]bool{},
		unnumbered: map[msgID]bool{}, byNumber: map[msgID]bool{}, pubs: map[msgID][]pub{}}
	w.up = &upDB{ident: w.newIdent()}
	w.down = &downDB{lineages: map[ID]*Lineage{}, keys: map[msgID]bool{}, applied: map[msgID]int{},
		decided: map[ID]map[int64]bool{}, firstIn: map[msgID]ID{}, firstAt: map[msgID]time.Time{}, lastAt: map[msgID]time.Time{}}
	w.down.oldRelease = rapid.IntRange(0, 4).Draw(t, "old release first") == 0
	w.up.before = rapid.IntRange(0, 2).Draw(t, "upstream's release before first") == 0
	if rapid.Bool().Draw(t, "forget") {
		w.keep = model_keep
	}
	return w
}

func (w *world) newIdent() int { w.idents++; return w.idents }

func (w *world) newID() ID {
	w.ids++
	return ID{0xaa, w.ids}
}

func rootOf(part int) ID { return ID{0xee, byte(part)} }

func (w *world) note(format string, args ...any) {
	w.history = append(w.history, fmt.Sprintf(format, args...))
}

func (w *world) actions() map[string]func(*rapid.T) {
	consumer := func(f func(*rapid.T)) func(*rapid.T) {
		return func(t *rapid.T) { f(t); w.forget() }
	}
	return map[string]func(*rapid.T){
		"":              func(t *rapid.T) {}, // rapid's invariant hook slot: nothing
		"produce":       w.produce,
		"upApply":       w.upApply,
		"upDeferred":    w.upDeferred,
		"relay":         w.relay,
		"refuse":        w.refuse,
		"lateGhost":     w.lateGhost,
		"upSnapshot":    w.upSnapshot,
		"upRestore":     w.upRestore,
		"upRestart":     w.upRestart,
		"tick":          w.tick,
		"downMain":      consumer(w.beside(w.downMain)),
		"downRetry":     consumer(w.beside(w.downRetry)),
		"downReplay":    consumer(w.downReplay),
		"downDiscard":   consumer(w.downDiscard),
		"downReadBack":  consumer(w.downReadBack),
		"downSnapshot":  w.downSnapshot,
		"downRestore":   w.downRestore,
		"upgrade":       w.upgrade,
		"finalize":      w.finalize,
		"upUpgrade":     w.upUpgrade,
		"upFinalize":    w.upFinalize,
		"foreignHeader": w.foreignHeader,
	}
}

// --- the upstream ---

func (w *world) produce(t *rapid.T) {
	p := rapid.IntRange(0, 1).Draw(t, "part")
	w.srcs[p] += rapid.IntRange(1, 3).Draw(t, "n")
}

// events is how many events applying a source record emits: the same in every history.
func events(r srcRef) int { return 1 + (r.off*7+r.part*3)%3%2 }

// number takes the numbers of n events of partition part's stream, as outbox_streams does.
func (w *world) number(db *upDB, part, n int) (Header, int64) {
	row := db.rows[part]
	switch {
	case row == nil:
		row = &upRow{stream: w.newID()}
		db.rows[part] = row
		w.note("up: stream %x created for part %d (ident %d)", row.stream[1], part, db.ident)
	case row.ident != db.ident:
		since := row.updated
		for _, o := range db.rows {
			if o != nil && o.ident == row.ident && o.updated.After(since) {
				since = o.updated
			}
		}
		old := *row
		*row = upRow{stream: w.newID(), parent: old.stream, forkSeq: old.seq, since: since}
		w.note("up: stream %x forks %x at %d (ident %d -> %d)", row.stream[1], old.stream[1], old.seq, old.ident, db.ident)
	}
	row.ident, row.updated = db.ident, w.now
	first := row.seq + 1
	row.seq += int64(n)
	return Header{Stream: row.stream, Root: rootOf(part), Parent: row.parent, ForkSeq: row.forkSeq, Since: row.since}, first
}

func (w *world) apply(db *upDB, r srcRef) {
	db.tick++
	n := events(r)
	if db.before || db.window && rapid.IntRange(0, 2).Draw(w.t, "by the upstream's release before") == 0 {
		for i := range n { // unnumbered: no stream header
			db.outbox = append(db.outbox, outRow{msg: msgID{r.part, r.off, i}})
		}
		w.note("up: applied %d/%d by the release before: %d events unnumbered", r.part, r.off, n)
		return
	}
	h, first := w.number(db, r.part, n)
	h.Keyed = db.window || w.now.Before(db.keyedUntil)
	for i := range n {
		h.Seq, h.Src = first+int64(i), int64(r.off)
		db.outbox = append(db.outbox, outRow{h: h, msg: msgID{r.part, r.off, i}})
	}
	w.note("up: applied %d/%d: %x %d..%d (keyed %v)", r.part, r.off, h.Stream[1], first, first+int64(n)-1, h.Keyed)
}

// upUpgrade: the upstream's first process of this release migrates its database; the window
// opens.
func (w *world) upUpgrade(t *rapid.T) {
	if !w.up.before {
		t.Skip("upstream upgraded")
	}
	w.up.before, w.up.window = false, true
	w.up.tick++
	w.note("up: upgraded; its window is open")
}

// upFinalize: the upstream's window is finalized; its events are numbered Keyed for a retention
// more.
func (w *world) upFinalize(t *rapid.T) {
	if !w.up.window {
		t.Skip("no upstream window")
	}
	w.up.window = false
	w.up.tick++
	w.up.keyedUntil = w.now.Add(keyAllSpan)
	w.note("up: its window finalized; keyed until %s", w.up.keyedUntil.Format(time.TimeOnly))
}

func (w *world) upApply(t *rapid.T) {
	p := rapid.IntRange(0, 1).Draw(t, "part")
	if w.up.pos[p] >= w.srcs[p] {
		t.Skip("nothing to apply")
	}
	r := srcRef{p, w.up.pos[p]}
	w.up.pos[p]++
	switch rapid.IntRange(0, 9).Draw(t, "fate") {
	case 0, 1: // a retry tier, held behind its key, or a dead letter replayed later: applied out of order
		w.up.deferred = append(w.up.deferred, r)
	case 2: // dead-lettered upstream for good: no event in this history
	default:
		w.apply(w.up, r)
	}
}

func (w *world) upDeferred(t *rapid.T) {
	if len(w.up.deferred) == 0 {
		t.Skip("none deferred")
	}
	i := rapid.IntRange(0, len(w.up.deferred)-1).Draw(t, "i")
	r := w.up.deferred[i]
	w.up.deferred = slices.Delete(w.up.deferred, i, i+1)
	w.apply(w.up, r)
}

func (w *world) publish(row outRow, skew time.Duration) {
	w.log = append(w.log, logRec{h: row.h, msg: row.msg, ts: w.now.Add(skew)})
	w.pubs[row.msg] = append(w.pubs[row.msg], pub{at: w.now.Add(skew), numbered: row.h != (Header{})})
}

// excuseTwin excuses applying r again when one of its copies was an unnumbered one the
// upstream's release before published and the other was applied by number: the upstream numbers
// an event Keyed while that release may have published it (its window open, or finalized less
// than a retention ago), so only copies published a retention or more apart, or a restore across
// the finalize past that (crossedLate), may be applied twice, as keys promise.
func (w *world) excuseTwin(r logRec, byNumber bool) {
	numbered := r.h != (Header{})
	if w.down.applied[r.msg] == 0 || (numbered && (!byNumber || !w.unnumbered[r.msg])) || (!numbered && !w.byNumber[r.msg]) {
		return
	}
	far := w.crossedLate
	for _, p := range w.pubs[r.msg] {
		if p.numbered != numbered {
			if d := r.ts.Sub(p.at); d >= keyAllSpan || d <= -keyAllSpan {
				far = true
			}
		}
	}
	if far {
		w.excused[r.msg] = true
	}
}

func (w *world) relay(t *rapid.T) {
	if len(w.up.outbox) == 0 {
		t.Skip("outbox empty")
	}
	i := rapid.IntRange(0, len(w.up.outbox)-1).Draw(t, "row") // lanes: any order across keys
	if rapid.IntRange(0, 2).Draw(t, "newest") == 0 {
		i = len(w.up.outbox) - 1 // often the newest first: a fork's records before its parent's
	}
	row := w.up.outbox[i]
	w.publish(row, w.skew)
	if rapid.IntRange(0, 6).Draw(t, "keep") > 0 { // else the relay died before its delete: published again later
		w.up.outbox = slices.Delete(w.up.outbox, i, i+1)
	}
}

// refuse: Kafka refuses a row for good (too large); the relay sets it aside, and nobody publishes
// it again: its number never comes.
func (w *world) refuse(t *rapid.T) {
	if len(w.up.outbox) == 0 {
		t.Skip("outbox empty")
	}
	i := rapid.IntRange(0, len(w.up.outbox)-1).Draw(t, "row")
	w.note("up: %x %d refused for good", w.up.outbox[i].h.Stream[1], w.up.outbox[i].h.Seq)
	w.up.outbox = slices.Delete(w.up.outbox, i, i+1)
}

func (w *world) lateGhost(t *rapid.T) {
	var ok []int
	for i, l := range w.lates {
		if !w.now.After(l.deadline) {
			ok = append(ok, i)
		}
	}
	if len(ok) == 0 {
		t.Skip("no late publish possible")
	}
	i := ok[rapid.IntRange(0, len(ok)-1).Draw(t, "late")]
	w.publish(w.lates[i].row, w.lates[i].skew)
	w.note("up: a relay of a database that is gone publishes %x %d late", w.lates[i].row.h.Stream[1], w.lates[i].row.h.Seq)
	if rapid.Bool().Draw(t, "again") {
		w.lates = slices.Delete(w.lates, i, i+1)
	}
}

func (w *world) upSnapshot(t *rapid.T) {
	if len(w.upSnaps) >= 4 {
		w.upSnaps = w.upSnaps[1:]
	}
	w.upSnaps = append(w.upSnaps, w.up.clone())
}

// loseTo replaces the upstream's database with db under a new identity; the relays of the one
// that is gone may still publish what they had read, for model_W.
func (w *world) loseTo(t *rapid.T, db *upDB) {
	for _, row := range w.up.outbox {
		if rapid.Bool().Draw(t, "in flight") {
			w.lates = append(w.lates, late{row: row, deadline: w.now.Add(model_W), skew: w.skew})
		}
	}
	w.up = db
	w.up.ident = w.newIdent()
	w.skew = time.Duration(rapid.Int64Range(-int64(model_skew), int64(model_skew)).Draw(t, "skew"))
}

func (w *world) upRestore(t *rapid.T) {
	if len(w.upSnaps) == 0 {
		t.Skip("no copy")
	}
	s := w.upSnaps[rapid.IntRange(0, len(w.upSnaps)-1).Draw(t, "copy")]
	w.note("up: database restored from a copy (ident %d)", w.idents+1)
	keyed := func(db *upDB) bool { return db.before || db.window || w.now.Before(db.keyedUntil) }
	if keyed(s) != keyed(w.up) || !s.ancestorOf(w.up) {
		// Between a copy where the release before acts, or did less than a retention ago, and a
		// database finalized more than a retention ago, either way (a backup from before the
		// upgrade's finalize: the way back, per docs/upgrading.md); or to a copy that is no
		// earlier state of this database (a backup taken before an earlier restore, of a history
		// abandoned since). Events one release emitted numbered and the other unnumbered are
		// decided by key only while the upgraded side numbers them Keyed, which it knows from its
		// own history: across such a restore, the promise ends (the docs say so).
		w.crossedLate = true
		w.note("up: the restore crosses the upgrade's finalize and a retention, or another history")
	}
	next := s.clone()
	w.branches++
	next.path, next.forkTick = append(slices.Clone(s.path), w.branches), append(slices.Clone(s.forkTick), s.tick)
	w.loseTo(t, next)
}

// ancestorOf reports whether db is an earlier state of cur's history: cur descends from it
// through writes and restores of copies taken no later than each branch point.
func (db *upDB) ancestorOf(cur *upDB) bool {
	n := len(db.path)
	if n > len(cur.path) || !slices.Equal(db.path, cur.path[:n]) {
		return false
	}
	if n == len(cur.path) {
		return db.tick <= cur.tick
	}
	return db.tick <= cur.forkTick[n]
}

func (w *world) upRestart(t *rapid.T) {
	w.note("up: database restarted (ident %d)", w.idents+1)
	w.loseTo(t, w.up)
}

func (w *world) tick(t *rapid.T) {
	defer func() { w.note("tick: %s", w.now.Format(time.DateTime)) }()
	switch rapid.IntRange(0, 9).Draw(t, "how long") {
	case 0:
		w.now = w.now.Add(time.Duration(rapid.IntRange(1, 48).Draw(t, "hours")) * time.Hour)
	case 1, 2:
		w.now = w.now.Add(time.Duration(rapid.IntRange(1, 20).Draw(t, "minutes")) * time.Minute)
	default:
		w.now = w.now.Add(time.Duration(rapid.IntRange(1, 90).Draw(t, "seconds")) * time.Second)
	}
}

// --- the consumer ---

func (w *world) event(off int) Event {
	r := w.log[off]
	return Event{Header: r.h, Offset: int64(off)}
}

// sinceOffset is the first offset whose timestamp is at or after at (ListOffsetsAfterMilli).
func (w *world) sinceOffset(at time.Time) int64 {
	for i, r := range w.log {
		if !r.ts.Before(at) {
			return int64(i)
		}
	}
	return int64(len(w.log))
}

func (w *world) lineage(root ID) *Lineage {
	l := w.down.lineages[root]
	if l == nil {
		l = &Lineage{Root: root}
		w.down.lineages[root] = l
	}
	return l
}

// byKey looks m's key up and records it: whether it was recorded before.
func (w *world) byKey(m msgID) (copy bool) {
	if w.down.keys[m] {
		return true
	}
	w.down.keys[m] = true
	return false
}

func (w *world) applied(m msgID, how string) {
	d := w.down
	d.applied[m]++
	if d.oldRelease {
		w.oldApplied[m] = true
	}
	if d.applied[m] > 1 && w.oldApplied[m] && !w.now.Before(d.keyAllUntil) && !d.oldRelease {
		w.excused[m] = true
	}
	if d.applied[m] > 1 && w.keep > 0 && w.now.Sub(d.lastAt[m]) >= w.keep {
		w.excused[m] = true // its stream forgotten: the promise of keys, kept for the retention
	}
	if strings.HasPrefix(how, "unnumbered") {
		w.unnumbered[m] = true
	} else if strings.HasSuffix(how, "by number") {
		w.byNumber[m] = true
	}

	d.lastAt[m] = w.now
	w.note("down: applied %v (%s)", m, how)
	if d.applied[m] > 1 && !w.excused[m] {
		w.t.Fatalf("event %v applied %d times (first in %x at %s, now %s)\nhistory:\n  %s\n%s", m, d.applied[m],
			d.firstIn[m][1], d.firstAt[m].Format(time.DateTime), w.now.Format(time.DateTime), joinLines(w.history), w.dump())
	}
}

// dump is the log and the consumer's lineages, for a failure's message.
func (w *world) dump() string {
	out := "log:\n"
	for i, r := range w.log {
		if r.h == (Header{}) {
			continue
		}
		out += fmt.Sprintf("  %d: stream %x seq %d src %d parent %x fork %d %v ts %s\n", i, r.h.Stream[1], r.h.Seq, r.h.Src, r.h.Parent[1], r.h.ForkSeq, r.msg, r.ts.Format(time.TimeOnly))
	}
	out += fmt.Sprintf("consumer at %d, retry %v, dlq %v\n", w.down.pos, w.down.retry, w.down.dlq)
	for root, l := range w.down.lineages {
		out += fmt.Sprintf("lineage %x: pending %+v unobserved %d\n", root[1], l.Pending, len(l.Unobserved))
		for _, s := range l.Streams {
			out += fmt.Sprintf("  stream %x parent %x fork %d first %d seen %d maxsrc %d floor %d high %d missing %s keyed>%d horizon %d\n",
				s.ID[1], s.Parent[1], s.ForkSeq, s.First, s.SeenHigh, s.MaxSrc, s.Floor, s.High, s.Missing, s.KeyedAbove, s.Horizon)
		}
	}
	return out
}

func joinLines(h []string) string {
	if len(h) > 400 {
		h = h[len(h)-400:] // the end of a long history: where it failed
	}
	return strings.Join(h, "\n  ")
}

// decide carries out the core's verdict on the record at off, as the transaction that applies it
// would; it returns false, having changed nothing, if the core said to wait for a read back.
func (w *world) decide(off int, keyAll, main bool) bool {
	r := w.log[off]
	if r.h == (Header{}) { // another producer's record, or a header that does not fit where it is
		w.excuseTwin(r, false)
		if !w.byKey(r.msg) {
			w.applied(r.msg, "unnumbered, by key")
		}
		return true
	}
	if w.down.oldRelease {
		if !w.byKey(r.msg) {
			w.applied(r.msg, "release before, by key")
		}
		return true
	}
	l := w.lineage(r.h.Root)
	e := w.event(off)
	if !main && l.NeedsPrepare(e, false) {
		// The prepare's own transaction, then this one.
		l.Prepare(e, int64(w.down.pos), w.sinceOffset(e.Since.Add(-Skew)), false)
		w.note("down: prepared unobserved %x %d at %d; pending %v", e.Stream[1], e.Seq, off, l.Pending != nil)
	}
	v := l.Decide(e, keyAll || w.down.window || w.now.Before(w.down.keyAllUntil))
	if v != Wait {
	}
	if v != Wait && l.Stream(e.Stream) != nil { // decided by its number state
		if w.down.decided[e.Stream] == nil {
			w.down.decided[e.Stream] = map[int64]bool{}
		}
		w.down.decided[e.Stream][e.Seq] = true
	}
	switch v {
	case Wait:
		return false
	case Apply:
		w.excuseTwin(r, true)
		if w.down.applied[r.msg] == 0 {
			w.down.firstIn[r.msg], w.down.firstAt[r.msg] = e.Stream, w.now
		}
		w.applied(r.msg, fmt.Sprintf("%x %d by number", r.h.Stream[1], r.h.Seq))
		l.Done(e, false)
	case Copy:
		w.note("down: %v skipped: %x %d applied", r.msg, r.h.Stream[1], r.h.Seq)
	case ByKey:
		if w.byKey(r.msg) {
			w.note("down: %v skipped by key", r.msg)
		} else {
			if w.down.applied[r.msg] == 0 {
				w.down.firstIn[r.msg], w.down.firstAt[r.msg] = e.Stream, w.now
			}
			w.applied(r.msg, fmt.Sprintf("%x %d by key", r.h.Stream[1], r.h.Seq))
		}
		l.Done(e, true)
	}
	return true
}

func (w *world) readBackStep(l *Lineage) {
	p := l.Pending
	if p == nil {
		return
	}
	end := min(p.Cursor+readBackMax, p.To)
	for off := p.Cursor; off < end; off++ {
		r := w.log[off]
		if r.h.Root != l.Root {
			continue
		}
		if l.ReadBackRecord(w.event(int(off))) {
			w.down.keys[r.msg] = true
			w.note("down: read back keys %v", r.msg)
		}
	}
	p.Cursor = end
	if p.Cursor >= p.To {
		l.ReadBackDone()
		w.note("down: read back done")
	}
}

func (w *world) downMain(t *rapid.T) {
	d := w.down
	if d.pos >= len(w.log) {
		t.Skip("caught up")
	}
	n := rapid.IntRange(1, 4).Draw(t, "batch")
	var fates []int
	for range min(n, len(w.log)-d.pos) {
		fates = append(fates, rapid.IntRange(0, 11).Draw(t, "fate"))
	}
	w.mainBatch(fates)
}

// mainBatch has the partition's worker take its next len(fates) records in one transaction: fate
// 0 sends a record to a retry tier, 1 dead-letters it, others apply it. If a record needs
// preparing, the batch's records are prepared (a transaction of its own) and the batch is left
// for the next step; if one must wait for a read back, a step of it is done instead and the batch
// rolls back.
func (w *world) mainBatch(fates []int) {
	d := w.down
	pos := d.pos
	if !d.oldRelease {
		need := false
		for k := range fates {
			if r := w.log[pos+k]; r.h != (Header{}) && w.lineage(r.h.Root).NeedsPrepare(w.event(pos+k), true) {
				need = true
			}
		}
		if need {
			for k := range fates {
				if r := w.log[pos+k]; r.h != (Header{}) {
					l := w.lineage(r.h.Root)
					e := w.event(pos + k)
					known := l.Stream(e.Stream) != nil
					l.Prepare(e, int64(pos), w.sinceOffset(e.Since.Add(-Skew)), true)
					if !known && l.Stream(e.Stream) != nil {
						delete(w.down.decided, e.Stream) // registered (again): its numbers start afresh
					}
					w.note("down: prepared %x %d at %d (parent %x at %d); pending %v", e.Stream[1], e.Seq, pos+k, e.Parent[1], e.ForkSeq, l.Pending != nil)
				}
			}
			return
		}
	}
	saved := d.clone() // the batch's transaction
	savedNotes := len(w.history)
	for k, fate := range fates {
		off := pos + k
		r := w.log[off]
		if r.h != (Header{}) && !d.oldRelease {
			l := w.lineage(r.h.Root)
			if l.NeedsPrepare(w.event(off), true) {
				panic("a record needs preparing after its batch was prepared")
			}
			l.Observe(w.event(off))
		}
		switch fate {
		case 0:
			d.retry = append(d.retry, off)
		case 1:
			d.dlq = append(d.dlq, off)
		default:
			if !w.decide(off, false, true) { // the batch rolls back; a read back step instead
				*w.down = *saved
				w.history = w.history[:savedNotes]
				w.readBackStep(w.lineage(r.h.Root))
				return
			}
		}
	}
	d.pos = pos + len(fates)
}

func (w *world) downRetry(t *rapid.T) {
	d := w.down
	if len(d.retry) == 0 {
		t.Skip("no retry")
	}
	i := rapid.IntRange(0, len(d.retry)-1).Draw(t, "i")
	off := d.retry[i]
	switch rapid.IntRange(0, 5).Draw(t, "fate") {
	case 0: // fails again: stays in the tiers
	case 1:
		d.retry = slices.Delete(d.retry, i, i+1)
		d.dlq = append(d.dlq, off)
	default:
		if w.decide(off, false, false) {
			d.retry = slices.Delete(d.retry, i, i+1)
		} else {
			w.readBackStep(w.lineage(w.log[off].h.Root))
		}
	}
}

func (w *world) downReplay(t *rapid.T) {
	d := w.down
	if len(d.dlq) == 0 || d.oldRelease {
		t.Skip("no dead letter")
	}
	i := rapid.IntRange(0, len(d.dlq)-1).Draw(t, "i")
	if w.decide(d.dlq[i], true, false) {
		d.dlq = slices.Delete(d.dlq, i, i+1)
	} else {
		w.readBackStep(w.lineage(w.log[d.dlq[i]].h.Root))
	}
}

func (w *world) downDiscard(t *rapid.T) {
	d := w.down
	if len(d.dlq) == 0 || d.oldRelease {
		t.Skip("no dead letter")
	}
	i := rapid.IntRange(0, len(d.dlq)-1).Draw(t, "i")
	r := w.log[d.dlq[i]]
	if r.h != (Header{}) {
		w.lineage(r.h.Root).Done(w.event(d.dlq[i]), false)
	}
	w.discarded[r.msg] = true
	w.note("down: discarded %v", r.msg)
	d.dlq = slices.Delete(d.dlq, i, i+1)
}

func (w *world) downReadBack(t *rapid.T) {
	for _, root := range []ID{rootOf(0), rootOf(1)} {
		if l := w.down.lineages[root]; l != nil && l.Pending != nil {
			w.readBackStep(l)
			return
		}
	}
	t.Skip("no read back")
}

func (w *world) downSnapshot(t *rapid.T) {
	if w.down.oldRelease {
		t.Skip("old release")
	}
	if len(w.dnSnaps) >= 3 {
		w.dnSnaps = w.dnSnaps[1:]
	}
	w.dnSnaps = append(w.dnSnaps, w.down.clone())
}

func (w *world) downRestore(t *rapid.T) {
	if len(w.dnSnaps) == 0 || w.down.oldRelease {
		t.Skip("no copy")
	}
	w.down = w.dnSnaps[rapid.IntRange(0, len(w.dnSnaps)-1).Draw(t, "copy")].clone()
	w.note("down: the consumer's database restored (position %d)", w.down.pos)
}

func (w *world) upgrade(t *rapid.T) {
	if !w.down.oldRelease {
		t.Skip("upgraded")
	}
	w.down.oldRelease, w.down.window = false, true
	w.note("down: upgraded; the window is open")
}

// finalize closes the upgrade window: the release before acts no more; numbered events are
// decided by key as well for a retention more.
func (w *world) finalize(t *rapid.T) {
	if !w.down.window {
		t.Skip("no window")
	}
	w.down.window = false
	w.down.keyAllUntil = w.now.Add(keyAllSpan)
	w.note("down: the window finalized; keys all until %s", w.down.keyAllUntil.Format(time.TimeOnly))
}

// beside has a step done, while the window is open, by a process of the release before now and
// then: a partition (or a retry tier's) moved to it in a rolling update or a rollback.
func (w *world) beside(step func(*rapid.T)) func(*rapid.T) {
	return func(t *rapid.T) {
		if !w.down.window || rapid.IntRange(0, 2).Draw(t, "by the release before") != 0 {
			step(t)
			return
		}
		w.down.oldRelease = true
		w.note("down: a process of the release before acts")
		defer func() { w.down.oldRelease = false }()
		step(t)
	}
}

// foreignHeader: another producer forwards an event with its headers (Kafka Streams does by
// default) into a topic or partition its stream does not belong to; the consumer's parse finds the
// header does not fit where it is and treats it as unnumbered (the model: a zero header).
func (w *world) foreignHeader(t *rapid.T) {
	w.log = append(w.log, logRec{msg: msgID{part: 9, src: len(w.log)}, ts: w.now})
}

// --- the end ---

// quiesce lets everything finish: the upstream applies what it has left, the relays publish, the
// consumer catches up, retries and replays all.
func (w *world) quiesce() {
	if w.down.oldRelease {
		w.down.oldRelease = false
		w.down.keyAllUntil = w.now.Add(keyAllSpan)
	}
	for p := range 2 {
		for w.up.pos[p] < w.srcs[p] {
			w.apply(w.up, srcRef{p, w.up.pos[p]})
			w.up.pos[p]++
		}
	}
	for _, r := range w.up.deferred {
		w.apply(w.up, r)
	}
	w.up.deferred = nil
	for _, l := range w.lates {
		if !w.now.After(l.deadline) {
			w.publish(l.row, l.skew)
		}
	}
	w.lates = nil
	for _, row := range w.up.outbox {
		w.publish(row, w.skew)
	}
	w.up.outbox = nil
	d := w.down
	for guard := 0; d.pos < len(w.log) || len(d.retry) > 0 || len(d.dlq) > 0; guard++ {
		if guard > 100000 {
			w.t.Fatalf("the consumer does not finish: position %d of %d, %d retries, %d dead letters", d.pos, len(w.log), len(d.retry), len(d.dlq))
		}
		switch {
		case d.pos < len(w.log):
			w.mainBatch([]int{2})
		case len(d.retry) > 0:
			if w.decide(d.retry[0], false, false) {
				d.retry = d.retry[1:]
			} else {
				w.readBackStep(w.lineage(w.log[d.retry[0]].h.Root))
			}
		default:
			if w.decide(d.dlq[0], true, false) {
				d.dlq = d.dlq[1:]
			} else {
				w.readBackStep(w.lineage(w.log[d.dlq[0]].h.Root))
			}
		}
	}
	for _, l := range d.lineages {
		for l.Pending != nil {
			w.readBackStep(l)
		}
	}
}

func (w *world) checkEnd() {
	d := w.down
	published := map[msgID]bool{}
	for _, r := range w.log {
		published[r.msg] = true
	}
	for m := range published {
		n := d.applied[m]
		switch {
		case w.excused[m]:
		case w.discarded[m] && n <= 1:
		case n != 1:
			w.t.Fatalf("event %v published and applied %d times\nhistory:\n  %s", m, n, joinLines(w.history))
		}
	}
	for _, l := range d.lineages {
		for _, s := range l.Streams {
			for _, sp := range s.Missing {
				for q := sp.Lo; q < sp.Hi; q++ {
					if w.down.decided[s.ID][q] {
						w.t.Fatalf("stream %x keeps %d missing, published and decided\nhistory:\n  %s", s.ID[1], q, joinLines(w.history))
					}
				}
			}
		}
	}
}

// forget is every transaction's write of its lineages (Forget before the write).
func (w *world) forget() {
	for _, l := range w.down.lineages {
		if n := l.Forget(w.now, w.keep); n > 0 {
			w.note("down: forgot %d streams of lineage %x", n, l.Root[1])
		}
	}
}

// checkForgets: once nothing was met for the retention, a lineage keeps nothing (the state of
// streams replaced is bounded by what the retention meets).
func (w *world) checkForgets() {
	if w.keep == 0 {
		return
	}
	w.forget()
	w.now = w.now.Add(w.keep)
	w.forget()
	for _, l := range w.down.lineages {
		if !l.Empty() {
			w.t.Fatalf("lineage %x keeps %d streams, %d unobserved, pending %v after a retention without a record", l.Root[1], len(l.Streams), len(l.Unobserved), l.Pending)
		}
	}
}
