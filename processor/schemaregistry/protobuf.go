package schemaregistry

import (
	"context"
	"fmt"

	"github.com/bufbuild/protocompile"
	"github.com/twmb/franz-go/pkg/sr"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/kafkapg/kafkapg/processor"
)

// Protobuf returns a Decoder of Protobuf records into a new M, a generated message
// (*orders.Order, say). The message a record carries (named by its message indexes in its
// writer schema) must be M's: a record of another message fails as permanent, naming both.
// Protobuf's own rules read older and newer versions of the message (fields are matched by
// number). Decode returns an M.
func Protobuf[M proto.Message](reg *Registry) processor.Decoder {
	var zero M
	return &protoDecoder[M]{reg: reg, want: zero.ProtoReflect().Descriptor().FullName()}
}

type protoDecoder[M proto.Message] struct {
	reg  *Registry
	want protoreflect.FullName
}

// protoFileKey is the key under which a Schema keeps its compiled Protobuf file.
type protoFileKey struct{}

func (d *protoDecoder[M]) Decode(ctx context.Context, data []byte) (any, error) {
	id, idx, payload, err := header(data, true)
	if err != nil {
		return nil, err
	}
	s, err := d.reg.SchemaByID(ctx, id)
	if err != nil {
		return nil, err
	}
	md, err := d.reg.protoMessage(ctx, s, idx)
	if err != nil {
		return nil, err
	}
	if md.FullName() != d.want {
		return nil, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("the record is a %s (schema id %d), and the handler reads %s", md.FullName(), id, d.want)}
	}
	var zero M
	m := zero.ProtoReflect().New().Interface().(M)
	if err := proto.Unmarshal(payload, m); err != nil {
		return nil, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("the bytes do not decode as %s (schema id %d): %w", d.want, id, err)}
	}
	return m, nil
}

// protoMessage returns the descriptor of the message that idx (the record's message indexes)
// names in s, a Protobuf schema, compiled with the schemas it imports.
func (r *Registry) protoMessage(ctx context.Context, s *Schema, idx []int) (protoreflect.MessageDescriptor, error) {
	if s.Type != sr.TypeProtobuf {
		return nil, wrongType(s, sr.TypeProtobuf)
	}
	f, err := s.parse(protoFileKey{}, func() (any, error) { return r.protoFile(ctx, s) })
	if err != nil {
		return nil, err
	}
	fd := f.(protoreflect.FileDescriptor)
	if len(idx) == 0 {
		idx = []int{0} // the wire format's shorthand for the first message
	}
	msgs := fd.Messages()
	var md protoreflect.MessageDescriptor
	for _, i := range idx {
		if i < 0 || i >= msgs.Len() {
			return nil, &processor.DecodeError{SchemaID: s.ID, Err: fmt.Errorf("the record's message indexes %v name no message of schema id %d", idx, s.ID)}
		}
		md = msgs.Get(i)
		msgs = md.Messages()
	}
	return md, nil
}

// protoFile compiles s with the files it imports (its references, by import path), and the
// well-known types.
func (r *Registry) protoFile(ctx context.Context, s *Schema) (protoreflect.FileDescriptor, error) {
	srcs, err := r.references(ctx, s)
	if err != nil {
		return nil, err
	}
	const main = "kafkapg-schema.proto"
	srcs[main] = s.Schema.Schema
	c := protocompile.Compiler{Resolver: protocompile.WithStandardImports(&protocompile.SourceResolver{Accessor: protocompile.SourceAccessorFromMap(srcs)})}
	files, err := c.Compile(ctx, main)
	if err != nil {
		return nil, &processor.DecodeError{SchemaID: s.ID, Err: fmt.Errorf("schema id %d does not compile as Protobuf: %w", s.ID, err)}
	}
	return files[0], nil
}

// ProtobufGeneric returns a Decoder of Protobuf records without a generated type: each decodes
// into a *dynamicpb.Message of the message its schema and indexes name (read it with
// protoreflect, or render it with protojson).
func ProtobufGeneric(reg *Registry) processor.Decoder {
	return &protoGeneric{reg: reg}
}

// ProtobufGenericFormat is ProtobufGeneric's Format: TOPIC_<topic>_VALUE_FORMAT=protobuf.
func ProtobufGenericFormat() Format {
	return format{"protobuf", func(r *Registry) (processor.Decoder, error) { return ProtobufGeneric(r), nil }}
}

type protoGeneric struct {
	reg *Registry
}

func (d *protoGeneric) Decode(ctx context.Context, data []byte) (any, error) {
	id, idx, payload, err := header(data, true)
	if err != nil {
		return nil, err
	}
	s, err := d.reg.SchemaByID(ctx, id)
	if err != nil {
		return nil, err
	}
	md, err := d.reg.protoMessage(ctx, s, idx)
	if err != nil {
		return nil, err
	}
	m := dynamicpb.NewMessage(md)
	if err := proto.Unmarshal(payload, m); err != nil {
		return nil, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("the bytes do not decode as %s (schema id %d): %w", md.FullName(), id, err)}
	}
	return m, nil
}
