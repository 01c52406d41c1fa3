package schemaregistry

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/sr"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/kafkapg/kafkapg/processor"
)

// Rendered is a record's value (or key) decoded for a person, with its writer schema alone: what
// an operator reads in `dlq show`, `trace` and the console instead of bytes.
type Rendered struct {
	SchemaID int
	// Type is the schema's: AVRO, PROTOBUF or JSON.
	Type string
	// Subjects are the subjects and versions the registry lists the schema under ("orders-value
	// v3"); empty if it lists none, or could not be asked.
	Subjects []string
	// Message is the Protobuf message the record is; "" for the other types.
	Message string
	// JSON is the value, indented.
	JSON string
}

// Describe says what the value is, in a line: "AVRO, schema id 7 (orders-value v3)".
func (r Rendered) Describe() string {
	s := fmt.Sprintf("%s, schema id %d", r.Type, r.SchemaID)
	if r.Message != "" {
		s += ", message " + r.Message
	}
	if len(r.Subjects) > 0 {
		s += " (" + strings.Join(r.Subjects, ", ") + ")"
	}
	return s
}

// ErrNotWireFormat is Render's error for bytes that are not in the wire format (they do not start
// with the magic byte and a schema id): they are shown as they are.
var ErrNotWireFormat = errors.New("not in the Schema Registry's wire format")

// LooksLikeWireFormat reports whether data starts as the wire format does: the magic byte 0 and
// a 4-byte schema id (its first byte 0 too, for ids under 2^24).
func LooksLikeWireFormat(data []byte) bool {
	return len(data) >= 5 && data[0] == 0
}

// Render decodes data, in the wire format, with the schema it carries (fetched as Decode fetches
// it), into indented JSON: an Avro value as hamba/avro decodes it generically, a Protobuf message
// as protojson writes it, a JSON Schema value as it is. Its error says why it could not
// (ErrNotWireFormat, or a *processor.DecodeError).
func (r *Registry) Render(ctx context.Context, data []byte) (Rendered, error) {
	if !LooksLikeWireFormat(data) {
		return Rendered{}, ErrNotWireFormat
	}
	var h sr.ConfluentHeader
	id, _, err := h.DecodeID(data)
	if err != nil {
		return Rendered{}, ErrNotWireFormat
	}
	s, err := r.SchemaByID(ctx, id)
	if err != nil {
		return Rendered{}, err
	}
	out := Rendered{SchemaID: id, Type: kindOf(s), Subjects: r.subjects(ctx, s)}
	var raw []byte
	switch s.Type {
	case sr.TypeAvro:
		v, err := AvroGeneric(r).Decode(ctx, data)
		if err != nil {
			return out, err
		}
		if w, err := r.avroWriter(ctx, s); err == nil { // parsed by Decode just now
			v = avroOrdered(w, v)
		}
		if raw, err = json.Marshal(v); err != nil {
			return out, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("render as JSON: %w", err)}
		}
	case sr.TypeProtobuf:
		v, err := ProtobufGeneric(r).Decode(ctx, data)
		if err != nil {
			return out, err
		}
		m := v.(proto.Message)
		out.Message = string(m.ProtoReflect().Descriptor().FullName())
		if raw, err = protojson.Marshal(m); err != nil {
			return out, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("render as JSON: %w", err)}
		}
	case sr.TypeJSON:
		if _, err := JSONSchema[any](r).Decode(ctx, data); err != nil {
			return out, err
		}
		raw = data[5:]
	default:
		return out, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("schema id %d is of type %s, which kafkapg does not decode", id, s.Type)}
	}
	var b bytes.Buffer
	if err := json.Indent(&b, raw, "", "  "); err != nil {
		return out, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("render as JSON: %w", err)}
	}
	out.JSON = b.String()
	return out, nil
}

// subjects returns the subjects and versions s is registered under, asked once per schema; none
// if the registry cannot say (the value is rendered all the same).
func (r *Registry) subjects(ctx context.Context, s *Schema) []string {
	v, _ := s.parse(subjectsKey{}, func() (any, error) {
		fctx, cancel := context.WithTimeout(ctx, r.timeout)
		defer cancel()
		svs, err := r.cl.SchemaVersionsByID(fctx, s.ID)
		if err != nil {
			return nil, &processor.DecodeError{Infrastructure: true, Err: err} // not kept: asked again
		}
		out := make([]string, 0, len(svs))
		for _, sv := range svs {
			out = append(out, fmt.Sprintf("%s v%d", sv.Subject, sv.Version))
		}
		return out, nil
	})
	out, _ := v.([]string)
	return out
}

type subjectsKey struct{}

// avroOrdered arranges v, an Avro value decoded generically with schema s, so that it marshals as
// JSON with each record's fields in the schema's order (a map would sort them), recursing into
// arrays, maps and unions (whose named branches decode as a one-entry map, as Avro's JSON
// encoding writes them).
func avroOrdered(s avro.Schema, v any) any {
	switch s := s.(type) {
	case *avro.RecordSchema:
		m, ok := v.(map[string]any)
		if !ok {
			return v
		}
		o := make(orderedObject, 0, len(s.Fields()))
		for _, f := range s.Fields() {
			o = append(o, field{f.Name(), avroOrdered(f.Type(), m[f.Name()])})
		}
		return o
	case *avro.ArraySchema:
		a, ok := v.([]any)
		if !ok {
			return v
		}
		out := make([]any, len(a))
		for i, e := range a {
			out[i] = avroOrdered(s.Items(), e)
		}
		return out
	case *avro.MapSchema:
		m, ok := v.(map[string]any)
		if !ok {
			return v
		}
		out := make(map[string]any, len(m))
		for k, e := range m {
			out[k] = avroOrdered(s.Values(), e)
		}
		return out
	case *avro.UnionSchema:
		m, ok := v.(map[string]any)
		if !ok || len(m) != 1 {
			return v
		}
		for name, inner := range m {
			for _, t := range s.Types() {
				if avroTypeName(t) == name {
					return orderedObject{{name, avroOrdered(t, inner)}}
				}
			}
		}
	case *avro.RefSchema:
		return avroOrdered(s.Schema(), v)
	}
	return v
}

// avroTypeName is how a union names its branch of type t in a generic value.
func avroTypeName(t avro.Schema) string {
	if n, ok := t.(avro.NamedSchema); ok {
		return n.FullName()
	}
	return string(t.Type())
}

type field struct {
	name  string
	value any
}

// orderedObject is a JSON object whose fields keep their order.
type orderedObject []field

func (o orderedObject) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, f := range o {
		if i > 0 {
			b.WriteByte(',')
		}
		k, err := json.Marshal(f.name)
		if err != nil {
			return nil, err
		}
		v, err := json.Marshal(f.value)
		if err != nil {
			return nil, err
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}
