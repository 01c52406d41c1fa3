package schemaregistry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/sr"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kafkapg/kafkapg/processor"
)

// Subject names, as Confluent's naming strategies make them: TopicSubject is the default
// (TopicNameStrategy), RecordSubject and TopicRecordSubject the others.
func TopicSubject(topic string, key bool) string {
	if key {
		return topic + "-key"
	}
	return topic + "-value"
}

// RecordSubject is RecordNameStrategy's subject: the record's (message's) full name.
func RecordSubject(fullName string) string { return fullName }

// TopicRecordSubject is TopicRecordNameStrategy's subject: the topic and the record's full name.
func TopicRecordSubject(topic, fullName string) string { return topic + "-" + fullName }

// An Encoder writes values in the wire format with one schema under one subject, for the events
// a handler emits (processor.Record.Emit): a consumer in any language reads them with its usual
// deserializer. The schema's id is looked up in the registry (registered first with
// AutoRegister) on the first Encode, once however many transactions encode at the same time, and
// kept: the emitting transactions wait on the network once per schema, not per event.
//
// Encode's errors say whose fault they are: the registry's or the deployment's (unreachable, 5xx,
// the schema not registered under the subject, a registration refused as incompatible) are
// processor.Infrastructure: returned by the handler, its record waits in place and is applied,
// with its events, once the registry answers or the schema is registered; no event is lost. A
// value the schema cannot encode is a plain error (the record's retries, then its dead letter).
type Encoder struct {
	reg     *Registry
	subject string
	schema  sr.Schema
	index   []int // Protobuf's message indexes
	encode  func(any) ([]byte, error)
	auto    bool

	mu sync.Mutex
	id int // 0 until known
}

// EncoderOpt configures an Encoder.
type EncoderOpt func(*Encoder)

// AutoRegister registers the schema under the subject when the registry does not have it there
// yet (with the subject's compatibility rules: an incompatible one is refused). Without it, the
// schema must have been registered (by CI, say), and an event waits until it is.
func AutoRegister() EncoderOpt { return func(e *Encoder) { e.auto = true } }

// AvroEncoder returns an Encoder of values (a struct with avro tags, or a map) with the Avro
// schema, under subject. reg may be nil until Bind.
func AvroEncoder(reg *Registry, subject, schema string, opts ...EncoderOpt) (*Encoder, error) {
	s, err := avro.ParseWithCache(schema, "", &avro.SchemaCache{})
	if err != nil {
		return nil, fmt.Errorf("schemaregistry: the schema does not parse as Avro: %w", err)
	}
	return newEncoder(reg, subject, sr.Schema{Schema: schema}, nil, func(v any) ([]byte, error) { return avro.Marshal(s, v) }, opts), nil
}

// ProtobufEncoder returns an Encoder of M messages under subject; source is the .proto file that
// declares M, as it is registered (the registry keeps Protobuf schemas as their source).
func ProtobufEncoder[M proto.Message](reg *Registry, subject, source string, opts ...EncoderOpt) *Encoder {
	var zero M
	return newEncoder(reg, subject, sr.Schema{Schema: source, Type: sr.TypeProtobuf}, messageIndex(zero.ProtoReflect().Descriptor()),
		func(v any) ([]byte, error) {
			m, ok := v.(M)
			if !ok {
				return nil, fmt.Errorf("schemaregistry: the encoder of %s was given a %T", zero.ProtoReflect().Descriptor().FullName(), v)
			}
			return proto.Marshal(m)
		}, opts)
}

// JSONSchemaEncoder returns an Encoder of values as JSON (encoding/json) with the JSON Schema,
// under subject. The value is not validated here: the consumer validates it.
func JSONSchemaEncoder(reg *Registry, subject, schema string, opts ...EncoderOpt) *Encoder {
	return newEncoder(reg, subject, sr.Schema{Schema: schema, Type: sr.TypeJSON}, nil, jsonMarshal, opts)
}

func newEncoder(reg *Registry, subject string, s sr.Schema, index []int, encode func(any) ([]byte, error), opts []EncoderOpt) *Encoder {
	e := &Encoder{reg: reg, subject: subject, schema: s, index: index, encode: encode}
	for _, o := range opts {
		o(e)
	}
	return e
}

// Subject is the subject the Encoder's schema is under.
func (e *Encoder) Subject() string { return e.subject }

// Bind sets the registry of an Encoder made without one (a nil *Registry): a service's handler
// declares its Encoders (service.Handler.Encoders), and the service binds them to the registry
// SCHEMA_REGISTRY_URL names when it starts.
func (e *Encoder) Bind(reg *Registry) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.reg != reg {
		e.reg, e.id = reg, 0
	}
}

// Encode returns v in the wire format: the schema's id (see Encoder), then v encoded.
func (e *Encoder) Encode(ctx context.Context, v any) ([]byte, error) {
	id, err := e.schemaID(ctx)
	if err != nil {
		return nil, err
	}
	payload, err := e.encode(v)
	if err != nil {
		return nil, fmt.Errorf("encode a %T with the schema of subject %s (id %d): %w", v, e.subject, id, err)
	}
	var h sr.ConfluentHeader
	b, err := h.AppendEncode(make([]byte, 0, 6+len(payload)), id, e.index)
	if err != nil {
		return nil, err
	}
	return append(b, payload...), nil
}

// schemaID returns the schema's id under the subject, looked up (and registered, with
// AutoRegister) once.
func (e *Encoder) schemaID(ctx context.Context) (int, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.id != 0 {
		return e.id, nil
	}
	if e.reg == nil {
		return 0, fmt.Errorf("schemaregistry: the encoder of subject %s has no registry: give it one, or declare it in service.Handler.Encoders", e.subject)
	}
	fctx, cancel := context.WithTimeout(ctx, e.reg.timeout)
	defer cancel()
	ss, err := e.reg.cl.LookupSchema(fctx, e.subject, e.schema)
	var re *sr.ResponseError
	if err != nil && e.auto && errors.As(err, &re) && re.StatusCode == http.StatusNotFound {
		ss, err = e.reg.cl.CreateSchema(fctx, e.subject, e.schema)
	}
	if err != nil {
		what := "look up"
		if e.auto {
			what = "look up or register"
		}
		switch {
		case errors.As(err, &re) && re.StatusCode == http.StatusNotFound:
			return 0, processor.Infrastructure(fmt.Errorf("the schema is not registered under subject %s (register it, or use AutoRegister): %s", e.subject, re.Message))
		case errors.As(err, &re):
			return 0, processor.Infrastructure(fmt.Errorf("%s the schema of subject %s: the registry answered %d (error code %d: %s)", what, e.subject, re.StatusCode, re.ErrorCode, re.Message))
		}
		return 0, processor.Infrastructure(fmt.Errorf("%s the schema of subject %s: %w", what, e.subject, err))
	}
	e.id = ss.ID
	return e.id, nil
}

// messageIndex is the wire format's message indexes of md: its position in its file, and in each
// message it is nested in.
func messageIndex(md protoreflect.MessageDescriptor) []int {
	var idx []int
	for d := protoreflect.Descriptor(md); ; {
		idx = append([]int{d.Index()}, idx...)
		parent := d.Parent()
		if _, ok := parent.(protoreflect.MessageDescriptor); !ok {
			return idx
		}
		d = parent
	}
}

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }
