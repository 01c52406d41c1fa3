// Package otlprecv is an OpenTelemetry trace receiver for tests and the chaos suite: it takes
// what OTLP/HTTP exporters post to /v1/traces (protobuf), decodes it, and keeps the spans, so that
// a test can check what a kafkapg service really exported.
package otlprecv

import (
	"fmt"
	"io"
	"net/http"
	"sync"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/protobuf/proto"
)

// Span is a span as received, its ids in hex.
type Span struct {
	Name    string
	TraceID string
	SpanID  string
	Parent  string // the parent span's id, "" for a root
	Service string // the resource's service.name
	Scope   string // the instrumentation scope
	Attrs   map[string]string
	Links   []string // trace id-span id of each link
}

// Receiver is an http.Handler for OTLP/HTTP trace exports.
type Receiver struct {
	// OnSpan, if set, is given each span as it arrives (one call at a time) instead of the
	// receiver keeping it: for runs that export more spans than are worth holding.
	OnSpan func(Span)

	mu      sync.Mutex
	spans   []Span
	refused []string
}

func (o *Receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	req := &coltrace.ExportTraceServiceRequest{}
	if err == nil {
		err = proto.Unmarshal(body, req)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if r.URL.Path != "/v1/traces" || r.Header.Get("Content-Type") != "application/x-protobuf" || err != nil {
		o.refused = append(o.refused, fmt.Sprintf("%s %s (%s): %v", r.Method, r.URL.Path, r.Header.Get("Content-Type"), err))
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	for _, rs := range req.ResourceSpans {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.Key == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				sp := Span{Name: s.Name, TraceID: fmt.Sprintf("%x", s.TraceId), SpanID: fmt.Sprintf("%x", s.SpanId), Service: service,
					Scope: ss.GetScope().GetName(), Attrs: map[string]string{}}
				if len(s.ParentSpanId) > 0 {
					sp.Parent = fmt.Sprintf("%x", s.ParentSpanId)
				}
				for _, kv := range s.Attributes {
					v := kv.GetValue()
					if _, ok := v.GetValue().(*commonpb.AnyValue_IntValue); ok {
						sp.Attrs[kv.Key] = fmt.Sprint(v.GetIntValue())
					} else {
						sp.Attrs[kv.Key] = v.GetStringValue()
					}
				}
				for _, l := range s.Links {
					sp.Links = append(sp.Links, fmt.Sprintf("%x-%x", l.TraceId, l.SpanId))
				}
				if o.OnSpan != nil {
					o.OnSpan(sp)
				} else {
					o.spans = append(o.spans, sp)
				}
			}
		}
	}
	w.Header().Set("Content-Type", "application/x-protobuf")
	out, _ := proto.Marshal(&coltrace.ExportTraceServiceResponse{})
	w.Write(out)
}

// Spans returns the spans received so far.
func (o *Receiver) Spans() []Span {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]Span(nil), o.spans...)
}

// Refused returns the requests it could not decode.
func (o *Receiver) Refused() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.refused...)
}
