package service

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

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
