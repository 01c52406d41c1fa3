package schemaregistry_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"path"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/sr"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kafkapg/kafkapg/internal/rig/srproxy"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
)

// The tests run against a real registry (testenv.SchemaRegistry: Apicurio's Confluent-compatible
// API); an srproxy in front of it plays the network and the registry's outages.

func newRegistry(t *testing.T, urls ...string) *schemaregistry.Registry {
	t.Helper()
	r, err := schemaregistry.New(schemaregistry.Config{URLs: urls, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// register registers schema under the test's own subject (suffix tells its schemas apart) and
// returns its id.
func register(t *testing.T, r *schemaregistry.Registry, suffix string, s sr.Schema) int {
	t.Helper()
	ss, err := r.Client().CreateSchema(context.Background(), testenv.Name(t, 60)+"-"+suffix, s)
	if err != nil {
		t.Fatal(err)
	}
	return ss.ID
}

// wire is payload in the wire format under schema id (and, for Protobuf, message indexes).
func wire(t *testing.T, id int, index []int, payload []byte) []byte {
	t.Helper()
	var h sr.ConfluentHeader
	b, err := h.AppendEncode(nil, id, index)
	if err != nil {
		t.Fatal(err)
	}
	return append(b, payload...)
}

// decodeError returns err as a *processor.DecodeError, failing the test if it is none.
func decodeError(t *testing.T, err error) *processor.DecodeError {
	t.Helper()
	var de *processor.DecodeError
	if !errors.As(err, &de) {
		t.Fatalf("error %v (%T) is not a *processor.DecodeError", err, err)
	}
	return de
}

const orderV1 = `{"type": "record", "name": "Order", "namespace": "shop", "fields": [
	{"name": "id", "type": "string"},
	{"name": "amount", "type": "long"}]}`

// orderV2 adds a field with a default: a compatible evolution, both ways.
const orderV2 = `{"type": "record", "name": "Order", "namespace": "shop", "fields": [
	{"name": "id", "type": "string"},
	{"name": "amount", "type": "long"},
	{"name": "note", "type": "string", "default": "none"}]}`

// orderBad changes amount's type: v1's readers cannot read it.
const orderBad = `{"type": "record", "name": "Order", "namespace": "shop", "fields": [
	{"name": "id", "type": "string"},
	{"name": "amount", "type": "string"}]}`

type order struct {
	ID     string `avro:"id"`
	Amount int64  `avro:"amount"`
}

type orderWithNote struct {
	ID     string `avro:"id"`
	Amount int64  `avro:"amount"`
	Note   string `avro:"note"`
}

func avroWire(t *testing.T, id int, schema string, v any) []byte {
	t.Helper()
	b, err := avro.Marshal(avro.MustParse(schema), v)
	if err != nil {
		t.Fatal(err)
	}
	return wire(t, id, nil, b)
}

// TestAvroReadsEvolvedSchemas: a record written with the handler's schema, a newer one (a field
// added with a default) and an older one decode into the handler's type, by Avro's resolution
// rules; a writer schema the reader cannot read (a field's type changed) fails as permanent,
// naming the schema.
func TestAvroReadsEvolvedSchemas(t *testing.T) {
	ctx := context.Background()
	r := newRegistry(t, testenv.SchemaRegistry(t))
	v1 := register(t, r, "value", sr.Schema{Schema: orderV1})
	v2 := register(t, r, "value", sr.Schema{Schema: orderV2})
	bad := register(t, r, "bad", sr.Schema{Schema: orderBad})

	readV1, err := schemaregistry.Avro[order](r, orderV1)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		data []byte
	}{
		{"same schema", avroWire(t, v1, orderV1, order{"o-1", 42})},
		{"newer writer", avroWire(t, v2, orderV2, orderWithNote{"o-1", 42, "gift"})},
	} {
		got, err := readV1.Decode(ctx, tc.data)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got != (order{"o-1", 42}) {
			t.Errorf("%s: decoded %#v", tc.name, got)
		}
	}
	readV2, err := schemaregistry.Avro[orderWithNote](r, orderV2)
	if err != nil {
		t.Fatal(err)
	}
	got, err := readV2.Decode(ctx, avroWire(t, v1, orderV1, order{"o-2", 7}))
	if err != nil {
		t.Fatal(err)
	}
	if got != (orderWithNote{"o-2", 7, "none"}) {
		t.Errorf("older writer: decoded %#v, want the added field's default", got)
	}

	_, err = readV1.Decode(ctx, avroWire(t, bad, orderBad, map[string]any{"id": "o-3", "amount": "lots"}))
	de := decodeError(t, err)
	if de.Infrastructure || de.SchemaID != bad || !strings.Contains(err.Error(), "shop.Order") || !strings.Contains(err.Error(), "cannot be read as the handler's") {
		t.Errorf("incompatible writer: %v (infrastructure %v, schema id %d)", err, de.Infrastructure, de.SchemaID)
	}

	generic := schemaregistry.AvroGeneric(r)
	m, err := generic.Decode(ctx, avroWire(t, v2, orderV2, orderWithNote{"o-4", 1, "x"}))
	if err != nil {
		t.Fatal(err)
	}
	if mm, ok := m.(map[string]any); !ok || mm["id"] != "o-4" || mm["note"] != "x" {
		t.Errorf("generic: decoded %#v", m)
	}
}

// TestTheRecordsFaultsArePermanent: bytes not in the wire format, a schema id the registry does
// not have, bytes that do not decode with their schema, and a schema of another format each fail
// as permanent, saying which.
func TestTheRecordsFaultsArePermanent(t *testing.T) {
	ctx := context.Background()
	r := newRegistry(t, testenv.SchemaRegistry(t))
	v1 := register(t, r, "value", sr.Schema{Schema: orderV1})
	js := register(t, r, "json", sr.Schema{Schema: `{"type": "object", "properties": {"id": {"type": "string"}}}`, Type: sr.TypeJSON})
	dec, err := schemaregistry.Avro[order](r, orderV1)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, want string
		data       []byte
	}{
		{"plain JSON", "its first byte is 0x7b, want 0 (the magic byte)", []byte(`{"id": "o-1"}`)},
		{"empty", "its first byte is none: the bytes are empty", []byte{}},
		{"short header", "not in the Schema Registry's wire format", []byte{0, 0, 1}},
		{"unknown id", "schema id 2000000000 is not in the registry (404", wire(t, 2000000000, nil, []byte{2, 'x'})},
		{"truncated payload", "the bytes do not decode with their Avro schema", wire(t, v1, nil, []byte{8, 'o'})},
		{"JSON Schema id", "is JSON, and this topic's values are decoded as AVRO", wire(t, js, nil, []byte(`{}`))},
	} {
		_, err := dec.Decode(ctx, tc.data)
		if err == nil {
			t.Errorf("%s: decoded", tc.name)
			continue
		}
		if de := decodeError(t, err); de.Infrastructure || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v (infrastructure %v); want permanent, saying %q", tc.name, err, de.Infrastructure, tc.want)
		}
		if got := processor.Classify(err); got != processor.ClassPermanent {
			t.Errorf("%s: Classify = %v", tc.name, got)
		}
	}
}

// TestAHugeArrayCountIsPermanent: an Avro value whose array block header claims 2^40 elements
// (a few bytes: a corrupt or hostile record) is a permanent decode error, not a slice of 2^40
// longs made before the first element is read (the process's memory, at every try).
func TestAHugeArrayCountIsPermanent(t *testing.T) {
	ctx := context.Background()
	r := newRegistry(t, testenv.SchemaRegistry(t))
	const many = `{"type": "record", "name": "Many", "fields": [{"name": "items", "type": {"type": "array", "items": "long"}}]}`
	id := register(t, r, "many", sr.Schema{Schema: many})
	type manyT struct {
		Items []int64 `avro:"items"`
	}
	dec, err := schemaregistry.Avro[manyT](r, many)
	if err != nil {
		t.Fatal(err)
	}
	count := binary.AppendUvarint(nil, uint64(1)<<41) // zigzag of 2^40
	_, err = dec.Decode(ctx, wire(t, id, nil, append(count, 2, 0)))
	if err == nil || processor.Classify(err) != processor.ClassPermanent || !strings.Contains(err.Error(), "MaxSliceAllocSize") {
		t.Fatalf("an array claiming 2^40 elements: %v, want a permanent decode error", err)
	}
	ok := append(binary.AppendUvarint(nil, 4), 2, 4, 0) // two elements, 1 and 2, then the end
	if got, err := dec.Decode(ctx, wire(t, id, nil, ok)); err != nil || len(got.(manyT).Items) != 2 {
		t.Fatalf("two elements: %v, %v", got, err)
	}
}

