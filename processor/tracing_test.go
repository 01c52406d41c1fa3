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

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// TestOneTracePerRecord follows two records a traced producer published through a processor
// with tracing on: one fails at every delivery (source, one retry tier, then the dead-letter
// topic), the other is applied and emits an event. Each record's deliveries and copies must be
// spans of the producer's trace, each the child of the hop before it, with the messaging
// attributes; the copies and the emitted event must carry exactly one traceparent, their send
// span's.
func TestOneTracePerRecord(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 1)
		emitTo := k.CreateTopic(t, 1)
		rec := tracetest.NewSpanRecorder()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
		t.Cleanup(func() { tp.Shutdown(context.Background()) })

		handler := processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
			switch string(r.Value) {
			case "fails":
				return fmt.Errorf("delivery %d of this record fails", r.Attempt)
			case "emits":
				if _, err := tx.Exec(ctx, `INSERT INTO ledger_entries (event_id, account, amount, seq) VALUES ('emits', 'a', 1, 1)`); err != nil {
					return err
				}
				return r.Emit(ctx, tx, sink.Event{Topic: emitTo, Key: r.Key, Value: []byte("emitted")})
			}
			return errors.New("unexpected record")
		})
		cfg := h.Config(handler)
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond}
		cfg.LocalAttempts = 1
		cfg.TracerProvider = tp
		h.Start(cfg)

		// The producer's own spans, as an instrumented producer would make them.
		producer := tp.Tracer("test producer")
		prop := tracing.DefaultPropagator()
		produce := func(value string) trace.SpanContext {
			ctx, span := producer.Start(context.Background(), "send "+h.Topic, trace.WithSpanKind(trace.SpanKindProducer))
			defer span.End()
			r := &kgo.Record{Topic: h.Topic, Key: []byte("k-" + value), Value: []byte(value),
				Headers: []kgo.RecordHeader{{Key: "app", Value: []byte("x")}}}
			r.Headers = tracing.New(tp, prop, "").Inject(ctx, r.Headers)
			k.Produce(t, r)
			return span.SpanContext()
		}
		failsRoot, emitsRoot := produce("fails"), produce("emits")

		dlq := retrytopics.DLQTopic(h.Topic, h.Group)
		tier := retrytopics.TierTopic(h.Topic, h.Group, 1)
		var dead, emitted []*kgo.Record
		testenv.Eventually(t, 30*time.Second, func() error {
			dead, emitted = k.ReadAll(t, dlq), k.ReadAll(t, emitTo)
			if len(dead) != 1 || len(emitted) != 1 {
				return fmt.Errorf("%d dead letters and %d emitted events, want 1 and 1", len(dead), len(emitted))
			}
			// The relay ends a send span after Kafka acknowledged the record.
			if len(spansNamed(rec.Ended(), "send "+dlq)) != 1 || len(spansNamed(rec.Ended(), "send "+emitTo)) != 1 {
				return errors.New("the send spans have not ended yet")
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
	})
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
