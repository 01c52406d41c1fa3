package service

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/internal/rig/otlprecv"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// TestTracesExportedOverOTLP runs the service with the standard OpenTelemetry environment
// pointing at an OTLP/HTTP receiver in the test, applies records that carry a traceparent, and
// decodes what arrived: the process span of the ledger's batch handler, linked to each record's
// producer span, with the service's name and the messaging attributes, and the handler's
// Postgres statements as its child spans.
func TestTracesExportedOverOTLP(t *testing.T) {
	_, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 1)
	recv := &otlprecv.Receiver{}
	srv := httptest.NewServer(recv)
	t.Cleanup(srv.Close)

	svc := startService(t, map[string]string{
		"DATABASE_URL": dbURL, "KAFKA_BROKERS": k.Brokers[0], "KAFKA_TOPICS": topic, "KAFKA_GROUP_ID": "traced",
		"OTEL_EXPORTER_OTLP_ENDPOINT": srv.URL, "OTEL_SERVICE_NAME": "ledger-svc",
		"OTEL_BSP_SCHEDULE_DELAY": "100", // export every 100 ms, not every 5 s
	})
	svc.waitReady()
	// Two records produced together, which the batch handler most likely gets in one call.
	traceIDs := []string{"4bf92f3577b34da6a3ce929d0e0e4736", "5bf92f3577b34da6a3ce929d0e0e4737"}
	var recs []*kgo.Record
	for i, id := range traceIDs {
		recs = append(recs, &kgo.Record{Topic: topic, Key: []byte("a"), Value: []byte(fmt.Sprintf(`{"event_id":"e%d","account":"a","amount":5,"seq":%d}`, i+1, i+1)),
			Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte("00-" + id + "-00f067aa0ba902b7-01")}}})
	}
	k.Produce(t, recs...)

	var process []otlprecv.Span
	testenv.Eventually(t, 30*time.Second, func() error {
		process = process[:0]
		linked := map[string]bool{}
		var names []string
		for _, s := range recv.Spans() {
			names = append(names, s.Name)
			if s.Name == "process "+topic {
				process = append(process, s)
				for _, l := range s.Links {
					linked[l] = true
				}
				// A record fetched alone is a call over one record: a child of its producer's span.
				linked[s.TraceID+"-"+s.Parent] = true
			}
		}
		for _, id := range traceIDs {
			if !linked[id+"-00f067aa0ba902b7"] {
				return fmt.Errorf("no process %s span links to (or is in) the producer span's trace %s among %v", topic, id, names)
			}
		}
		return nil
	})
	for _, p := range process {
		if p.Service != "ledger-svc" {
			t.Errorf("service.name = %q, want OTEL_SERVICE_NAME's ledger-svc", p.Service)
		}
		for k, v := range map[string]string{"messaging.system": "kafka", "messaging.destination.name": topic, "messaging.consumer.group.name": "traced",
			"messaging.operation.type": "process"} {
			if p.Attrs[k] != v {
				t.Errorf("process span: %s = %q, want %q", k, p.Attrs[k], v)
			}
		}
	}
	var statements []string
	for _, s := range recv.Spans() {
		if s.TraceID == process[0].TraceID && strings.Contains(s.Scope, "otelpgx") {
			statements = append(statements, s.Name)
		}
	}
	if len(statements) == 0 {
		t.Errorf("no Postgres statement spans in the batch's trace")
	}
	t.Logf("%d process spans; the handler's statements as spans %v", len(process), statements)
	svc.stop()
	if refused := recv.Refused(); len(refused) > 0 {
		t.Errorf("the receiver refused %d exports: %v", len(refused), refused)
	}
}

// TestTracingEnvironment: tracing is off unless configured, and what kafkapg cannot honour is a
// configuration error naming the variable.
func TestTracingEnvironment(t *testing.T) {
	for _, c := range []struct {
		env      map[string]string
		exporter string
		protocol string
		err      string
	}{
		{env: nil, exporter: "none"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, exporter: "otlp", protocol: "http/protobuf"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, exporter: "otlp", protocol: "grpc"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, exporter: "none"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, exporter: "none"},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, err: "OTEL_TRACES_EXPORTER"},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, err: "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, err: "OTEL_TRACES_SAMPLER_ARG"},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "sometimes"}, err: "OTEL_TRACES_SAMPLER"},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_PROPAGATORS": "b3"}, err: "OTEL_PROPAGATORS"},
		{env: map[string]string{"OTEL_SDK_DISABLED": "maybe"}, err: "OTEL_SDK_DISABLED"},
	} {
		s, err := readTracing(func(k string) string { return c.env[k] })
		switch {
		case c.err != "":
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%v: err %v, want one naming %s", c.env, err, c.err)
			}
		case err != nil:
			t.Errorf("%v: %v", c.env, err)
		case s.exporter != c.exporter || s.protocol != c.protocol:
			t.Errorf("%v: exporter %q protocol %q, want %q %q", c.env, s.exporter, s.protocol, c.exporter, c.protocol)
		}
	}
}

