// Package tracing carries OpenTelemetry trace context through the headers of the records
// kafkapg reads and publishes, and starts the spans the processor and the outbox relay report,
// after OpenTelemetry's messaging semantic conventions (semconv v1.43.0):
//
//   - process {topic}: one delivery of one record to the handler (a BatchHandler's call: one span
//     for its run of records, linked to each record's context). Its parent is the context the
//     record carries in its headers (W3C traceparent), so a record's trace goes on from its
//     producer; without one, the batch's span.
//   - commit {topic}: the batch transaction that applies the records and advances the partition,
//     linked to each record's process span.
//   - send {topic}: the relay publishing an outbox row (an emitted event, a retry copy, a
//     dead-letter copy); its parent is the context stored in the row's headers, and the record
//     published carries the send span's own context instead: each hop replaces the header, so
//     headers never pile up however often a record is retried.
//
// A nil *Tracer is tracing switched off: every method is then a no-op that costs a nil check.
package tracing

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/internal/safetext"
)

// Scope is the instrumentation scope of kafkapg's spans.
const Scope = "github.com/kafkapg/kafkapg"

// Tracer starts kafkapg's spans and moves their context in and out of record headers.
type Tracer struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	group  string
}

// DefaultPropagator is W3C Trace Context alone. OpenTelemetry SDKs add Baggage unless told
// otherwise; kafkapg does not, because a record's baggage header is whatever its producer wrote,
// and taken in it would travel on into the handler's outgoing calls and the records kafkapg
// publishes. Baggage is a choice (OTEL_PROPAGATORS=tracecontext,baggage in the service).
func DefaultPropagator() propagation.TextMapPropagator {
	return propagation.TraceContext{}
}

// New returns a Tracer reporting to tp for consumer group group, or nil (tracing off) if tp is
// nil. A nil prop is DefaultPropagator.
func New(tp trace.TracerProvider, prop propagation.TextMapPropagator, group string) *Tracer {
	if tp == nil {
		return nil
	}
	if prop == nil {
		prop = DefaultPropagator()
	}
	return &Tracer{tracer: tp.Tracer(Scope), prop: prop, group: group}
}

// headers adapts record headers to propagation.TextMapCarrier. Set replaces every header of
// that key, so that a context injected into a record that already carries one replaces it.
type headers struct{ hs []kgo.RecordHeader }

func (c *headers) Get(key string) string {
	for i := len(c.hs) - 1; i >= 0; i-- {
		if c.hs[i].Key == key {
			return string(c.hs[i].Value)
		}
	}
	return ""
}

func (c *headers) Set(key, value string) {
	out := c.hs[:0]
	for _, h := range c.hs {
		if h.Key != key {
			out = append(out, h)
		}
	}
	c.hs = append(out, kgo.RecordHeader{Key: key, Value: []byte(value)})
}

func (c *headers) Keys() []string {
	keys := make([]string, len(c.hs))
	for i, h := range c.hs {
		keys[i] = h.Key
	}
	return keys
}

// Extract returns ctx with the remote span context hs carry, if any.
func (t *Tracer) Extract(ctx context.Context, hs []kgo.RecordHeader) context.Context {
	if t == nil || len(hs) == 0 {
		return ctx
	}
	return t.prop.Extract(ctx, &headers{hs: hs})
}

// Inject returns hs with the context of ctx's span in place of any trace context they carried
// (a copy: hs itself is not changed); baggage in ctx replaces the baggage header, if any. Without
// a valid span in ctx, it returns hs.
func (t *Tracer) Inject(ctx context.Context, hs []kgo.RecordHeader) []kgo.RecordHeader {
	if t == nil || !trace.SpanContextFromContext(ctx).IsValid() {
		return hs
	}
	replaced := propagation.TraceContext{}.Fields()
	out := make([]kgo.RecordHeader, 0, len(hs)+len(replaced))
	for _, h := range hs {
		if !slices.Contains(replaced, h.Key) {
			out = append(out, h)
		}
	}
	c := &headers{hs: out}
	t.prop.Inject(ctx, c)
	return c.hs
}