// TestARegistryOutageIsAnOutage: a registry that answers 503 or 401, hangs past the timeout,
// hangs up, or is not there at all fails a record whose schema is not cached as infrastructure
// (it waits in place); a schema fetched before keeps decoding throughout.
func TestARegistryOutageIsAnOutage(t *testing.T) {
	ctx := context.Background()
	p := srproxy.New(t, testenv.SchemaRegistry(t))
	r := newRegistry(t, p.URL())
	v1 := register(t, r, "value", sr.Schema{Schema: orderV1})
	v2 := register(t, r, "value", sr.Schema{Schema: orderV2})
	dec, err := schemaregistry.Avro[order](r, orderV1)
	if err != nil {
		t.Fatal(err)
	}
	cached := avroWire(t, v1, orderV1, order{"o-1", 1})
	if _, err := dec.Decode(ctx, cached); err != nil {
		t.Fatal(err)
	}
	notCached := avroWire(t, v2, orderV2, orderWithNote{"o-2", 2, "n"})
	for _, tc := range []struct {
		mode srproxy.Mode
		want string
	}{
		{srproxy.Unavailable, "the registry answered 503"},
		{srproxy.Unauthorized, "the registry answered 401"},
		{srproxy.Hang, "fetch schema id"},
		{srproxy.HangUp, "fetch schema id"},
	} {
		p.Set(tc.mode)
		_, err := dec.Decode(ctx, notCached)
		if err == nil {
			t.Fatalf("mode %d: decoded a schema the registry could not give", tc.mode)
		}
		if de := decodeError(t, err); !de.Infrastructure || de.SchemaID != v2 || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("mode %d: %v (infrastructure %v, schema id %d); want infrastructure, saying %q", tc.mode, err, de.Infrastructure, de.SchemaID, tc.want)
		}
		if got := processor.Classify(err); got != processor.ClassInfrastructure {
			t.Errorf("mode %d: Classify = %v", tc.mode, got)
		}
		if v, err := dec.Decode(ctx, cached); err != nil || v != (order{"o-1", 1}) {
			t.Errorf("mode %d: the cached schema's record: %v, %v", tc.mode, v, err)
		}
	}

	// Nobody listening at all.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	gone := newRegistry(t, "http://"+addr+"/apis/ccompat/v7")
	dec2, err := schemaregistry.Avro[order](gone, orderV1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dec2.Decode(ctx, cached); err == nil || !decodeError(t, err).Infrastructure {
		t.Errorf("no registry: %v; want infrastructure", err)
	}

	// Back: the record decodes.
	p.Set(srproxy.Forward)
	if v, err := dec.Decode(ctx, notCached); err != nil || v != (order{"o-2", 2}) {
		t.Errorf("registry back: %v, %v", v, err)
	}
}

// TestASchemaIsFetchedOnce: records of a schema not yet fetched, decoded at once from many
// goroutines, cost the registry one request; later ones none.
func TestASchemaIsFetchedOnce(t *testing.T) {
	ctx := context.Background()
	p := srproxy.New(t, testenv.SchemaRegistry(t))
	r := newRegistry(t, p.URL())
	id := register(t, r, "value", sr.Schema{Schema: orderV1})
	dec, err := schemaregistry.Avro[order](r, orderV1)
	if err != nil {
		t.Fatal(err)
	}
	data := avroWire(t, id, orderV1, order{"o", 1})
	p.ResetSchemaRequests() // registering read the schema back
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := dec.Decode(ctx, data); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	for range 100 {
		if _, err := dec.Decode(ctx, data); err != nil {
			t.Fatal(err)
		}
	}
	if n := p.SchemaRequests(); n != 1 {
		t.Errorf("%d requests for schema %d, want 1", n, id)
	}
}

