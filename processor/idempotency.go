package processor

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/internal/streams"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// IdempotencyKey returns the idempotency key of a record: the identity of the business event it
// carries, the same in every copy a producer sent (TopicPolicy.IdempotencyKey). A nil key with a
// nil error says the record has none: it is handled without deduplication. An error fails the
// record permanently (it is dead-lettered, with the error): a record that should carry a key and
// does not is malformed.
type IdempotencyKey func(rec *Record) ([]byte, error)

// ErrNoIdempotencyKey is the error (permanent) of a record KeyFromHeader or KeyFromJSON finds no
// key in.
var ErrNoIdempotencyKey = errors.New("no idempotency key")

// String names the key as it was built, for the startup log and the service's config command:
// KeyFromJSON("order.id"), KeyFromHeader("x-id"), "none" for a nil key, and "a function of
// yours" for any other function, which String never calls.
func (k IdempotencyKey) String() string {
	// A func value cannot be compared, nor looked up in a map, so kafkapg cannot remember which
	// key it built from which argument (and keying a registry on a closure's address would lean
	// on how the runtime lays out func values). What reflect does give is a func value's code
	// pointer: the function or function literal it runs, the same for every closure of one
	// literal whatever it captured. It tells KeyFromJSON's closures from KeyFromHeader's and
	// from a function of the user's, but not KeyFromJSON("a.b") from KeyFromJSON("c"). So
	// String recognises kafkapg's own closures by their code pointer, and calls only those,
	// with a record no one else can hold (describeKey), which they answer with what they were
	// built from. A function of the user's has another code pointer and is never called: it
	// may have effects, or panic on a record it was not written for. KeyFromJSON and
	// KeyFromHeader are not inlined: the compiler copies an inlined call's function literal
	// into the caller, with a code pointer of its own, which String would take for a function
	// of the user's (TestIdempotencyKeyString, outside the package, would catch it).
	switch code := codeOf(k); {
	case k == nil:
		return "none"
	case code == messageIDKeyCode:
		return fmt.Sprintf("KeyFromHeader(%q)", sink.HeaderMessageID)
	case code == headerKeyCode || code == jsonKeyCode:
		d, _ := k(describeKey)
		return string(d)
	}
	return "a function of yours"
}

// describeKey is the record a closure of KeyFromHeader or KeyFromJSON answers with what it was
// built from (see IdempotencyKey.String). No record from Kafka, nor any of a user's, is it.
var describeKey = new(Record)

// codeOf is the code pointer of key (see IdempotencyKey.String).
func codeOf(key IdempotencyKey) uintptr { return reflect.ValueOf(key).Pointer() }

// The code pointers of kafkapg's idempotency keys: messageIDKey, and every closure of
// KeyFromHeader and of KeyFromJSON.
var (
	messageIDKeyCode = codeOf(messageIDKey)
	headerKeyCode    = codeOf(KeyFromHeader(""))
	jsonKeyCode      = codeOf(KeyFromJSON(""))
)

// KeyFromHeader takes the idempotency key from the record's header name (the last one, if it has
// several). A record without it, or with an empty one, fails with ErrNoIdempotencyKey.
// KeyFromHeader(sink.HeaderMessageID) deduplicates what a kafkapg outbox emitted.
//
// KeyFromHeader(sink.HeaderMessageID) deduplicates the events a kafkapg service emitted by their
// streams (see sink.Event.Source): a few numbers per stream instead of a key per event.
//
//go:noinline
func KeyFromHeader(name string) IdempotencyKey {
	if name == sink.HeaderMessageID {
		return messageIDKey
	}
	return func(rec *Record) ([]byte, error) {
		if rec == describeKey {
			return fmt.Appendf(nil, "KeyFromHeader(%q)", name), nil
		}
		return headerKey(name, rec)
	}
}

// headerKey is KeyFromHeader(name)'s key of rec.
func headerKey(name string, rec *Record) ([]byte, error) {
	for i := len(rec.Headers) - 1; i >= 0; i-- {
		if h := rec.Headers[i]; h.Key == name && len(h.Value) > 0 {
			return h.Value, nil
		}
	}
	return nil, fmt.Errorf("%w: the record has no header %q (or it is empty)", ErrNoIdempotencyKey, name)
}

// nonStringKey starts the key KeyFromJSON takes from a field that is not a string: json.Unmarshal
// gives a string's text as UTF-8, where 0xff never appears.
const nonStringKey = 0xff

// KeyFromJSON takes the idempotency key from a field of the record's value, a JSON object; path
// names nested fields with dots ("order.id"). A string field's key is its text; any other value's
// is its JSON, compacted, after a byte no string's text has (0xff, not UTF-8), so that the string
// "1" and the number 1 are different keys. A value that is not a JSON object, or lacks the field
// (or has it null or ""), fails with ErrNoIdempotencyKey.
//
//go:noinline
func KeyFromJSON(path string) IdempotencyKey {
	fields := strings.Split(path, ".")
	return func(rec *Record) ([]byte, error) {
		if rec == describeKey {
			return fmt.Appendf(nil, "KeyFromJSON(%q)", path), nil
		}
		raw := json.RawMessage(rec.Value)
		for _, f := range fields {
			var obj map[string]json.RawMessage
			if err := json.Unmarshal(raw, &obj); err != nil || obj == nil {
				return nil, fmt.Errorf("%w: field %q: the value is not a JSON object where %q should be", ErrNoIdempotencyKey, path, f)
			}
			v, ok := obj[f]
			if !ok {
				return nil, fmt.Errorf("%w: the value has no field %q", ErrNoIdempotencyKey, path)
			}
			raw = v
		}
		var s string
		if err := json.Unmarshal(raw, &s); err == nil {
			if s == "" {
				return nil, fmt.Errorf("%w: field %q is empty", ErrNoIdempotencyKey, path)
			}
			return []byte(s), nil
		}
		if string(raw) == "null" {
			return nil, fmt.Errorf("%w: field %q is null", ErrNoIdempotencyKey, path)
		}
		key := bytes.NewBuffer([]byte{nonStringKey})
		if err := json.Compact(key, raw); err != nil {
			return nil, fmt.Errorf("%w: field %q: %v", ErrNoIdempotencyKey, path, err)
		}
		return key.Bytes(), nil
	}
}

// dedupe records, in tx, the idempotency keys of recs (all of source) that were not applied
// before, and marks the others duplicate: they are not given to the handler. Within recs, the
// first record with a key wins. It returns the records to handle and, for each, its index in recs
// (nil when all are). A record whose key cannot be taken fails alone: a *RecordError naming it.
//
// On a topic deduplicated on the message id, the events a kafkapg service numbered are decided
// by their streams (dedupeStreams), and by key as well where another stream's event may share
// their key; other records by key,
// in the key ring (keyring.Ring.Record). A key inserted by a concurrent transaction (a copy of the
// record in another partition) makes this one wait on the key's primary key until that one ends:
// it is then a duplicate if that transaction committed, and the key is this record's if it rolled
// back.
func (p *Processor) dedupe(ctx context.Context, tx pgx.Tx, source string, key IdempotencyKey, recs []*Record) ([]*Record, []int, error) {
	hashes := make([]*[32]byte, len(recs))
	keys := make([][]byte, len(recs))
	for i, r := range recs {
		r.duplicate = nil
		k, err := p.idempotencyKey(key, r)
		if err != nil {
			return nil, nil, &RecordError{Index: i, Err: Permanent(err)}
		}
		if k != nil {
			h := p.keyHash(source, k)
			hashes[i], keys[i] = &h, k
		}
	}
	var byStream map[int]streams.Header // the records their stream decided, by index
	byKey := make([]int, 0, len(recs))
	var streamsDone func() error
	if isMessageIDKey(key) {
		var nums []int
		var evs []streams.Event
		for i, r := range recs {
			if hashes[i] == nil {
				continue
			}
			if e, ok := streamEvent(r); ok {
				nums, evs = append(nums, i), append(evs, e)
			} else {
				byKey = append(byKey, i)
			}
		}
		if len(nums) > 0 {
			keyed, done, err := p.dedupeStreams(ctx, tx, source, recs, nums, evs, hashes)
			if err != nil {
				return nil, nil, err
			}
			byStream = map[int]streams.Header{}
			for j, i := range nums {
				if !slices.Contains(keyed, i) {
					byStream[i] = evs[j].Header
				}
			}
			byKey = append(byKey, keyed...)
			slices.Sort(byKey)
			streamsDone = done
		}
	} else {
		for i := range recs {
			if hashes[i] != nil {
				byKey = append(byKey, i)
			}
		}
	}
	if err := p.dedupeByKey(ctx, tx, recs, byKey, hashes); err != nil {
		return nil, nil, err
	}
	if streamsDone != nil {
		if err := streamsDone(); err != nil {
			return nil, nil, err
		}
	}
	if err := p.keepSkipped(ctx, tx, recs, keys, hashes, byStream); err != nil {
		return nil, nil, err
	}
	live := make([]*Record, 0, len(recs))
	var index []int
	for i, r := range recs {
		if r.duplicate != nil {
			if index == nil {
				index = make([]int, 0, len(recs))
				for j := range i {
					index = append(index, j)
				}
			}
			continue
		}
		live = append(live, r)
		if index != nil {
			index = append(index, i)
		}
	}
	return live, index, nil
}

// keepSkipped keeps in skipped_duplicates, in tx, the records of recs marked duplicate (but those a
// replay brought back: their dead letter's history tells it), with their idempotency key (keys,
// hashes), what decided them (byStream: their stream, by index; by key otherwise) and the copy
// applied before if it is in recs: an earlier record with the same key, not a duplicate. Nothing
// (no round trip) when none is a duplicate.
func (p *Processor) keepSkipped(ctx context.Context, tx pgx.Tx, recs []*Record, keys [][]byte, hashes []*[32]byte, byStream map[int]streams.Header) error {
	var skips []retrytopics.Skip
	for i, r := range recs {
		if r.duplicate == nil || r.deadLetter != 0 {
			continue
		}
		sk := retrytopics.Skip{Origin: retrytopics.Origin{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset},
			IdempotencyKey: keys[i], KeyHash: r.duplicate}
		for j := range i {
			if recs[j].duplicate == nil && hashes[j] != nil && *hashes[j] == *hashes[i] {
				sk.First = &retrytopics.Origin{Topic: recs[j].Topic, Partition: recs[j].Partition, Offset: recs[j].Offset}
				break
			}
		}
		if h, ok := byStream[i]; ok {
			sk.Stream, sk.Seq = h.Stream, h.Seq
		}
		skips = append(skips, sk)
	}
	if err := p.retry.Skipped(ctx, tx, skips); err != nil {
		return own(err)
	}
	return nil
}

// dedupeByKey records the keys of recs[i] for i in which (in order), the first of a key in the
// batch winning, and marks the records whose key was recorded before duplicate.
func (p *Processor) dedupeByKey(ctx context.Context, tx pgx.Tx, recs []*Record, which []int, hashes []*[32]byte) error {
	type keyed struct {
		hash [32]byte
		i    int
	}
	var ks []keyed
	first := map[[32]byte]bool{}
	for _, i := range which {
		h := *hashes[i]
		if first[h] {
			recs[i].duplicate = h[:]
			continue
		}
		first[h] = true
		ks = append(ks, keyed{h, i})
	}
	if len(ks) == 0 {
		return nil
	}
	// In hash order: two transactions inserting the same keys wait for each other in one
	// order, never in a cycle.
	slices.SortFunc(ks, func(a, b keyed) int { return bytes.Compare(a.hash[:], b.hash[:]) })
	sorted := make([][32]byte, len(ks))
	for j, k := range ks {
		sorted[j] = k.hash
	}
	fresh, err := p.keys.Record(ctx, tx, sorted)
	if err != nil {
		return own(fmt.Errorf("record idempotency keys: %w", err))
	}
	for _, k := range ks {
		if !fresh[keyring.Short(k.hash)] {
			recs[k.i].duplicate = k.hash[:]
		}
	}
	return nil
}

