// Package schemaregistry decodes records written in the Confluent Schema Registry's wire format (a
// magic byte 0, a 4-byte schema id, for Protobuf the message's indexes, then the payload), for
// kafkapg handlers: Avro into a Go struct or a generic map, Protobuf into a generated message,
// JSON Schema into a Go value, validated. A topic's Decoder goes in processor.TopicPolicy.Values
// (and Keys); the handler reads processor.Record.Decoded.
//
// A schema is fetched from the registry by id the first time a record carries it, once however
// many records wait for it, and kept: a cached schema keeps working while the registry is down.
// What cannot be fetched because of the registry (unreachable, timing out, answering 5xx,
// refusing the credentials) is an outage, a *processor.DecodeError of class infrastructure: the
// record waits in place, dead-letters nothing and uses no attempt. What the record's bytes get
// wrong (no magic byte, a schema id the registry does not have, bytes that do not decode with
// their schema, a schema the handler's type cannot read) is permanent, and the dead letter's
// error says which.
package schemaregistry

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/sr"
	"golang.org/x/sync/singleflight"

	"github.com/kafkapg/kafkapg/processor"
)

// Config is how to reach the registry.
type Config struct {
	// URLs are the registry's base URLs (a Confluent Schema Registry's, or a compatible API's,
	// such as Apicurio's .../apis/ccompat/v7), tried in turn. Required.
	URLs []string
	// Username and Password, if set, authenticate with HTTP basic authentication.
	Username, Password string
	// BearerToken, if set, authenticates with a bearer token instead.
	BearerToken string
	// TLS configures the connections to https URLs; nil uses the system's roots.
	TLS *tls.Config
	// Timeout bounds each request. Defaults to 5s.
	Timeout time.Duration
}

// Registry fetches and keeps the schemas records carry, by id. Safe for concurrent use.
type Registry struct {
	cl      *sr.Client
	tr      *http.Transport
	timeout time.Duration

	fetches singleflight.Group // by id: one request however many records wait
	mu      sync.Mutex
	byID    map[int]*Schema
}

// New returns a Registry for cfg. It does not contact the registry.
func New(cfg Config) (*Registry, error) {
	if len(cfg.URLs) == 0 {
		return nil, errors.New("schemaregistry: no URLs")
	}
	if cfg.BearerToken != "" && (cfg.Username != "" || cfg.Password != "") {
		return nil, errors.New("schemaregistry: basic authentication and a bearer token are both set: choose one")
	}
	timeout := cfg.Timeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if cfg.TLS != nil {
		tr.TLSClientConfig = cfg.TLS
	}
	opts := []sr.ClientOpt{
		sr.URLs(cfg.URLs...),
		sr.HTTPClient(&http.Client{Transport: tr, Timeout: timeout}),
		sr.UserAgent("kafkapg"),
	}
	if cfg.Username != "" || cfg.Password != "" {
		opts = append(opts, sr.BasicAuth(cfg.Username, cfg.Password))
	}
	if cfg.BearerToken != "" {
		opts = append(opts, sr.BearerToken(cfg.BearerToken))
	}
	cl, err := sr.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("schemaregistry: %w", err)
	}
	return &Registry{cl: cl, tr: tr, timeout: timeout, byID: map[int]*Schema{}}, nil
}

// Close closes the Registry's idle connections to the registry. What it fetched stays; a later
// call connects again.
func (r *Registry) Close() { r.tr.CloseIdleConnections() }

// Client returns the franz-go client the Registry uses, to register schemas, say.
func (r *Registry) Client() *sr.Client { return r.cl }

// Schema is a schema as the registry has it under an id, with what decoders made of it.
type Schema struct {
	ID int
	sr.Schema

	mu     sync.Mutex
	parsed map[any]*parsed // by what parsed it (see Schema.parse)
}

type parsed struct {
	done chan struct{} // closed once v and err are set
	v    any
	err  error
}

// parse returns what fn makes of s, made once for each key (callers of a key being made wait for
// it; fn may parse s under another key); an outage's error (fetching a referenced schema) is not
// kept: the next record tries again.
func (s *Schema) parse(key any, fn func() (any, error)) (any, error) {
	s.mu.Lock()
	p, ok := s.parsed[key]
	if ok {
		s.mu.Unlock()
		<-p.done
		return p.v, p.err
	}
	if s.parsed == nil {
		s.parsed = map[any]*parsed{}
	}
	p = &parsed{done: make(chan struct{})}
	s.parsed[key] = p
	s.mu.Unlock()
	p.v, p.err = fn()
	var de *processor.DecodeError
	if errors.As(p.err, &de) && de.Infrastructure {
		s.mu.Lock()
		delete(s.parsed, key)
		s.mu.Unlock()
	}
	close(p.done)
	return p.v, p.err
}

