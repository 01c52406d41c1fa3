package processor

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// Record is one Kafka record handed to a Handler. Whichever way it arrives (from its source
// topic, from a retry tier, or held behind its key), Topic, Partition, Offset, Key, Value,
// Headers and Timestamp are those of the record in its source topic; kafkapg's own headers are
// removed.
type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []kgo.RecordHeader
	Timestamp time.Time
	// Attempt is the delivery attempt: 1 for the first delivery (from the source topic, or after
	// waiting behind its key), n+1 from retry tier n. Retries inside one delivery (see
	// Config.LocalAttempts) do not change it. A dead letter that died at attempt n and is brought
	// back by a replay is delivered as attempt n+1, and counts on from there through the tiers.
	Attempt int

	consumed    int64 // offset in the partition it was consumed from (source topic or tier)
	leaderEpoch int32
	stage       retrytopics.Stage
	ordered     bool      // its key orders it: a non-null key, from a source topic
	foreign     bool      // read from a retry tier without valid kafkapg headers: no origin to retry
	notOurs     bool      // read from a retry tier, but another group's or source topic's record: skipped
	control     bool      // a Kafka transaction marker: skipped, the offset moves past it
	firstFailed time.Time // zero until its first failure
	tier        int       // the retry tier it was consumed from; 0 from its source topic or held
	deadLetter  int64     // its dead_letters row, when a replay brought it back
	// duplicate is the hash of its idempotency key (as idempotency_keys has it) when a record with
	// that key was applied before: it is not given to the handler. Nil otherwise.
	duplicate []byte
	proc      *Processor
	pending   []sink.Event      // events it emitted in the current handler call, written when the handler returns
	span      trace.SpanContext // its last process span's; invalid if tracing is off
	// sharedSpan: span is a BatchHandler's call over several records, a trace of its own.
	sharedSpan bool
	// prepared: the handler's Prepare (Preparer) returned nil for this attempt; prepErr: it
	// failed in the partition's window, and fails the record when it reaches the handler.
	prepared bool
	prepErr  error

	// Prepared is what the handler's Prepare left for its Handle (see Preparer); nil when the
	// handler is no Preparer.
	Prepared any
	// Decoded is the record's value decoded by its topic's Decoder (TopicPolicy.Values), and
	// DecodedKey its key (TopicPolicy.Keys); nil without one, or for a null value or key. See
	// DecodedAs.
	Decoded, DecodedKey any
}

// Emit writes events into tx, the transaction the record is being handled in: they are published
// to Kafka if, and once, tx commits (see sink.Outbox.Emit for the order and locking). The events
// of a batch are written together, in one round trip, when the handler returns nil; an event
// without a Topic is refused at once. An event without an ID gets one derived from the record's
// source coordinates (group, topic, partition, offset) and its position among the record's
// emits, so that the same emit has the same id (header sink.HeaderMessageID) after a retry, a
// replay or a crash between publishing and acknowledging: a consumer that deduplicates on it
// (KeyFromHeader(sink.HeaderMessageID)) applies each event once. Call it only from the Handle (or
// HandleBatch) call the record was given to.
func (r *Record) Emit(ctx context.Context, tx pgx.Tx, events ...sink.Event) error {
	if r.proc == nil {
		return errors.New("processor: Record.Emit called on a record that is not being handled by a processor")
	}
	for i, e := range events {
		if err := sink.CheckTopic(e.Topic); err != nil {
			return fmt.Errorf("processor: Record.Emit: event %d: %w", i, err)
		}
		if e.ID == "" {
			e.ID = sink.DerivedID(r.proc.cfg.Group, r.Topic, r.Partition, r.Offset, len(r.pending))
			e.Source = &sink.Source{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset}
		}
		// The outbox row keeps the emitting delivery's trace context; the relay's send span
		// is its child. A BatchHandler's call over several records is a trace of its own,
		// linked to theirs: what one of them emits goes on in that record's trace.
		ectx := ctx
		if r.sharedSpan {
			ectx = r.proc.tracer.Extract(ctx, r.Headers)
		}
		e.Headers = r.proc.tracer.Inject(ectx, e.Headers)
		r.pending = append(r.pending, e)
	}
	return nil
}

