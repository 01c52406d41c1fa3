package processor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/sink"
)

// Streams, the consuming side. A topic deduplicated on the message id (KeyFromHeader with
// sink.HeaderMessageID) receives, from kafkapg services, numbered events (sink.Event.Source):
// for those it keeps, per stream, the highest number applied and the numbers below it not
// applied yet (idempotency_streams), instead of a key per event. The argument for why that is
// exact is in sink/doc.go ("Streams"); in short:
//
//   - A stream's numbers are dense and each is taken once, by the transaction that emitted the
//     event, which committed (a rolled-back one took none). A copy of an event (the relay
//     published its row twice) carries the same number. So an event is new exactly when its
//     number was never applied: above high, or missing.
//   - The relay publishes a stream's events of different keys in any order, and a record can wait
//     in the retry path or as a dead letter: numbers below high not applied yet are kept as
//     missing (a few ranges), and applied when they come, however late.
//   - A database that loses commits (a failover to a standby that lacked them, a restore) takes
//     the numbers past what it kept again, for the same events applied again, or others: the
//     stream forks. The fork names the stream it replaces, how far that one is kept, and the
//     lineage both belong to (their root); a stream the database lost entirely is created again
//     under the same root. The first transaction here to meet such a successor reads the records
//     of its lineage it may repeat from Kafka (handleFork), records the keys of those applied
//     here, and notes the highest source offset among them (its horizon). From then on, the
//     successor's records from source offsets up to the horizon (a record applied again after
//     the loss comes from one of those; later ones are new), and for ten minutes all of them,
//     and the records it may repeat, are deduplicated by key as well. State per record only for
//     what a failover lost.
//
// The state changes in the transaction that applies the records; a lineage's rows are locked by
// it, so the transactions applying a lineage's records (its partition's, a retry tier's, the
// held keys', a replay's) take turns.

// messageIDKey is KeyFromHeader(sink.HeaderMessageID): a topic deduplicated on it deduplicates
// numbered events by their stream.
func messageIDKey(rec *Record) ([]byte, error) { return headerKey(sink.HeaderMessageID, rec) }

// isMessageIDKey reports whether key is messageIDKey (a function, not a closure: its code
// pointer is its own).
func isMessageIDKey(key IdempotencyKey) bool {
	return key != nil && reflect.ValueOf(key).Pointer() == reflect.ValueOf(IdempotencyKey(messageIDKey)).Pointer()
}

// streamState is a stream's row in idempotency_streams.
type streamState struct {
	id, root, parent [16]byte
	forkSeq          int64
	successor        bool  // a fork, or a stream created again for its root
	horizon          int64 // a successor's records from source offsets up to this are deduplicated by key too
	high             int64
	missing          spans
	firstOffset      int64
	young            bool // created less than successorYouth ago
	fresh            bool // inserted by this transaction: the stream is new here
}

// successorYouth is how long all of a successor's records are deduplicated by key too, whatever
// their source offset: a record of the stream it replaces may still come after the successor's
// first (published by a relay of the old database just before it went).
const successorYouth = 10 * time.Minute

// applied reports whether seq was applied.
func (s *streamState) applied(seq int64) bool { return seq <= s.high && !s.missing.has(seq) }

// apply marks seqs applied.
func (s *streamState) apply(seqs []int64) {
	top := s.high
	for _, q := range seqs {
		top = max(top, q)
	}
	if top > s.high {
		s.missing = s.missing.add(s.high+1, top+1)
		s.high = top
	}
	for _, q := range seqs {
		s.missing = s.missing.remove(q)
	}
}

// mayRepeat reports whether successor c may repeat, under its numbers, the record numbered seq
// of stream s: s is c's parent and seq past what the database kept, or c is a stream created
// again for the root s was created for first.
func (c *streamState) mayRepeat(s *streamState, seq int64) bool {
	if !c.successor || c.id == s.id {
		return false
	}
	if c.forkSeq > 0 {
		return c.parent == s.id && seq > c.forkSeq
	}
	return s.forkSeq == 0 && s.firstOffset < c.firstOffset
}

// spans is a set of int64s as sorted, disjoint, non-adjacent half-open ranges.
type spans []span

type span struct{ lo, hi int64 } // [lo, hi)

func (ss spans) has(q int64) bool {
	i, found := slices.BinarySearchFunc(ss, q, func(s span, q int64) int {
		switch {
		case s.hi <= q:
			return -1
		case s.lo > q:
			return 1
		}
		return 0
	})
	return found && i >= 0
}

// add returns ss with [lo, hi) added: it is above every span of ss (a new high).
func (ss spans) add(lo, hi int64) spans {
	if lo >= hi {
		return ss
	}
	if n := len(ss); n > 0 && ss[n-1].hi == lo {
		ss[n-1].hi = hi
		return ss
	}
	return append(ss, span{lo, hi})
}

// remove returns ss without q.
func (ss spans) remove(q int64) spans {
	for i, s := range ss {
		if q < s.lo || q >= s.hi {
			continue
		}
		switch {
		case s.lo == q && s.hi == q+1:
			return slices.Delete(ss, i, i+1)
		case s.lo == q:
			ss[i].lo++
		case s.hi == q+1:
			ss[i].hi--
		default: // split [lo, hi) into [lo, q) and [q+1, hi)
			out := make(spans, 0, len(ss)+1)
			out = append(out, ss[:i]...)
			out = append(out, span{s.lo, q}, span{q + 1, s.hi})
			return append(out, ss[i+1:]...)
		}
		return ss
	}
	return ss
}

// String is ss as Postgres writes an int8multirange: "{[1,5),[7,8)}".
func (ss spans) String() string {
	var b strings.Builder
	b.WriteByte('{')
	for i, s := range ss {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "[%d,%d)", s.lo, s.hi)
	}
	b.WriteByte('}')
	return b.String()
}

// parseSpans reads an int8multirange as Postgres writes it (canonical: "[lo,hi)" ranges).
func parseSpans(text string) (spans, error) {
	body, ok := strings.CutPrefix(text, "{")
	if body, ok = strings.CutSuffix(body, "}"); !ok {
		return nil, fmt.Errorf("not a multirange: %q", text)
	}
	var out spans
	for body != "" {
		r, rest, closed := strings.Cut(body, ")")
		lo, hi, ok := strings.Cut(strings.TrimPrefix(r, "["), ",")
		l, err1 := strconv.ParseInt(lo, 10, 64)
		h, err2 := strconv.ParseInt(hi, 10, 64)
		if !closed || !ok || !strings.HasPrefix(r, "[") || err1 != nil || err2 != nil || l >= h {
			return nil, fmt.Errorf("not a multirange of int8: %q", text)
		}
		out = append(out, span{l, h})
		if body, ok = strings.CutPrefix(rest, ","); (!ok && rest != "") || (ok && body == "") {
			return nil, fmt.Errorf("not a multirange of int8: %q", text)
		}
	}
	return out, nil
}

// streamSQL is the statements of the consuming side, for a schema.
type streamSQL struct {
	ensure, lineage, update string
}

func newStreamSQL(schema string) streamSQL {
	streams := pgx.Identifier{schema, "idempotency_streams"}.Sanitize()
	return streamSQL{
		// Rows for the streams met for the first time; the ones this statement inserted are new.
		ensure: `INSERT INTO ` + streams + ` (consumer_group, stream, topic, partition, root, parent, fork_seq, successor, horizon, high, missing,
				first_offset, created_at, updated_at)
			SELECT $1, s, $2, p, r, par, fs, false, -1, 0, '{}', o, now(), now()
			FROM unnest($3::uuid[], $4::int4[], $5::uuid[], $6::uuid[], $7::int8[], $8::int8[]) AS u(s, p, r, par, fs, o)
			ORDER BY s ON CONFLICT DO NOTHING RETURNING stream`,
		// Every stream of the batch's lineages, locked in id order.
		lineage: `SELECT stream, root, parent, fork_seq, successor, horizon, high, missing::text, first_offset, created_at > now() - $3::interval
			FROM ` + streams + ` WHERE consumer_group = $1 AND root = ANY($2) ORDER BY stream FOR UPDATE`,
		update: `UPDATE ` + streams + ` AS s SET high = u.high, missing = u.missing::int8multirange, first_offset = least(s.first_offset, u.o),
				successor = u.successor, horizon = u.horizon, updated_at = now()
			FROM unnest($2::uuid[], $3::int8[], $4::text[], $5::int8[], $6::bool[], $7::int8[]) AS u(stream, high, missing, o, successor, horizon)
			WHERE s.consumer_group = $1 AND s.stream = u.stream`,
	}
}

// numberedRec is a record of a batch that carries a stream number.
type numberedRec struct {
	i  int // index in the batch
	st sink.Stream
}

// dedupeStreams decides, in tx, which of recs (numbered, of source) are copies of events applied
// before, by their streams' state, and marks them duplicate; it returns the ones the state
// cannot decide alone (a fork may repeat them, or they may be repeats: deduplicate them by key as
// well) and the function that writes the streams' new state (every number not a copy's is done
// with: applied, or found a copy by its key), to call once the by-key decision is made.
func (p *Processor) dedupeStreams(ctx context.Context, tx pgx.Tx, source string, recs []*Record, nums []numberedRec, keyOf func(int) [32]byte) (byKey []int, commit func() error, err error) {
	type met struct {
		st   sink.Stream
		recs []numberedRec
	}
	byID := map[[16]byte]*met{}
	var ids, roots [][16]byte
	for _, n := range nums {
		m := byID[n.st.ID]
		if m == nil {
			m = &met{st: n.st}
			byID[n.st.ID] = m
			ids = append(ids, n.st.ID)
			if !slices.Contains(roots, n.st.Root) {
				roots = append(roots, n.st.Root)
			}
		}
		m.recs = append(m.recs, n)
	}
	// In id order: the rows are locked in that order, no deadlock between two transactions
	// applying records of the same lineages.
	slices.SortFunc(ids, func(a, b [16]byte) int { return slices.Compare(a[:], b[:]) })
	sids, parts, sroots, parents, forkSeqs, offs := make([][16]byte, len(ids)), make([]int32, len(ids)), make([][16]byte, len(ids)),
		make([][16]byte, len(ids)), make([]int64, len(ids)), make([]int64, len(ids))
	for i, id := range ids {
		m := byID[id]
		sids[i], parts[i], sroots[i], forkSeqs[i] = id, recs[m.recs[0].i].Partition, m.st.Root, m.st.ForkSeq
		parents[i] = m.st.Parent
		if m.st.IsRoot() {
			parents[i] = m.st.Root
		}
		offs[i] = recs[m.recs[0].i].Offset
		for _, n := range m.recs {
			offs[i] = min(offs[i], recs[n.i].Offset)
		}
	}

	b := &pgx.Batch{}
	b.Queue(p.streamSQL.ensure, p.cfg.Group, source, sids, parts, sroots, parents, forkSeqs, offs)
	b.Queue(p.streamSQL.lineage, p.cfg.Group, roots, successorYouth)
	br := tx.SendBatch(ctx, b)
	inserted, err := collect(br, func(r pgx.CollectableRow) ([16]byte, error) {
		var id [16]byte
		return id, r.Scan(&id)
	})
	if err != nil {
		br.Close()
		return nil, nil, own(fmt.Errorf("streams: %w", err))
	}
	lineage, err := collect(br, scanState)
	if err := errors.Join(err, br.Close()); err != nil {
		return nil, nil, own(fmt.Errorf("streams: %w", err))
	}
	state := map[[16]byte]*streamState{}
	byRoot := map[[16]byte][]*streamState{}
	for _, s := range lineage {
		state[s.id] = s
		byRoot[s.root] = append(byRoot[s.root], s)
	}
	for _, id := range inserted {
		if s := state[id]; s != nil {
			s.fresh = true
		}
	}

	// A stream met for the first time may be a successor: find what it may repeat. In first
	// offset order, so that of two met in one batch the earlier is found first.
	fresh := slices.Clone(ids)
	slices.SortFunc(fresh, func(a, b [16]byte) int { return cmp.Compare(state[a].firstOffset, state[b].firstOffset) })
	for _, id := range fresh {
		s := state[id]
		if s == nil {
			return nil, nil, own(fmt.Errorf("streams: stream %s has no row", fmtUUID(id)))
		}
		if !s.fresh {
			continue
		}
		if err := p.meetStream(ctx, tx, source, recs[byID[id].recs[0].i].Partition, s, byID[id].st, byRoot[s.root]); err != nil {
			return nil, nil, err
		}
	}

	// Decide: by number; and by key as well where a successor may repeat a record, or a
	// successor's record may be a repeat.
	seen := map[[16]byte]map[int64]bool{}
	for _, id := range ids {
		m, s := byID[id], state[id]
		seen[id] = map[int64]bool{}
		for _, n := range m.recs {
			r := recs[n.i]
			if s.applied(n.st.Seq) || seen[id][n.st.Seq] {
				h := keyOf(n.i)
				r.duplicate = h[:]
				continue
			}
			seen[id][n.st.Seq] = true
			if s.successor && (s.young || n.st.SourceOffset <= s.horizon) || repeatable(byRoot[s.root], s, n.st.Seq) {
				byKey = append(byKey, n.i)
			}
		}
	}
	commit = func() error {
		var uids [][16]byte
		var highs, firsts, horizons []int64
		var missing []string
		var successors []bool
		for _, id := range ids {
			m, s := byID[id], state[id]
			var done []int64
			first := s.firstOffset
			for _, n := range m.recs {
				first = min(first, recs[n.i].Offset)
				if seen[id][n.st.Seq] {
					done = append(done, n.st.Seq)
					seen[id][n.st.Seq] = false // a number once
				}
			}
			if len(done) == 0 && first == s.firstOffset && !s.fresh {
				continue
			}
			s.apply(done)
			uids, highs, missing, firsts = append(uids, id), append(highs, s.high), append(missing, s.missing.String()), append(firsts, first)
			successors, horizons = append(successors, s.successor), append(horizons, s.horizon)
		}
		if len(uids) == 0 {
			return nil
		}
		if _, err := tx.Exec(ctx, p.streamSQL.update, p.cfg.Group, uids, highs, missing, firsts, successors, horizons); err != nil {
			return own(fmt.Errorf("streams: %w", err))
		}
		return nil
	}
	return byKey, commit, nil
}

