package ops

import (
	"bytes"
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// Where a traced record is now (RecordTrace.State).
const (
	// TraceNotConsumed: the group's position in the partition has not reached the record (or
	// the group has no position there yet, or the record is not produced yet).
	TraceNotConsumed = "not_consumed"
	// TraceApplied: the partition's position passed the record and no table of the retry path
	// holds it; or a replay of its dead letter applied it.
	TraceApplied = "applied"
	// TraceSkippedDuplicate: it was skipped as a duplicate, never given to the handler: a copy of
	// it was applied before, by its idempotency key (or, for an event a kafkapg service emitted,
	// by its stream's number). Consumed (the partition's position passed it, or from a retry
	// tier), or brought back by a replay of its dead letter. The trace names the key, or the
	// stream, and the copy applied before when the skip knew it (an earlier record of the same
	// batch): the key ring keeps only the keys' hashes.
	TraceSkippedDuplicate = "skipped_duplicate"
	// TraceInTier: the record is in a retry tier, waiting for its due time.
	TraceInTier = "in_tier"
	// TraceOutbox: a copy of the record waits in the outbox to be published (to its next retry
	// tier, or, with nothing else holding the record, to any topic).
	TraceOutbox = "outbox"
	// TraceHeld: the record waits in held_records behind an earlier record of its key (or,
	// replayed, to be applied). Once it moved on, its trace keeps the wait as a StepHeld step.
	TraceHeld = "held"
	// TraceDeadLettered: the record is dead-lettered (its dead letter is new, replaying or
	// discarded).
	TraceDeadLettered = "dead_lettered"
	// TraceBeyondRetention: the record is below the partition's log start offset: the broker
	// deleted it, and no table of the retry path holds it.
	TraceBeyondRetention = "beyond_retention"
	// TraceSkippedByOperator: an operator set the partition's position past the record
	// (positions set, forward): it was never given to the handler. The trace names who, when
	// and why (position_changes).
	TraceSkippedByOperator = "skipped_by_operator"
)

// TraceQuery chooses the records Trace follows: the record at Topic, Partition, Offset; or,
// with Key set (non-nil; an empty key is a key), the latest records of Key in Topic.
type TraceQuery struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	// Limit bounds the records of a key, newest first. Defaults to 20.
	Limit int
	// Scan is how many of the last records of each partition of Topic are read from Kafka to
	// find the key's records that Postgres does not keep. Defaults to 1000.
	Scan int
	// Concurrency is the topic's CONCURRENCY, if the caller knows it (0: not known): a record not
	// applied yet is then said to be possibly in its partition's window, being prepared.
	Concurrency int
}

const (
	defaultTraceLimit = 20
	maxTraceLimit     = 1000
	defaultTraceScan  = 1000
	maxTraceScan      = 1_000_000
	// traceKafkaTimeout bounds all of a trace's reads from Kafka.
	traceKafkaTimeout = 15 * time.Second
	// traceScanIdle: a scan that receives nothing for this long twice in a row stops (the rest
	// of a partition may hold no records at all: transaction markers).
	traceScanIdle = 2 * time.Second
	// traceFetchBytes and traceFetchPartitionBytes bound a fetch of a trace's reads from Kafka
	// (kgo.FetchMaxBytes, kgo.FetchMaxPartitionBytes; franz-go's defaults are 50 MiB and 1 MiB).
	traceFetchBytes          = 4 << 20
	traceFetchPartitionBytes = 1 << 20
)

// MaxTraces is how many traces a process runs at once, whoever asks (the console's viewers and
// operators, the JSON API, the CLI): each reads Kafka with clients of its own, one at a time,
// each holding at most two fetches of traceFetchBytes; a trace over the limit is refused
// (ErrBusy), not queued.
const MaxTraces = 4

// traceSlots holds a token per trace running in the process. It is the process's, not an Ops's:
// the console and the JSON API each have their own, and the memory they share is the process's.
var traceSlots = make(chan struct{}, MaxTraces)

// ErrBusy wraps the error of an operation refused because as many as the process runs at once
// are running (MaxTraces traces): the caller may try again in a moment.
var ErrBusy = errors.New("busy")

// startTrace takes a trace's slot, or refuses with ErrBusy; release gives it back.
func startTrace() (release func(), err error) {
	select {
	case traceSlots <- struct{}{}:
		return func() { <-traceSlots }, nil
	default:
		return nil, fmt.Errorf("%w: %d traces are running in this process, the most it runs at once (each reads Kafka): try again in a moment", ErrBusy, MaxTraces)
	}
}

func (q TraceQuery) withDefaults() (TraceQuery, error) {
	if q.Topic == "" {
		return q, usage("a topic is required")
	}
	if err := text("topic", q.Topic); err != nil {
		return q, err
	}
	if q.Key == nil {
		if q.Partition < 0 || q.Offset < 0 {
			return q, usage("a partition and an offset (both at least 0) are required, or a key")
		}
		return q, nil
	}
	q.Limit, q.Scan = cmp.Or(q.Limit, defaultTraceLimit), cmp.Or(q.Scan, defaultTraceScan)
	if q.Limit < 0 || q.Limit > maxTraceLimit {
		return q, usage("limit must be between 1 and %d, got %d", maxTraceLimit, q.Limit)
	}
	if q.Scan < 0 || q.Scan > maxTraceScan {
		return q, usage("scan must be between 1 and %d, got %d", maxTraceScan, q.Scan)
	}
	return q, nil
}

// TraceResult is what Trace found.
type TraceResult struct {
	Records []RecordTrace `json:"records"`
	// Notes say what could not be checked (Kafka unreachable, a scan cut short).
	Notes []string `json:"notes,omitempty"`
}

// RecordTrace says where a record is now and how it got there.
type RecordTrace struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	Offset    int64  `json:"offset"`
	Key       []byte `json:"key"`
	// KeyText is Key for people (KeyText); empty when the key is not known (the record is
	// neither in Postgres nor read from Kafka).
	KeyText string `json:"key_text,omitempty"`
	// State is one of the Trace* constants.
	State string `json:"state"`
	// Now says in words where the record is now.
	Now string `json:"now"`
	// Steps say how it got there, in the order it went.
	Steps []TraceStep `json:"steps"`
	// TraceID is the OpenTelemetry trace the record belongs to (hex), as the trace context it
	// carries says: its dead letter's (the delivery that dead-lettered it), its held record's, or
	// its Kafka record's. Empty when it carries none (tracing off, or an untraced producer).
	TraceID string `json:"trace_id,omitempty"`
}

// TraceStep is a step of a record's way through kafkapg.
type TraceStep struct {
	At time.Time `json:"at"`
	// Kind is one of the Step* constants.
	Kind string `json:"kind"`
	// Tier is the retry tier a StepTier step sent the record to; 0 for other steps.
	Tier int    `json:"tier,omitempty"`
	What string `json:"what"`
	// Until is when a StepHeld step's wait ended (the record left held_records); nil while it
	// waits, and for other steps.
	Until *time.Time `json:"until,omitempty"`
	// Behind is the offset of the record of its key a StepHeld step waited behind (its key's
	// head then, or the first record held before it), when known.
	Behind *int64 `json:"behind_offset,omitempty"`
	// IdempotencyKey is a StepSkippedDuplicate step's idempotency key, for people (KeyText;
	// empty if not known), Stream and StreamSeq the stream and number that decided it, for an
	// event a kafkapg service emitted, and First the copy applied before, when known.
	IdempotencyKey string    `json:"idempotency_key,omitempty"`
	Stream         string    `json:"stream,omitempty"`
	StreamSeq      int64     `json:"stream_seq,omitempty"`
	First          *TraceRef `json:"first,omitempty"`
}

// TraceRef names a record of the traced topic.
type TraceRef struct {
	Partition int32 `json:"partition"`
	Offset    int64 `json:"offset"`
}

// The kinds of a record's steps (TraceStep.Kind).
const (
	StepProduced     = "produced"      // the record's timestamp
	StepFailed       = "failed"        // its first failure
	StepTier         = "tier"          // sent to a retry tier
	StepHeld         = "held"          // held behind an earlier record of its key: which, and for how long
	StepOutbox       = "outbox"        // a copy written to the outbox
	StepRefused      = "refused"       // Kafka refused the copy for good
	StepReleased     = "released"      // its key released by an operator
	StepDeadLettered = "dead_lettered" // dead-lettered
	StepReplayQueued = "replay_queued" // a replay brought it back
	StepReplayed     = "replayed"      // applied by a replay
	// StepSkippedDuplicate: it was skipped as a duplicate, consumed or brought back by a replay:
	// by its idempotency key, or its stream's number (a copy was applied before).
	StepSkippedDuplicate = "skipped_duplicate"
	StepDiscarded        = "discarded" // its dead letter discarded
	StepApplied          = "applied"   // the partition's position passed it
	// StepPositionSet: an operator set the partition's position across the record: forward
	// past it (skipped), or back before it (applied again once the position passes it).
	StepPositionSet = "position_set"
)

// Trace answers, for the records q chooses, where each is now and how it got there, from the
// group's tables and, through kc, the topic's log start and end offsets (nil kc: Postgres only).
// kafkapg keeps little history of a record it applied: an applied record is one that the
// partition's position passed and that no table of the retry path holds; skipped_duplicates says
// which of those were skipped as duplicates, and held_history how long a record waited behind its
// key (found by the record's key: read from Kafka, or from the tables). For a key, the records
// are those Postgres keeps in the retry path plus those of the last q.Scan records of each
// partition (read from Kafka with a short-lived consumer built from kc's options), newest
// (highest offset) first, at most q.Limit.
// Kafka reads stop after 15 seconds; what they could not check is in the result's notes.
//
// q.Topic must be one of the group's (CheckTopic: bad usage otherwise). A process runs at most
// MaxTraces traces at once: one more is refused with ErrBusy. A trace keeps nothing of a record's
// value, and its reads from Kafka fetch a few megabytes at a time.
func (o *Ops) Trace(ctx context.Context, q TraceQuery, kc *kgo.Client) (TraceResult, error) {
	q, err := q.withDefaults()
	if err != nil {
		return TraceResult{}, err
	}
	if err := o.CheckTopic(ctx, q.Topic); err != nil {
		return TraceResult{}, err
	}
	release, err := startTrace()
	if err != nil {
		return TraceResult{}, err
	}
	defer release()
	res := TraceResult{Records: []RecordTrace{}}
	kctx, cancel := context.WithTimeout(ctx, traceKafkaTimeout)
	defer cancel()
	var bounds map[int32]logBounds
	switch {
	case kc == nil && q.Key != nil:
		res.Notes = append(res.Notes, "Kafka was not consulted: only the key's records that Postgres keeps are listed, and the broker's retention is not checked")
	case kc == nil:
		res.Notes = append(res.Notes, "Kafka was not consulted: the broker's retention is not checked")
	default:
		bounds, err = topicBounds(kctx, kc, q.Topic)
		if err != nil {
			res.Notes = append(res.Notes, fmt.Sprintf("the offsets of %s could not be read from Kafka (%s): the broker's retention is not checked", q.Topic, safetext.Text(err.Error(), 300)))
		}
	}

	found := map[traceOrigin]*scanned{}
	var origins []traceOrigin
	if q.Key == nil {
		org := traceOrigin{q.Partition, q.Offset}
		origins = append(origins, org)
		if b, ok := bounds[q.Partition]; ok && q.Offset >= b.start && q.Offset < b.end {
			recs, notes := scanTopic(kctx, kc, q.Topic, map[int32][2]int64{q.Partition: {q.Offset, q.Offset + 1}}, nil)
			res.Notes = append(res.Notes, notes...)
			for _, r := range recs {
				found[r.traceOrigin] = r
			}
		} else if kc != nil && bounds != nil && !ok {
			res.Notes = append(res.Notes, fmt.Sprintf("Kafka has no partition %d of %s", q.Partition, q.Topic))
		}
	} else {
		if origins, err = o.keyOrigins(ctx, q); err != nil {
			return TraceResult{}, err
		}
		if len(bounds) > 0 {
			ranges := map[int32][2]int64{}
			for p, b := range bounds {
				ranges[p] = [2]int64{max(b.start, b.end-int64(q.Scan)), b.end}
			}
			recs, notes := scanTopic(kctx, kc, q.Topic, ranges, q.Key)
			res.Notes = append(res.Notes, notes...)
			for _, r := range recs {
				found[r.traceOrigin] = r
				origins = append(origins, r.traceOrigin)
			}
		}
		slices.SortFunc(origins, func(a, b traceOrigin) int {
			return cmp.Or(cmp.Compare(b.offset, a.offset), cmp.Compare(a.partition, b.partition))
		})
		origins = slices.Compact(origins)
		origins = origins[:min(len(origins), q.Limit)]
	}
	if len(origins) == 0 {
		return res, nil
	}
	keys := map[traceOrigin][]byte{}
	for org, r := range found {
		keys[org] = r.key
	}
	if q.Key != nil {
		for _, org := range origins {
			keys[org] = q.Key
		}
	}
	f, err := o.traceFacts(ctx, q.Topic, origins, keys)
	if err != nil {
		return TraceResult{}, err
	}
	if kc != nil {
		// How each got through the retry tiers: their topics keep the copies, with the failure
		// each was sent there after, where the tables forget a record once it is applied.
		since, want := map[int32]time.Time{}, map[traceOrigin]bool{}
		for _, org := range origins {
			at := f.producedAt(org, found[org])
			if at.IsZero() {
				continue
			}
			want[org] = true
			if s, ok := since[org.partition]; !ok || at.Before(s) {
				since[org.partition] = at
			}
		}
		var notes []string
		f.tiers, notes = o.tierHistory(kctx, kc, q.Topic, since, want)
		res.Notes = append(res.Notes, notes...)
	}
	for _, org := range origins {
		res.Records = append(res.Records, o.describe(q, org, f, found[org], bounds))
	}
	return res, nil
}

// traceOrigin is a record of the traced topic.
type traceOrigin struct {
	partition int32
	offset    int64
}

// logBounds are a partition's log start and end offsets.
type logBounds struct{ start, end int64 }

// topicBounds reads the log start and end offsets of topic's partitions.
func topicBounds(ctx context.Context, kc *kgo.Client, topic string) (map[int32]logBounds, error) {
	adm := kadm.NewClient(kc)
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err == nil {
		err = starts.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("list start offsets: %w", err)
	}
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("list end offsets: %w", err)
	}
	out := map[int32]logBounds{}
	starts.Each(func(s kadm.ListedOffset) {
		if e, ok := ends.Lookup(topic, s.Partition); ok {
			out[s.Partition] = logBounds{s.Offset, e.Offset}
		}
	})
	return out, nil
}

// scanned is what a trace keeps of a record it read from Kafka: what it tells, never the value.
type scanned struct {
	traceOrigin
	key       []byte
	timestamp time.Time
	traceID   string // of the trace context its headers carry; "" if none
}