// references returns the text of every schema s references, directly or not, by the name it is
// referenced with (an Avro named type, a Protobuf import path, a JSON Schema $ref), fetched from
// the registry by subject and version.
func (r *Registry) references(ctx context.Context, s *Schema) (map[string]string, error) {
	out := map[string]string{}
	var walk func(refs []sr.SchemaReference) error
	walk = func(refs []sr.SchemaReference) error {
		for _, ref := range refs {
			if _, ok := out[ref.Name]; ok {
				continue
			}
			fctx, cancel := context.WithTimeout(ctx, r.timeout)
			ss, err := r.cl.SchemaByVersion(fctx, ref.Subject, ref.Version)
			cancel()
			if err != nil {
				de := fetchError(s.ID, err)
				de.Err = fmt.Errorf("schema id %d references %s (subject %s, version %d): %w", s.ID, ref.Name, ref.Subject, ref.Version, de.Err)
				return de
			}
			out[ref.Name] = ss.Schema.Schema
			if err := walk(ss.References); err != nil {
				return err
			}
		}
		return nil
	}
	return out, walk(s.References)
}

// SchemaByID returns the schema with id: from what the Registry keeps, or fetched (once, however
// many callers ask for it at the same time). Its error is a *processor.DecodeError: an outage
// (infrastructure) or an id the registry does not have (permanent).
func (r *Registry) SchemaByID(ctx context.Context, id int) (*Schema, error) {
	r.mu.Lock()
	s, ok := r.byID[id]
	r.mu.Unlock()
	if ok {
		return s, nil
	}
	ch := r.fetches.DoChan(fmt.Sprint(id), func() (any, error) {
		r.mu.Lock()
		s, ok := r.byID[id] // fetched by a flight that ended since this caller looked
		r.mu.Unlock()
		if ok {
			return s, nil
		}
		// Not the first caller's context: its end must not fail the others waiting.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.timeout)
		defer cancel()
		sch, err := r.cl.SchemaByID(fctx, id)
		if err != nil {
			return nil, err
		}
		s = &Schema{ID: id, Schema: sch}
		r.mu.Lock()
		r.byID[id] = s
		r.mu.Unlock()
		return s, nil
	})
	select {
	case res := <-ch:
		if res.Err != nil {
			return nil, fetchError(id, res.Err)
		}
		return res.Val.(*Schema), nil
	case <-ctx.Done():
		return nil, &processor.DecodeError{Infrastructure: true, SchemaID: id, Err: fmt.Errorf("waiting for schema %d from the registry: %w", id, ctx.Err())}
	}
}

// fetchError classifies a failure to fetch schema id: the registry's answer that it has no such
// schema is the record's fault (permanent); anything else (no answer, a timeout, 5xx, 401/403, a
// 4xx other than not found) is the registry's or the deployment's, and passes by waiting or by
// fixing them: infrastructure.
func fetchError(id int, err error) *processor.DecodeError {
	var re *sr.ResponseError
	if errors.As(err, &re) {
		if re.StatusCode == http.StatusNotFound {
			return &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("schema id %d is not in the registry (%d, error code %d: %s)", id, re.StatusCode, re.ErrorCode, re.Message)}
		}
		return &processor.DecodeError{Infrastructure: true, SchemaID: id, Err: fmt.Errorf("the registry answered %d for schema id %d (error code %d: %s)", re.StatusCode, id, re.ErrorCode, re.Message)}
	}
	return &processor.DecodeError{Infrastructure: true, SchemaID: id, Err: fmt.Errorf("fetch schema id %d from the registry: %w", id, err)}
}

// header reads the wire format's header: the schema id and, for Protobuf (index), the message
// indexes; it returns them and the payload after them.
func header(data []byte, index bool) (id int, idx []int, payload []byte, err error) {
	if len(data) == 0 || data[0] != 0 {
		first := "none: the bytes are empty"
		if len(data) > 0 {
			first = fmt.Sprintf("0x%02x", data[0])
		}
		return 0, nil, nil, &processor.DecodeError{Err: fmt.Errorf("not in the Schema Registry's wire format: its first byte is %s, want 0 (the magic byte)", first)}
	}
	var h sr.ConfluentHeader
	id, payload, err = h.DecodeID(data)
	if err != nil {
		return 0, nil, nil, &processor.DecodeError{Err: fmt.Errorf("not in the Schema Registry's wire format: %w", err)}
	}
	if index {
		idx, payload, err = h.DecodeIndex(payload, 100)
		if err != nil {
			return 0, nil, nil, &processor.DecodeError{SchemaID: id, Err: fmt.Errorf("read the Protobuf message indexes: %w", err)}
		}
	}
	return id, idx, payload, nil
}

// kindOf names a schema's type as the registry does.
func kindOf(s *Schema) string {
	if s.Type == sr.TypeAvro {
		return "AVRO"
	}
	return s.Type.String()
}

// wrongType is the permanent error for a record whose schema is not of the decoder's type.
func wrongType(s *Schema, want sr.SchemaType) error {
	return &processor.DecodeError{SchemaID: s.ID, Err: fmt.Errorf("schema id %d is %s, and this topic's values are decoded as %s", s.ID, kindOf(s), want)}
}