// timestampProto is google/protobuf/timestamp.proto's message as a producer would register it:
// the tests' generated message is timestamppb.Timestamp.
const timestampProto = `syntax = "proto3";
package google.protobuf;
message Timestamp {
  int64 seconds = 1;
  int32 nanos = 2;
}
message Other {
  string name = 1;
}`

// TestProtobufDecodesIntoTheGeneratedMessage: a record of the handler's message decodes into it;
// one of another message of the schema (its message indexes) fails as permanent, naming both.
func TestProtobufDecodesIntoTheGeneratedMessage(t *testing.T) {
	ctx := context.Background()
	r := newRegistry(t, testenv.SchemaRegistry(t))
	id := register(t, r, "value", sr.Schema{Schema: timestampProto, Type: sr.TypeProtobuf})
	dec := schemaregistry.Protobuf[*timestamppb.Timestamp](r)
	want := &timestamppb.Timestamp{Seconds: 1764900000, Nanos: 5}
	b, err := proto.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	got, err := dec.Decode(ctx, wire(t, id, []int{0}, b))
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(got.(*timestamppb.Timestamp), want) {
		t.Errorf("decoded %v, want %v", got, want)
	}
	_, err = dec.Decode(ctx, wire(t, id, []int{1}, []byte{10, 1, 'x'}))
	if de := decodeError(t, err); de.Infrastructure || !strings.Contains(err.Error(), "the record is a google.protobuf.Other") || !strings.Contains(err.Error(), "the handler reads google.protobuf.Timestamp") {
		t.Errorf("another message: %v", err)
	}
	_, err = dec.Decode(ctx, wire(t, id, []int{5}, b))
	if de := decodeError(t, err); de.Infrastructure || !strings.Contains(err.Error(), "name no message") {
		t.Errorf("indexes past the schema's messages: %v", err)
	}

	// Without a generated type (TOPIC_<topic>_VALUE_FORMAT=protobuf): a dynamic message of the
	// schema's, whatever message the record is.
	f, err := schemaregistry.FormatNamed("protobuf")
	if err != nil {
		t.Fatal(err)
	}
	generic, err := f.Decoder(r)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		index []int
		data  []byte
		want  string
	}{
		{[]int{0}, b, `"2025-12-05T02:00:00.000000005Z"`}, // protojson writes the well-known Timestamp so
		{[]int{1}, []byte{10, 1, 'x'}, `{"name":"x"}`},
	} {
		m, err := generic.Decode(ctx, wire(t, id, tc.index, tc.data))
		if err != nil {
			t.Fatal(err)
		}
		j, err := protojson.MarshalOptions{}.Marshal(m.(proto.Message))
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.ReplaceAll(string(j), " ", ""); got != tc.want {
			t.Errorf("generic, indexes %v: %s, want %s", tc.index, got, tc.want)
		}
	}
}

type payment struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount"`
}

// TestJSONSchemaValidates: a record that validates against its schema decodes into the handler's
// type; one that does not fails as permanent, saying where.
func TestJSONSchemaValidates(t *testing.T) {
	ctx := context.Background()
	r := newRegistry(t, testenv.SchemaRegistry(t))
	id := register(t, r, "value", sr.Schema{Type: sr.TypeJSON, Schema: `{"type": "object",
		"properties": {"id": {"type": "string"}, "amount": {"type": "integer", "minimum": 0}},
		"required": ["id", "amount"]}`})
	dec := schemaregistry.JSONSchema[payment](r)
	got, err := dec.Decode(ctx, wire(t, id, nil, []byte(`{"id": "p-1", "amount": 5}`)))
	if err != nil {
		t.Fatal(err)
	}
	if got != (payment{"p-1", 5}) {
		t.Errorf("decoded %#v", got)
	}
	for _, tc := range []struct{ data, want string }{
		{`{"id": "p-2"}`, "missing property 'amount'"},
		{`{"id": "p-3", "amount": -1}`, "minimum"},
		{`{"id": `, "are not JSON"},
	} {
		_, err := dec.Decode(ctx, wire(t, id, nil, []byte(tc.data)))
		if err == nil {
			t.Errorf("%s: decoded", tc.data)
			continue
		}
		if de := decodeError(t, err); de.Infrastructure || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want permanent, saying %q", tc.data, err, tc.want)
		}
	}
}