// scanTopic reads the records of topic in the offset ranges [from, to) of ranges with a consumer
// built from kc's options, keeping those whose key is key (all of them if key is nil). It stops
// when every range is read, ctx ends, or nothing arrives for a while, and says so in notes.
//
// It keeps a copy of what it tells of each record (its coordinates, key, time and trace id), not
// the record: a record's key and value are slices of the fetch response they came in, which a
// kept key would keep whole, values included.
func scanTopic(ctx context.Context, kc *kgo.Client, topic string, ranges map[int32][2]int64, key []byte) (recs []*scanned, notes []string) {
	notes = scanRanges(ctx, kc, topic, ranges, 0, func(r *kgo.Record) {
		if key != nil && (r.Key == nil || string(r.Key) != string(key)) {
			return
		}
		k := key // the key asked for, equal to the record's
		if key == nil {
			k = bytes.Clone(r.Key)
		}
		recs = append(recs, &scanned{traceOrigin: traceOrigin{r.Partition, r.Offset}, key: k, timestamp: r.Timestamp,
			traceID: tracing.TraceID(r.Headers)})
	})
	return recs, notes
}

// scanRanges reads the records of topic in the offset ranges [from, to) of ranges with a consumer
// built from kc's options, giving each to visit (which must not keep its value: the scan is
// bounded by maxBytes of values, if not 0). It stops when every range is read, maxBytes is
// reached, ctx ends, or nothing arrives for a while, and says so in notes.
func scanRanges(ctx context.Context, kc *kgo.Client, topic string, ranges map[int32][2]int64, maxBytes int, visit func(*kgo.Record)) (notes []string) {
	pending := map[int32]int64{}
	at := map[int32]kgo.Offset{}
	for p, r := range ranges {
		if r[0] < r[1] {
			pending[p] = r[1]
			at[p] = kgo.NewOffset().At(r[0])
		}
	}
	if len(pending) == 0 {
		return nil
	}
	opts := append(slices.Clone(kc.Opts()),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: at}),
		kgo.FetchMaxWait(200*time.Millisecond),
		// What the client holds at once: one fetch in flight and one polled, each of at most
		// traceFetchBytes (but a first batch larger than that: brokers send it whole).
		kgo.FetchMaxBytes(traceFetchBytes), kgo.FetchMaxPartitionBytes(traceFetchPartitionBytes), kgo.MaxConcurrentFetches(1))
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return []string{fmt.Sprintf("%s could not be read: %s", topic, safetext.Text(err.Error(), 300))}
	}
	defer cl.Close()
	idle, read := 0, 0
	for len(pending) > 0 && ctx.Err() == nil && idle < 2 && (maxBytes == 0 || read < maxBytes) {
		pctx, cancel := context.WithTimeout(ctx, traceScanIdle)
		fs := cl.PollFetches(pctx)
		cancel()
		got := false
		fs.EachError(func(t string, p int32, err error) {
			if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
				return
			}
			if _, ok := pending[p]; ok && t == topic {
				notes = append(notes, fmt.Sprintf("%s[%d] could not be read to its end: %s", topic, p, safetext.Text(err.Error(), 300)))
				delete(pending, p)
			}
		})
		fs.EachRecord(func(r *kgo.Record) {
			end, ok := pending[r.Partition]
			if ok && r.Offset >= end-1 {
				// The end of the range (its last offset may hold no record: a transaction
				// marker, or compacted away).
				delete(pending, r.Partition)
			}
			if !ok || r.Offset >= end {
				return
			}
			got = true
			read += len(r.Value)
			visit(r)
			if r.Offset >= end-1 {
				delete(pending, r.Partition)
			}
		})
		if got {
			idle = 0
		} else {
			idle++
		}
	}
	for _, p := range slices.Sorted(maps.Keys(pending)) {
		notes = append(notes, fmt.Sprintf("%s[%d] was not read to its end (offset %d) in time: its last records may be missing", topic, p, pending[p]))
	}
	return notes
}

// tierCopy is a copy of a traced record found in the topic of one of its retry tiers: the
// failure it was sent there after.
type tierCopy struct {
	tier int
	f    retrytopics.Failure
}

// Bounds of the search of the retry tiers' topics for a record's copies (tierHistory).
const (
	traceMaxTiers  = 32       // tier topics looked for
	traceTierBytes = 32 << 20 // of record values read per tier topic
)

// tierHistory finds, in the topics of topic's retry tiers, the copies of origins: how each got
// through the tiers, which the tables forget once it is applied. since gives, per partition, the
// earliest time one of origins was produced; copies are published later, to the same partition
// number. What it could not read is in notes.
func (o *Ops) tierHistory(ctx context.Context, kc *kgo.Client, topic string, since map[int32]time.Time, want map[traceOrigin]bool) (map[traceOrigin][]tierCopy, []string) {
	if len(since) == 0 {
		return nil, nil
	}
	names := make([]string, traceMaxTiers)
	for n := range names {
		names[n] = retrytopics.TierTopic(topic, o.group, n+1)
	}
	adm := kadm.NewClient(kc)
	details, err := adm.ListTopics(ctx, names...)
	if err != nil {
		return nil, []string{fmt.Sprintf("the retry tiers' topics could not be listed (%s): the record's way through them is not shown", safetext.Text(err.Error(), 300))}
	}
	out := map[traceOrigin][]tierCopy{}
	var notes []string
	for n, tierTopic := range names {
		if d, ok := details[tierTopic]; !ok || d.Err != nil {
			continue
		}
		ends, err := adm.ListEndOffsets(ctx, tierTopic)
		if err == nil {
			err = ends.Error()
		}
		ranges := map[int32][2]int64{}
		for p, at := range since {
			var from kadm.ListedOffsets
			if err == nil {
				if from, err = adm.ListOffsetsAfterMilli(ctx, at.UnixMilli(), tierTopic); err == nil {
					err = from.Error()
				}
			}
			if err != nil {
				break
			}
			f, ok1 := from.Lookup(tierTopic, p)
			e, ok2 := ends.Lookup(tierTopic, p)
			if ok1 && ok2 {
				ranges[p] = [2]int64{f.Offset, e.Offset}
			}
		}
		if err != nil {
			notes = append(notes, fmt.Sprintf("%s could not be read (%s): the record's way through retry tier %d is not shown", tierTopic, safetext.Text(err.Error(), 300), n+1))
			continue
		}
		notes = append(notes, scanRanges(ctx, kc, tierTopic, ranges, traceTierBytes, func(r *kgo.Record) {
			f, err := retrytopics.ParseFailure(r.Headers)
			org := traceOrigin{f.Partition, f.Offset}
			if err == nil && f.Topic == topic && f.Group == o.group && want[org] {
				out[org] = append(out[org], tierCopy{tier: n + 1, f: f})
			}
		})...)
	}
	for org, cs := range out {
		// One copy per attempt: the relay publishes at least once.
		slices.SortFunc(cs, func(a, b tierCopy) int { return cmp.Compare(a.f.Attempt, b.f.Attempt) })
		out[org] = slices.CompactFunc(cs, func(a, b tierCopy) bool { return a.f.Attempt == b.f.Attempt })
	}
	return out, notes
}

// keyOrigins returns the records of q.Key in q.Topic that the retry path's tables keep, newest
// first, at most q.Limit.
func (o *Ops) keyOrigins(ctx context.Context, q TraceQuery) ([]traceOrigin, error) {
	rows, err := o.pool.Query(ctx, `SELECT partition, "offset" FROM (
			SELECT partition, "offset" FROM `+o.table("retries")+` WHERE consumer_group = $1 AND topic = $2 AND key = $3
			UNION SELECT partition, "offset" FROM `+o.table("held_records")+`
				WHERE consumer_group = $1 AND topic = $2 AND key_hash = sha256($3::bytea) AND key = $3 AND NOT keyless
			UNION SELECT partition, "offset" FROM `+o.table("dead_letters")+`
				WHERE consumer_group = $1 AND topic = $2 AND key_hash = sha256($3::bytea) AND key = $3
		) k ORDER BY "offset" DESC, partition LIMIT $4`, o.group, q.Topic, q.Key, q.Limit)
	if err != nil {
		return nil, fmt.Errorf("find the key's records: %w", err)
	}
	var out []traceOrigin
	var org traceOrigin
	if _, err := pgx.ForEachRow(rows, []any{&org.partition, &org.offset}, func() error {
		out = append(out, org)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("find the key's records: %w", err)
	}
	// Copies waiting in the outbox name their record in their headers.
	rows, err = o.pool.Query(ctx, `SELECT p, off FROM (`+o.outboxOriginsSQL()+`) x
		WHERE key = $3 ORDER BY id DESC LIMIT $4`, o.group, []byte(q.Topic), q.Key, q.Limit)
	if err != nil {
		return nil, fmt.Errorf("find the key's records in the outbox: %w", err)
	}
	var p, off []byte
	if _, err := pgx.ForEachRow(rows, []any{&p, &off}, func() error {
		if org, ok := parseOrigin(p, off); ok {
			out = append(out, org)
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("find the key's records in the outbox: %w", err)
	}
	return out, nil
}

// traceparentSQL selects a row's W3C traceparent header (bytes; NULL if none).
var traceparentSQL = `(SELECT h.v FROM unnest(header_keys, header_values) AS h(k, v) WHERE h.k = '\x` +
	fmt.Sprintf("%x", "traceparent") + `'::bytea LIMIT 1)`

// traceID is the trace id a traceparent header value names, or "".
func traceID(traceparent []byte) string {
	if traceparent == nil {
		return ""
	}
	return tracing.TraceID([]kgo.RecordHeader{{Key: "traceparent", Value: traceparent}})
}

// outboxOriginsSQL selects the group's ($1) outbox rows that are copies of records of the topic
// $2 (as bytes), with the partition (p) and offset (off) of the record, as their headers say.
func (o *Ops) outboxOriginsSQL() string {
	hdr := func(name string) string {
		return `(SELECT h.v FROM unnest(o.header_keys, o.header_values) AS h(k, v) WHERE h.k = '\x` +
			fmt.Sprintf("%x", name) + `'::bytea LIMIT 1)`
	}
	return `SELECT o.id, o.topic, o.key, o.created_at, o.refused_at, o.refused_error,
			` + hdr(retrytopics.HeaderOriginalPartition) + ` AS p, ` + hdr(retrytopics.HeaderOriginalOffset) + ` AS off
		FROM ` + o.table("outbox") + ` o
		WHERE o.consumer_group = $1 AND o.published_at IS NULL AND ` + hdr(retrytopics.HeaderOriginalTopic) + ` = $2::bytea`
}

// parseOrigin reads the partition and offset headers of a copy.
func parseOrigin(p, off []byte) (traceOrigin, bool) {
	pn, err1 := strconv.ParseInt(string(p), 10, 32)
	on, err2 := strconv.ParseInt(string(off), 10, 64)
	return traceOrigin{int32(pn), on}, err1 == nil && err2 == nil
}

// traceFacts is what the group's tables say about a set of records of one topic.
type traceFacts struct {
	positions map[int32]tracePosition
	retries   map[traceOrigin]traceRetry
	held      map[traceOrigin]traceHeld
	dead      map[traceOrigin]traceDead
	outbox    map[traceOrigin][]traceCopy
	releases  map[traceOrigin][]traceRelease
	history   map[traceOrigin][]traceHistory // skipped_duplicates and held_history: what the tables above forgot
	keys      []HeldKey                      // the held keys of the records' keys
	// tiers are the copies of the records found in the retry tiers' topics (tierHistory).
	tiers map[traceOrigin][]tierCopy
	// changes are the position changes whose range has the record, oldest first.
	changes map[traceOrigin][]tracePositionChange
}

// tracePositionChange is a position_changes row: an operator set the position from from to to.
type tracePositionChange struct {
	from, to      int64 // from -1: the partition had no stored position (it covers [0, to))
	at            time.Time
	actor, reason string
}

// fromText says where the change set the position from.
func (c tracePositionChange) fromText() string {
	if c.from < 0 {
		return "none stored"
	}
	return strconv.FormatInt(c.from, 10)
}

// step is the change's step of a record in its range.
func (c tracePositionChange) step() TraceStep {
	who := fmt.Sprintf("%s (%s)", safetext.Text(oneLine(c.actor), 80), safetext.Text(oneLine(c.reason), 200))
	if c.to > c.from {
		return TraceStep{At: c.at, Kind: StepPositionSet, What: fmt.Sprintf("skipped: %s set the partition's position forward from %s to %d, past it, never applied", who, c.fromText(), c.to)}
	}
	return TraceStep{At: c.at, Kind: StepPositionSet, What: fmt.Sprintf("rewound: %s set the partition's position back from %d to %d: it is applied again once the position passes it", who, c.from, c.to)}
}

// producedAt is when the record org was produced, as its Kafka record (kr, if read) or the tables
// say; zero if nothing does.
func (f *traceFacts) producedAt(org traceOrigin, kr *scanned) time.Time {
	switch {
	case kr != nil:
		return kr.timestamp
	case f.dead[org].id != 0:
		return time.UnixMilli(f.dead[org].timestamp)
	}
	if h, ok := f.held[org]; ok {
		return time.UnixMilli(h.timestamp)
	}
	return time.Time{}
}

type tracePosition struct {
	next      *int64
	updatedAt time.Time
}

type traceRetry struct {
	key                       []byte
	attempt                   int
	firstFailed, due, updated time.Time
	class, message            string
	tier                      int
}

type traceHeld struct {
	traceparent []byte
	key         []byte
	keyless     bool
	timestamp   int64
	heldAt      time.Time
	attempt     int
	deadLetter  int64
	behind      *int64
}

// traceHistory is what the tables of the retry path forgot of a record: that it was skipped as a
// duplicate (a skipped_duplicates row), or waited behind its key (its part of a held_history row).
type traceHistory struct {
	event          string // skipped_duplicate or held
	at             time.Time
	until          *time.Time
	behind         *int64
	idempotencyKey []byte
	keyHash        []byte
	first          *TraceRef
	stream         *string
	streamSeq      *int64
}

type traceDead struct {
	traceparent                         []byte
	id                                  int64
	key                                 []byte
	timestamp                           int64
	class, message, status              string
	attempts                            int
	firstFailed, deadLettered, statusAt time.Time
	events                              []TraceStep
}

type traceCopy struct {
	topic     string
	key       []byte
	createdAt time.Time
	refusedAt *time.Time
	refused   *string
}

type traceRelease struct {
	at                 time.Time
	actor, reason, why string
}

// traceFacts reads, in one snapshot, what the group's tables keep about origins of topic; keys
// are their keys read from Kafka, if any (a past wait behind a key is found by the key).
func (o *Ops) traceFacts(ctx context.Context, topic string, origins []traceOrigin, keys map[traceOrigin][]byte) (*traceFacts, error) {
	f := &traceFacts{positions: map[int32]tracePosition{}, retries: map[traceOrigin]traceRetry{}, held: map[traceOrigin]traceHeld{},
		dead: map[traceOrigin]traceDead{}, outbox: map[traceOrigin][]traceCopy{}, releases: map[traceOrigin][]traceRelease{},
		history: map[traceOrigin][]traceHistory{}, changes: map[traceOrigin][]tracePositionChange{}}
	parts := make([]int32, len(origins))
	offs := make([]int64, len(origins))
	partText := make([]string, len(origins))
	offText := make([]string, len(origins))
	for i, org := range origins {
		parts[i], offs[i] = org.partition, org.offset
		partText[i], offText[i] = strconv.Itoa(int(org.partition)), strconv.FormatInt(org.offset, 10)
	}
	err := pgx.BeginTxFunc(ctx, o.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		type query struct {
			what string
			sql  string
			args []any
			scan []any
			row  func() error
		}
		in := `AND (partition, "offset") IN (SELECT * FROM unnest($3::int[], $4::bigint[]))`
		var (
			org    traceOrigin
			pos    tracePosition
			rt     traceRetry
			hr     traceHeld
			dl     traceDead
			cp     traceCopy
			rl     traceRelease
			hs     traceHistory
			fp     *int32
			fo     *int64
			p, off []byte
			rp, ro string
			pc     tracePositionChange
		)
		queries := []query{
			{"positions", `SELECT partition, next_offset, updated_at FROM ` + o.table("offsets") + `
				WHERE consumer_group = $1 AND topic = $2 AND partition = ANY($3)`,
				[]any{o.group, topic, parts}, []any{&org.partition, &pos.next, &pos.updatedAt},
				func() error { f.positions[org.partition] = pos; pos = tracePosition{}; return nil }},
			{"retry states", `SELECT partition, "offset", key, attempt, first_failed_at, due_at, updated_at, error_class, error_message,
					tier
				FROM ` + o.table("retries") + ` WHERE consumer_group = $1 AND topic = $2 ` + in,
				[]any{o.group, topic, parts, offs},
				[]any{&org.partition, &org.offset, &rt.key, &rt.attempt, &rt.firstFailed, &rt.due, &rt.updated, &rt.class, &rt.message, &rt.tier},
				func() error { f.retries[org] = rt; rt = traceRetry{}; return nil }},
			{"held records", `SELECT partition, "offset", key, keyless, "timestamp", held_at, attempt, coalesce(dead_letter_id, 0), behind, ` + traceparentSQL + `
				FROM ` + o.table("held_records") + ` WHERE consumer_group = $1 AND topic = $2 ` + in,
				[]any{o.group, topic, parts, offs},
				[]any{&org.partition, &org.offset, &hr.key, &hr.keyless, &hr.timestamp, &hr.heldAt, &hr.attempt, &hr.deadLetter, &hr.behind, &hr.traceparent},
				func() error { f.held[org] = hr; hr = traceHeld{}; return nil }},
			{"dead letters", `SELECT partition, "offset", id, key, "timestamp", error_class, error_message, status, attempts,
					first_failed_at, dead_lettered_at, status_changed_at, ` + traceparentSQL + `
				FROM ` + o.table("dead_letters") + ` WHERE consumer_group = $1 AND topic = $2 ` + in,
				[]any{o.group, topic, parts, offs},
				[]any{&org.partition, &org.offset, &dl.id, &dl.key, &dl.timestamp, &dl.class, &dl.message, &dl.status, &dl.attempts,
					&dl.firstFailed, &dl.deadLettered, &dl.statusAt, &dl.traceparent},
				func() error { f.dead[org] = dl; dl = traceDead{}; return nil }},
			{"outbox", `SELECT p, off, topic, key, created_at, refused_at, refused_error FROM (` + o.outboxOriginsSQL() + `) x
				WHERE (p, off) IN (SELECT convert_to(a, 'UTF8'), convert_to(b, 'UTF8') FROM unnest($3::text[], $4::text[]) AS u(a, b))
				ORDER BY id`,
				[]any{o.group, []byte(topic), partText, offText},
				[]any{&p, &off, &cp.topic, &cp.key, &cp.createdAt, &cp.refusedAt, &cp.refused},
				func() error {
					if org, ok := parseOrigin(p, off); ok {
						f.outbox[org] = append(f.outbox[org], cp)
					}
					cp = traceCopy{}
					return nil
				}},
			{"skipped duplicates", `SELECT partition, "offset", skipped_at, idempotency_key, key_hash, first_partition, first_offset,
					stream::text, stream_seq
				FROM ` + o.table("skipped_duplicates") + ` WHERE consumer_group = $1 AND topic = $2 ` + in,
				[]any{o.group, topic, parts, offs},
				[]any{&org.partition, &org.offset, &hs.at, &hs.idempotencyKey, &hs.keyHash, &fp, &fo, &hs.stream, &hs.streamSeq},
				func() error {
					hs.event = "skipped_duplicate"
					if fp != nil && fo != nil {
						hs.first = &TraceRef{Partition: *fp, Offset: *fo}
					}
					f.history[org] = append(f.history[org], hs)
					hs, fp, fo = traceHistory{}, nil, nil
					return nil
				}},
			{"key releases", `SELECT detail->>'partition', detail->>'head_offset', at, actor, reason, coalesce(detail->>'reason', '')
				FROM ` + o.table("audit") + ` WHERE consumer_group = $1 AND action = 'release_key' AND detail->>'topic' = $2
				AND (detail->>'partition', detail->>'head_offset') IN (SELECT * FROM unnest($3::text[], $4::text[]))
				ORDER BY id`,
				[]any{o.group, topic, partText, offText},
				[]any{&rp, &ro, &rl.at, &rl.actor, &rl.reason, &rl.why},
				func() error {
					if org, ok := parseOrigin([]byte(rp), []byte(ro)); ok {
						f.releases[org] = append(f.releases[org], rl)
					}
					return nil
				}},
		}
		queries = append(queries, query{"position changes", `SELECT u.p, u.o, coalesce(c.from_offset, -1), c.to_offset, c.changed_at, c.actor, c.reason
				FROM unnest($3::int[], $4::bigint[]) AS u(p, o)
				JOIN ` + o.table("position_changes") + ` c ON c.consumer_group = $1 AND c.topic = $2 AND c.partition = u.p
				AND u.o >= least(coalesce(c.from_offset, 0), c.to_offset) AND u.o < greatest(coalesce(c.from_offset, 0), c.to_offset)
				ORDER BY c.id`,
			[]any{o.group, topic, parts, offs},
			[]any{&org.partition, &org.offset, &pc.from, &pc.to, &pc.at, &pc.actor, &pc.reason},
			func() error { f.changes[org] = append(f.changes[org], pc); pc = tracePositionChange{}; return nil }})
		for _, q := range queries {
			rows, err := tx.Query(ctx, q.sql, q.args...)
			if err != nil {
				return fmt.Errorf("trace: read %s: %w", q.what, err)
			}
			if _, err := pgx.ForEachRow(rows, q.scan, q.row); err != nil {
				return fmt.Errorf("trace: read %s: %w", q.what, err)
			}
		}
		if err := o.traceEvents(ctx, tx, f); err != nil {
			return err
		}
		if err := o.traceWaits(ctx, tx, topic, origins, keys, f); err != nil {
			return err
		}
		return o.traceKeys(ctx, tx, topic, f)
	})
	if err != nil {
		return nil, err
	}
	return f, nil
}

// traceWaits reads, from held_history, the past waits behind their key of origins whose key is
// known (from Kafka, keys, or the tables, f): each record's part of its key's last row starting
// at or before its offset.
func (o *Ops) traceWaits(ctx context.Context, tx pgx.Tx, topic string, origins []traceOrigin, keys map[traceOrigin][]byte, f *traceFacts) error {
	var parts []int32
	var offs []int64
	var ks [][]byte
	for _, org := range origins {
		k, ok := keys[org]
		switch {
		case ok:
		case f.held[org].key != nil:
			k = f.held[org].key
		case f.dead[org].key != nil:
			k = f.dead[org].key
		case f.retries[org].key != nil:
			k = f.retries[org].key
		}
		if k != nil {
			parts, offs, ks = append(parts, org.partition), append(offs, org.offset), append(ks, k)
		}
	}
	if len(ks) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, `SELECT u.p, u.o, h.held_at[i], h.behind[i], h.until
		FROM unnest($3::int[], $4::bigint[], $5::bytea[]) AS u(p, o, k)
		CROSS JOIN LATERAL (SELECT * FROM `+o.table("held_history")+` h
			WHERE h.consumer_group = $1 AND h.topic = $2 AND h.partition = u.p AND h.key_hash = sha256(u.k) AND h.first_offset <= u.o
			ORDER BY h.first_offset DESC LIMIT 1) h
		CROSS JOIN LATERAL array_position(h.offsets, u.o) AS i
		WHERE i IS NOT NULL`, o.group, topic, parts, offs, ks)
	if err != nil {
		return fmt.Errorf("trace: read past waits behind keys: %w", err)
	}
	var org traceOrigin
	var hs traceHistory
	var until time.Time
	_, err = pgx.ForEachRow(rows, []any{&org.partition, &org.offset, &hs.at, &hs.behind, &until}, func() error {
		u := until
		hs.event, hs.until = "held", &u
		f.history[org] = append(f.history[org], hs)
		hs = traceHistory{}
		return nil
	})
	if err != nil {
		return fmt.Errorf("trace: read past waits behind keys: %w", err)
	}
	return nil
}

// traceEvents reads the history of the dead letters in f.
func (o *Ops) traceEvents(ctx context.Context, tx pgx.Tx, f *traceFacts) error {
	if len(f.dead) == 0 {
		return nil
	}
	byID := map[int64]traceOrigin{}
	var ids []int64
	for org, d := range f.dead {
		byID[d.id] = org
		ids = append(ids, d.id)
	}
	rows, err := tx.Query(ctx, `SELECT e.dead_letter_id, e.at, e.event, coalesce(e.task_id, 0), coalesce(e.attempt, 0), coalesce(e.error_class, ''),
			coalesce(e.error_message, ''), d.idempotency_key_hash
		FROM `+o.table("dead_letter_events")+` e JOIN `+o.table("dead_letters")+` d ON d.id = e.dead_letter_id
		WHERE e.dead_letter_id = ANY($1) ORDER BY e.id`, ids)
	if err != nil {
		return fmt.Errorf("trace: read dead letter history: %w", err)
	}
	var id, task int64
	var at time.Time
	var event, class, msg string
	var attempt int
	var keyHash []byte
	_, err = pgx.ForEachRow(rows, []any{&id, &at, &event, &task, &attempt, &class, &msg, &keyHash}, func() error {
		by := ""
		if task != 0 {
			by = fmt.Sprintf(" by task %d", task)
		}
		var what string
		kind := event
		switch event {
		case "dead_lettered":
			what = fmt.Sprintf("dead-lettered at attempt %d (%s) as dead letter #%d", attempt, errorText(class, msg), id)
		case "replay_queued":
			what = fmt.Sprintf("replay queued%s: back in held_records, to be handled as attempt %d", by, attempt)
		case "replayed":
			what = "applied by the replay" + by
		case "skipped_duplicate":
			what = "skipped as a duplicate by the replay" + by + " (" + idempotencyKeyText(keyHash) + "): a copy with its key was applied before"
		case "discarded":
			what = "dead letter discarded" + by
		default:
			what, kind = event+by, "other"
		}
		d := f.dead[byID[id]]
		d.events = append(d.events, TraceStep{At: at, Kind: kind, What: what})
		f.dead[byID[id]] = d
		return nil
	})
	if err != nil {
		return fmt.Errorf("trace: read dead letter history: %w", err)
	}
	return nil
}

// idempotencyKeyText names an idempotency key by the start of its hash (as dead_letters keeps it:
// the record's key itself is not kept), as the processor's log does.
func idempotencyKeyText(hash []byte) string {
	if len(hash) == 0 {
		return "its idempotency key"
	}
	return "idempotency key hash " + hex.EncodeToString(hash[:min(len(hash), 8)]) + "…"
}

// traceKeys reads the held keys of the keys of the records in f.
func (o *Ops) traceKeys(ctx context.Context, tx pgx.Tx, topic string, f *traceFacts) error {
	var parts []int32
	var keys [][]byte
	add := func(org traceOrigin, key []byte) {
		if key != nil {
			parts, keys = append(parts, org.partition), append(keys, key)
		}
	}
	for org, h := range f.held {
		add(org, h.key)
	}
	for org, d := range f.dead {
		add(org, d.key)
	}
	if len(keys) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, o.heldKeySQL(`AND h.topic = $2
		AND (h.partition, h.key_hash) IN (SELECT p, sha256(k) FROM unnest($3::int[], $4::bytea[]) AS u(p, k))`, ""),
		o.group, topic, parts, keys)
	if err != nil {
		return fmt.Errorf("trace: read held keys: %w", err)
	}
	if f.keys, err = o.scanHeldKeys(rows); err != nil {
		return fmt.Errorf("trace: read held keys: %w", err)
	}
	return nil
}

