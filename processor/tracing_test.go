package processor_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/topicread"
	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// TestOneTracePerRecord follows two records a traced producer published through a processor
// with tracing on: one fails at both its deliveries (source, one retry tier, then the dead-letter
// topic), is replayed and applied, and emits an event that a second service (another group)
// consumes; the other is applied and emits an event at once. Each record's deliveries and copies
// must be spans of the producer's trace, each the child of the hop before it, with the messaging
// attributes; the copies and the emitted events must carry exactly one traceparent, their send
// span's.
func TestOneTracePerRecord(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		emitTo := k.CreateTopic(t, 1)
		rec, tp := recordSpans(t)

		handler := processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
			switch string(r.Value) {
			case "fails":
				if r.Attempt <= 2 {
					return fmt.Errorf("delivery %d of this record fails", r.Attempt)
				}
				fallthrough // replayed
			case "emits":
				if _, err := tx.Exec(ctx, `INSERT INTO ledger_entries (event_id, account, amount, seq) VALUES ($1, 'a', 1, 1)`, r.Value); err != nil {
					return err
				}
				return r.Emit(ctx, tx, sink.Event{Topic: emitTo, Key: r.Key, Value: append([]byte("emitted by "), r.Value...)})
			case "after":
				_, err := tx.Exec(ctx, `INSERT INTO ledger_entries (event_id, account, amount, seq) VALUES ('after', 'a', 1, 1)`)
				return err
			}
			return errors.New("unexpected record")
		})
		cfg := h.Config(handler)
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond}
		cfg.LocalAttempts = 1
		cfg.TracerProvider = tp
		r := h.Start(cfg)

		// The producer's own spans, as an instrumented producer would make them.
		producer := tp.Tracer("test producer")
		prop := tracing.DefaultPropagator()
		produce := func(key, value string) trace.SpanContext {
			ctx, span := producer.Start(context.Background(), "send "+h.Topic, trace.WithSpanKind(trace.SpanKindProducer))
			defer span.End()
			r := &kgo.Record{Topic: h.Topic, Key: []byte(key), Value: []byte(value),
				Headers: []kgo.RecordHeader{{Key: "app", Value: []byte("x")}}}
			r.Headers = tracing.New(tp, prop, "").Inject(ctx, r.Headers)
			k.Produce(t, r)
			return span.SpanContext()
		}
		// "after" has the failing record's key: it waits in held_records while that one is in
		// the tier, and is applied once it is dead-lettered.
		failsRoot, afterRoot, emitsRoot := produce("k1", "fails"), produce("k1", "after"), produce("k2", "emits")

		dlq := retrytopics.DLQTopic(h.Topic, h.Group)
		tier := retrytopics.TierTopic(h.Topic, h.Group, 1)
		var dead, emitted []*kgo.Record
		testenv.Eventually(t, 30*time.Second, func() error {
			// Not k.ReadAll, which fails the test: the processor may not have created the
			// dead-letter topic yet (CI: UNKNOWN_TOPIC_OR_PARTITION on the first look).
			var err error
			if dead, err = topicread.All(context.Background(), k.Brokers, dlq); err != nil {
				return err
			}
			if emitted, err = topicread.All(context.Background(), k.Brokers, emitTo); err != nil {
				return err
			}
			if len(dead) != 1 || len(emitted) != 1 {
				return fmt.Errorf("%d dead letters and %d emitted events, want 1 and 1", len(dead), len(emitted))
			}
			// The relay ends a send span after Kafka acknowledged the record.
			if len(spansNamed(rec.Ended(), "send "+dlq)) != 1 || len(spansNamed(rec.Ended(), "send "+emitTo)) != 1 {
				return errors.New("the send spans have not ended yet")
			}
			if len(spansNamed(inTrace(rec.Ended(), afterRoot), "process "+h.Topic)) != 1 {
				return errors.New("the held record has not been applied yet")
			}
			return nil
		})
		spans := rec.Ended()

		// The failing record: producer → process (source) → send (tier) → process (tier) → send (DLQ).
		p1 := only(t, spansNamed(inTrace(spans, failsRoot), "process "+h.Topic))
		s1 := only(t, spansNamed(inTrace(spans, failsRoot), "send "+tier))
		p2 := only(t, spansNamed(inTrace(spans, failsRoot), "process "+tier))
		s2 := only(t, spansNamed(inTrace(spans, failsRoot), "send "+dlq))
		wantParent(t, p1, failsRoot)
		wantParent(t, s1, p1.SpanContext())
		wantParent(t, p2, s1.SpanContext())
		wantParent(t, s2, p2.SpanContext())
		for i, p := range []sdktrace.ReadOnlySpan{p1, p2} {
			wantAttrs(t, p, map[string]string{
				"messaging.system": "kafka", "messaging.operation.type": "process", "messaging.operation.name": "process",
				"messaging.destination.partition.id": "0", "messaging.consumer.group.name": h.Group,
				"messaging.kafka.offset": "0", "kafkapg.attempt": fmt.Sprint(i + 1), "error.type": "retryable",
			})
			if p.Status().Code != codes.Error || !strings.Contains(p.Status().Description, "fails") {
				t.Errorf("%s: status %+v, want an error with the handler's message", p.Name(), p.Status())
			}
			if p.SpanKind() != trace.SpanKindConsumer {
				t.Errorf("%s: kind %v, want consumer", p.Name(), p.SpanKind())
			}
		}
		wantAttrs(t, p2, map[string]string{"kafkapg.source_topic": h.Topic})
		for _, s := range []sdktrace.ReadOnlySpan{s1, s2} {
			wantAttrs(t, s, map[string]string{"messaging.system": "kafka", "messaging.operation.type": "send", "messaging.destination.partition.id": "0"})
			if s.SpanKind() != trace.SpanKindProducer {
				t.Errorf("%s: kind %v, want producer", s.Name(), s.SpanKind())
			}
		}
		wantTraceparent(t, "the dead-letter copy", dead[0].Headers, s2.SpanContext())
		if hs := headersNamed(dead[0].Headers, "app"); len(hs) != 1 {
			t.Errorf("the dead-letter copy carries %d app headers, want the producer's one", len(hs))
		}
		for _, r := range k.ReadAll(t, tier) {
			wantTraceparent(t, "the tier copy", r.Headers, s1.SpanContext())
		}

		// Latency histograms point at traces (exemplars, for Prometheus's exemplar storage).
		traced := map[string]bool{}
		for _, s := range spans {
			traced[s.SpanContext().TraceID().String()] = true
		}
		mfs, err := r.Reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		exemplars := map[string]int{}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				for _, b := range m.GetHistogram().GetBucket() {
					for _, l := range b.GetExemplar().GetLabel() {
						if l.GetName() == "trace_id" && traced[l.GetValue()] {
							exemplars[mf.GetName()]++
						}
					}
				}
			}
		}
		for _, name := range []string{"kafkapg_handler_duration_seconds", "kafkapg_transaction_duration_seconds"} {
			if exemplars[name] == 0 {
				t.Errorf("%s has no exemplar of a trace the processor reported (exemplars: %v)", name, exemplars)
			}
		}

		// The held record: applied from held_records, its delivery a child of its producer's span.
		pa := only(t, spansNamed(inTrace(spans, afterRoot), "process "+h.Topic))
		wantParent(t, pa, afterRoot)
		if r.Counter("kafkapg_records_held_total") != 1 {
			t.Errorf("kafkapg_records_held_total = %v: the record with the failing one's key was not held", r.Counter("kafkapg_records_held_total"))
		}

		// The applied record: producer → process (source) → send (emitted event), and the
		// batch transaction's commit span linked to its process span.
		pe := only(t, spansNamed(inTrace(spans, emitsRoot), "process "+h.Topic))
		se := only(t, spansNamed(inTrace(spans, emitsRoot), "send "+emitTo))
		wantParent(t, pe, emitsRoot)
		wantParent(t, se, pe.SpanContext())
		if pe.Status().Code == codes.Error {
			t.Errorf("the applied record's process span failed: %+v", pe.Status())
		}
		id := string(headersNamed(emitted[0].Headers, sink.HeaderMessageID)[0].Value)
		wantAttrs(t, se, map[string]string{"messaging.message.id": id})
		wantTraceparent(t, "the emitted event", emitted[0].Headers, se.SpanContext())
		var commit sdktrace.ReadOnlySpan
		for _, s := range spansNamed(spans, "commit "+h.Topic) {
			if linksTo(s, pe.SpanContext()) {
				commit = s
			}
		}
		if commit == nil {
			t.Fatalf("no commit %s span links to the applied record's process span", h.Topic)
		}
		wantAttrs(t, commit, map[string]string{"messaging.operation.type": "settle", "messaging.operation.name": "commit"})
		if !linksTo(pe, commit.SpanContext()) {
			t.Errorf("the process span does not link to its batch transaction's span")
		}

		// trace (and the console's trace page) name the dead letter's trace.
		tr, err := ops.New(h.Pool, "kafkapg", h.Group).Trace(context.Background(), ops.TraceQuery{Topic: h.Topic, Partition: 0, Offset: 0}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(tr.Records) != 1 || tr.Records[0].TraceID != failsRoot.TraceID().String() {
			t.Errorf("trace of the dead letter: %+v, want trace id %s", tr.Records, failsRoot.TraceID())
		}

		// The dead letter replayed: its delivery goes on from the one that dead-lettered it, and
		// the event it emits is a second service's delivery, in the same trace.
		second := h.Config(processor.HandlerFunc(func(context.Context, pgx.Tx, *processor.Record) error { return nil }))
		second.Group, second.Topics, second.TracerProvider = h.Group+"-downstream", []string{emitTo}, tp
		h.Start(second)
		o := ops.New(h.Pool, "kafkapg", h.Group)
		task, err := o.StartTask(context.Background(), ops.Replay, ops.Filter{}, ops.Actor{Name: "tester", Reason: "traced"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := o.RunTask(context.Background(), task.ID, "test", nil); err != nil {
			t.Fatal(err)
		}
		var downstream sdktrace.ReadOnlySpan
		testenv.Eventually(t, 30*time.Second, func() error {
			for _, s := range spansNamed(inTrace(rec.Ended(), failsRoot), "process "+emitTo) {
				downstream = s
				return nil
			}
			return errors.New("the second service has not processed the replayed record's event yet")
		})
		spans = inTrace(rec.Ended(), failsRoot)
		p3 := only(t, spansNamed(spans, "process "+h.Topic)[1:]) // [0] is p1
		s3 := only(t, spansNamed(spans, "send "+emitTo))
		wantParent(t, p3, p2.SpanContext())
		var deadLetter int64
		if err := h.Pool.QueryRow(context.Background(), `SELECT id FROM kafkapg.dead_letters`).Scan(&deadLetter); err != nil {
			t.Fatal(err)
		}
		wantAttrs(t, p3, map[string]string{"kafkapg.attempt": "3", "kafkapg.replayed_dead_letter": fmt.Sprint(deadLetter)})
		wantParent(t, s3, p3.SpanContext())
		wantParent(t, downstream, s3.SpanContext())
		wantAttrs(t, downstream, map[string]string{"messaging.consumer.group.name": second.Group})
	})
}

