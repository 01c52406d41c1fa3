package schemaregistry

import (
	"fmt"
	"reflect"

	"google.golang.org/protobuf/proto"

	"github.com/kafkapg/kafkapg/processor"
)

// A Format is how a topic's values (or keys) are decoded, before there is a Registry to decode
// them with: what a service's handler declares (service.Handler's Values and Keys), or
// TOPIC_<topic>_VALUE_FORMAT names, and the service binds to the registry SCHEMA_REGISTRY_URL
// names. String names it, for `config` and the startup log.
type Format interface {
	Decoder(*Registry) (processor.Decoder, error)
	String() string
}

type format struct {
	name string
	dec  func(*Registry) (processor.Decoder, error)
}

func (f format) Decoder(r *Registry) (processor.Decoder, error) { return f.dec(r) }
func (f format) String() string                                 { return f.name }

// AvroFormat is Avro's Format: records decoded into a T with readerSchema (see Avro).
func AvroFormat[T any](readerSchema string) Format {
	return format{fmt.Sprintf("avro into %s", typeName[T]()), func(r *Registry) (processor.Decoder, error) { return Avro[T](r, readerSchema) }}
}

// AvroGenericFormat is Avro's Format without a Go type (see AvroGeneric): TOPIC_<topic>_VALUE_FORMAT=avro.
func AvroGenericFormat() Format {
	return format{"avro", func(r *Registry) (processor.Decoder, error) { return AvroGeneric(r), nil }}
}

// ProtobufFormat is Protobuf's Format: records decoded into a generated M (see Protobuf).
func ProtobufFormat[M proto.Message]() Format {
	return format{fmt.Sprintf("protobuf into %s", typeName[M]()), func(r *Registry) (processor.Decoder, error) { return Protobuf[M](r), nil }}
}

// JSONSchemaFormat is JSON Schema's Format: records validated, then decoded into a T (see
// JSONSchema). JSONSchemaFormat[any]() is TOPIC_<topic>_VALUE_FORMAT=json-schema.
func JSONSchemaFormat[T any]() Format {
	name := "json-schema"
	if typeName[T]() != "interface {}" {
		name += " into " + typeName[T]()
	}
	return format{name, func(r *Registry) (processor.Decoder, error) { return JSONSchema[T](r), nil }}
}

// FormatNamed returns the Format a TOPIC_<topic>_VALUE_FORMAT (or _KEY_FORMAT) value names,
// decoding without a Go type of the handler's: avro, protobuf or json-schema.
func FormatNamed(name string) (Format, error) {
	switch name {
	case "avro":
		return AvroGenericFormat(), nil
	case "protobuf":
		return ProtobufGenericFormat(), nil
	case "json-schema":
		return JSONSchemaFormat[any](), nil
	}
	return nil, fmt.Errorf("%q is not a format: want avro, protobuf or json-schema", name)
}

func typeName[T any]() string {
	return reflect.TypeFor[T]().String()
}