// heldKey returns the held key of a record's key, if it is held.
func (f *traceFacts) heldKey(partition int32, key []byte) (HeldKey, bool) {
	for _, k := range f.keys {
		if k.Partition == partition && string(k.Key) == string(key) {
			return k, true
		}
	}
	return HeldKey{}, false
}

// describe says where the record at org is now and how it got there.
func (o *Ops) describe(q TraceQuery, org traceOrigin, f *traceFacts, kr *scanned, bounds map[int32]logBounds) RecordTrace {
	t := RecordTrace{Topic: q.Topic, Partition: org.partition, Offset: org.offset, Steps: []TraceStep{}}
	step := func(at time.Time, kind, format string, args ...any) {
		t.Steps = append(t.Steps, TraceStep{At: at, Kind: kind, What: fmt.Sprintf(format, args...)})
	}
	known := false
	setKey := func(k []byte) {
		if !known {
			t.Key, known = k, true
		}
	}
	produced := int64(0)
	if kr != nil {
		setKey(kr.key)
		produced = kr.timestamp.UnixMilli()
	}
	rt, inTier := f.retries[org]
	hr, held := f.held[org]
	dl, dead := f.dead[org]
	copies := f.outbox[org]
	if q.Key != nil {
		setKey(q.Key)
	}
	if held {
		if hr.keyless {
			setKey(nil)
		} else {
			setKey(hr.key)
		}
		produced = cmp.Or(produced, hr.timestamp)
	}
	if dead {
		setKey(dl.key)
		produced = cmp.Or(produced, dl.timestamp)
	}
	if inTier {
		setKey(rt.key)
	}
	for _, c := range copies {
		setKey(c.key)
	}
	if known {
		t.KeyText = KeyText(t.Key)
	}
	switch {
	case dead && dl.traceparent != nil:
		t.TraceID = traceID(dl.traceparent)
	case held && hr.traceparent != nil:
		t.TraceID = traceID(hr.traceparent)
	case kr != nil:
		t.TraceID = kr.traceID
	}
	if produced > 0 {
		step(time.UnixMilli(produced).UTC(), StepProduced, "produced (record timestamp)")
	}

	// How it got there, in the order of the record's way (the times come from the clocks of
	// several processes and Postgres, which need not agree to the millisecond).
	// Its way through the retry tiers, as their topics keep it (the tables forget it once it is
	// applied): after its first failure, before it was dead-lettered or is in the tier it is in.
	copiesInTiers := f.tiers[org]
	tierSteps := func() {
		for _, c := range copiesInTiers {
			if inTier && c.f.Attempt >= rt.attempt-1 {
				continue // the retries table says it, below
			}
			step(c.f.FailedAt, StepTier, "attempt %d failed (%s): sent to retry tier %d (%s), due %s", c.f.Attempt, errorText(c.f.Class, c.f.Message),
				c.tier, retrytopics.TierTopic(q.Topic, o.group, c.tier), timeText(c.f.DueAt))
			t.Steps[len(t.Steps)-1].Tier = c.tier
		}
	}
	switch {
	case dead:
		step(dl.firstFailed, StepFailed, "first failed")
		tierSteps()
		t.Steps = append(t.Steps, dl.events...)
		if len(dl.events) == 0 {
			step(dl.deadLettered, StepDeadLettered, "dead-lettered at attempt %d (%s) as dead letter #%d", dl.attempts, errorText(dl.class, dl.message), dl.id)
		}
	case inTier:
		step(rt.firstFailed, StepFailed, "first failed")
		tierSteps()
	case len(copiesInTiers) > 0:
		step(copiesInTiers[0].f.FirstFailedAt, StepFailed, "first failed")
		tierSteps()
	}
	tier := rt.tier
	if inTier {
		step(rt.updated, StepTier, "attempt %d failed (%s): sent to retry tier %d (%s), due %s", rt.attempt-1, errorText(rt.class, rt.message),
			tier, retrytopics.TierTopic(q.Topic, o.group, tier), timeText(rt.due))
		t.Steps[len(t.Steps)-1].Tier = tier
	}
	if held && hr.deadLetter == 0 {
		step(hr.heldAt, StepHeld, "held behind %s", behindText(hr.behind))
		t.Steps[len(t.Steps)-1].Behind = hr.behind
	}
	var skip, lastWait *traceHistory
	for i, h := range f.history[org] {
		switch h.event {
		case "held":
			lastWait = &f.history[org][i]
			what := "held behind " + behindText(h.behind)
			if h.until != nil {
				what += fmt.Sprintf(" for %s, until %s", waitText(h.until.Sub(h.at)), timeText(*h.until))
			}
			t.Steps = append(t.Steps, TraceStep{At: h.at, Kind: StepHeld, What: what, Until: h.until, Behind: h.behind})
		case "skipped_duplicate":
			skip = &f.history[org][i]
			t.Steps = append(t.Steps, skipStep(q.Topic, *skip))
		}
	}
	for _, c := range copies {
		step(c.createdAt, StepOutbox, "copy written to the outbox, to be published to %s", o.topicRole(q.Topic, c.topic))
		if c.refusedAt != nil {
			step(*c.refusedAt, StepRefused, "Kafka refused the copy for good: %s", errorText("refused", derefString(c.refused)))
		}
	}
	for _, r := range f.releases[org] {
		step(r.at, StepReleased, "its key was released by %s (%s): %s", safetext.Text(oneLine(r.actor), 80), r.why, safetext.Text(oneLine(r.reason), 200))
	}

	// Where it is now.
	lookup := t.Key
	if held {
		lookup = hr.key // a replayed record without a key waits under a key of its own
	}
	hk, keyHeld := f.heldKey(org.partition, lookup)
	switch {
	case held:
		t.State = TraceHeld
		wait := "its key is not held any more (nothing will apply it: report this)"
		if keyHeld {
			wait = fmt.Sprintf("its key is %s: %s", hk.State, hk.Why)
		}
		if hr.deadLetter != 0 {
			t.Now = fmt.Sprintf("replayed dead letter #%d waits in held_records to be applied as attempt %d; %s", hr.deadLetter, hr.attempt, wait)
		} else {
			t.Now = "held behind its key; " + wait
		}
	case inTier:
		tierTopic := retrytopics.TierTopic(q.Topic, o.group, tier)
		detail := fmt.Sprintf("attempt %d, due %s%s, last error %s", rt.attempt, timeText(rt.due), overdue(rt.due), errorText(rt.class, rt.message))
		t.State, t.Now = TraceInTier, fmt.Sprintf("in retry tier %d (%s): %s", tier, tierTopic, detail)
		for _, c := range copies {
			if c.topic == tierTopic && c.refusedAt == nil {
				t.State, t.Now = TraceOutbox, fmt.Sprintf("waits in the outbox to be published to %s (retry tier %d): %s", tierTopic, tier, detail)
			}
		}
	case dead && dl.status == "replayed" && len(dl.events) > 0 && dl.events[len(dl.events)-1].Kind == StepSkippedDuplicate:
		t.State, t.Now = TraceSkippedDuplicate, fmt.Sprintf("skipped as a duplicate by a replay of dead letter #%d (%s): a copy with its idempotency key was applied before",
			dl.id, timeText(dl.statusAt))
	case dead && dl.status == "replayed":
		t.State, t.Now = TraceApplied, fmt.Sprintf("applied by a replay of dead letter #%d (%s)", dl.id, timeText(dl.statusAt))
	case dead:
		t.State = TraceDeadLettered
		t.Now = fmt.Sprintf("dead-lettered: dead letter #%d, %s, status %s, after %d attempts", dl.id, errorText(dl.class, dl.message), dl.status, dl.attempts)
		if keyHeld && hk.State == "blocked" && hk.HeadOffset != nil && *hk.HeadOffset == org.offset {
			t.Now += fmt.Sprintf("; its key is blocked behind it with %d held records (keys release)", hk.Held)
		}
		t.Now += pendingCopies(o, q.Topic, copies)
	case len(copies) > 0:
		t.State, t.Now = TraceOutbox, strings.TrimPrefix(pendingCopies(o, q.Topic, copies), "; ")
	default:
		t.State, t.Now = o.position(org, f.positions[org.partition], bounds, q.Concurrency, step)
		if n := len(f.changes[org]); n > 0 {
			// The last position change across it decides: forward, it was skipped (the
			// position passing it is that change, not an application); back, it was applied
			// again (or will be) after the rewind.
			last := f.changes[org][n-1]
			for _, c := range f.changes[org] {
				t.Steps = append(t.Steps, c.step())
			}
			switch {
			case last.to > last.from && (t.State == TraceApplied || t.State == TraceBeyondRetention):
				if i := len(t.Steps) - n - 1; i >= 0 && t.Steps[i].Kind == StepApplied {
					t.Steps = slices.Delete(t.Steps, i, i+1)
				}
				t.State = TraceSkippedByOperator
				t.Now = fmt.Sprintf("skipped, never applied: %s set the partition's position from %s to %d at %s: %s",
					safetext.Text(oneLine(last.actor), 80), last.fromText(), last.to, timeText(last.at), safetext.Text(oneLine(last.reason), 200))
			case last.to < last.from && t.State == TraceApplied:
				t.Now = fmt.Sprintf("applied again after the rewind by %s at %s (from %d to %d: %s); %s",
					safetext.Text(oneLine(last.actor), 80), timeText(last.at), last.from, last.to, safetext.Text(oneLine(last.reason), 200), t.Now)
			case last.to < last.from && t.State == TraceNotConsumed:
				t.Now = fmt.Sprintf("applied before, to be applied again: %s rewound the partition's position from %d to %d at %s (%s); %s",
					safetext.Text(oneLine(last.actor), 80), last.from, last.to, timeText(last.at), safetext.Text(oneLine(last.reason), 200), t.Now)
			}
		}
		if n := len(copiesInTiers); n > 0 && t.State == TraceApplied {
			last := copiesInTiers[n-1]
			t.Now = fmt.Sprintf("applied from retry tier %d (%s), at attempt %d (its source partition's position passed it by %s, as it left for the tiers)",
				last.tier, retrytopics.TierTopic(q.Topic, o.group, last.tier), last.f.Attempt+1, timeText(f.positions[org.partition].updatedAt))
			t.Steps[len(t.Steps)-1].What = "the partition's position passed it, the record on its way through the retry tiers"
			if skip == nil {
				step(last.f.DueAt, StepApplied, "applied from retry tier %d at attempt %d (once due)", last.tier, last.f.Attempt+1)
			}
		}
		if n := len(t.Steps); lastWait != nil && lastWait.until != nil && skip == nil && len(copiesInTiers) == 0 &&
			t.State == TraceApplied && t.Steps[n-1].Kind == StepApplied {
			// The position passed it as it was held (in the transaction that held it, the
			// offsets row's time said nothing of it since); it was applied as it left
			// held_records, its key's earlier records settled.
			t.Steps[n-1] = TraceStep{At: *lastWait.until, Kind: StepApplied, What: "applied, taken from held_records once the earlier records of its key were settled"}
			t.Now = fmt.Sprintf("applied after waiting %s behind %s (%s)", waitText(lastWait.until.Sub(lastWait.at)), behindText(lastWait.behind), timeText(*lastWait.until))
		}
		if skip != nil && t.State == TraceApplied {
			// The handler never got it: its key (or stream) says a copy was applied before. The
			// position passing it says nothing more (and is not its application).
			t.State, t.Now = TraceSkippedDuplicate, skipStep(q.Topic, *skip).What+fmt.Sprintf(" (%s)", timeText(skip.at))
			if n := len(t.Steps); len(copiesInTiers) == 0 && n > 0 && t.Steps[n-1].Kind == StepApplied {
				t.Steps = t.Steps[:n-1]
			}
		}
	}
	// In time order: the steps above are gathered table by table, and a record's way does not
	// follow the tables (it left its partition before it was applied from a tier). Stable: steps
	// of one instant keep the order of the way. The times come from the clocks of several
	// processes and Postgres, which need not agree to the millisecond.
	slices.SortStableFunc(t.Steps, func(a, b TraceStep) int { return a.At.Compare(b.At) })
	return t
}