// recordSpans returns a tracer provider that records every span, shut down when the test ends.
func recordSpans(t *testing.T) (*tracetest.SpanRecorder, *sdktrace.TracerProvider) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	return rec, tp
}

func spansNamed(spans []sdktrace.ReadOnlySpan, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range spans {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func inTrace(spans []sdktrace.ReadOnlySpan, root trace.SpanContext) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range spans {
		if s.SpanContext().TraceID() == root.TraceID() {
			out = append(out, s)
		}
	}
	return out
}

func only(t *testing.T, spans []sdktrace.ReadOnlySpan) sdktrace.ReadOnlySpan {
	t.Helper()
	if len(spans) != 1 {
		var names []string
		for _, s := range spans {
			names = append(names, s.Name())
		}
		t.Fatalf("%d spans %v, want one", len(spans), names)
	}
	return spans[0]
}

func wantParent(t *testing.T, s sdktrace.ReadOnlySpan, parent trace.SpanContext) {
	t.Helper()
	if s.Parent().SpanID() != parent.SpanID() || s.SpanContext().TraceID() != parent.TraceID() {
		t.Errorf("%s: parent %s/%s, want %s/%s", s.Name(), s.SpanContext().TraceID(), s.Parent().SpanID(), parent.TraceID(), parent.SpanID())
	}
}

func wantAttrs(t *testing.T, s sdktrace.ReadOnlySpan, want map[string]string) {
	t.Helper()
	got := map[string]string{}
	for _, kv := range s.Attributes() {
		got[string(kv.Key)] = kv.Value.Emit()
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %s = %q, want %q", s.Name(), k, got[k], v)
		}
	}
}

func linksTo(s sdktrace.ReadOnlySpan, sc trace.SpanContext) bool {
	for _, l := range s.Links() {
		if l.SpanContext.SpanID() == sc.SpanID() {
			return true
		}
	}
	return false
}

func headersNamed(hs []kgo.RecordHeader, key string) []kgo.RecordHeader {
	var out []kgo.RecordHeader
	for _, h := range hs {
		if h.Key == key {
			out = append(out, h)
		}
	}
	return out
}

func wantTraceparent(t *testing.T, what string, hs []kgo.RecordHeader, sc trace.SpanContext) {
	t.Helper()
	tps := headersNamed(hs, "traceparent")
	want := fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID())
	if len(tps) != 1 || string(tps[0].Value) != want {
		var got []string
		for _, h := range tps {
			got = append(got, string(h.Value))
		}
		t.Errorf("%s carries traceparent %q, want exactly one, %q", what, got, want)
	}
}

// TestBatchHandlerTraces: a BatchHandler's call over several records is a trace of its own,
// linked to the records' traces; a record it names as failed (RecordFailed) is dead-lettered in
// its own trace, and an event another record emits goes on in that record's trace, not in the
// call's.
func TestBatchHandlerTraces(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		emitTo := k.CreateTopic(t, 1)
		rec, tp := recordSpans(t)
		tracer := tracing.New(tp, tracing.DefaultPropagator(), "")

		// Produced before the processor starts: one batch.
		roots := map[string]trace.SpanContext{}
		for _, v := range []string{"emits", "plain", "poison"} {
			ctx, span := tp.Tracer("test producer").Start(context.Background(), "send "+h.Topic)
			k.Produce(t, &kgo.Record{Topic: h.Topic, Key: []byte(v), Value: []byte(v), Headers: tracer.Inject(ctx, nil)})
			span.End()
			roots[v] = span.SpanContext()
		}
		var calls []int
		handler := processor.BatchHandlerFunc(func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
			calls = append(calls, len(recs))
			for i, r := range recs {
				switch string(r.Value) {
				case "poison":
					return processor.RecordFailed(i, processor.Permanent(errors.New("poison")))
				case "emits":
					if err := r.Emit(ctx, tx, sink.Event{Topic: emitTo, Key: r.Key, Value: []byte("emitted")}); err != nil {
						return err
					}
				}
			}
			return nil
		})
		cfg := h.Config(handler)
		cfg.TracerProvider = tp
		h.Start(cfg)

		dlq := retrytopics.DLQTopic(h.Topic, h.Group)
		var dead, emitted []*kgo.Record
		testenv.Eventually(t, 30*time.Second, func() error {
			// The DLQ topic exists once the processor consumes: it creates it first.
			if emitted = k.ReadAll(t, emitTo); len(emitted) != 1 {
				return fmt.Errorf("%d emitted events, want 1", len(emitted))
			}
			if dead = k.ReadAll(t, dlq); len(dead) != 1 || len(emitted) != 1 {
				return fmt.Errorf("%d dead letters and %d emitted events, want 1 and 1", len(dead), len(emitted))
			}
			if len(spansNamed(rec.Ended(), "send "+dlq)) != 1 || len(spansNamed(rec.Ended(), "send "+emitTo)) != 1 {
				return errors.New("the send spans have not ended yet")
			}
			return nil
		})
		if len(calls) == 0 || calls[0] != 3 {
			t.Fatalf("the handler's calls had %v records, want a first call over all three", calls)
		}
		spans := rec.Ended()

		// The first call: a process span in a trace of its own, linked to the three records'.
		var first sdktrace.ReadOnlySpan
		for _, s := range spansNamed(spans, "process "+h.Topic) {
			if len(s.Links()) >= 3 {
				first = s
			}
		}
		if first == nil {
			t.Fatal("no process span links to the three records of the first call")
		}
		for v, root := range roots {
			if !linksTo(first, root) {
				t.Errorf("the first call's span does not link to %s's trace", v)
			}
			if first.SpanContext().TraceID() == root.TraceID() {
				t.Errorf("the first call's span is in %s's trace", v)
			}
		}

		// The poison record: a failed process span of its own, a child of its producer's span,
		// linked to the call; the DLQ copy's send span its child.
		pp := only(t, spansNamed(inTrace(spans, roots["poison"]), "process "+h.Topic))
		wantParent(t, pp, roots["poison"])
		wantAttrs(t, pp, map[string]string{"error.type": "permanent", "kafkapg.failed_in_batch": "true"})
		if !linksTo(pp, first.SpanContext()) {
			t.Errorf("the poison record's span does not link to the call it failed in")
		}
		sd := only(t, spansNamed(inTrace(spans, roots["poison"]), "send "+dlq))
		wantParent(t, sd, pp.SpanContext())
		wantTraceparent(t, "the dead-letter copy", dead[0].Headers, sd.SpanContext())

		// The emitted event, from the second call (emits and plain, after the poison record was
		// dead-lettered): in the emitting record's trace, a child of its producer's span (the
		// call's span is the other records' too, and links to it).
		if len(calls) != 2 || calls[1] != 2 {
			t.Fatalf("the handler's calls had %v records, want 3, then the two records before the poison one", calls)
		}
		se := only(t, spansNamed(inTrace(spans, roots["emits"]), "send "+emitTo))
		wantParent(t, se, roots["emits"])
		wantTraceparent(t, "the emitted event", emitted[0].Headers, se.SpanContext())
	})
}