// writeEmits writes what the handler emitted for recs (Record.Emit) into tx, in one round trip.
func (p *Processor) writeEmits(ctx context.Context, tx pgx.Tx, recs []*Record) error {
	var all []sink.Event
	for _, r := range recs {
		all = append(all, r.pending...)
	}
	if len(all) == 0 {
		return nil
	}
	if p.captured != nil { // processortest
		*p.captured = append(*p.captured, all...)
		return nil
	}
	if err := p.outbox.Emit(ctx, tx, all...); err != nil {
		return own(err) // kafkapg's statements: retried in place (a deadlock waits, quietly)
	}
	return nil
}

// delivery describes r for its process span.
func (p *Processor) delivery(r *Record) tracing.Delivery {
	topic := r.Topic
	if r.tier > 0 {
		topic = retrytopics.TierTopic(r.Topic, p.cfg.Group, r.tier)
	}
	d := tracing.Delivery{Topic: topic, Partition: r.Partition, Offset: r.consumed, Source: r.Topic, Attempt: r.Attempt, Headers: r.Headers,
		DeadLetter: r.deadLetter}
	for _, h := range r.Headers {
		if h.Key == sink.HeaderMessageID {
			d.MessageID = string(h.Value)
		}
	}
	return d
}

// startProcess starts r's process span, if tracing is on, linked both ways with the batch
// transaction's span in ctx. r keeps its context, for where it goes if it fails.
func (p *Processor) startProcess(ctx context.Context, r *Record) (context.Context, trace.Span) {
	if p.tracer == nil {
		return ctx, nil
	}
	rctx, span := p.tracer.StartProcess(ctx, p.delivery(r))
	r.span, r.sharedSpan = span.SpanContext(), false
	tracing.Link(trace.SpanFromContext(ctx), rctx)
	return rctx, span
}

// startProcessBatch starts the process span of a BatchHandler's call over run, if tracing is on.
func (p *Processor) startProcessBatch(ctx context.Context, run []*Record) (context.Context, trace.Span) {
	if p.tracer == nil {
		return ctx, nil
	}
	ds := make([]tracing.Delivery, len(run))
	for i, r := range run {
		ds[i] = p.delivery(r)
	}
	bctx, span := p.tracer.StartProcessBatch(ctx, ds[0].Topic, run[0].Partition, ds)
	for _, r := range run {
		r.span, r.sharedSpan = span.SpanContext(), len(run) > 1
	}
	return bctx, span
}

// failedInBatch gives the record a BatchHandler's call over several records named as failed
// (index k of run; -1: none) a process span of its own, in its own trace and linked to the call's
// span (in bctx), so that its retry or dead-letter copy goes on in its trace, not in the call's.
// The other records of the run lose the call's span: they are tried again, each in its own trace.
func (p *Processor) failedInBatch(ctx, bctx context.Context, run []*Record, k int, cause error) {
	if p.tracer == nil || len(run) < 2 {
		return
	}
	for _, r := range run {
		r.span, r.sharedSpan = trace.SpanContext{}, false
	}
	if k < 0 {
		return
	}
	_, span := p.startProcess(ctx, run[k])
	tracing.Link(span, bctx)
	span.SetAttributes(attribute.Bool("kafkapg.failed_in_batch", true))
	p.endProcess(span, run[k].Topic, cause)
}

// endProcess ends a process span; a failure's error.type is its class.
func (p *Processor) endProcess(span trace.Span, source string, err error) {
	if span == nil {
		return
	}
	var class string
	if err != nil {
		_, cause := failedRecord(err, 1)
		class = p.classify(source, cause).String()
	}
	tracing.End(span, err, class)
}

// traceAttrs are the log attributes that point at a delivery's span.
func traceAttrs(sc trace.SpanContext) []any {
	return []any{"trace_id", sc.TraceID().String(), "span_id", sc.SpanID().String()}
}

