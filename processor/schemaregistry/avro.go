package schemaregistry

import (
	"context"
	"fmt"
	"slices"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/sr"

	"github.com/kafkapg/kafkapg/processor"
)

// Avro returns a Decoder of Avro records into a T: a struct whose fields carry avro tags (see
// github.com/hamba/avro/v2), or map[string]any. readerSchema is the schema T follows, the
// handler's; each record's writer schema (fetched by the id the record carries) is resolved
// against it by Avro's rules, so that records written with an older or newer compatible schema
// decode into T. A writer schema the reader cannot read (a field removed without a default, a
// type changed) fails the record as permanent, naming both schemas. Decode returns a T.
func Avro[T any](reg *Registry, readerSchema string) (processor.Decoder, error) {
	rs, err := avro.ParseWithCache(readerSchema, "", &avro.SchemaCache{})
	if err != nil {
		return nil, fmt.Errorf("schemaregistry: the reader schema does not parse as Avro: %w", err)
	}
	return &avroDecoder[T]{reg: reg, reader: rs}, nil
}

// AvroGeneric returns a Decoder of Avro records with their writer schema alone, into what
// github.com/hamba/avro/v2 makes of them without a Go type: map[string]any for a record.
func AvroGeneric(reg *Registry) processor.Decoder {
	return &avroDecoder[any]{reg: reg}
}

type avroDecoder[T any] struct {
	reg    *Registry
	reader avro.Schema // nil: the writer schema alone
}

func (d *avroDecoder[T]) Decode(ctx context.Context, data []byte) (any, error) {
	id, _, payload, err := header(data, false)
	if err != nil {
		return nil, err
	}
	s, err := d.reg.SchemaByID(ctx, id)
	if err != nil {
		return nil, err
	}
	if s.Type != sr.TypeAvro {
		return nil, wrongType(s, sr.TypeAvro)
	}
	// A writer schema is parsed once per schema; resolved against a reader, once per decoder
	// (they live as long as the service).
	var schema any
	if d.reader == nil {
		schema, err = d.reg.avroWriter(ctx, s)
	} else {
		schema, err = s.parse(d, func() (any, error) {
			w, err := d.reg.avroWriter(ctx, s)
			if err != nil {
				return nil, err
			}
			res, err := avro.NewSchemaCompatibility().Resolve(d.reader, w)
			if err != nil {
				return nil, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("the record's schema (id %d, %s) cannot be read as the handler's (%s): %w",
					id, avroName(w), avroName(d.reader), err)}
			}
			return res, nil
		})
	}
	if err != nil {
		return nil, err
	}
	var v T
	if err := avroAPI.Unmarshal(schema.(avro.Schema), payload, &v); err != nil {
		return nil, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("the bytes do not decode with their Avro schema (id %d): %w", id, err)}
	}
	return v, nil
}

// MaxAvroArrayElements bounds the elements of one array a record's value decodes into: an
// array's block header states its count, and the slice is made that long before a byte of it is
// read, so a few bytes claiming 2^40 elements would take the process's memory (a poison record
// killing the processor at each try). An honest value of a million elements is a megabyte at
// least; past the bound the record is permanent, dead-lettered, saying so.
const MaxAvroArrayElements = 1 << 20

var avroAPI = avro.Config{MaxSliceAllocSize: MaxAvroArrayElements}.Freeze()

// avroWriterKey is the key under which a Schema keeps its parsed Avro schema.
type avroWriterKey struct{}

// avroWriter returns s, an Avro schema, parsed (once) with the schemas it references.
func (r *Registry) avroWriter(ctx context.Context, s *Schema) (avro.Schema, error) {
	w, err := s.parse(avroWriterKey{}, func() (any, error) { return r.avroSchema(ctx, s) })
	if err != nil {
		return nil, err
	}
	return w.(avro.Schema), nil
}

// avroSchema parses s, an Avro schema, with the schemas it references.
func (r *Registry) avroSchema(ctx context.Context, s *Schema) (avro.Schema, error) {
	refs, err := r.references(ctx, s)
	if err != nil {
		return nil, err
	}
	cache := &avro.SchemaCache{}
	// A referenced named type is parsed before what references it; each may reference others.
	names := make([]string, 0, len(refs))
	for n := range refs {
		names = append(names, n)
	}
	slices.Sort(names)
	for pending := names; len(pending) > 0; {
		var failed []string
		var lastErr error
		for _, n := range pending {
			if _, err := avro.ParseWithCache(refs[n], "", cache); err != nil {
				failed, lastErr = append(failed, n), err
			}
		}
		if len(failed) == len(pending) {
			return nil, &processor.DecodeError{SchemaID: s.ID, Err: fmt.Errorf("schema id %d's reference %s does not parse as Avro: %w", s.ID, failed[0], lastErr)}
		}
		pending = failed
	}
	w, err := avro.ParseWithCache(s.Schema.Schema, "", cache)
	if err != nil {
		return nil, &processor.DecodeError{SchemaID: s.ID, Err: fmt.Errorf("schema id %d does not parse as Avro: %w", s.ID, err)}
	}
	return w, nil
}

// avroName names a schema in an error: a named type's full name, or its type.
func avroName(s avro.Schema) string {
	if n, ok := s.(avro.NamedSchema); ok {
		return n.FullName()
	}
	return string(s.Type())
}
