package processor

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
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

// KeyFromHeader takes the idempotency key from the record's header name (the last one, if it has
// several). A record without it, or with an empty one, fails with ErrNoIdempotencyKey.
// KeyFromHeader(sink.HeaderMessageID) deduplicates what a kafkapg outbox emitted.
func KeyFromHeader(name string) IdempotencyKey {
	return func(rec *Record) ([]byte, error) {
		for i := len(rec.Headers) - 1; i >= 0; i-- {
			if h := rec.Headers[i]; h.Key == name && len(h.Value) > 0 {
				return h.Value, nil
			}
		}
		return nil, fmt.Errorf("%w: the record has no header %q (or it is empty)", ErrNoIdempotencyKey, name)
	}
}

// nonStringKey starts the key KeyFromJSON takes from a field that is not a string: json.Unmarshal
// gives a string's text as UTF-8, where 0xff never appears.
const nonStringKey = 0xff

// KeyFromJSON takes the idempotency key from a field of the record's value, a JSON object; path
// names nested fields with dots ("order.id"). A string field's key is its text; any other value's
// is its JSON, compacted, after a byte no string's text has (0xff, not UTF-8), so that the string
// "1" and the number 1 are different keys. A value that is not a JSON object, or lacks the field
// (or has it null or ""), fails with ErrNoIdempotencyKey.
func KeyFromJSON(path string) IdempotencyKey {
	fields := strings.Split(path, ".")
	return func(rec *Record) ([]byte, error) {
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

// dedupeSQL returns the statement dedupe runs: it records idempotency keys in schema's table,
// returning the new ones.
func dedupeSQL(schema string) string {
	return `INSERT INTO ` + pgx.Identifier{schema, "idempotency_keys"}.Sanitize() + ` (key_hash, consumer_group, topic, partition, "offset")
		SELECT k, $1, $2, p, o FROM unnest($3::bytea[], $4::int4[], $5::int8[]) AS u(k, p, o)
		ON CONFLICT DO NOTHING RETURNING key_hash`
}

// dedupe records, in tx, the idempotency keys of recs (all of source) that were not applied
// before, and marks the others duplicate: they are not given to the handler. Within recs, the
// first record with a key wins. It returns the records to handle and, for each, its index in recs
// (nil when all are). A record whose key cannot be taken fails alone: a *RecordError naming it.
//
// A key inserted by a concurrent transaction (a copy of the record in another partition) makes
// this one wait on the key's unique index until that one ends: it is then a duplicate if that
// transaction committed, and the key is this record's if it rolled back.
func (p *Processor) dedupe(ctx context.Context, tx pgx.Tx, source string, key IdempotencyKey, recs []*Record) ([]*Record, []int, error) {
	type keyed struct {
		hash [32]byte
		i    int
	}
	var ks []keyed
	first := map[[32]byte]int{}
	for i, r := range recs {
		r.duplicate = nil
		k, err := p.idempotencyKey(key, r)
		if err != nil {
			return nil, nil, &RecordError{Index: i, Err: Permanent(err)}
		}
		if k == nil {
			continue
		}
		h := p.keyHash(source, k)
		if _, ok := first[h]; ok {
			r.duplicate = h[:]
			continue
		}
		first[h] = i
		ks = append(ks, keyed{h, i})
	}
	if len(ks) > 0 {
		// In hash order: two transactions inserting the same keys wait for each other in one
		// order, never in a cycle.
		slices.SortFunc(ks, func(a, b keyed) int { return bytes.Compare(a.hash[:], b.hash[:]) })
		hashes := make([][]byte, len(ks))
		parts := make([]int32, len(ks))
		offs := make([]int64, len(ks))
		for j, k := range ks {
			hashes[j], parts[j], offs[j] = k.hash[:], recs[k.i].Partition, recs[k.i].Offset
		}
		rows, err := tx.Query(ctx, p.dedupeSQL, p.cfg.Group, source, hashes, parts, offs)
		if err != nil {
			return nil, nil, own(fmt.Errorf("record idempotency keys: %w", err))
		}
		fresh, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
		if err != nil {
			return nil, nil, own(fmt.Errorf("record idempotency keys: %w", err))
		}
		isFresh := make(map[[32]byte]bool, len(fresh))
		for _, h := range fresh {
			isFresh[[32]byte(h)] = true
		}
		for _, k := range ks {
			if !isFresh[k.hash] {
				recs[k.i].duplicate = k.hash[:]
			}
		}
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

// keyHash is the idempotency_keys row of key, a key of a record of source: the SHA-256 of the
// group, the topic and the key, each of the first two preceded by its length.
func (p *Processor) keyHash(source string, key []byte) [32]byte {
	h := sha256.New()
	for _, s := range []string{p.cfg.Group, source} {
		h.Write(binary.AppendUvarint(nil, uint64(len(s))))
		h.Write([]byte(s))
	}
	h.Write(key)
	var out [32]byte
	h.Sum(out[:0])
	return out
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

// keysOn reports whether a topic of the processor has idempotency keys.
func (p *Processor) keysOn() bool {
	for _, pol := range p.policies {
		if pol.idempotencyKey != nil {
			return true
		}
	}
	return false
}

// keyBytesEach is about what one idempotency key costs on disk in the idempotency_keys table:
// its row (which holds the group's and the topic's names: longer names cost more) and its two
// index entries, with the free space a random primary key leaves in its pages.
// BenchmarkIdempotencyKeys measures it as the table's size over the keys it holds: 221 bytes
// with names of about 20 characters; a user's run at 3,000 records/s measured 190.
const keyBytesEach = 220

// keySizing is the cost of keeping idempotency keys for retention, said where a user decides
// (the startup log): the bytes per key, and what that comes to at a round rate.
func keySizing(retention time.Duration) string {
	perThousand := float64(keyBytesEach) * 1000 * retention.Seconds()
	return fmt.Sprintf("each key takes about %d bytes of Postgres for IDEMPOTENCY_RETENTION (%s): at 1,000 keyed records/s that is %s, growing until the first prune; size it as records/s x retention x %d bytes",
		keyBytesEach, retention, humanBytes(perThousand), keyBytesEach)
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

// refreshKeyState publishes the idempotency keys' size: the table's live rows as Postgres's
// statistics count them (no scan of a table that may hold billions) and its bytes, indexes
// included.
func (p *Processor) refreshKeyState(ctx context.Context) error {
	var rows, bytes int64
	if err := p.pool.QueryRow(ctx, `SELECT coalesce((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = c.oid), 0), pg_total_relation_size(c.oid)
		FROM pg_class c WHERE c.oid = to_regclass($1)`, p.keysTable).Scan(&rows, &bytes); err != nil {
		return fmt.Errorf("read the size of %s: %w", p.keysTable, err)
	}
	p.metrics.keyRows.Set(float64(rows))
	p.metrics.keyBytes.Set(float64(bytes))
	return nil
}

// pruneKeys deletes the group's idempotency keys older than Config.IdempotencyRetention, a
// thousand per statement, every minute (or every tenth of the retention, if shorter), until ctx
// is done, and then publishes the keys' size (refreshKeyState: a gauge a 3-day projection reads
// needs no finer grain, and the size of a table of billions of rows is a stat of each of its
// files). Statements skip rows another replica's pruning holds; the pipeline's inserts of new
// keys never wait for them.
func (p *Processor) pruneKeys(ctx context.Context) {
	every := min(time.Minute, max(p.cfg.IdempotencyRetention/10, time.Second))
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		for ctx.Err() == nil {
			tag, err := p.pool.Exec(ctx, p.pruneKeysSQL, p.cfg.Group, p.cfg.IdempotencyRetention)
			if err != nil {
				if ctx.Err() == nil {
					p.log.Warn("cannot prune idempotency keys; will try again", "err", err)
				}
				break
			}
			p.metrics.keysPruned.Add(float64(tag.RowsAffected()))
			if tag.RowsAffected() < 1000 {
				break
			}
		}
		if err := p.refreshKeyState(ctx); err != nil && ctx.Err() == nil {
			p.log.Debug("cannot read the idempotency keys' size", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