// repeatable reports whether a successor in lineage may repeat the record numbered seq of s.
func repeatable(lineage []*streamState, s *streamState, seq int64) bool {
	for _, c := range lineage {
		if c.mayRepeat(s, seq) {
			return true
		}
	}
	return false
}

func scanState(r pgx.CollectableRow) (*streamState, error) {
	s := &streamState{}
	var missing string
	if err := r.Scan(&s.id, &s.root, &s.parent, &s.forkSeq, &s.successor, &s.horizon, &s.high, &missing, &s.firstOffset, &s.young); err != nil {
		return nil, err
	}
	var err error
	s.missing, err = parseSpans(missing)
	return s, err
}

// collect reads the next result of br as rows.
func collect[T any](br pgx.BatchResults, fn pgx.RowToFunc[T]) ([]T, error) {
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, fn)
}

// forkBack is how far before a fork's fork_at (by Kafka's record timestamps) its parent's
// records are read again: the clocks of the database and of the relays publishing may differ.
const forkBack = 5 * time.Minute

// meetStream looks at s, a stream of lineage met here for the first time in source's partition
// (st its header). If it is a successor (a fork, or a stream created again for a root whose first
// stream is known here), the records of its lineage it may repeat are read again from Kafka
// (handleFork): the keys of those applied here are recorded, and s's horizon set, for the
// decision to use.
func (p *Processor) meetStream(ctx context.Context, tx pgx.Tx, source string, partition int32, s *streamState, st sink.Stream, lineage []*streamState) error {
	var from int64 = -1
	s.successor = s.forkSeq > 0
	for _, o := range lineage {
		if o.id != s.id && o.forkSeq == 0 && s.forkSeq == 0 && o.firstOffset < s.firstOffset {
			s.successor = true // created again: its siblings' records may come again
			if from < 0 || o.firstOffset < from {
				from = o.firstOffset
			}
		}
	}
	if !s.successor {
		return nil
	}
	s.young = true
	// Successors before it in the lineage may still be repeating their own predecessors'.
	for _, o := range lineage {
		if o.id != s.id && o.successor {
			s.horizon = max(s.horizon, o.horizon)
		}
	}
	horizon, err := p.handleFork(ctx, tx, source, partition, s, st, from, lineage)
	if err != nil {
		return err
	}
	s.horizon = max(s.horizon, horizon)
	return nil
}