// behindText names the record a held record waited behind.
func behindText(behind *int64) string {
	if behind == nil {
		return "an earlier record of its key"
	}
	return fmt.Sprintf("the record at offset %d of its key", *behind)
}

// waitText says how long a wait lasted: to the millisecond under a second, to the tenth above.
func waitText(d time.Duration) string {
	if d < time.Second {
		return d.Round(time.Millisecond).String()
	}
	return d.Round(100 * time.Millisecond).String()
}

// skipStep is the step of a record skipped as a duplicate (h, its skipped_duplicates row), of topic.
func skipStep(topic string, h traceHistory) TraceStep {
	st := TraceStep{At: h.at, Kind: StepSkippedDuplicate, First: h.first}
	by := "its idempotency key"
	if h.idempotencyKey != nil {
		st.IdempotencyKey = KeyText(h.idempotencyKey)
		by = fmt.Sprintf("its idempotency key %s (%s)", strconv.Quote(st.IdempotencyKey), idempotencyKeyText(h.keyHash))
	} else if len(h.keyHash) > 0 {
		by = idempotencyKeyText(h.keyHash)
	}
	if h.stream != nil && h.streamSeq != nil {
		st.Stream, st.StreamSeq = *h.stream, *h.streamSeq
		by = fmt.Sprintf("its stream %s, event number %d (message id %s)", st.Stream, st.StreamSeq, strconv.Quote(st.IdempotencyKey))
	}
	switch {
	case h.first != nil:
		st.What = fmt.Sprintf("skipped as a duplicate by %s: the copy at %s[%d]@%d was applied before it", by, topic, h.first.Partition, h.first.Offset)
	case h.stream != nil:
		st.What = fmt.Sprintf("skipped as a duplicate by %s: its stream's event of that number was applied before", by)
	default:
		st.What = fmt.Sprintf("skipped as a duplicate by %s: a copy with its key was applied before (which one is not known: the key ring keeps only the keys' hashes)", by)
	}
	return st
}

