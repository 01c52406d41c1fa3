package service

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// otelEnv is the part of OpenTelemetry's standard environment the service reads itself; the OTLP
// exporter reads the rest (OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT, _CERTIFICATE, _COMPRESSION, and
// their _TRACES_ variants) and the SDK reads OTEL_TRACES_SAMPLER(_ARG), OTEL_RESOURCE_ATTRIBUTES
// and the span limits.
var otelEnv = []string{
	"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
	"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER",
	"OTEL_TRACES_SAMPLER_ARG", "OTEL_PROPAGATORS",
}

// tracingSetup is what the OpenTelemetry environment asks for.
type tracingSetup struct {
	exporter string // "otlp" or "none"
	protocol string // "http/protobuf" or "grpc"
	prop     propagation.TextMapPropagator
	secrets  []string // what the OTLP headers' variables hold, as written and decoded: never printed
	warnings []string // what newTracerProvider logs at startup
}

// readTracing reads the OpenTelemetry environment. Tracing is off unless an OTLP endpoint or
// OTEL_TRACES_EXPORTER=otlp is set, and off whatever is set if OTEL_SDK_DISABLED=true or
// OTEL_TRACES_EXPORTER=none. Values it cannot honour are configuration errors that name the
// variable, not a silent fallback.
func readTracing(getenv func(string) string) (tracingSetup, error) {
	var s tracingSetup
	if v := strings.TrimSpace(getenv("OTEL_SDK_DISABLED")); v != "" {
		off, err := strconv.ParseBool(v)
		if err != nil {
			return s, fmt.Errorf("OTEL_SDK_DISABLED must be true or false, got %q", v)
		}
		if off {
			s.exporter = "none"
			return s, nil
		}
	}
	s.exporter = strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER"))
	if s.exporter == "" {
		s.exporter = "none"
		if getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "" {
			s.exporter = "otlp"
		}
	}
	switch s.exporter {
	case "none":
		return s, nil
	case "otlp":
	default:
		return s, fmt.Errorf("OTEL_TRACES_EXPORTER=%q: kafkapg exports traces over OTLP only (otlp, or none)", s.exporter)
	}
	s.protocol = strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
	if s.protocol == "" {
		s.protocol = strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_PROTOCOL"))
	}
	switch s.protocol {
	case "":
		s.protocol = "http/protobuf" // the specification's default
	case "http/protobuf", "grpc":
	default:
		return s, fmt.Errorf("OTEL_EXPORTER_OTLP_PROTOCOL=%q: want http/protobuf or grpc (http/json is not supported)", s.protocol)
	}
	switch v := strings.TrimSpace(getenv("OTEL_TRACES_SAMPLER")); v {
	case "", "always_on", "always_off", "parentbased_always_on", "parentbased_always_off":
	case "traceidratio", "parentbased_traceidratio":
		if a := strings.TrimSpace(getenv("OTEL_TRACES_SAMPLER_ARG")); a != "" {
			if r, err := strconv.ParseFloat(a, 64); err != nil || r < 0 || r > 1 {
				return s, fmt.Errorf("OTEL_TRACES_SAMPLER_ARG=%q: want a ratio from 0 to 1", a)
			}
		}
	default:
		return s, fmt.Errorf("OTEL_TRACES_SAMPLER=%q: want always_on, always_off, traceidratio or their parentbased_ forms", v)
	}
	if err := s.readHeaders(getenv); err != nil {
		return s, err
	}
	var props []propagation.TextMapPropagator
	for _, name := range strings.Split(getenv("OTEL_PROPAGATORS"), ",") {
		switch strings.TrimSpace(name) {
		case "":
		case "tracecontext":
			props = append(props, propagation.TraceContext{})
		case "baggage":
			props = append(props, propagation.Baggage{})
		case "none":
			props = []propagation.TextMapPropagator{}
		default:
			return s, fmt.Errorf("OTEL_PROPAGATORS: %q is not supported (tracecontext, baggage or none)", name)
		}
	}
	if props == nil {
		// Trace context only, not OpenTelemetry's default "tracecontext,baggage": baggage is
		// whatever a record's producer wrote in its headers, and propagated it would travel on
		// into the handler's outgoing calls and the records kafkapg publishes. Taking it in is
		// a choice: OTEL_PROPAGATORS=tracecontext,baggage.
		props = []propagation.TextMapPropagator{propagation.TraceContext{}}
	}
	s.prop = propagation.NewCompositeTextMapPropagator(props...)
	return s, nil
}