// TraceID returns the trace id the headers carry (hex), or "" if none.
func TraceID(hs []kgo.RecordHeader) string {
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), &headers{hs: hs}))
	if !sc.IsValid() {
		return ""
	}
	return sc.TraceID().String()
}

// ViewerURL is the page of trace traceID in a trace viewer, from a template with {trace_id} in
// it (TRACE_URL); "" if either is empty.
func ViewerURL(template, traceID string) string {
	if template == "" || traceID == "" {
		return ""
	}
	return strings.ReplaceAll(template, "{trace_id}", traceID)
}

// CheckViewerURL says what is wrong with a TRACE_URL template, if anything.
func CheckViewerURL(template string) error {
	if template == "" {
		return nil
	}
	u, err := url.Parse(strings.ReplaceAll(template, "{trace_id}", "0"))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("TRACE_URL=%q: want an http(s) URL of the trace viewer", template)
	}
	if !strings.Contains(template, "{trace_id}") {
		return fmt.Errorf("TRACE_URL=%q: put {trace_id} where the trace id goes, e.g. https://grafana.example/explore?traceId={trace_id}", template)
	}
	return nil
}

// Delivery describes a record delivered to the handler: where it was read, and what it is.
type Delivery struct {
	Topic     string // the topic it was read from: a source topic or a retry tier's
	Partition int32
	Offset    int64
	Source    string // its source topic (Topic, unless read from a retry tier)
	Attempt   int
	Headers   []kgo.RecordHeader
	MessageID string // sink.HeaderMessageID, when a kafkapg service emitted it
	// DeadLetter is its dead_letters row when a replay brought it back; its headers then carry
	// the context of the delivery that dead-lettered it, which its span goes on from.
	DeadLetter int64
}

// StartBatch starts the span of a batch transaction over n records of topic's partition.
func (t *Tracer) StartBatch(ctx context.Context, topic string, partition int32, n int) (context.Context, trace.Span) {
	if t == nil {
		return ctx, nil
	}
	return t.tracer.Start(ctx, "commit "+topic, trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			semconv.MessagingSystemKafka,
			semconv.MessagingOperationTypeSettle,
			semconv.MessagingOperationName("commit"),
			semconv.MessagingDestinationName(topic),
			semconv.MessagingDestinationPartitionID(strconv.Itoa(int(partition))),
			semconv.MessagingConsumerGroupName(t.group),
			semconv.MessagingBatchMessageCount(n),
		))
}

// StartProcess starts the span of one delivery of d to the handler, as a child of the context d
// carries (or of ctx's span, the batch's, if it carries none), linked to the batch's span.
func (t *Tracer) StartProcess(ctx context.Context, d Delivery) (context.Context, trace.Span) {
	if t == nil {
		return ctx, nil
	}
	batch := trace.SpanContextFromContext(ctx)
	parent := ctx
	var opts []trace.SpanStartOption
	if pc := t.Extract(ctx, d.Headers); trace.SpanContextFromContext(pc).IsValid() {
		parent = pc
		if batch.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: batch}))
		}
	}
	attrs := append(t.consumed(d.Topic, d.Partition),
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingKafkaOffset(int(d.Offset)),
		attribute.Int("kafkapg.attempt", d.Attempt),
	)
	if d.Source != d.Topic {
		attrs = append(attrs, attribute.String("kafkapg.source_topic", d.Source))
	}
	if d.MessageID != "" {
		attrs = append(attrs, semconv.MessagingMessageID(d.MessageID))
	}
	if d.DeadLetter != 0 {
		attrs = append(attrs, attribute.Int64("kafkapg.replayed_dead_letter", d.DeadLetter))
	}
	opts = append(opts, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
	return t.tracer.Start(parent, "process "+d.Topic, opts...)
}

