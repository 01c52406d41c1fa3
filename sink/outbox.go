package sink

import (
	"context"
	"crypto/rand"
	"crypto/sha1"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
)

// HeaderMessageID is the header that carries an emitted record's id (Event.ID). A consumer that
// deduplicates on it (processor.KeyFromHeader(HeaderMessageID)) applies each emitted record once,
// however often the relay publishes it.
const HeaderMessageID = "message-id"

// Event is a record a transaction emits: it is published to Kafka if, and once, the transaction
// commits (see Outbox).
type Event struct {
	// Topic to publish to. Required.
	Topic string
	// Key and Value of the record. The record goes to the partition Kafka's own producers would
	// choose for Key (murmur2 of the key); a record without a key goes to any partition.
	Key, Value []byte
	// Headers of the record. Headers named HeaderMessageID or HeaderStream are replaced.
	Headers []kgo.RecordHeader
	// ID is sent as the HeaderMessageID header. Outbox.Emit fills an empty ID with a random UUID;
	// processor.Record.Emit with one derived from the record being handled (DerivedID), so that
	// the same emit has the same id however often the record is handled. Set it yourself to
	// derive it from the business event (an order id and the event's type).
	ID string
	// Source, when set (processor.Record.Emit sets it for the events whose ID it derives),
	// numbers the event in its stream: the events one source partition of the group emits to one
	// partition of Topic (header HeaderStream). A kafkapg consumer deduplicating on the message id
	// then keeps a few numbers per stream instead of a key per event. The event's partition is fixed when it is emitted (its key's, as Kafka's producers
	// place it, among the partitions OutboxConfig.Partitions reports); without Partitions, or if
	// it fails, the event is published by key, unnumbered. Leave it nil with an ID of your own:
	// the number would stand for this emit, not for your id.
	Source *Source
}

// Lanes is the number of lanes an outbox is published in. The records of one topic and key are
// in one lane; one relay at a time publishes a lane, in the order the records committed.
const Lanes = 16

// lane returns the lane of the records of topic and key.
func lane(topic string, key []byte) int16 {
	h := fnv.New32a()
	h.Write([]byte(topic))
	h.Write([]byte{0})
	h.Write(key)
	return int16(h.Sum32() % Lanes)
}

// keyLock returns the transaction-scoped advisory lock a writer holds on topic and key while it
// inserts their records: a second writer of the same key waits until the first commits, so ids
// (taken after the lock) follow commit order. Keys that collide only wait for each other.
func keyLock(topic string, key []byte) int64 {
	h := fnv.New64a()
	h.Write([]byte("kafkapg-outbox\x00"))
	h.Write([]byte(topic))
	h.Write([]byte{0})
	h.Write(key)
	return int64(h.Sum64())
}

// laneLockClass is the first half of the advisory lock (two int4 keys) on a lane of the outbox
// of group in schema; the lane is the second half.
func laneLockClass(schema, group string) int32 {
	h := fnv.New32a()
	h.Write([]byte("kafkapg-outbox-lane\x00"))
	h.Write([]byte(schema))
	h.Write([]byte{0})
	h.Write([]byte(group))
	return int32(h.Sum32())
}

// notifyChannel is the channel a commit that emitted records notifies; the payload names the
// outbox (schema and group) so that a relay wakes only for its own.
const notifyChannel = "kafkapg_outbox"

func notifyPayload(schema, group string) string { return schema + "/" + group }

// OutboxConfig configures an Outbox.
type OutboxConfig struct {
	// Schema holds kafkapg's tables. Required.
	Schema string
	// Group names the outbox: the relay of that group publishes its records (a processor's
	// relay publishes its consumer group's; a service without source topics runs a relay alone).
	// Required.
	Group string
	// NoNotify leaves out the NOTIFY that wakes the relays (LISTENing, RelayConfig.Listen) when an
	// emitting transaction commits. Postgres serializes the commits of notifying transactions (one
	// database-wide lock, held through the commit's flush), which caps them at about a thousand
	// to a few thousand per second, whatever else runs; without it, the relay finds the records
	// on its poll (RelayConfig.Interval) unless something else wakes it (Relay.Notify after the
	// commit, in the same process: what a processor does for Record.Emit).
	NoNotify bool
	// Partitions reports the partition count of a topic, for numbering events with a Source
	// (see Event.Source). Nil: no event is numbered.
	Partitions func(ctx context.Context, topic string) (int, error)
}

// Outbox writes events into the caller's transaction. It is safe for concurrent use.
type Outbox struct {
	group      string
	payload    string // "" with NoNotify
	insertSQL  string
	streamSQL  string
	partitions func(ctx context.Context, topic string) (int, error)
}

// NewOutbox returns an Outbox.
func NewOutbox(cfg OutboxConfig) (*Outbox, error) {
	switch {
	case cfg.Schema == "":
		return nil, errors.New("sink: OutboxConfig.Schema is required")
	case cfg.Group == "":
		return nil, errors.New("sink: OutboxConfig.Group is required")
	}
	payload := notifyPayload(cfg.Schema, cfg.Group)
	if cfg.NoNotify {
		payload = ""
	}
	return &Outbox{
		group:   cfg.Group,
		payload: payload,
		insertSQL: `INSERT INTO ` + pgx.Identifier{cfg.Schema, "outbox"}.Sanitize() +
			` (consumer_group, topic, partition, lane, key, value, header_keys, header_values, created_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, clock_timestamp())`,
		streamSQL:  streamSQL(cfg.Schema),
		partitions: cfg.Partitions,
	}, nil
}

// Emit writes events into tx: they are published to Kafka if tx commits, and exactly when it
// does (the relay is woken by LISTEN/NOTIFY after the commit, or finds them on its next poll; see
// OutboxConfig.NoNotify for what NOTIFY costs).
// Events of the same topic and key reach Kafka in the order their transactions committed; within
// one transaction, in the order they were emitted. Publication is at least once: each record
// carries its id (Event.ID, a random UUID if empty) in the HeaderMessageID header, for its
// consumers to deduplicate on.
//
// Emit takes a transaction-scoped lock on each event's topic and key, held until tx ends: a
// concurrent transaction emitting to the same key waits for tx. Two transactions that each emit to
// the same two keys in opposite orders can deadlock; Postgres then aborts one of them (SQLSTATE
// 40P01), which a processor retries. One round trip, however many events (two when some are
// numbered, Event.Source).
func (o *Outbox) Emit(ctx context.Context, tx pgx.Tx, events ...Event) error {
	ids := make([]string, len(events))
	for i, e := range events {
		ids[i] = e.ID
		if ids[i] == "" {
			ids[i] = randomID()
		}
	}
	return o.emit(ctx, tx, ids, events)
}