// size is what Config.MaxRecordBytes bounds: key, value and headers.
func (r *Record) size() int {
	n := len(r.Key) + len(r.Value)
	for _, h := range r.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

func (r *Record) origin() retrytopics.Origin {
	return retrytopics.Origin{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset}
}

func (r *Record) rec() retrytopics.Rec {
	return retrytopics.Rec{Origin: r.origin(), Key: r.Key, Value: r.Value, Headers: r.Headers, Timestamp: r.Timestamp,
		Attempt: r.Attempt, DeadLetter: r.deadLetter}
}

// Handler applies one record's effects. It is the main extension point of kafkapg.
//
// Handle runs inside the transaction tx that the processor opened for the record's batch; the
// same transaction advances the partition's stored offset and commits after the handler returns.
// Everything written through tx therefore takes effect exactly once. Handle must not commit or
// roll back tx, and should not keep it or the record after returning.
//
// Return nil on success; Permanent(err) for a record that can never succeed (it is dead-lettered
// without retries); any other error to have the record retried (with backoff within the
// delivery, then through the retry tiers, then dead-lettered). Errors caused by Postgres being unreachable are recognised and retried in
// place without counting against the record (see Classify). A panic is recovered and treated as a
// retryable error, with its stack logged.
//
// Work done outside tx (HTTP calls, e-mails) is not covered by the guarantee: the transaction may
// roll back after Handle returned, and the record is then handled again.
type Handler interface {
	Handle(ctx context.Context, tx pgx.Tx, rec *Record) error
}

// BatchHandler is an optional interface for a Handler that applies a whole batch at once, for
// example with COPY or a pgx.Batch. recs belong to one partition, in offset order. The rules of
// Handle apply; in addition, return RecordFailed(i, err) to say that recs[i] failed: the records
// before it are then applied without it, and recs[i] alone is retried or dead-lettered. If the
// error does not name a record, the processor splits the batch to find the failing ones.
type BatchHandler interface {
	HandleBatch(ctx context.Context, tx pgx.Tx, recs []*Record) error
}

// BatchHandlerFunc adapts a function of a whole batch to the Handler and BatchHandler interfaces:
// a handler written for batches only (COPY) needs no Handle of its own. A record handled alone
// (retried after a failure) is a batch of one.
type BatchHandlerFunc func(ctx context.Context, tx pgx.Tx, recs []*Record) error

// HandleBatch calls f.
func (f BatchHandlerFunc) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*Record) error {
	return f(ctx, tx, recs)
}

// Handle calls f with rec alone.
func (f BatchHandlerFunc) Handle(ctx context.Context, tx pgx.Tx, rec *Record) error {
	return f(ctx, tx, []*Record{rec})
}

// CopyFailed returns err, the error of a COPY that wrote one row per record of a batch, in the
// batch's order (pgx.Tx.CopyFrom with pgx.CopyFromRows or CopyFromSlice over the records), as
// the failure of the record whose row Postgres rejected: RecordFailed(line-1, err), read from
// the error's context ("COPY page_views, line 1234"). The processor then applies the records
// before it at once and retries it alone, instead of splitting the batch to find it (about
// log2(n) transactions). An error that names no line (it is not a row's) is returned as is.
func CopyFailed(err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err
	}
	// "COPY page_views, line 1234" or "COPY page_views, line 1234, column url: ..."
	_, rest, ok := strings.Cut(pgErr.Where, ", line ")
	if !ok || !strings.HasPrefix(pgErr.Where, "COPY ") {
		return err
	}
	end := strings.IndexFunc(rest, func(r rune) bool { return r < '0' || r > '9' })
	if end < 0 {
		end = len(rest)
	}
	line, perr := strconv.Atoi(rest[:end])
	if perr != nil || line < 1 {
		return err
	}
	return RecordFailed(line-1, err)
}

// HandlerFunc adapts a function to the Handler interface.
type HandlerFunc func(ctx context.Context, tx pgx.Tx, rec *Record) error

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, tx pgx.Tx, rec *Record) error {
	return f(ctx, tx, rec)
}

// handle runs the handler over recs inside tx, recovering panics. A record larger than
// MaxRecordBytes fails, permanently, without reaching the handler. A handler that returns nil
// but left tx unusable (a statement of its failed, or its connection closed) fails: nothing of
// kafkapg's own may run in that transaction, and it could not commit.
//
// Records whose idempotency key was applied before (TopicPolicy.IdempotencyKey) are marked
// duplicate and not given to the handler; the RecordError of a failure indexes recs all the same.
func (p *Processor) handle(ctx context.Context, tx pgx.Tx, source string, recs []*Record) error {
	pol := p.policy(source)
	for i, r := range recs {
		r.duplicate = nil
		if n := r.size(); n > pol.maxRecordBytes {
			return &RecordError{Index: i, Err: Permanent(fmt.Errorf("%w: key, value and headers are %d bytes, more than MaxRecordBytes (%d)",
				ErrRecordTooLarge, n, pol.maxRecordBytes))}
		}
	}
	if pol.idempotencyKey == nil {
		return p.handleLive(ctx, tx, pol, recs)
	}
	live, index, err := p.dedupe(ctx, tx, source, pol.idempotencyKey, recs)
	if err != nil || len(live) == 0 {
		return err
	}
	err = p.handleLive(ctx, tx, pol, live)
	if k, cause := failedRecord(err, len(live)); k >= 0 && index != nil {
		return &RecordError{Index: index[k], Err: cause}
	}
	return err
}

