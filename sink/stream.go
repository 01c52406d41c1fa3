package sink

import (
	"context"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
)

// HeaderStream is the header of a numbered event (see "Streams" in the package documentation):
//
//	<stream> <seq> <root> <source offset> <dest>                                a stream created afresh
//	<stream> <seq> <root> <source offset> <dest> <parent> <fork seq> <since>    a fork
//
// either followed by " k" when the event is Keyed (see Stream.Keyed).
//
// stream is the stream's id (a UUID); seq the event's number in it (1, 2, 3, ... in the order the
// emitting transactions committed); root the id its lineage shares (derived from the group, the
// source partition and the destination partition: the first stream and every stream forked
// after it, or created again for it); source offset the offset of the record whose handling
// emitted the event; dest where the stream's events go, <partition>@<the first 8 hex digits of the
// SHA-256 of the topic's name>, for a consumer to tell a header copied onto another record (Kafka
// Streams forwards headers) from its own; and, for a fork, the stream it replaces, the last number
// of that one the database kept, and a time before which no event of it that the database lost
// was published (Unix milliseconds; see Stream.Since). Like HeaderMessageID it is part of the
// event's identity: it travels with the record through a consumer's retry tiers and dead letters,
// and Emit replaces one a handler copied.
const HeaderStream = "message-stream"

// Source is where an event a processor emits came from: the record it applied. See Event.Source.
type Source struct {
	Topic     string
	Partition int32
	Offset    int64
}

// Stream is a numbered event's place in its stream, as its header says (ParseStream).
type Stream struct {
	ID            [16]byte
	Seq           int64
	Root          [16]byte
	SourceOffset  int64
	DestPartition int32
	DestTopic     [4]byte  // the first 4 bytes of the SHA-256 of the destination topic's name
	Parent        [16]byte // the stream this one replaces; zero for a stream created afresh
	ForkSeq       int64    // the last number of Parent the database kept; 0 for a stream created afresh
	// Since, for a fork: no event of Parent that the fork's database lost was published before
	// it (by the database's clock). It is the latest time a number was taken under Parent's
	// database identity among the streams the database kept: the lost commits came after the
	// copy or standby the database was restored from, and a relay publishes after a commit.
	Since time.Time
	// Keyed: the emitting schema's upgrade window was open when the event was numbered, or its
	// group's window of keys was (a retention after finalizing, or after the group first ran this
	// release). A process of the release before may then have applied its source record and
	// emitted the event unnumbered, a commit its database lost since: that copy is in no stream, so
	// a consumer decides a Keyed event by its key as well as by its number.
	Keyed bool
}

// Fits reports whether s's stream goes to partition of topic: a header copied onto a record of
// another topic or partition (another producer forwarding headers) does not.
func (s Stream) Fits(topic string, partition int32) bool {
	return s.DestPartition == partition && s.DestTopic == topicHash(topic)
}

func topicHash(topic string) [4]byte {
	h := sha256.Sum256([]byte(topic))
	return [4]byte(h[:4])
}

// IsRoot reports whether the stream was created afresh rather than forked from another.
func (s Stream) IsRoot() bool { return s.ForkSeq == 0 }

// ParseStream reads the stream header of a record; ok is false if it has none, or it is malformed
// (a consumer then deduplicates the record by its message id, as an event of any producer).
func ParseStream(headers []kgo.RecordHeader) (s Stream, ok bool) {
	var v []byte
	for _, h := range headers {
		if h.Key == HeaderStream {
			v = h.Value
		}
	}
	f := strings.Fields(string(v))
	if n := len(f); (n == 6 || n == 9) && f[n-1] == "k" {
		s.Keyed, f = true, f[:n-1]
	}
	if len(f) != 5 && len(f) != 8 {
		return Stream{}, false
	}
	var err error
	if s.ID, err = parseUUID(f[0]); err != nil {
		return Stream{}, false
	}
	if s.Seq, err = strconv.ParseInt(f[1], 10, 64); err != nil || s.Seq < 1 {
		return Stream{}, false
	}
	if s.Root, err = parseUUID(f[2]); err != nil {
		return Stream{}, false
	}
	if s.SourceOffset, err = strconv.ParseInt(f[3], 10, 64); err != nil || s.SourceOffset < 0 {
		return Stream{}, false
	}
	part, topic, found := strings.Cut(f[4], "@")
	p, err := strconv.ParseInt(part, 10, 32)
	th, err1 := hex.DecodeString(topic)
	if !found || err != nil || p < 0 || err1 != nil || len(th) != 4 || len(topic) != 8 || strings.ToLower(topic) != topic {
		return Stream{}, false
	}
	s.DestPartition, s.DestTopic = int32(p), [4]byte(th)
	if len(f) == 5 {
		return s, true
	}
	if s.Parent, err = parseUUID(f[5]); err != nil {
		return Stream{}, false
	}
	ms, err1 := strconv.ParseInt(f[7], 10, 64)
	if s.ForkSeq, err = strconv.ParseInt(f[6], 10, 64); err != nil || err1 != nil || s.ForkSeq < 1 || ms < 1 {
		return Stream{}, false
	}
	s.Since = time.UnixMilli(ms)
	return s, true
}

