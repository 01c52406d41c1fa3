package service

import (
	"cmp"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
)

// schemaRegistryEnv is how the service reaches a Schema Registry (a Confluent Schema Registry or
// a compatible API), for the topics whose values or keys are decoded with it: TOPIC_<topic>_
// VALUE_FORMAT and _KEY_FORMAT, or a handler's Values and Keys.
type schemaRegistryEnv struct {
	URL         string        `envconfig:"SCHEMA_REGISTRY_URL"`
	Username    string        `envconfig:"SCHEMA_REGISTRY_USERNAME"`
	Password    string        `envconfig:"SCHEMA_REGISTRY_PASSWORD"`
	BearerToken string        `envconfig:"SCHEMA_REGISTRY_BEARER_TOKEN"`
	TLSCAFile   string        `envconfig:"SCHEMA_REGISTRY_TLS_CA_FILE"`
	TLSCertFile string        `envconfig:"SCHEMA_REGISTRY_TLS_CERT_FILE"`
	TLSKeyFile  string        `envconfig:"SCHEMA_REGISTRY_TLS_KEY_FILE"`
	Timeout     time.Duration `envconfig:"SCHEMA_REGISTRY_TIMEOUT" default:"5s"`
}

// registry returns the Registry the variables describe, or nil without SCHEMA_REGISTRY_URL.
// Errors name the variable at fault and never contain a secret.
func (e *schemaRegistryEnv) registry() (*schemaregistry.Registry, error) {
	var errs []error
	var urls []string
	for _, u := range strings.Split(e.URL, ",") {
		u = strings.TrimSpace(u)
		if u == "" {
			continue
		}
		p, err := url.Parse(u)
		if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
			errs = append(errs, fmt.Errorf("SCHEMA_REGISTRY_URL: %q is not an http or https URL (a registry's base URL: https://registry:8081, or Apicurio's .../apis/ccompat/v7)", u))
			continue
		}
		if p.User != nil {
			errs = append(errs, fmt.Errorf("SCHEMA_REGISTRY_URL: %s carries credentials in the URL: set SCHEMA_REGISTRY_USERNAME and SCHEMA_REGISTRY_PASSWORD instead (a URL is logged, a password is not)", p.Redacted()))
			continue
		}
		urls = append(urls, u)
	}
	if len(urls) == 0 {
		for _, v := range []struct{ name, value string }{
			{"SCHEMA_REGISTRY_USERNAME", e.Username}, {"SCHEMA_REGISTRY_PASSWORD", e.Password}, {"SCHEMA_REGISTRY_BEARER_TOKEN", e.BearerToken},
			{"SCHEMA_REGISTRY_TLS_CA_FILE", e.TLSCAFile}, {"SCHEMA_REGISTRY_TLS_CERT_FILE", e.TLSCertFile}, {"SCHEMA_REGISTRY_TLS_KEY_FILE", e.TLSKeyFile},
		} {
			if v.value != "" && len(errs) == 0 {
				errs = append(errs, fmt.Errorf("%s is set but SCHEMA_REGISTRY_URL is not: set the registry's URL", v.name))
			}
		}
		return nil, errors.Join(errs...)
	}
	if (e.Username == "") != (e.Password == "") {
		errs = append(errs, errors.New("SCHEMA_REGISTRY_USERNAME and SCHEMA_REGISTRY_PASSWORD must be set together (basic authentication)"))
	}
	if e.BearerToken != "" && e.Username != "" {
		errs = append(errs, errors.New("SCHEMA_REGISTRY_BEARER_TOKEN and SCHEMA_REGISTRY_USERNAME are both set: choose basic authentication or a bearer token"))
	}
	if e.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("SCHEMA_REGISTRY_TIMEOUT must be positive, got %v", e.Timeout))
	}
	var tlsCfg *tls.Config
	if e.TLSCAFile != "" || e.TLSCertFile != "" || e.TLSKeyFile != "" {
		tlsCfg = &tls.Config{MinVersion: tls.VersionTLS12}
		if e.TLSCAFile != "" {
			pem, err := os.ReadFile(e.TLSCAFile)
			if err != nil {
				errs = append(errs, fmt.Errorf("SCHEMA_REGISTRY_TLS_CA_FILE: %w", err))
			} else {
				tlsCfg.RootCAs = x509.NewCertPool()
				if !tlsCfg.RootCAs.AppendCertsFromPEM(pem) {
					errs = append(errs, fmt.Errorf("SCHEMA_REGISTRY_TLS_CA_FILE=%q holds no PEM certificate", e.TLSCAFile))
				}
			}
		}
		switch {
		case e.TLSCertFile != "" && e.TLSKeyFile != "":
			cert, err := tls.LoadX509KeyPair(e.TLSCertFile, e.TLSKeyFile)
			if err != nil {
				errs = append(errs, fmt.Errorf("SCHEMA_REGISTRY_TLS_CERT_FILE/SCHEMA_REGISTRY_TLS_KEY_FILE: %w", err))
			}
			tlsCfg.Certificates = []tls.Certificate{cert}
		case e.TLSCertFile != "" || e.TLSKeyFile != "":
			errs = append(errs, errors.New("SCHEMA_REGISTRY_TLS_CERT_FILE and SCHEMA_REGISTRY_TLS_KEY_FILE must be set together (client certificate)"))
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return schemaregistry.New(schemaregistry.Config{URLs: urls, Username: e.Username, Password: e.Password, BearerToken: e.BearerToken, TLS: tlsCfg, Timeout: e.Timeout})
}

// formats returns topic's value and key formats: TOPIC_<topic>_VALUE_FORMAT and _KEY_FORMAT, or
// its handler's Values and Keys; nil for none.
func (e *env) formats(hs *registry, topic string) (values, keys schemaregistry.Format) {
	te := e.topics[topic]
	values, keys = te.values, te.keys
	if h := hs.get(cmp.Or(te.handler, e.Handler)); h != nil {
		if te.vars["Values"] == "" {
			values = h.Values
		}
		if te.vars["Keys"] == "" {
			keys = h.Keys
		}
	}
	return values, keys
}

// buildDecoders binds every topic's formats to the registry (e.sr), keeping the Decoders in
// e.decoders. A topic with a format and no registry is an error naming both.
func (e *env) buildDecoders(hs *registry) error {
	var errs []error
	e.decoders = map[string][2]processor.Decoder{}
	for _, t := range e.KafkaTopics {
		values, keys := e.formats(hs, t)
		var decs [2]processor.Decoder
		for i, f := range []schemaregistry.Format{values, keys} {
			if f == nil {
				continue
			}
			field := [2]string{"Values", "Keys"}[i]
			if e.sr == nil {
				errs = append(errs, fmt.Errorf("SCHEMA_REGISTRY_URL is required: topic %q's %s are %s (%s)", t, strings.ToLower(field), f, e.settingSource(hs, t, field)))
				continue
			}
			d, err := f.Decoder(e.sr)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", e.settingSource(hs, t, field), err))
				continue
			}
			decs[i] = d
		}
		e.decoders[t] = decs
	}
	for _, name := range e.handlersUsed() {
		h := hs.get(name)
		if h == nil || len(h.Encoders) == 0 {
			continue
		}
		if e.sr == nil {
			errs = append(errs, fmt.Errorf("SCHEMA_REGISTRY_URL is required: handler %q emits with %d Encoder(s) (service.Handler{Name: %q}.Encoders)", name, len(h.Encoders), name))
			continue
		}
		for _, enc := range h.Encoders {
			enc.Bind(e.sr)
		}
	}
	return errors.Join(errs...)
}