// TestRenderForOperators: a record of each format renders as indented JSON with what it is
// (type, schema id, subject and version, Protobuf's message); bytes not in the wire format and
// an unknown schema id say why not.
func TestRenderForOperators(t *testing.T) {
	ctx := context.Background()
	r := newRegistry(t, testenv.SchemaRegistry(t))
	// Schemas of this test's own: the registry gives the same content the same id, whatever the
	// subject, and lists every subject it is under.
	renderOrder := strings.Replace(orderV2, `"namespace": "shop"`, `"namespace": "render"`, 1)
	av := register(t, r, "avro", sr.Schema{Schema: renderOrder})
	pb := register(t, r, "proto", sr.Schema{Schema: strings.Replace(timestampProto, "package google.protobuf;", "package render;", 1), Type: sr.TypeProtobuf})
	js := register(t, r, "json", sr.Schema{Type: sr.TypeJSON, Schema: `{"title": "render", "type": "object", "properties": {"id": {"type": "string"}}}`})
	for _, tc := range []struct {
		name     string
		data     []byte
		describe string
		json     string
	}{
		{"avro", avroWire(t, av, renderOrder, orderWithNote{"o-1", 42, "gift"}), fmt.Sprintf("AVRO, schema id %d (testrenderforoperators_*-avro v1)", av),
			"{\n  \"id\": \"o-1\",\n  \"amount\": 42,\n  \"note\": \"gift\"\n}"}, // the schema's order
		{"protobuf", wire(t, pb, []int{1}, []byte{10, 1, 'x'}), fmt.Sprintf("PROTOBUF, schema id %d, message render.Other (testrenderforoperators_*-proto v1)", pb),
			"{\n  \"name\": \"x\"\n}"},
		{"json", wire(t, js, nil, []byte(`{"id":"p-1"}`)), fmt.Sprintf("JSON, schema id %d (testrenderforoperators_*-json v1)", js),
			"{\n  \"id\": \"p-1\"\n}"},
	} {
		got, err := r.Render(ctx, tc.data)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		// The subject's name ends in a suffix of the run's own (testenv.Name).
		if ok, _ := path.Match(tc.describe, got.Describe()); !ok || got.JSON != tc.json {
			t.Errorf("%s: %q\n%s\nwant %q\n%s", tc.name, got.Describe(), got.JSON, tc.describe, tc.json)
		}
	}
	if _, err := r.Render(ctx, []byte(`{"id": 1}`)); !errors.Is(err, schemaregistry.ErrNotWireFormat) {
		t.Errorf("plain JSON: %v", err)
	}
	if _, err := r.Render(ctx, wire(t, 2000000000, nil, []byte{1})); err == nil || !strings.Contains(err.Error(), "is not in the registry") {
		t.Errorf("unknown id: %v", err)
	}
}