// StartPrepare starts the span of a Preparer's Prepare of d, outside the transaction: a child of
// the context d carries (or of ctx's), so that the calls Prepare makes are in the record's trace.
func (t *Tracer) StartPrepare(ctx context.Context, d Delivery) (context.Context, trace.Span) {
	if t == nil {
		return ctx, nil
	}
	parent := ctx
	if pc := t.Extract(ctx, d.Headers); trace.SpanContextFromContext(pc).IsValid() {
		parent = pc
	}
	attrs := append(t.consumed(d.Topic, d.Partition),
		semconv.MessagingKafkaOffset(int(d.Offset)),
		attribute.Int("kafkapg.attempt", d.Attempt),
	)
	if d.Source != d.Topic {
		attrs = append(attrs, attribute.String("kafkapg.source_topic", d.Source))
	}
	return t.tracer.Start(parent, "prepare "+d.Topic, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...))
}

// StartProcessBatch starts the span of a BatchHandler's call over ds: a child of ctx's span (the
// batch transaction's), linked to the context each record carries. A call over one record (a
// failing record is retried alone) is that record's delivery, as StartProcess has it.
func (t *Tracer) StartProcessBatch(ctx context.Context, topic string, partition int32, ds []Delivery) (context.Context, trace.Span) {
	if t == nil {
		return ctx, nil
	}
	if len(ds) == 1 {
		return t.StartProcess(ctx, ds[0])
	}
	links := make([]trace.Link, 0, len(ds))
	for _, d := range ds {
		if sc := trace.SpanContextFromContext(t.Extract(context.Background(), d.Headers)); sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{semconv.MessagingKafkaOffset(int(d.Offset))}})
		}
	}
	attrs := append(t.consumed(topic, partition),
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingBatchMessageCount(len(ds)),
	)
	return t.tracer.Start(ctx, "process "+topic, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithLinks(links...), trace.WithAttributes(attrs...))
}

func (t *Tracer) consumed(topic string, partition int32) []attribute.KeyValue {
	return []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingDestinationName(topic),
		semconv.MessagingDestinationPartitionID(strconv.Itoa(int(partition))),
		semconv.MessagingConsumerGroupName(t.group),
	}
}

// StartSend starts the span of publishing a record to topic's partition, as a child of the
// context its headers carry (the transaction that wrote it to the outbox); its own context is to
// be injected into the record (Inject) in place of that one.
func (t *Tracer) StartSend(hs []kgo.RecordHeader, topic string, partition int32, messageID string) (context.Context, trace.Span) {
	ctx := context.Background()
	if t == nil {
		return ctx, nil
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("send"),
		semconv.MessagingDestinationName(topic),
		semconv.MessagingDestinationPartitionID(strconv.Itoa(int(partition))),
	}
	if messageID != "" {
		attrs = append(attrs, semconv.MessagingMessageID(messageID))
	}
	return t.tracer.Start(t.Extract(ctx, hs), "send "+topic, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
}

// End ends span (nil: tracing off). A non-nil err marks it failed, errType naming the kind of
// failure (error.type: low cardinality, such as an error class).
func End(span trace.Span, err error, errType string) {
	if span == nil {
		return
	}
	if err != nil {
		if errType == "" {
			errType = "_OTHER"
		}
		span.SetAttributes(semconv.ErrorTypeKey.String(errType))
		span.SetStatus(codes.Error, safetext.Text(err.Error(), 1024))
	}
	span.End()
}

// Link adds a link from span (nil: tracing off) to the span of ctx.
func Link(span trace.Span, ctx context.Context) {
	if span == nil {
		return
	}
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		span.AddLink(trace.Link{SpanContext: sc})
	}
}

// PostgresTracer traces Postgres statements run in a traced context as child spans
// (github.com/exaring/otelpgx), one span per statement, per pipelined batch as a whole (not one
// per statement queued in it: a batch handler queues one or more per record, and a span each
// cost a fifth of the throughput, BenchmarkTracing), per COPY and per connection made.
func PostgresTracer(tp trace.TracerProvider) pgx.QueryTracer {
	return batchWhole{otelpgx.NewTracer(otelpgx.WithTracerProvider(tp), otelpgx.WithDisableConnectionDetailsInAttributes())}
}

type batchWhole struct{ *otelpgx.Tracer }

// TraceBatchQuery does nothing: the batch's span stands for its statements.
func (batchWhole) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