// parseUUID reads a UUID in its canonical form (36 characters), as formatUUID writes it.
func parseUUID(s string) ([16]byte, error) {
	if len(s) != 36 {
		return [16]byte{}, fmt.Errorf("not a UUID: %q", s)
	}
	u, err := uuid.Parse(s)
	return [16]byte(u), err
}

// streamKey is a stream as the emitting side keys it (outbox_streams), within one group.
type streamKey struct {
	topic         string
	partition     int32
	dest          string
	destPartition int32
}

// rootID is the root of the streams of key in group: every stream created afresh for it names
// it, so that one created again after the database lost the first finds its sibling.
func rootID(group string, k streamKey) [16]byte {
	h := sha1.New()
	h.Write(idNamespace[:])
	for _, s := range []string{"stream-root", group, k.topic, k.dest} {
		h.Write(binary.AppendUvarint(nil, uint64(len(s))))
		h.Write([]byte(s))
	}
	h.Write(binary.BigEndian.AppendUint32(nil, uint32(k.partition)))
	h.Write(binary.BigEndian.AppendUint32(nil, uint32(k.destPartition)))
	var u [16]byte
	copy(u[:], h.Sum(nil))
	u[6] = u[6]&0x0f | 0x50
	u[8] = u[8]&0x3f | 0x80
	return u
}

// DatabaseIdentitySQL is the SQL expression of the database's identity as outbox_streams
// records it: its system identifier, the timeline it writes WAL on, and when the server started.
// A failover to a standby and a restore to a point in time start a new timeline; a restore into
// another cluster has another system identifier; a copy of the data directory started as it was
// (commits lost, the same identifier and timeline) starts the server anew. So does a plain
// restart, which loses nothing: its streams fork all the same, which costs a consumer nothing to
// read back (nothing past a fork point was applied) and a few minutes of keys.
const DatabaseIdentitySQL = `((SELECT system_identifier::text FROM pg_control_system()) || '/' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) || '/' || (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::int8::text)`

// CheckStreams reports whether this database lets an Outbox number events: it must be able to
// read its own identity (DatabaseIdentitySQL; some managed services do not allow it). Without,
// leave OutboxConfig.Partitions nil: events are published by key, with their message id only.
func CheckStreams(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) error {
	var id string
	if err := db.QueryRow(ctx, `SELECT `+DatabaseIdentitySQL).Scan(&id); err != nil {
		return fmt.Errorf("sink: the database cannot tell its identity (pg_control_system, pg_walfile_name): %w", err)
	}
	return nil
}

// streamSQL takes the numbers of a transaction's events, n per stream, in one statement, and
// forks the streams whose row was written under another database identity. A fork's fork_at is
// its Since: the latest updated_at among the rows written under the forking row's identity (the
// database kept them all from before it lost anything).
//
// It also says whether the events are Keyed: the schema's upgrade window open
// (schema_migrations_pending has a row), or the group's window of keys (idempotency_groups, which
// finalizing extends by a retention) not past.
func streamSQL(schema string) string {
	table := pgx.Identifier{schema, "outbox_streams"}.Sanitize()
	keyed := `(EXISTS (SELECT 1 FROM ` + pgx.Identifier{schema, "schema_migrations_pending"}.Sanitize() + `)
		OR EXISTS (SELECT 1 FROM ` + pgx.Identifier{schema, "idempotency_groups"}.Sanitize() + ` WHERE consumer_group = $1 AND keys_all_until > now()))`
	same := `s.database IS NOT DISTINCT FROM EXCLUDED.database`
	return `INSERT INTO ` + table + ` AS s (consumer_group, topic, partition, dest_topic, dest_partition, stream, seq, database, parent, fork_seq, fork_at, updated_at)
		SELECT $1, t, p, dt, dp, gen_random_uuid(), n, ` + DatabaseIdentitySQL + `, r, 0, NULL, now()
		FROM unnest($2::text[], $3::int4[], $4::text[], $5::int4[], $6::int8[], $7::uuid[]) AS u(t, p, dt, dp, n, r)
		ORDER BY t, p, dt, dp
		ON CONFLICT (consumer_group, topic, partition, dest_topic, dest_partition) DO UPDATE SET
			stream = CASE WHEN ` + same + ` THEN s.stream ELSE EXCLUDED.stream END,
			parent = CASE WHEN ` + same + ` THEN s.parent ELSE s.stream END,
			fork_seq = CASE WHEN ` + same + ` THEN s.fork_seq ELSE s.seq END,
			fork_at = CASE WHEN ` + same + ` THEN s.fork_at
				ELSE (SELECT max(o.updated_at) FROM ` + table + ` o WHERE o.database IS NOT DISTINCT FROM s.database) END,
			seq = CASE WHEN ` + same + ` THEN s.seq + EXCLUDED.seq ELSE EXCLUDED.seq END,
			database = EXCLUDED.database,
			updated_at = EXCLUDED.updated_at
		RETURNING topic, partition, dest_topic, dest_partition, stream, seq, parent, fork_seq, fork_at, ` + keyed
}