// TestEncodersWriteWhatDecodersRead: an event encoded for Emit with each format's Encoder (the
// schema registered on the first Encode with AutoRegister) decodes with the same format's
// Decoder; the schema's id is looked up once.
func TestEncodersWriteWhatDecodersRead(t *testing.T) {
	ctx := context.Background()
	p := srproxy.New(t, testenv.SchemaRegistry(t))
	r := newRegistry(t, p.URL())
	subject := testenv.Name(t, 50)

	ae, err := schemaregistry.AvroEncoder(r, schemaregistry.TopicSubject(subject+".avro", false), orderV1, schemaregistry.AutoRegister())
	if err != nil {
		t.Fatal(err)
	}
	b, err := ae.Encode(ctx, order{"o-1", 10})
	if err != nil {
		t.Fatal(err)
	}
	p.ResetSchemaRequests()
	for range 20 {
		if _, err := ae.Encode(ctx, order{"o-1", 10}); err != nil {
			t.Fatal(err)
		}
	}
	ad, err := schemaregistry.Avro[order](r, orderV1)
	if err != nil {
		t.Fatal(err)
	}
	if v, err := ad.Decode(ctx, b); err != nil || v != (order{"o-1", 10}) {
		t.Errorf("avro: %v, %v", v, err)
	}
	if n := p.SchemaRequests(); n != 1 { // the decoder's fetch; the encoder asked nothing more
		t.Errorf("%d requests for schemas after the first encode, want the decoder's 1", n)
	}

	pe := schemaregistry.ProtobufEncoder[*timestamppb.Timestamp](r, schemaregistry.TopicSubject(subject+".proto", false), timestampProto, schemaregistry.AutoRegister())
	want := &timestamppb.Timestamp{Seconds: 5, Nanos: 6}
	b, err = pe.Encode(ctx, want)
	if err != nil {
		t.Fatal(err)
	}
	if v, err := schemaregistry.Protobuf[*timestamppb.Timestamp](r).Decode(ctx, b); err != nil || !proto.Equal(v.(*timestamppb.Timestamp), want) {
		t.Errorf("protobuf: %v, %v", v, err)
	}

	je := schemaregistry.JSONSchemaEncoder(r, schemaregistry.TopicSubject(subject+".json", false), `{"type": "object", "title": "encoders",
		"properties": {"id": {"type": "string"}, "amount": {"type": "integer"}}, "required": ["id", "amount"]}`, schemaregistry.AutoRegister())
	b, err = je.Encode(ctx, payment{"p-1", 3})
	if err != nil {
		t.Fatal(err)
	}
	if v, err := schemaregistry.JSONSchema[payment](r).Decode(ctx, b); err != nil || v != (payment{"p-1", 3}) {
		t.Errorf("json schema: %v, %v", v, err)
	}
}

// TestAnEncodersOutageIsAnOutage: an Encoder that cannot learn its schema's id (the registry
// unreachable or answering 503, or the schema not registered without AutoRegister) fails as
// infrastructure, so that the emitting record waits in place; once known, the id keeps working
// through an outage.
func TestAnEncodersOutageIsAnOutage(t *testing.T) {
	ctx := context.Background()
	p := srproxy.New(t, testenv.SchemaRegistry(t))
	r := newRegistry(t, p.URL())
	subject := testenv.Name(t, 50) + "-value"

	unregistered, err := schemaregistry.AvroEncoder(r, subject, orderV1)
	if err != nil {
		t.Fatal(err)
	}
	_, err = unregistered.Encode(ctx, order{"o", 1})
	if processor.Classify(err) != processor.ClassInfrastructure || !strings.Contains(err.Error(), "not registered under subject "+subject) {
		t.Errorf("an unregistered schema: %v (%v)", err, processor.Classify(err))
	}

	enc, err := schemaregistry.AvroEncoder(r, subject, orderV1, schemaregistry.AutoRegister())
	if err != nil {
		t.Fatal(err)
	}
	p.Set(srproxy.Unavailable)
	if _, err := enc.Encode(ctx, order{"o", 1}); processor.Classify(err) != processor.ClassInfrastructure || !strings.Contains(err.Error(), "503") {
		t.Errorf("the registry answering 503: %v (%v)", err, processor.Classify(err))
	}
	p.Set(srproxy.Forward)
	if _, err := enc.Encode(ctx, order{"o", 1}); err != nil {
		t.Fatal(err)
	}
	p.Set(srproxy.HangUp)
	if _, err := enc.Encode(ctx, order{"o", 2}); err != nil {
		t.Errorf("the id known, the registry down: %v", err)
	}
	p.Set(srproxy.Forward)
	// And the unregistered encoder, the schema registered meanwhile (by the other), now works.
	if _, err := unregistered.Encode(ctx, order{"o", 3}); err != nil {
		t.Errorf("the schema registered since: %v", err)
	}
}
