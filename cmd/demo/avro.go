package main

import (
	"context"
	"fmt"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/sr"

	"github.com/kafkapg/kafkapg/examples/ledger"
)

// avroEvents encodes the demo's events as a producer with the Schema Registry does: in Avro
// (ledger.EventAvroSchema, registered under subject), behind the wire format's magic byte and
// schema id.
type avroEvents struct {
	subject string
	id      int
	schema  avro.Schema
}

func newAvroEvents(ctx context.Context, url, subject string) (*avroEvents, error) {
	schema, err := avro.Parse(ledger.EventAvroSchema)
	if err != nil {
		return nil, err
	}
	cl, err := sr.NewClient(sr.URLs(url))
	if err != nil {
		return nil, fmt.Errorf("SCHEMA_REGISTRY_URL: %w", err)
	}
	ss, err := cl.CreateSchema(ctx, subject, sr.Schema{Schema: ledger.EventAvroSchema})
	if err != nil {
		return nil, fmt.Errorf("register the events' schema under %s at %s: %w", subject, url, err)
	}
	return &avroEvents{subject: subject, id: ss.ID, schema: schema}, nil
}

// encode returns an item's value in the wire format; a malformed item's bytes are left as they
// are (not in the wire format: dead-lettered, saying so).
func (e *avroEvents) encode(it ledger.Item) ([]byte, error) {
	if it.Kind == ledger.KindMalformed {
		return it.Value, nil
	}
	payload, err := avro.Marshal(e.schema, it.Event)
	if err != nil {
		return nil, fmt.Errorf("encode %s: %w", it.Event.EventID, err)
	}
	var h sr.ConfluentHeader
	b, err := h.AppendEncode(make([]byte, 0, 5+len(payload)), e.id, nil)
	if err != nil {
		return nil, err
	}
	return append(b, payload...), nil
}
