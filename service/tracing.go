package service

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"

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
		props = []propagation.TextMapPropagator{propagation.TraceContext{}, propagation.Baggage{}}
	}
	s.prop = propagation.NewCompositeTextMapPropagator(props...)
	return s, nil
}

// newTracerProvider returns the TracerProvider s asks for, exporting in batches, or nil when
// tracing is off. Its service.name is OTEL_SERVICE_NAME (or service.name in
// OTEL_RESOURCE_ATTRIBUTES), else the consumer group. It becomes OpenTelemetry's global provider
// and propagator too, so that spans a handler starts (otel.Tracer) join the record's trace.
func newTracerProvider(ctx context.Context, s tracingSetup, group string, log *slog.Logger) (*sdktrace.TracerProvider, error) {
	if s.exporter != "otlp" {
		return nil, nil
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
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Warn("OpenTelemetry", "err", err) // an unreachable collector, say: spans are dropped, records are not
	}))
	return tp, nil
}
