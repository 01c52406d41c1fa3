package schemaregistry

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"github.com/twmb/franz-go/pkg/sr"

	"github.com/kafkapg/kafkapg/processor"
)

// JSONSchema returns a Decoder of JSON Schema records into a T, with encoding/json, once the
// record validates against its writer schema (fetched by the id it carries, with the schemas it
// references). A record that does not validate, or does not unmarshal into T, fails as permanent,
// saying where. Decode returns a T; T = map[string]any or any decodes generically.
func JSONSchema[T any](reg *Registry) processor.Decoder {
	return &jsonDecoder[T]{reg: reg}
}

type jsonDecoder[T any] struct {
	reg *Registry
}

// jsonSchemaKey is the key under which a Schema keeps its compiled JSON Schema.
type jsonSchemaKey struct{}

func (d *jsonDecoder[T]) Decode(ctx context.Context, data []byte) (any, error) {
	id, _, payload, err := header(data, false)
	if err != nil {
		return nil, err
	}
	s, err := d.reg.SchemaByID(ctx, id)
	if err != nil {
		return nil, err
	}
	if s.Type != sr.TypeJSON {
		return nil, wrongType(s, sr.TypeJSON)
	}
	c, err := s.parse(jsonSchemaKey{}, func() (any, error) { return d.reg.jsonSchema(ctx, s) })
	if err != nil {
		return nil, err
	}
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(payload))
	if err != nil {
		return nil, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("the bytes after the header are not JSON (schema id %d): %w", id, err)}
	}
	if err := c.(*jsonschema.Schema).Validate(inst); err != nil {
		return nil, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("the value does not validate against its JSON Schema (id %d): %s", id, oneLine(err.Error()))}
	}
	var v T
	if err := json.Unmarshal(payload, &v); err != nil {
		return nil, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("the value validates against schema id %d but does not unmarshal into %T: %w", id, v, err)}
	}
	return v, nil
}

// jsonSchema compiles s with the schemas it references (by the name its $refs use).
func (r *Registry) jsonSchema(ctx context.Context, s *Schema) (*jsonschema.Schema, error) {
	refs, err := r.references(ctx, s)
	if err != nil {
		return nil, err
	}
	c := jsonschema.NewCompiler()
	add := func(name, text string) error {
		doc, err := jsonschema.UnmarshalJSON(strings.NewReader(text))
		if err != nil {
			return err
		}
		return c.AddResource(name, doc)
	}
	for name, text := range refs {
		if err := add(name, text); err != nil {
			return nil, &processor.DecodeError{SchemaID: s.ID, Err: fmt.Errorf("schema id %d's reference %s is not a JSON Schema: %w", s.ID, name, err)}
		}
	}
	const main = "kafkapg-schema.json"
	if err := add(main, s.Schema.Schema); err != nil {
		return nil, &processor.DecodeError{SchemaID: s.ID, Err: fmt.Errorf("schema id %d is not JSON: %w", s.ID, err)}
	}
	sch, err := c.Compile(main)
	if err != nil {
		return nil, &processor.DecodeError{SchemaID: s.ID, Err: fmt.Errorf("schema id %d does not compile as a JSON Schema: %s", s.ID, oneLine(err.Error()))}
	}
	return sch, nil
}

// oneLine joins a multi-line message (jsonschema's are indented trees) into one line.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }
