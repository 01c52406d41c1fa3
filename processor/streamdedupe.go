package processor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/streams"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// Streams, the consuming side. A topic deduplicated on the message id (KeyFromHeader with
// sink.HeaderMessageID) receives, from kafkapg services, numbered events (sink.Event.Source):
// for those it keeps, per lineage of streams, a few numbers per stream instead of a key per event
// (idempotency_lineages). What to do with each record is decided by package internal/streams,
// which does no I/O; this file loads and writes its state, inside the transactions that apply
// the records, and does what it asks for outside them:
//
//   - The partition's worker observes every numbered record of its batch, in the batch's
//     transaction, whatever becomes of the record (observeStreams; route observes a record it
//     sends to a tier or dead-letters).
//   - A record that needs preparing (a stream met for the first time; an event that raises a newer
//     stream's horizon; on another path, a record the worker never observed) fails the
//     transaction with a *streamsWork; inPlace does the work — a transaction of its own that
//     prepares the records (streamsPrepare), then any read back — and tries again.
//   - A read back (readBack) reads the partition from Kafka with no transaction open, and
//     records, a chunk at a time, in a transaction that also moves its cursor, the keys the core
//     asks for: progress survives a retry and a restart, and no connection is held while Kafka is
//     read, nor a second one taken.
//
// The argument for why this applies every event exactly once is in sink/doc.go ("Streams") and
// internal/streams; TestProtocol checks it over random histories.

// messageIDKey is KeyFromHeader(sink.HeaderMessageID): a topic deduplicated on it deduplicates
// numbered events by their stream.
func messageIDKey(rec *Record) ([]byte, error) { return headerKey(sink.HeaderMessageID, rec) }

// isMessageIDKey reports whether key is messageIDKey (a function, not a closure: its code
// pointer is its own).
func isMessageIDKey(key IdempotencyKey) bool {
	return key != nil && codeOf(key) == messageIDKeyCode
}

// streamEvent is r as the core sees it, if r carries a stream header that fits where r is (its
// origin topic and partition: a header copied onto another record by another producer does not).
func streamEvent(r *Record) (streams.Event, bool) {
	st, ok := sink.ParseStream(r.Headers)
	if !ok || !st.Fits(r.Topic, r.Partition) {
		return streams.Event{}, false
	}
	return streams.Event{Header: streams.Header{
		Stream: st.ID, Seq: st.Seq, Root: st.Root, Src: st.SourceOffset,
		Parent: st.Parent, ForkSeq: st.ForkSeq, Since: st.Since, Keyed: st.Keyed,
	}, Offset: r.Offset}, true
}

// streamSQL is the statements of the consuming side, for a schema, beside its lineages' Store.
type streamSQL struct {
	store                       *streams.Store
	read, position, groupWindow string
}

func newStreamSQL(schema string) streamSQL {
	t := pgx.Identifier{schema, "idempotency_lineages"}.Sanitize()
	return streamSQL{
		store: streams.NewStore(schema),
		read:  `SELECT state FROM ` + t + ` WHERE consumer_group = $1 AND root = $2`,
		position: `SELECT coalesce(next_offset, 0) FROM ` + pgx.Identifier{schema, "offsets"}.Sanitize() + `
			WHERE consumer_group = $1 AND topic = $2 AND partition = $3`,
		// A group that consumed before this release decides by key as well for its first retention.
		groupWindow: `WITH g AS (INSERT INTO ` + pgx.Identifier{schema, "idempotency_groups"}.Sanitize() + ` (consumer_group, keys_all_until)
				SELECT $1, CASE WHEN EXISTS (SELECT 1 FROM ` + pgx.Identifier{schema, "offsets"}.Sanitize() + ` WHERE consumer_group = $1)
					OR EXISTS (SELECT 1 FROM ` + t + ` WHERE consumer_group = $1) THEN now() + $2::interval ELSE now() END
				ON CONFLICT (consumer_group) DO NOTHING RETURNING keys_all_until)
			SELECT keys_all_until FROM g UNION ALL
			SELECT keys_all_until FROM ` + pgx.Identifier{schema, "idempotency_groups"}.Sanitize() + ` WHERE consumer_group = $1 LIMIT 1`,
	}
}

