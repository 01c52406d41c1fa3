package service

import (
	"context"
	"strings"
	"testing"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
)

// TestSchemaRegistryConfiguration: the registry's variables and the per-topic formats are
// checked at startup, each error naming the variable (or the handler's field) at fault, and a
// format without a registry is refused; what is valid becomes the topic's Decoders.
func TestSchemaRegistryConfiguration(t *testing.T) {
	emitted, err := schemaregistry.AvroEncoder(nil, "shipped-value", `{"type": "string"}`)
	if err != nil {
		t.Fatal(err)
	}
	hs, err := newRegistry(append(builtinHandlers, Handler{Name: "orders", Handler: ledger.Handler{},
		Values: schemaregistry.AvroFormat[map[string]any](`{"type": "record", "name": "Order", "fields": [{"name": "id", "type": "string"}]}`)},
		Handler{Name: "badschema", Handler: ledger.Handler{}, Values: schemaregistry.AvroFormat[map[string]any](`{"type": "recrod"}`)},
		Handler{Name: "emitter", Handler: ledger.Handler{}, Encoders: []*schemaregistry.Encoder{emitted}}))
	if err != nil {
		t.Fatal(err)
	}
	const url = "http://127.0.0.1:8081"
	for _, tc := range []struct {
		name string
		vars map[string]string
		want []string // all in the error; none: no error
	}{
		{"a format without a registry", with("TOPIC_ORDERS_VALUE_FORMAT", "avro"),
			[]string{`SCHEMA_REGISTRY_URL is required: topic "orders"'s values are avro (TOPIC_ORDERS_VALUE_FORMAT)`}},
		{"a handler's format without a registry", with("HANDLER", "orders"),
			[]string{`SCHEMA_REGISTRY_URL is required: topic "orders"'s values are avro into map[string]interface {} (service.Handler{Name: "orders"}.Values)`}},
		{"an unknown format", with("SCHEMA_REGISTRY_URL", url, "TOPIC_ORDERS_KEY_FORMAT", "avro4"),
			[]string{`TOPIC_ORDERS_KEY_FORMAT="avro4": "avro4" is not a format: want avro, protobuf or json-schema, or none`}},
		{"a reader schema that does not parse", with("SCHEMA_REGISTRY_URL", url, "HANDLER", "badschema"),
			[]string{`service.Handler{Name: "badschema"}.Values: schemaregistry: the reader schema does not parse as Avro`}},
		{"not a URL", with("SCHEMA_REGISTRY_URL", "registry:8081"),
			[]string{`SCHEMA_REGISTRY_URL: "registry:8081" is not an http or https URL`}},
		{"credentials in the URL", with("SCHEMA_REGISTRY_URL", "https://key:s3cret@registry:8081"),
			[]string{"SCHEMA_REGISTRY_URL: https://key:xxxxx@registry:8081 carries credentials in the URL"}},
		{"a password alone", with("SCHEMA_REGISTRY_URL", url, "SCHEMA_REGISTRY_PASSWORD", "s3cret"),
			[]string{"SCHEMA_REGISTRY_USERNAME and SCHEMA_REGISTRY_PASSWORD must be set together"}},
		{"both kinds of authentication", with("SCHEMA_REGISTRY_URL", url, "SCHEMA_REGISTRY_USERNAME", "u", "SCHEMA_REGISTRY_PASSWORD", "p", "SCHEMA_REGISTRY_BEARER_TOKEN", "t"),
			[]string{"SCHEMA_REGISTRY_BEARER_TOKEN and SCHEMA_REGISTRY_USERNAME are both set"}},
		{"credentials without a URL", with("SCHEMA_REGISTRY_USERNAME", "u"),
			[]string{"SCHEMA_REGISTRY_USERNAME is set but SCHEMA_REGISTRY_URL is not"}},
		{"a CA file that is not there", with("SCHEMA_REGISTRY_URL", "https://registry:8081", "SCHEMA_REGISTRY_TLS_CA_FILE", "/nonexistent/ca.pem"),
			[]string{"SCHEMA_REGISTRY_TLS_CA_FILE: open /nonexistent/ca.pem"}},
		{"a client certificate without its key", with("SCHEMA_REGISTRY_URL", "https://registry:8081", "SCHEMA_REGISTRY_TLS_CERT_FILE", "/tmp/c.pem"),
			[]string{"SCHEMA_REGISTRY_TLS_CERT_FILE and SCHEMA_REGISTRY_TLS_KEY_FILE must be set together"}},
		{"a handler's encoders without a registry", with("HANDLER", "emitter"),
			[]string{`SCHEMA_REGISTRY_URL is required: handler "emitter" emits with 1 Encoder(s) (service.Handler{Name: "emitter"}.Encoders)`}},
		{"a timeout of zero", with("SCHEMA_REGISTRY_URL", url, "SCHEMA_REGISTRY_TIMEOUT", "0s"),
			[]string{"SCHEMA_REGISTRY_TIMEOUT must be positive"}},
		{"valid: an env format and a handler's", with("SCHEMA_REGISTRY_URL", url+","+url, "HANDLER", "orders", "SCHEMA_REGISTRY_USERNAME", "u",
			"SCHEMA_REGISTRY_PASSWORD", "p", "TOPIC_ORDERS_KEY_FORMAT", "json-schema"), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			setEnv(t, tc.vars)
			e, err := loadEnv(hs)
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				tp, _ := e.topicPolicy(hs, "orders")
				if tp.Values == nil || tp.Keys == nil {
					t.Errorf("the topic's decoders: values %v, keys %v", tp.Values, tp.Keys)
				}
				cfg := e.processorConfig(hs, nil, nil)
				if p := cfg.TopicPolicies["orders"]; p.Values == nil || p.Keys == nil {
					t.Errorf("processor.Config's TopicPolicies: %+v", cfg.TopicPolicies)
				}
				shown := e.topicShown(hs, "orders")
				if shown.ValueFormat != "avro into map[string]interface {} (the Schema Registry's wire format)" || shown.From["value_format"] != `service.Handler{Name: "orders"}.Values` ||
					shown.KeyFormat != "json-schema (the Schema Registry's wire format)" || shown.From["key_format"] != "TOPIC_ORDERS_KEY_FORMAT" {
					t.Errorf("config shows %q from %q, keys %q from %q", shown.ValueFormat, shown.From["value_format"], shown.KeyFormat, shown.From["key_format"])
				}
				for _, v := range e.shown(hs).Variables {
					if v.Name == "SCHEMA_REGISTRY_PASSWORD" && v.Value != redacted {
						t.Errorf("config shows SCHEMA_REGISTRY_PASSWORD as %q", v.Value)
					}
				}
				return
			}
			if err == nil {
				t.Fatalf("no error; want %q", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "s3cret") {
				t.Errorf("the error shows a secret: %v", err)
			}
		})
	}
}

