package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/sr"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/faultproxy"
)

// -schema-registry runs the ledger on Avro events in the Schema Registry's wire format
// (HANDLER=ledger-avro), against the real registry at SCHEMA_REGISTRY_URL (`make
// chaos-registry` starts one), which the processors reach through a proxy of the suite's. The
// producer registers a new version of the events' schema (a field added, with a default) every
// fifth of the events, so that the processors meet schema ids they have not fetched all through
// the run, and not only at their start; the fault registry-cut takes the registry away (refused
// or stalled) for 1-3 s meanwhile. The check is the ledger's: every event applied exactly once in
// per-account order, every dead letter the one expected (poison, outlasting the tiers, malformed:
// bytes not in the wire format) and no other — an outage dead-letters nothing.

// schemaRegistry is the registry side of a run.
type schemaRegistry struct {
	url     string            // the registry's, for the producer
	proxy   *faultproxy.Proxy // the processors' way to it
	procURL string            // SCHEMA_REGISTRY_URL for the processors: through the proxy
	cl      *sr.Client        // the producer's
	subject string            // the events' subject
	ids     []int             // the schema versions' ids, in order
	schemas []avro.Schema     // their schemas
	extra   [][]string        // each version's added fields
	cuts    int               // registry-cut faults
}

func (s *suite) setupRegistry() error {
	u := os.Getenv("SCHEMA_REGISTRY_URL")
	if u == "" {
		return fmt.Errorf("-schema-registry needs SCHEMA_REGISTRY_URL (make chaos-registry starts a registry)")
	}
	parsed, err := url.Parse(u)
	if err != nil {
		return fmt.Errorf("SCHEMA_REGISTRY_URL: %w", err)
	}
	p, err := faultproxy.Listen("127.0.0.1:0", parsed.Host)
	if err != nil {
		return err
	}
	cl, err := sr.NewClient(sr.URLs(u))
	if err != nil {
		return err
	}
	s.registry = &schemaRegistry{url: u, proxy: p, procURL: "http://" + p.Addr() + parsed.Path, cl: cl, subject: s.topic + "-value"}
	return s.registry.newVersion(context.Background())
}

// newVersion registers the next version of the events' schema: the first is
// ledger.EventAvroSchema, each next one adds a string field with a default.
func (r *schemaRegistry) newVersion(ctx context.Context) error {
	n := len(r.ids)
	var added []string
	if n > 0 {
		added = append(append([]string{}, r.extra[n-1]...), fmt.Sprintf("note_v%d", n+1))
	}
	var doc map[string]any
	if err := json.Unmarshal([]byte(ledger.EventAvroSchema), &doc); err != nil {
		return err
	}
	fields := doc["fields"].([]any)
	for _, f := range added {
		fields = append(fields, map[string]any{"name": f, "type": "string", "default": ""})
	}
	doc["fields"] = fields
	b, err := json.Marshal(doc)
	if err != nil {
		return err
	}
	text := string(b)
	schema, err := avro.ParseWithCache(text, "", &avro.SchemaCache{})
	if err != nil {
		return fmt.Errorf("schema version %d: %w", n+1, err)
	}
	ss, err := r.cl.CreateSchema(ctx, r.subject, sr.Schema{Schema: text})
	if err != nil {
		return fmt.Errorf("register schema version %d under %s: %w", n+1, r.subject, err)
	}
	r.ids, r.schemas, r.extra = append(r.ids, ss.ID), append(r.schemas, schema), append(r.extra, added)
	return nil
}

// encode returns an item's value in the wire format with the latest schema version; a malformed
// item's bytes are left as they are (not in the wire format: dead-lettered, as expected).
func (r *schemaRegistry) encode(it ledger.Item) ([]byte, error) {
	if it.Kind == ledger.KindMalformed {
		return it.Value, nil
	}
	ev := map[string]any{"event_id": it.Event.EventID, "account": it.Event.Account, "amount": it.Event.Amount, "seq": it.Event.Seq,
		"fail_attempts": it.Event.FailAttempts, "poison": it.Event.Poison, "mistake": it.Event.Mistake, "pad": it.Event.Pad}
	n := len(r.ids) - 1
	for _, f := range r.extra[n] {
		ev[f] = "added in a later version"
	}
	payload, err := avro.Marshal(r.schemas[n], ev)
	if err != nil {
		return nil, fmt.Errorf("encode %s: %w", it.Event.EventID, err)
	}
	var h sr.ConfluentHeader
	b, err := h.AppendEncode(make([]byte, 0, 5+len(payload)), r.ids[n], nil)
	if err != nil {
		return nil, err
	}
	return append(b, payload...), nil
}

// registryCut takes the registry away from the processors for 1-3 s: half the time refused,
// half the time stalled (connections open, no answer: their requests time out).
func (s *suite) registryCut(ctx context.Context) error {
	s.count(func(*stats) { s.registry.cuts++ })
	p := s.registry.proxy
	if s.rng.IntN(2) == 0 {
		return s.outage(ctx, p.Cut, p.Restore)
	}
	return s.outage(ctx, p.Stall, p.Restore)
}

func (r *schemaRegistry) describe() string {
	return fmt.Sprintf("schema registry: %d versions of the events' Avro schema registered during the run (ids %v), %d registry-cut faults", len(r.ids), r.ids, r.cuts)
}