// handleLive runs the handler over recs, none of them a duplicate.
func (p *Processor) handleLive(ctx context.Context, tx pgx.Tx, pol *policy, recs []*Record) error {
	for _, r := range recs {
		// The handler's emits count from 0 on every try: the same ids.
		r.proc, r.pending = p, r.pending[:0]
	}
	if pol.preparer != nil {
		if k, err := p.prepareInline(ctx, pol, recs); k >= 0 {
			return &RecordError{Index: k, Err: err}
		}
	}
	start := time.Now()
	if pol.batch != nil {
		// One call per partition's run of records: the BatchHandler contract (the held-record
		// applier brings the records of several partitions' keys, sorted by partition and offset).
		for i := 0; i < len(recs); {
			j := i + 1
			for j < len(recs) && recs[j].Partition == recs[i].Partition {
				j++
			}
			run := recs[i:j]
			bctx, span := p.startProcessBatch(ctx, run)
			err := p.call(run, func() error { return usable(tx, pol.batch.HandleBatch(bctx, tx, run)) })
			p.endProcess(span, run[0].Topic, err)
			if err != nil {
				observe(p.metrics.handlerDuration, time.Since(start).Seconds(), run[0].span)
				k, cause := failedRecord(err, len(run))
				p.failedInBatch(ctx, bctx, run, k, cause)
				if k >= 0 {
					run[k].unprepare() // its next attempt prepares it again
				}
				if k >= 0 && i > 0 {
					return &RecordError{Index: i + k, Err: cause}
				}
				return err
			}
			i = j
		}
		observe(p.metrics.handlerDuration, time.Since(start).Seconds(), recs[0].span)
		return p.writeEmits(ctx, tx, recs)
	}
	for i, r := range recs {
		rctx, span := p.startProcess(ctx, r)
		err := p.call(recs[i:i+1], func() error { return usable(tx, pol.handler.Handle(rctx, tx, r)) })
		p.endProcess(span, r.Topic, err)
		if err != nil {
			observe(p.metrics.handlerDuration, time.Since(start).Seconds(), r.span)
			r.unprepare() // its next attempt prepares it again
			return &RecordError{Index: i, Err: err}
		}
	}
	observe(p.metrics.handlerDuration, time.Since(start).Seconds(), recs[len(recs)-1].span)
	return p.writeEmits(ctx, tx, recs)
}

// usable returns err, the handler's return, or, if it is nil, why tx cannot go on: the handler's
// connection closed under it (sink.Apply then tells whether Postgres or the handler's own context
// closed it), or one of its statements failed and aborted the transaction.
func usable(tx pgx.Tx, err error) error {
	switch {
	case err != nil:
		return err
	case tx.Conn().IsClosed():
		return sink.ErrNilOnClosedConn
	case tx.Conn().PgConn().TxStatus() == 'E':
		return sink.ErrTxAborted
	}
	return nil
}

// call runs fn, the handler over recs, turning a panic into a *PanicError.
func (p *Processor) call(recs []*Record, fn func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			stack := debug.Stack()
			p.metrics.handlerPanics.Inc()
			first := recs[0]
			log := p.log.With("topic", first.Topic, "partition", first.Partition, "offset", first.Offset)
			if first.span.IsValid() {
				log = log.With(traceAttrs(first.span)...)
			}
			if len(recs) == 1 {
				log = log.With("key_hash", keyHash(first.Key))
			} else {
				log = log.With("records", len(recs))
			}
			log.Error("handler panicked; the record will be retried", "panic", fmt.Sprint(v), "stack", string(stack))
			err = &PanicError{Value: v, Stack: stack}
		}
	}()
	return fn()
}

// keyHash identifies a key in logs without logging its (possibly sensitive) bytes.
func keyHash(key []byte) string {
	if key == nil {
		return "null"
	}
	h := fnv.New64a()
	h.Write(key)
	return fmt.Sprintf("%016x", h.Sum64())
}