// keyHash is the idempotency_keys row of key, a key of a record of source (keyring.Hash: the
// SHA-256 of the group, the topic and the key, each of the first two preceded by its length).
func (p *Processor) keyHash(source string, key []byte) [32]byte {
	return keyring.Hash(p.cfg.Group, source, key)
}

// idempotencyKey runs key over r, turning a panic into an error.
func (p *Processor) idempotencyKey(key IdempotencyKey, r *Record) (k []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("%w: the idempotency key function panicked: %v", ErrNoIdempotencyKey, v)
		}
	}()
	return key(r)
}

// committed is told that recs, handled in a transaction, committed: it counts the ones skipped as
// duplicates, logging each at debug level, and returns how many there were; and it wakes the
// relay if any of the others emitted events.
func (p *Processor) committed(source string, recs []*Record) int {
	n := 0
	emitted := false
	for _, r := range recs {
		emitted = emitted || (len(r.pending) > 0 && r.duplicate == nil)
		if r.duplicate != nil {
			n++
			p.log.Debug("record skipped: its idempotency key was applied before", "topic", r.Topic, "partition", r.Partition, "offset", r.Offset,
				"key_hash", keyHash(r.Key), "idempotency_key_hash", hex.EncodeToString(r.duplicate))
		}
	}
	if n > 0 {
		p.metrics.dupKeys.WithLabelValues(source).Add(float64(n))
	}
	if emitted {
		if r := p.relay.Load(); r != nil {
			r.Notify()
		}
	}
	return n
}

// countReplayed counts, in kafkapg_replayed_records_total, the records of dead letters among
// recs (of source, handled in a transaction that committed) that a replay brought back: applied,
// or skipped as duplicates by their idempotency key.
func (p *Processor) countReplayed(source string, recs []*Record) {
	applied, skipped := 0, 0
	for _, r := range recs {
		switch {
		case r.deadLetter == 0:
		case r.duplicate != nil:
			skipped++
		default:
			applied++
		}
	}
	if applied > 0 {
		p.metrics.replayed.WithLabelValues(source, "applied").Add(float64(applied))
	}
	if skipped > 0 {
		p.metrics.replayed.WithLabelValues(source, "skipped_duplicate").Add(float64(skipped))
	}
}

// keysOn reports whether a topic of the processor has idempotency keys.
func (p *Processor) keysOn() bool {
	for _, pol := range p.policies {
		if pol.idempotencyKey != nil {
			return true
		}
	}
	return false
}

// What an idempotency key costs on disk in the key ring (migration 8; BenchmarkIdempotencyKeys
// measures both as the tables' size over the keys they hold): keyBytesCurrent while its
// generation is current, a row (a tuple header, the 16-byte hash, a line pointer: 44 bytes) and a
// primary key entry (28 bytes, in pages a random key leaves about 70 % full); keyBytesCompacted
// once compacted, in rows of 120 sorted keys.
const (
	keyBytesCurrent   = 85
	keyBytesCompacted = 18
)

// keyBytesPeak is what the ring holds at its fullest, per key of a retention: the current
// generation full (a third of the retention's keys) and three compacted generations.
const keyBytesPeak = (keyBytesCurrent + (keyring.Generations-1)*keyBytesCompacted) / (keyring.Generations - 1)