// TestHandlersEncodersAreBound: a handler's Encoders are bound at startup to the registry
// SCHEMA_REGISTRY_URL names: an Encode then asks it (here nobody listens: an outage), where an
// unbound one says it has no registry.
func TestHandlersEncodersAreBound(t *testing.T) {
	enc, err := schemaregistry.AvroEncoder(nil, "shipped-value", `{"type": "string"}`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := enc.Encode(context.Background(), "x"); err == nil || !strings.Contains(err.Error(), "has no registry") {
		t.Fatalf("unbound: %v", err)
	}
	hs, err := newRegistry(append(builtinHandlers, Handler{Name: "emitter", Handler: ledger.Handler{}, Encoders: []*schemaregistry.Encoder{enc}}))
	if err != nil {
		t.Fatal(err)
	}
	setEnv(t, with("HANDLER", "emitter", "SCHEMA_REGISTRY_URL", "http://127.0.0.1:1", "SCHEMA_REGISTRY_TIMEOUT", "1s"))
	if _, err := loadEnv(hs); err != nil {
		t.Fatal(err)
	}
	_, err = enc.Encode(context.Background(), "x")
	if processor.Classify(err) != processor.ClassInfrastructure || !strings.Contains(err.Error(), "look up the schema of subject shipped-value") {
		t.Errorf("bound, the registry down: %v (%v)", err, processor.Classify(err))
	}
}