// otlpHeaderVars hold the OTLP exporter's headers: credentials, often (Authorization, API keys).
var otlpHeaderVars = []string{"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"}

// readHeaders checks the OTLP headers' variables as the exporter will parse them
// (comma-separated name=value, names HTTP tokens, values percent-encoded) and keeps their values
// as secrets. The exporter itself skips an entry it cannot parse, prints it through
// OpenTelemetry's own logger (to stderr, token included) and exports without it: here a
// malformed value is a configuration error that names the variable and the entry's place, never
// its text. It also warns when the headers would travel in clear to another host.
func (s *tracingSetup) readHeaders(getenv func(string) string) error {
	var names []string
	for _, variable := range otlpHeaderVars {
		raw := getenv(variable)
		if raw == "" {
			continue
		}
		s.secrets = append(s.secrets, raw)
		for i, entry := range strings.Split(raw, ",") {
			name, value, ok := strings.Cut(entry, "=")
			name = strings.TrimSpace(name)
			if ok {
				s.secrets = append(s.secrets, value, strings.TrimSpace(value))
			}
			decoded, err := url.PathUnescape(value)
			switch {
			case !ok:
				return fmt.Errorf("%s: entry %d has no '=' (want name=value,name=value; the value is not shown: it may hold a credential)", variable, i+1)
			case !httpToken(name):
				return fmt.Errorf("%s: entry %d's name is not an HTTP header name (the value is not shown: it may hold a credential)", variable, i+1)
			case err != nil:
				return fmt.Errorf("%s: the value of header %s is not percent-encoded correctly (the value is not shown: it may hold a credential)", variable, name)
			}
			s.secrets = append(s.secrets, decoded, strings.TrimSpace(decoded))
			names = append(names, name)
		}
	}
	slices.SortFunc(s.secrets, func(a, b string) int { return cmp.Or(len(b)-len(a), strings.Compare(a, b)) })
	s.secrets = slices.Compact(s.secrets)
	if host, clear := otlpInClear(getenv); clear && len(names) > 0 {
		s.warnings = append(s.warnings, fmt.Sprintf("the OTLP headers (%s) go in clear text, unencrypted, to %s: whoever is on the way reads them; "+
			"give the collector an https:// endpoint, or run it on this host (localhost)", strings.Join(names, ", "), host))
	}
	return nil
}

// httpToken reports whether name is an HTTP header name (RFC 9110's token), as the exporter wants.
func httpToken(name string) bool {
	if name == "" {
		return false
	}
	for _, c := range name {
		if c > unicode.MaxASCII || !(unicode.IsLetter(c) || unicode.IsDigit(c) || strings.ContainsRune("!#$%&'*+-.^_`|~", c)) {
			return false
		}
	}
	return true
}

// otlpInClear returns the collector's host and whether the exporter will reach it without TLS
// over a network: an http:// endpoint or OTEL_EXPORTER_OTLP_(TRACES_)INSECURE=true, the later
// variable of the exporter's order deciding, to a host that is not this one.
func otlpInClear(getenv func(string) string) (host string, clear bool) {
	host = "localhost"
	for _, v := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"} {
		if u, err := url.Parse(strings.TrimSpace(getenv(v))); err == nil && u.Host != "" {
			host, clear = u.Hostname(), strings.EqualFold(u.Scheme, "http")
		}
	}
	for _, v := range []string{"OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE"} {
		if b, err := strconv.ParseBool(strings.TrimSpace(getenv(v))); err == nil {
			clear = b
		}
	}
	if ip := net.ParseIP(host); host == "localhost" || ip != nil && ip.IsLoopback() {
		return host, false
	}
	return host, clear
}

// newTracerProvider returns the TracerProvider s asks for, exporting in batches, or nil when
// tracing is off. Its service.name is OTEL_SERVICE_NAME (or service.name in
// OTEL_RESOURCE_ATTRIBUTES), else the consumer group. It becomes OpenTelemetry's global provider
// and propagator too, so that spans a handler starts (otel.Tracer) join the record's trace.
func newTracerProvider(ctx context.Context, s tracingSetup, group string, log *slog.Logger) (*sdktrace.TracerProvider, error) {
	if s.exporter != "otlp" {
		return nil, nil
	}
	// Before the exporter reads its environment: what it or the SDK reports goes to the
	// service's log, with the OTLP headers' values cut, not to stderr through OpenTelemetry's
	// default logger.
	h := &redactHandler{h: log.Handler(), secrets: s.secrets}
	otel.SetLogger(logr.FromSlogHandler(h))
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		// an unreachable collector, say: spans are dropped, records are not
		slog.New(h).Warn("OpenTelemetry", "err", err)
	}))
	for _, w := range s.warnings {
		log.Warn("OpenTelemetry: " + w)
	}
	var client otlptrace.Client
	if s.protocol == "grpc" {
		client = otlptracegrpc.NewClient()
	} else {
		client = otlptracehttp.NewClient()
	}
	exp, err := otlptrace.New(ctx, client)
	if err != nil {
		return nil, &configError{fmt.Errorf("OpenTelemetry OTLP exporter: %v", err)}
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(group)),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES: over the default
		resource.WithTelemetrySDK(),
		resource.WithHost(),
	)
	if err != nil {
		return nil, &configError{fmt.Errorf("OTEL_RESOURCE_ATTRIBUTES: %v", err)}
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(s.prop)
	return tp, nil
}

// redactHandler is a slog.Handler that cuts secrets out of what OpenTelemetry logs: the message,
// and each attribute's value as text.
type redactHandler struct {
	h       slog.Handler
	secrets []string
}

func (r *redactHandler) Enabled(ctx context.Context, l slog.Level) bool { return r.h.Enabled(ctx, l) }

func (r *redactHandler) Handle(ctx context.Context, rec slog.Record) error {
	out := slog.NewRecord(rec.Time, rec.Level, r.cut(rec.Message), rec.PC)
	rec.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(r.attr(a))
		return true
	})
	return r.h.Handle(ctx, out)
}

func (r *redactHandler) WithAttrs(as []slog.Attr) slog.Handler {
	cut := make([]slog.Attr, len(as))
	for i, a := range as {
		cut[i] = r.attr(a)
	}
	return &redactHandler{h: r.h.WithAttrs(cut), secrets: r.secrets}
}

func (r *redactHandler) WithGroup(name string) slog.Handler {
	return &redactHandler{h: r.h.WithGroup(name), secrets: r.secrets}
}

func (r *redactHandler) attr(a slog.Attr) slog.Attr {
	v := a.Value.Resolve()
	switch v.Kind() {
	case slog.KindGroup:
		as := v.Group()
		cut := make([]any, len(as))
		for i, g := range as {
			cut[i] = r.attr(g)
		}
		return slog.Group(a.Key, cut...)
	case slog.KindString:
		return slog.String(a.Key, r.cut(v.String()))
	case slog.KindAny:
		text := fmt.Sprint(v.Any()) // an error, a header map: as the handler would print it
		if cut := r.cut(text); cut != text {
			return slog.String(a.Key, cut)
		}
	}
	return slog.Attr{Key: a.Key, Value: v}
}

// cut replaces each secret in s, the longest first (a header's value is part of the variable's).
func (r *redactHandler) cut(s string) string {
	for _, secret := range r.secrets {
		if strings.TrimSpace(secret) != "" {
			s = strings.ReplaceAll(s, secret, redacted)
		}
	}
	return s
}