// keySizing is the cost of keeping idempotency keys for retention, said where a user decides
// (the startup log): the bytes per key, and what that comes to at a round rate.
func keySizing(retention time.Duration) string {
	perThousand := float64(keyBytesPeak) * 1000 * retention.Seconds()
	return fmt.Sprintf("each key takes about %d bytes of Postgres while its generation is current and %d once compacted, kept for IDEMPOTENCY_RETENTION (%s) to 4/3 of it (of the longest retention among the schema's groups, if another's is longer): at 1,000 keyed records/s that is up to %s; size it as records/s x retention x %d bytes (records a kafkapg service emitted take none: see docs/configuration.md)",
		keyBytesCurrent, keyBytesCompacted, retention, humanBytes(perThousand), keyBytesPeak)
}

// humanBytes writes n bytes in the largest unit (decimal) that keeps it at least 1.
func humanBytes(n float64) string {
	for _, u := range []string{"B", "kB", "MB", "GB", "TB"} {
		if n < 999.5 { // 999.5 and above would print as 1e+03 with %.3g
			return fmt.Sprintf("%.3g %s", n, u)
		}
		if u == "TB" {
			return fmt.Sprintf("%.0f %s", n, u)
		}
		n /= 1000
	}
	panic("unreachable")
}

// keepKeys says, every minute (or every tenth of the retention, if shorter), that the group
// keeps its idempotency keys for Config.IdempotencyRetention, moves the key ring as far as it can
// (keyring.Ring.Keep: a turn when it is due, a move at a time, each waiting up to 2 s, without
// queueing, for the batches recording keys two moves before it) and compacts the generation a
// turn froze (keyring.Ring.Compact), until ctx is done; then it publishes the keys' size (a gauge
// a 3-day projection reads needs no finer grain, and the size of a table of billions of rows is
// a stat of each of its files). A move not ready yet (keyring.ErrBusy: batches still open) is
// tried again at the next keep, said at debug level: it delays the turn, never a batch.
func (p *Processor) keepKeys(ctx context.Context) {
	every := min(time.Minute, max(p.cfg.IdempotencyRetention/10, time.Second))
	t := time.NewTicker(every)
	defer t.Stop()
	heldBy := ""
	for {
		done, err := p.keys.KeepEach(ctx, p.pool, p.cfg.Group, p.cfg.IdempotencyRetention, 2*time.Second, func(d keyring.Turned) {
			p.metrics.keysPruned.Add(float64(d.Emptied))
			p.log.Info("idempotency keys: the oldest keys were dropped", "keys", d.Emptied, "generation", !d.Legacy, "table_before_migration_8", d.Legacy)
		})
		switch {
		case errors.Is(err, keyring.ErrBusy):
			p.log.Debug("idempotency keys: the ring's next move waits for batches recording keys; it will try again", "err", err, "every", every.String())
		case err != nil && ctx.Err() == nil:
			p.log.Warn("cannot keep the idempotency keys; will try again", "err", err)
		}
		if done.LegacyHeldBy != heldBy && err == nil {
			heldBy = done.LegacyHeldBy
			if heldBy != "" {
				p.log.Info("idempotency keys: the table before migration 8 (idempotency_keys) is kept while a group of the schema has not run this release: its keys may be there",
					"held_by", heldBy, "hint", "run that group on this release, or delete its rows from the offsets table if it is gone")
			}
		}
		if n, err := p.keys.Compact(ctx, p.pool, 2*time.Second); err != nil && !errors.Is(err, keyring.ErrBusy) && ctx.Err() == nil {
			p.log.Warn("cannot compact the idempotency keys of a generation past; will try again", "err", err)
		} else if n > 0 {
			p.log.Info("idempotency keys: a generation past was compacted", "generations", n)
		}
		if rows, bytes, err := p.keys.Size(ctx, p.pool); err == nil {
			p.metrics.keyRows.Set(float64(rows))
			p.metrics.keyBytes.Set(float64(bytes))
		} else if ctx.Err() == nil {
			p.log.Debug("cannot read the idempotency keys' size", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