// position describes a record that no table of the retry path holds, from the partition's
// position and the broker's log bounds.
func (o *Ops) position(org traceOrigin, pos tracePosition, bounds map[int32]logBounds, concurrency int, step func(time.Time, string, string, ...any)) (state, now string) {
	b, haveBounds := bounds[org.partition]
	if haveBounds && org.offset >= b.end {
		return TraceNotConsumed, fmt.Sprintf("not produced yet: the partition ends at offset %d", b.end)
	}
	gone := haveBounds && org.offset < b.start
	if pos.next != nil && org.offset < *pos.next {
		step(pos.updatedAt, StepApplied, "the partition's position passed it (the group's next offset is now %d)", *pos.next)
		now = fmt.Sprintf("applied (the partition's position passed it by %s)", timeText(pos.updatedAt))
		if gone {
			return TraceBeyondRetention, now + fmt.Sprintf("; beyond the broker's retention now: the log starts at offset %d", b.start)
		}
		return TraceApplied, now
	}
	next := "the group has no position in the partition yet"
	if pos.next != nil {
		next = fmt.Sprintf("the group's next offset in the partition is %d", *pos.next)
	}
	if gone {
		return TraceBeyondRetention, fmt.Sprintf("not consumed (%s) and beyond the broker's retention: the log starts at offset %d, so it can no longer be consumed", next, b.start)
	}
	if haveBounds && org.offset < b.end && concurrency > 1 {
		return TraceNotConsumed, fmt.Sprintf("not applied yet: %s; with CONCURRENCY=%d its partition's owner prepares it ahead of the position, "+
			"after the earlier records of its key, and applies it once the records before it are prepared", next, concurrency)
	}
	return TraceNotConsumed, "not consumed yet: " + next
}

