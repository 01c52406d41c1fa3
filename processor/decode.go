package processor

import (
	"context"
	"errors"
	"fmt"
)

// A Decoder turns the bytes of a topic's record values (TopicPolicy.Values) or keys
// (TopicPolicy.Keys) into what its handler reads: Record.Decoded, Record.DecodedKey. Package
// registry has the decoders of the Schema Registry's formats (Avro, Protobuf, JSON Schema).
//
// A record is decoded before its Handle, where a Preparer's Prepare runs (and before it): outside
// the transaction when the topic's Concurrency is above 1, just before Handle otherwise, and again
// at each attempt. A null value (a tombstone) or a null key is not decoded: Decoded (DecodedKey)
// stays nil.
//
// Its errors fail the record as Handle's would; a *DecodeError has a class no ErrorClassifier
// changes, so that an unreachable registry waits in place and bytes that cannot be decoded go to
// the dead-letter topic, whatever the handler says.
type Decoder interface {
	Decode(ctx context.Context, data []byte) (any, error)
}

// DecodeError is a Decoder's failure, its class fixed: infrastructure when waiting fixes it (the
// registry unreachable, timing out, answering 5xx or refusing the credentials): the record waits
// in place, is never dead-lettered and uses no attempt; permanent when the bytes are at fault (not
// in the wire format, a schema id the registry does not have, bytes that do not decode with their
// schema, a schema the handler's type cannot read): dead-lettered at once, with this error.
type DecodeError struct {
	// Key: the record's key failed to decode, not its value.
	Key bool
	// Infrastructure: the class is ClassInfrastructure; ClassPermanent otherwise.
	Infrastructure bool
	// SchemaID is the schema id the bytes carry; 0 if none was read.
	SchemaID int
	Err      error
}

func (e *DecodeError) Error() string {
	what := "value"
	if e.Key {
		what = "key"
	}
	if e.SchemaID != 0 {
		return fmt.Sprintf("decode the record's %s (schema id %d): %v", what, e.SchemaID, e.Err)
	}
	return fmt.Sprintf("decode the record's %s: %v", what, e.Err)
}

func (e *DecodeError) Unwrap() error { return e.Err }

// class is the error's class.
func (e *DecodeError) class() ErrorClass {
	if e.Infrastructure {
		return ClassInfrastructure
	}
	return ClassPermanent
}

// decodingPreparer decodes a record's key and value with its topic's Decoders, then runs the
// handler's own Prepare, if it has one: the policy's preparer when the topic has a Decoder.
type decodingPreparer struct {
	values, keys Decoder
	next         Preparer // the handler's, or nil
}

func (d decodingPreparer) Prepare(ctx context.Context, rec *Record) error {
	rec.Decoded, rec.DecodedKey = nil, nil
	if d.keys != nil && rec.Key != nil {
		v, err := d.keys.Decode(ctx, rec.Key)
		if err != nil {
			return keyError(err)
		}
		rec.DecodedKey = v
	}
	if d.values != nil && rec.Value != nil {
		v, err := d.values.Decode(ctx, rec.Value)
		if err != nil {
			return err
		}
		rec.Decoded = v
	}
	if d.next != nil {
		return d.next.Prepare(ctx, rec)
	}
	return nil
}

// keyError marks a key Decoder's *DecodeError as the key's.
func keyError(err error) error {
	var de *DecodeError
	if errors.As(err, &de) && !de.Key {
		c := *de
		c.Key = true
		return &c
	}
	return err
}

// DecodedAs returns rec's decoded value (Record.Decoded) as a T, or an error that says what it
// is instead: the topic has no Decoder for its values, or one that decodes to another type.
// A tombstone (a null value) has none.
func DecodedAs[T any](rec *Record) (T, error) {
	v, ok := rec.Decoded.(T)
	if !ok {
		var zero T
		if rec.Decoded == nil {
			return zero, fmt.Errorf("record %s[%d]@%d has no decoded value (a null value, or no Decoder for its topic's values: TopicPolicy.Values)", rec.Topic, rec.Partition, rec.Offset)
		}
		return zero, fmt.Errorf("record %s[%d]@%d's decoded value is a %T, not a %T", rec.Topic, rec.Partition, rec.Offset, rec.Decoded, zero)
	}
	return v, nil
}