// numbered is a stream's share of a transaction's events.
type numbered struct {
	key    streamKey
	events []int // indexes into the events, in emit order
}

// number takes the numbers of the events of streams in tx (one round trip) and returns, per
// event index, its stream header.
func (o *Outbox) number(ctx context.Context, tx pgx.Tx, events []Event, streams []*numbered) (map[int]kgo.RecordHeader, error) {
	n := len(streams)
	topics, dests := make([]string, n), make([]string, n)
	parts, destParts := make([]int32, n), make([]int32, n)
	counts, roots := make([]int64, n), make([][16]byte, n)
	byKey := make(map[streamKey]*numbered, n)
	for i, s := range streams {
		topics[i], parts[i], dests[i], destParts[i] = s.key.topic, s.key.partition, s.key.dest, s.key.destPartition
		counts[i], roots[i] = int64(len(s.events)), rootID(o.group, s.key)
		byKey[s.key] = s
	}
	rows, err := tx.Query(ctx, o.streamSQL, o.group, topics, parts, dests, destParts, counts, roots)
	if err != nil {
		return nil, err
	}
	out := map[int]kgo.RecordHeader{}
	for rows.Next() {
		var k streamKey
		var st Stream
		var forkAt *time.Time
		if err := rows.Scan(&k.topic, &k.partition, &k.dest, &k.destPartition, &st.ID, &st.Seq, &st.Parent, &st.ForkSeq, &forkAt, &st.Keyed); err != nil {
			rows.Close()
			return nil, err
		}
		s := byKey[k]
		if s == nil {
			rows.Close()
			return nil, fmt.Errorf("numbering returned a stream not asked for: %+v", k)
		}
		st.Root = rootID(o.group, k)
		st.DestPartition, st.DestTopic = k.destPartition, topicHash(k.dest)
		if st.IsRoot() {
			st.Parent = [16]byte{}
		} else if forkAt != nil {
			st.Since = *forkAt
		}
		first := st.Seq - int64(len(s.events)) + 1
		for j, i := range s.events {
			st.Seq, st.SourceOffset = first+int64(j), events[i].Source.Offset
			out[i] = st.header()
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(out) != countEvents(streams) {
		return nil, fmt.Errorf("numbering returned %d of %d events' numbers", len(out), countEvents(streams))
	}
	return out, nil
}

func countEvents(streams []*numbered) int {
	n := 0
	for _, s := range streams {
		n += len(s.events)
	}
	return n
}

// header is s's header on an event.
func (s Stream) header() kgo.RecordHeader {
	v := fmt.Sprintf("%s %d %s %d %d@%x", formatUUID(s.ID), s.Seq, formatUUID(s.Root), s.SourceOffset, s.DestPartition, s.DestTopic)
	if !s.IsRoot() {
		v += fmt.Sprintf(" %s %d %d", formatUUID(s.Parent), s.ForkSeq, max(s.Since.UnixMilli(), 1))
	}
	if s.Keyed {
		v += " k"
	}
	return kgo.RecordHeader{Key: HeaderStream, Value: []byte(v)}
}

// keyPartitioner places a keyed record as Kafka's own producers do (murmur2 of the key); it keeps
// no state for keyed records, so one serves every topic and goroutine.
var keyPartitioner = kgo.StickyKeyPartitioner(nil).ForTopic("")

// partitionOf is the partition an event goes to among n: its key's, as Kafka's producers place
// it, or, without a key, its id's.
func partitionOf(key []byte, id string, n int) int32 {
	if key != nil {
		return int32(keyPartitioner.Partition(&kgo.Record{Key: key}, n))
	}
	h := fnv.New32a()
	h.Write([]byte(id))
	return int32(h.Sum32() % uint32(n))
}