// pendingCopies describes the copies of a record waiting in the outbox, after a semicolon.
func pendingCopies(o *Ops, source string, copies []traceCopy) string {
	s := ""
	for _, c := range copies {
		if c.refusedAt != nil {
			s += fmt.Sprintf("; its copy to %s was refused by Kafka for good (%s) and is set aside in the outbox",
				o.topicRole(source, c.topic), errorText("refused", derefString(c.refused)))
		} else {
			s += fmt.Sprintf("; its copy waits in the outbox to be published to %s", o.topicRole(source, c.topic))
		}
	}
	return s
}

// topicRole names a topic a copy of a record of source goes to, with its role.
func (o *Ops) topicRole(source, topic string) string {
	if topic == retrytopics.DLQTopic(source, o.group) {
		return topic + " (the dead-letter topic)"
	}
	for n := 1; n <= retrytopics.MaxTiers; n++ {
		if topic == retrytopics.TierTopic(source, o.group, n) {
			return fmt.Sprintf("%s (retry tier %d)", topic, n)
		}
	}
	return topic
}

// overdue says how long past its due time a record is, if it is.
func overdue(due time.Time) string {
	if late := time.Since(due); late >= time.Second {
		return fmt.Sprintf(" (overdue by %s)", late.Round(time.Second))
	}
	return ""
}

func derefString(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