// streamsOn reports whether a topic of the processor deduplicates numbered events by streams.
func (p *Processor) streamsOn() bool {
	for _, pol := range p.policies {
		if isMessageIDKey(pol.idempotencyKey) {
			return true
		}
	}
	return false
}

// streamsGroupWindow reads (and on the group's first run of this release, sets) until when the
// group decides every numbered record by key as well.
func (p *Processor) streamsGroupWindow(ctx context.Context) error {
	var until time.Time
	err := p.inPlace(ctx, nil, p.log, "", nil, func() error {
		if err := p.pool.QueryRow(ctx, p.streamSQL.groupWindow, p.cfg.Group, p.cfg.IdempotencyRetention).Scan(&until); err != nil {
			return fmt.Errorf("read the group's window of keys: %w", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	p.keysAllUntil.Store(until.UnixMilli())
	if time.Until(until) > 0 {
		p.log.Info("numbered events are deduplicated by key as well until the group's first retention under streams ends: copies of events the release before applied carry numbers it never marked",
			"until", until.UTC().Format(time.RFC3339))
	}
	return nil
}

// lineages is what one transaction loaded of the lineages, written back (flush) before it
// commits.
type lineages struct {
	source    string
	partition int32
	byRoot    map[streams.ID]*streams.Lineage
	dirty     map[streams.ID]bool
}

type lineagesKey struct{}

// withLineages gives the transaction of ctx a cache of lineages, for observeStreams and dedupe to
// share; the caller flushes it before committing.
func withLineages(ctx context.Context) (context.Context, *lineages) {
	ls := &lineages{}
	return context.WithValue(ctx, lineagesKey{}, ls), ls
}

func lineagesFrom(ctx context.Context) *lineages {
	ls, _ := ctx.Value(lineagesKey{}).(*lineages)
	return ls
}

// load locks and reads the lineages of roots (of source's partition) not loaded yet.
func (ls *lineages) load(ctx context.Context, p *Processor, tx pgx.Tx, source string, partition int32, roots []streams.ID) error {
	if ls.byRoot == nil {
		ls.byRoot, ls.dirty = map[streams.ID]*streams.Lineage{}, map[streams.ID]bool{}
		ls.source, ls.partition = source, partition
	}
	var want []streams.ID
	for _, r := range roots {
		if _, ok := ls.byRoot[r]; !ok {
			want = append(want, r)
		}
	}
	got, err := p.streamSQL.store.Lock(ctx, tx, p.cfg.Group, want, true, source, partition)
	if err != nil {
		return err
	}
	maps.Copy(ls.byRoot, got)
	return nil
}

// flush writes the lineages changed.
func (ls *lineages) flush(ctx context.Context, p *Processor, tx pgx.Tx) error {
	if ls == nil || len(ls.dirty) == 0 {
		return nil
	}
	var changed []*streams.Lineage
	now := time.Now()
	for r := range ls.dirty {
		l := ls.byRoot[r]
		// What it keeps of streams no record of which was met for the retention of keys goes,
		// as keys do: a stream per upstream start would be kept for ever otherwise.
		if n := l.Forget(now, p.cfg.IdempotencyRetention); n > 0 {
			p.log.Debug("streams forgotten: no record of them met for the retention of idempotency keys",
				"topic", ls.source, "partition", ls.partition, "root", r.String(), "streams", n, "idempotency_retention", p.cfg.IdempotencyRetention.String())
		}
		changed = append(changed, l)
	}
	clear(ls.dirty)
	return p.streamSQL.store.Save(ctx, tx, p.cfg.Group, changed)
}

// streamsWork is what a transaction needs done before it can decide its numbered records: it
// fails with it, and inPlace does it (Processor.doStreams) and tries again.
type streamsWork struct {
	source    string
	partition int32
	main      bool            // the partition's worker, whose batch starts at pos
	pos       int64           // main only
	prepare   []streams.Event // in offset order
	readBack  []streams.ID    // lineages with a read back pending
}

func (w *streamsWork) Error() string {
	return fmt.Sprintf("streams of %s/%d: %d records to prepare, %d lineages to read back first", w.source, w.partition, len(w.prepare), len(w.readBack))
}

// observeStreams is the partition's worker observing the numbered records of its batch recs (all
// of source's partition, from its position), in the batch's transaction, in offset order. It
// returns a *streamsWork if one must be prepared first.
func (p *Processor) observeStreams(ctx context.Context, tx pgx.Tx, source string, recs []*Record) error {
	pol := p.policy(source)
	if !isMessageIDKey(pol.idempotencyKey) || len(recs) == 0 {
		return nil
	}
	var evs []streams.Event
	var roots []streams.ID
	for _, r := range recs {
		if r.control {
			continue
		}
		if e, ok := streamEvent(r); ok {
			evs, roots = append(evs, e), append(roots, e.Root)
		}
	}
	if len(evs) == 0 {
		return nil
	}
	ls := lineagesFrom(ctx)
	if err := ls.load(ctx, p, tx, source, recs[0].Partition, roots); err != nil {
		return own(fmt.Errorf("streams: %w", err))
	}
	for _, e := range evs {
		if ls.byRoot[e.Root].NeedsPrepare(e, true) {
			return &streamsWork{source: source, partition: recs[0].Partition, main: true, pos: recs[0].Offset, prepare: evs}
		}
	}
	for _, e := range evs {
		ls.byRoot[e.Root].Observe(e)
		ls.dirty[e.Root] = true
	}
	return nil
}

// keyAll reports whether r, numbered, is decided by key as well whatever its stream says: a
// replay, the group's first retention under streams, or the upgrade window (the release before
// applies numbered events by key only).
func (p *Processor) keyAll(r *Record) bool {
	return r.deadLetter != 0 || p.window.Load() || time.Now().UnixMilli() < p.keysAllUntil.Load()
}

// dedupeStreams decides, in tx, the numbered records nums of recs (all of source's partition)
// by their lineages: it marks copies duplicate and returns the records to decide by key as well
// (byKey), and a function to call once they are decided (their numbers done). It returns a
// *streamsWork if records must be prepared, or a read back done, first.
func (p *Processor) dedupeStreams(ctx context.Context, tx pgx.Tx, source string, recs []*Record, nums []int, evs []streams.Event, hashes []*[32]byte) (byKey []int, done func() error, err error) {
	ls := lineagesFrom(ctx)
	local := ls == nil
	if local {
		ls = &lineages{}
	}
	roots := make([]streams.ID, len(evs))
	for j, e := range evs {
		roots[j] = e.Root
	}
	partition := recs[nums[0]].Partition
	if err := ls.load(ctx, p, tx, source, partition, roots); err != nil {
		return nil, nil, own(fmt.Errorf("streams: %w", err))
	}
	// Records no worker observed (another path; a release before) are prepared first.
	var prep []streams.Event
	for j, i := range nums {
		if recs[i].stage != retrytopics.FromSource && ls.byRoot[evs[j].Root].NeedsPrepare(evs[j], false) {
			prep = append(prep, evs[j])
		}
	}
	if len(prep) > 0 {
		return nil, nil, &streamsWork{source: source, partition: partition, prepare: prep}
	}
	var keyed []int // indexes into nums/evs
	var wait []streams.ID
	for j, i := range nums {
		l, e := ls.byRoot[evs[j].Root], evs[j]
		switch l.Decide(e, p.keyAll(recs[i])) {
		case streams.Copy:
			recs[i].duplicate = hashes[i][:]
		case streams.Wait:
			if !slices.Contains(wait, e.Root) {
				wait = append(wait, e.Root)
			}
		case streams.ByKey:
			keyed = append(keyed, j)
			byKey = append(byKey, i)
		case streams.Apply:
			l.Done(e, false)
			ls.dirty[e.Root] = true
		}
	}
	if len(wait) > 0 {
		return nil, nil, &streamsWork{source: source, partition: partition, readBack: wait}
	}
	done = func() error {
		for _, j := range keyed {
			ls.byRoot[evs[j].Root].Done(evs[j], true)
			ls.dirty[evs[j].Root] = true
		}
		if local {
			if err := ls.flush(ctx, p, tx); err != nil {
				return own(fmt.Errorf("streams: %w", err))
			}
		}
		return nil
	}
	return byKey, done, nil
}

// doStreams does what a transaction asked for (w), with no transaction open: the preparing
// transaction, then any read back.
func (p *Processor) doStreams(ctx context.Context, w *streamsWork) error {
	pending := slices.Clone(w.readBack)
	if len(w.prepare) > 0 {
		more, err := p.streamsPrepare(ctx, w)
		if err != nil {
			return err
		}
		for _, r := range more {
			if !slices.Contains(pending, r) {
				pending = append(pending, r)
			}
		}
	}
	for _, root := range pending {
		if err := p.readBack(ctx, w.source, w.partition, root); err != nil {
			return err
		}
	}
	return nil
}

// streamsPrepare prepares w's records in a transaction of its own and returns the lineages that
// now have a read back pending.
func (p *Processor) streamsPrepare(ctx context.Context, w *streamsWork) ([]streams.ID, error) {
	// Where each fork's parent may have published what the fork's database lost: asked of Kafka
	// before the transaction.
	since := map[time.Time]int64{}
	for _, e := range w.prepare {
		if e.ForkSeq <= 0 {
			continue
		}
		if _, ok := since[e.Since]; ok {
			continue
		}
		cl := p.client.Load()
		if cl == nil {
			return nil, Infrastructure(errors.New("streams: a fork to prepare, and no kafka client yet"))
		}
		lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		at, err := kadm.NewClient(cl).ListOffsetsAfterMilli(lctx, e.Since.Add(-streams.Skew).UnixMilli(), w.source)
		cancel()
		if err == nil {
			err = at.Error()
		}
		if err != nil { // Kafka's: waited out in place, as an outage
			return nil, Infrastructure(fmt.Errorf("streams: find the first record of %s/%d published after %s: %w", w.source, w.partition, e.Since.Add(-streams.Skew).UTC().Format(time.RFC3339), err))
		}
		since[e.Since] = 0
		if o, ok := at.Lookup(w.source, w.partition); ok {
			since[e.Since] = o.Offset
		}
	}
	var pending []streams.ID
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		ls := &lineages{}
		roots := make([]streams.ID, len(w.prepare))
		for j, e := range w.prepare {
			roots[j] = e.Root
		}
		if err := ls.load(ctx, p, tx, w.source, w.partition, roots); err != nil {
			return err
		}
		pos := w.pos
		if !w.main {
			// Every record before the worker's position was observed.
			if err := tx.QueryRow(ctx, p.streamSQL.position, p.cfg.Group, w.source, w.partition).Scan(&pos); err != nil && !errors.Is(err, pgx.ErrNoRows) {
				return err
			}
		}
		pending = pending[:0]
		for _, e := range w.prepare {
			l := ls.byRoot[e.Root]
			before := len(l.Streams)
			if !w.main && !l.NeedsPrepare(e, false) {
				continue
			}
			if l.Prepare(e, pos, since[e.Since], w.main) && !slices.Contains(pending, e.Root) {
				pending = append(pending, e.Root)
			}
			ls.dirty[e.Root] = true
			if len(l.Streams) > before && e.ForkSeq > 0 {
				p.log.Info("a stream of events forked upstream (its database restarted, failed over or was restored): what it may repeat is decided by key as well",
					"topic", w.source, "partition", w.partition, "stream", e.Stream.String(), "parent", e.Parent.String(), "fork_seq", e.ForkSeq,
					"read_back", l.Pending != nil)
			}
		}
		return ls.flush(ctx, p, tx)
	})
	if err != nil {
		return nil, own(fmt.Errorf("streams: prepare %d records of %s/%d: %w", len(w.prepare), w.source, w.partition, err))
	}
	return pending, nil
}

// readBackChunk is how many records a read back reads and records the keys of per transaction.
var readBackChunk int64 = 5000

// readBackChunkDone, if set (tests), is told of each chunk of a read back once its transaction
// committed; an error it returns ends the read back there, as a failure would.
var readBackChunkDone func(from, to int64) error

// readBackPause slows the read back down by that much a record, for a test of a read back that
// outlives a transaction's idle timeout; 0 otherwise.
var readBackPause atomic.Int64

// readBack does root's pending read back: it reads the partition from Kafka from the read back's
// cursor, a chunk at a time with no transaction open, and for each chunk, in a transaction that
// moves the cursor past it, records the keys of the chunk's records the core asks for (applied
// by number, and another stream may share their key). A chunk whose transaction finds the cursor
// moved (another process did it, or a registration widened the read back) is read again from
// where the cursor is.
func (p *Processor) readBack(ctx context.Context, source string, partition int32, root streams.ID) error {
	started := time.Now()
	records, keys := 0, 0
	for {
		var state []byte
		if err := p.pool.QueryRow(ctx, p.streamSQL.read, p.cfg.Group, [16]byte(root)).Scan(&state); err != nil {
			return own(fmt.Errorf("streams: read lineage %s: %w", root, err))
		}
		var l streams.Lineage
		if err := json.Unmarshal(state, &l); err != nil {
			return own(fmt.Errorf("streams: lineage %s: %w", root, err))
		}
		if l.Pending == nil {
			if records > 0 {
				p.log.Info("streams: read back done", "topic", source, "partition", partition, "lineage", root.String(),
					"records", records, "keys_recorded", keys, "took", time.Since(started).Round(time.Millisecond).String())
			}
			return nil
		}
		from, to := l.Pending.Cursor, min(l.Pending.Cursor+readBackChunk, l.Pending.To)
		if records == 0 {
			p.log.Warn("streams: reading back what a newer stream may repeat, before its records are decided",
				"topic", source, "partition", partition, "lineage", root.String(), "from", l.Pending.From, "cursor", from, "to", l.Pending.To)
		}
		type read struct {
			e   streams.Event
			key [32]byte
		}
		var got []read
		n, err := p.readRange(ctx, source, partition, from, to, func(r *kgo.Record) {
			rec := &Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Headers: r.Headers}
			e, ok := streamEvent(rec)
			if !ok || e.Root != root {
				return
			}
			id, err := messageIDKey(rec)
			if err != nil {
				return
			}
			got = append(got, read{e, p.keyHash(source, id)})
		})
		if err != nil { // Kafka's: waited out in place, as an outage; the cursor keeps what was done
			return Infrastructure(fmt.Errorf("streams: read back %s/%d from %d to %d: %w", source, partition, from, to, err))
		}
		records += n
		err = pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
			ls := &lineages{}
			if err := ls.load(ctx, p, tx, source, partition, []streams.ID{root}); err != nil {
				return err
			}
			l := ls.byRoot[root]
			if l.Pending == nil || l.Pending.Cursor != from {
				return nil // moved meanwhile: read again from where it is
			}
			var ks [][32]byte
			for _, g := range got {
				if l.ReadBackRecord(g.e) {
					ks = append(ks, g.key)
				}
			}
			slices.SortFunc(ks, func(a, b [32]byte) int { return bytes.Compare(a[:], b[:]) })
			ks = slices.Compact(ks)
			if len(ks) > 0 {
				if _, err := p.keys.Record(ctx, tx, ks); err != nil {
					return err
				}
				keys += len(ks)
			}
			l.Pending.Cursor = to
			if to >= l.Pending.To {
				l.ReadBackDone()
			}
			ls.dirty[root] = true
			return ls.flush(ctx, p, tx)
		})
		if err != nil {
			return own(fmt.Errorf("streams: record what the read back of %s/%d from %d to %d found: %w", source, partition, from, to, err))
		}
		if readBackChunkDone != nil {
			if err := readBackChunkDone(from, to); err != nil {
				return err
			}
		}
	}
}

// readRange reads the records of topic's partition from offset from up to (not including) to,
// with a client of its own, and gives each to fn. It returns how many it read.
func (p *Processor) readRange(ctx context.Context, topic string, partition int32, from, to int64, fn func(*kgo.Record)) (int, error) {
	if from >= to {
		return 0, nil
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(p.cfg.Brokers...),
		kgo.ClientID("kafkapg-read-back"),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: {partition: kgo.NewOffset().At(from)}}),
		kgo.FetchMaxWait(100 * time.Millisecond),
	}
	cl, err := kgo.NewClient(append(opts, p.cfg.KafkaOptions...)...)
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	// A chunk, not the whole read back: its progress is kept, so a slow broker costs a retry of
	// one chunk at most.
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	n := 0
	for {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return n, err
		}
		for _, e := range fs.Errors() {
			return n, e.Err
		}
		done := false
		fs.EachRecord(func(r *kgo.Record) {
			if r.Offset >= to || done {
				done = true
				return
			}
			n++
			if d := readBackPause.Load(); d > 0 {
				time.Sleep(time.Duration(d))
			}
			fn(r)
			done = r.Offset >= to-1
		})
		if done {
			return n, nil
		}
	}
}