// TestOTLPHeadersMalformed: an OTLP headers variable the exporter cannot parse stops the service
// with an error naming the variable and none of its text (the exporter would print the entry,
// token and all, to stderr and export without it).
func TestOTLPHeadersMalformed(t *testing.T) {
	for _, c := range []struct {
		name, variable, value string
	}{
		{name: "no =", variable: "OTEL_EXPORTER_OTLP_HEADERS", value: "authorization: Bearer tok-0123456789"},
		{name: "an empty entry", variable: "OTEL_EXPORTER_OTLP_HEADERS", value: "x-tenant=a,,authorization=Bearer%20tok-0123456789"},
		{name: "not a header name", variable: "OTEL_EXPORTER_OTLP_TRACES_HEADERS", value: "auth orization=Bearer tok-0123456789"},
		{name: "bad percent-encoding", variable: "OTEL_EXPORTER_OTLP_HEADERS", value: "authorization=Bearer%zztok-0123456789"},
	} {
		t.Run(c.name, func(t *testing.T) {
			env := map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318", c.variable: c.value}
			_, err := readTracing(func(k string) string { return env[k] })
			if err == nil || !strings.Contains(err.Error(), c.variable) || strings.Contains(err.Error(), "tok-0123456789") {
				t.Errorf("%s=%q: err %v; want one naming the variable, without the value", c.variable, c.value, err)
			}
		})
	}
	env := map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318", "OTEL_EXPORTER_OTLP_HEADERS": " authorization = Bearer%20tok , x-tenant=a"}
	if _, err := readTracing(func(k string) string { return env[k] }); err != nil {
		t.Errorf("well-formed headers: %v", err)
	}
}

// TestOpenTelemetryLogsRedacted: what OpenTelemetry reports, through its logger (the exporter's
// complaints about its environment) or its error handler, goes to the service's log with the
// OTLP headers' values cut, not to stderr through OpenTelemetry's default logger.
func TestOpenTelemetryLogsRedacted(t *testing.T) {
	const token = "tok-0123456789abcdef"
	env := map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "https://127.0.0.1:1", "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer " + token}
	s, err := readTracing(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	// The exporter reads the process's environment itself: give it an entry it cannot parse
	// (here, after the check), so that it complains through OpenTelemetry's logger.
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://127.0.0.1:1")
	t.Setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization Bearer "+token)
	var logs syncBuffer
	tp, err := newTracerProvider(t.Context(), s, "g", slog.New(slog.NewJSONHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = tp.Shutdown(ctx)
		otel.SetLogger(logr.Discard())
	})
	otel.Handle(fmt.Errorf("export: the collector refused authorization=Bearer %s", token))
	out := logs.String()
	if strings.Contains(out, token) {
		t.Errorf("the service's log shows the token:\n%s", out)
	}
	if !strings.Contains(out, "parse headers") || !strings.Contains(out, "the collector refused") {
		t.Errorf("OpenTelemetry's complaints are not in the service's log:\n%s", out)
	}
}

// TestOTLPHeadersInClear: headers sent to a collector on another host without TLS are warned
// about at startup, by name, never by value.
func TestOTLPHeadersInClear(t *testing.T) {
	for _, c := range []struct {
		name string
		env  map[string]string
		warn bool
	}{
		{name: "http", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer tok-1"}, warn: true},
		{name: "traces endpoint over the generic one", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318",
			"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces", "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "authorization=Bearer tok-1"}, warn: true},
		{name: "insecure", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
			"OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer tok-1"}, warn: true},
		{name: "https", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318", "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer tok-1"}},
		{name: "localhost", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4318", "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer tok-1"}},
		{name: "loopback", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1]:4318", "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer tok-1"}},
		{name: "no headers", env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := readTracing(func(k string) string { return c.env[k] })
			if err != nil {
				t.Fatal(err)
			}
			warned := strings.Join(s.warnings, "\n")
			if (warned != "") != c.warn || strings.Contains(warned, "tok-1") || c.warn && !strings.Contains(warned, "authorization") {
				t.Errorf("warnings %q; want a warning: %v, naming the header and not its value", s.warnings, c.warn)
			}
		})
	}
}

// TestBaggageOptIn: a record's baggage header is taken in (and so passed on to the handler's
// outgoing calls and the records kafkapg publishes) only when OTEL_PROPAGATORS asks for baggage;
// the default is W3C trace context alone.
func TestBaggageOptIn(t *testing.T) {
	carrier := propagation.MapCarrier{
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"baggage":     "user.id=injected,admin=true",
	}
	for _, c := range []struct {
		propagators string
		baggage     bool
	}{
		{propagators: "", baggage: false},
		{propagators: "tracecontext", baggage: false},
		{propagators: "tracecontext,baggage", baggage: true},
	} {
		env := map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318", "OTEL_PROPAGATORS": c.propagators}
		s, err := readTracing(func(k string) string { return env[k] })
		if err != nil {
			t.Fatal(err)
		}
		ctx := s.prop.Extract(context.Background(), carrier)
		if !trace.SpanContextFromContext(ctx).IsValid() {
			t.Errorf("OTEL_PROPAGATORS=%q: the trace context is not taken in", c.propagators)
		}
		if got := baggage.FromContext(ctx).Len() > 0; got != c.baggage {
			t.Errorf("OTEL_PROPAGATORS=%q: baggage taken in: %v, want %v", c.propagators, got, c.baggage)
		}
	}
}