// preparing is a handler whose Prepare starts a span of its own (a call it makes) and fails the
// record "bad" permanently.
type preparing struct{ tp trace.TracerProvider }

func (h preparing) Prepare(ctx context.Context, rec *processor.Record) error {
	_, span := h.tp.Tracer("test client").Start(ctx, "GET /price")
	defer span.End()
	if string(rec.Value) == "bad" {
		return processor.Permanent(errors.New("no price"))
	}
	rec.Prepared = len(rec.Value)
	return nil
}

func (preparing) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error { return nil }

// TestPrepareTraces: with Concurrency, each record's Prepare is a "prepare {topic}" span in the
// record's trace (a child of its producer's span), the calls Prepare makes are its children, and a
// failed Prepare says its class.
func TestPrepareTraces(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		rec, tp := recordSpans(t)
		tracer := tracing.New(tp, tracing.DefaultPropagator(), "")
		roots := map[string]trace.SpanContext{}
		for _, v := range []string{"a", "b", "bad"} {
			ctx, span := tp.Tracer("test producer").Start(context.Background(), "send "+h.Topic)
			k.Produce(t, &kgo.Record{Topic: h.Topic, Key: []byte(v), Value: []byte(v), Headers: tracer.Inject(ctx, nil)})
			span.End()
			roots[v] = span.SpanContext()
		}
		cfg := h.Config(preparing{tp})
		cfg.TracerProvider = tp
		cfg.Concurrency = 4
		h.Start(cfg)
		testenv.Eventually(t, 30*time.Second, func() error {
			if n := len(spansNamed(rec.Ended(), "process "+h.Topic)); n < 2 {
				return fmt.Errorf("%d process spans, want 2", n)
			}
			if n := len(spansNamed(rec.Ended(), "prepare "+h.Topic)); n < 3 {
				return fmt.Errorf("%d prepare spans, want 3", n)
			}
			return nil
		})
		spans := rec.Ended()
		for v, root := range roots {
			ps := spansNamed(inTrace(spans, root), "prepare "+h.Topic)
			if len(ps) == 0 {
				t.Errorf("%s: no prepare span in its trace", v)
				continue
			}
			wantParent(t, ps[0], root)
			call := only(t, spansNamed(inTrace(spans, root), "GET /price"))
			if call.Parent().SpanID() != ps[0].SpanContext().SpanID() {
				t.Errorf("%s: the call Prepare made is not a child of its prepare span", v)
			}
			if v == "bad" {
				wantAttrs(t, ps[0], map[string]string{"error.type": "permanent"})
			}
		}
	})
}