// handleFork reads again, from Kafka, the records of source's partition that successor s may
// repeat (its parent's past what the database kept, or, created again, its siblings'), from from
// (a fork: the first published after its fork_at, less forkBack) up to s's first record, and
// records, in a transaction of its own, the keys (message ids) of those applied here: a repeat of
// one of them under s's numbers is then found by its key. It returns the highest source offset
// among the records read.
func (p *Processor) handleFork(ctx context.Context, tx pgx.Tx, source string, partition int32, s *streamState, st sink.Stream, from int64, lineage []*streamState) (int64, error) {
	cl := p.client.Load()
	if cl == nil {
		return 0, own(errors.New("streams: a fork to read again, and no kafka client"))
	}
	if st.ForkSeq > 0 {
		at, err := kadm.NewClient(cl).ListOffsetsAfterMilli(ctx, st.ForkAt.Add(-forkBack).UnixMilli(), source)
		if err == nil {
			err = at.Error()
		}
		if err != nil {
			return 0, own(fmt.Errorf("streams: find where fork %s's parent may repeat: %w", fmtUUID(s.id), err))
		}
		from = 0
		if o, ok := at.Lookup(source, partition); ok {
			from = o.Offset
		}
	}
	byID := map[[16]byte]*streamState{}
	for _, n := range lineage {
		byID[n.id] = n
	}
	horizon := int64(-1)
	var keys [][32]byte
	read, err := p.readKeepingTx(ctx, tx, source, partition, from, s.firstOffset, func(r *kgo.Record) {
		o, ok := sink.ParseStream(r.Headers)
		if !ok || o.Root != s.root {
			return
		}
		n := byID[o.ID]
		if n == nil || !s.mayRepeat(n, o.Seq) {
			return
		}
		horizon = max(horizon, o.SourceOffset)
		if !n.applied(o.Seq) {
			return
		}
		for _, h := range r.Headers {
			if h.Key == sink.HeaderMessageID && len(h.Value) > 0 {
				keys = append(keys, p.keyHash(source, h.Value))
			}
		}
	})
	if err != nil {
		return 0, own(fmt.Errorf("streams: read %s/%d from %d to %d again for stream %s: %w", source, partition, from, s.firstOffset, fmtUUID(s.id), err))
	}
	slices.SortFunc(keys, func(a, b [32]byte) int { return slices.Compare(a[:], b[:]) })
	keys = slices.Compact(keys)
	if len(keys) > 0 {
		err = pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
			_, err := p.keys.Record(ctx, tx, keys)
			return err
		})
		if err != nil {
			return 0, own(fmt.Errorf("streams: record the keys stream %s may repeat: %w", fmtUUID(s.id), err))
		}
	}
	p.log.Warn("a stream of events forked upstream (its database failed over or was restored, and lost commits): the events it may repeat were read back from kafka, and its records from source offsets up to the horizon are deduplicated by key too",
		"topic", source, "partition", partition, "stream", fmtUUID(s.id), "parent", fmtUUID(st.Parent), "fork_seq", st.ForkSeq,
		"read_from", from, "read_to", s.firstOffset, "records_read", read, "keys_recorded", len(keys), "horizon", max(s.horizon, horizon))
	return horizon, nil
}

// readKeepingTx is readRange while tx, the batch transaction that waits for it, is kept from
// Postgres's idle timeout (Config.TxIdleTimeout: a lost sibling read back from its first record
// may take longer): a statement every third of it. fn runs in the reading goroutine.
func (p *Processor) readKeepingTx(ctx context.Context, tx pgx.Tx, topic string, partition int32, from, to int64, fn func(*kgo.Record)) (int, error) {
	type result struct {
		n   int
		err error
	}
	readCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan result, 1)
	go func() {
		n, err := p.readRange(readCtx, topic, partition, from, to, fn)
		done <- result{n, err}
	}()
	keep := time.NewTicker(max(p.cfg.TxIdleTimeout/3, 10*time.Millisecond))
	defer keep.Stop()
	for {
		select {
		case r := <-done:
			return r.n, r.err
		case <-keep.C:
			if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
				cancel()
				<-done
				return 0, fmt.Errorf("keep the transaction while reading back: %w", err)
			}
		}
	}
}

// readBackPause slows readRange down by that much a record, for a test of a read back longer
// than the transaction's idle timeout; 0 otherwise.
var readBackPause atomic.Int64

// readRange reads the records of topic's partition from offset from up to (not including) to,
// with a client of its own, and gives each to fn. It returns how many it read.
func (p *Processor) readRange(ctx context.Context, topic string, partition int32, from, to int64, fn func(*kgo.Record)) (int, error) {
	if from >= to {
		return 0, nil
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(p.cfg.Brokers...),
		kgo.ClientID("kafkapg-fork"),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: {partition: kgo.NewOffset().At(from)}}),
		kgo.FetchMaxWait(100 * time.Millisecond),
	}
	cl, err := kgo.NewClient(append(opts, p.cfg.KafkaOptions...)...)
	if err != nil {
		return 0, err
	}
	defer cl.Close()
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
			if r.Offset >= to {
				done = true
				return
			}
			n++
			if d := readBackPause.Load(); d > 0 {
				time.Sleep(time.Duration(d))
			}
			fn(r)
			done = done || r.Offset >= to-1
		})
		if done {
			return n, nil
		}
	}
}

func fmtUUID(u [16]byte) string { return uuid.UUID(u).String() }