func (o *Outbox) emit(ctx context.Context, tx pgx.Tx, ids []string, events []Event) error {
	if len(events) == 0 {
		return nil
	}
	locks := make([]int64, 0, len(events))
	for i, e := range events {
		if err := CheckTopic(e.Topic); err != nil {
			return fmt.Errorf("sink: emit: event %d: %w", i, err)
		}
		if e.Key != nil {
			locks = append(locks, keyLock(e.Topic, e.Key))
		}
	}
	// Always in the same order, so that two transactions emitting to the same keys in one call
	// each cannot deadlock.
	slices.Sort(locks)
	locks = slices.Compact(locks)

	// Numbered events: each in its stream, its partition fixed now.
	parts := make([]*int32, len(events))
	var streams []*numbered
	if o.partitions != nil {
		byKey := map[streamKey]*numbered{}
		for i, e := range events {
			if e.Source == nil {
				continue
			}
			n, err := o.partitions(ctx, e.Topic)
			if err != nil || n <= 0 {
				continue // published by key, unnumbered: consumers deduplicate it by its message id
			}
			p := partitionOf(e.Key, ids[i], n)
			parts[i] = &p
			k := streamKey{topic: e.Source.Topic, partition: e.Source.Partition, dest: e.Topic, destPartition: p}
			s := byKey[k]
			if s == nil {
				s = &numbered{key: k}
				byKey[k] = s
				streams = append(streams, s)
			}
			s.events = append(s.events, i)
		}
	}

	b := &pgx.Batch{}
	if len(locks) > 0 {
		b.Queue(`SELECT pg_advisory_xact_lock(h) FROM unnest($1::int8[]) AS h`, locks)
	}
	var seqs map[int]kgo.RecordHeader
	if len(streams) > 0 {
		// The numbers are taken after the keys' locks, each stream's row locked until tx ends:
		// a stream's numbers follow the order its transactions commit in. One round trip more.
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("sink: emit %d events: %w", len(events), err)
		}
		var err error
		if seqs, err = o.number(ctx, tx, events, streams); err != nil {
			return fmt.Errorf("sink: number %d events: %w", len(events), err)
		}
		b = &pgx.Batch{}
	}
	for i, e := range events {
		hs := make([]kgo.RecordHeader, 0, len(e.Headers)+4)
		for _, h := range e.Headers {
			if h.Key != HeaderMessageID && h.Key != HeaderStream {
				hs = append(hs, h)
			}
		}
		hs = append(hs, kgo.RecordHeader{Key: HeaderMessageID, Value: []byte(ids[i])})
		if h, ok := seqs[i]; ok {
			hs = append(hs, h)
		}
		keys, vals := SplitHeaders(hs)
		ln := lane(e.Topic, e.Key)
		if e.Key == nil {
			ln = lane(e.Topic, []byte(ids[i])) // no order to keep: spread over the lanes
		}
		b.Queue(o.insertSQL, o.group, e.Topic, parts[i], ln, e.Key, e.Value, keys, vals)
	}
	if o.payload != "" {
		b.Queue(`SELECT pg_notify($1, $2)`, notifyChannel, o.payload)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("sink: emit %d events: %w", len(events), err)
	}
	return nil
}

// CheckTopic reports whether topic is a name Kafka accepts: 1 to 249 characters among ASCII
// letters, digits, '.', '_' and '-', and not "." or "..". Emit checks it, so that a name Postgres
// or Kafka would refuse for good (NUL, invalid UTF-8, a typo with a space) fails the emitting
// transaction with this error instead of a row no relay can ever publish.
func CheckTopic(topic string) error {
	switch {
	case topic == "":
		return errors.New("the event has no Topic")
	case len(topic) > 249:
		return fmt.Errorf("topic %.40q… is %d characters; Kafka allows 249", topic, len(topic))
	case topic == "." || topic == "..":
		return fmt.Errorf("topic %q is not a name Kafka allows", topic)
	}
	for i := 0; i < len(topic); i++ {
		c := topic[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("topic %q has byte %#x at %d: Kafka allows ASCII letters, digits, '.', '_' and '-'", topic, c, i)
		}
	}
	return nil
}

// DerivedID is the id of the n-th event (from 0) emitted while group applied the record at topic,
// partition and offset: a UUID (version 5, SHA-1) of those coordinates.
func DerivedID(group, topic string, partition int32, offset int64, n int) string {
	h := sha1.New()
	h.Write(idNamespace[:])
	for _, s := range []string{group, topic} {
		h.Write(binary.AppendUvarint(nil, uint64(len(s))))
		h.Write([]byte(s))
	}
	h.Write(binary.BigEndian.AppendUint32(nil, uint32(partition)))
	h.Write(binary.BigEndian.AppendUint64(nil, uint64(offset)))
	h.Write([]byte(strconv.Itoa(n)))
	var u [16]byte
	copy(u[:], h.Sum(nil))
	u[6] = u[6]&0x0f | 0x50 // version 5
	u[8] = u[8]&0x3f | 0x80 // RFC 4122 variant
	return formatUUID(u)
}

// idNamespace is the UUID namespace of DerivedID.
var idNamespace = [16]byte{0x6b, 0x61, 0x66, 0x6b, 0x61, 0x70, 0x67, 0x2d, 0x6f, 0x75, 0x74, 0x62, 0x6f, 0x78, 0x2d, 0x31}

func randomID() string {
	var u [16]byte
	_, _ = rand.Read(u[:])  // never fails (crypto/rand)
	u[6] = u[6]&0x0f | 0x40 // version 4
	u[8] = u[8]&0x3f | 0x80
	return formatUUID(u)
}

func formatUUID(u [16]byte) string { return uuid.UUID(u).String() }
