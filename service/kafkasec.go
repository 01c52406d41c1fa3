package service

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"

	"github.com/kafkapg/kafkapg/internal/kafkalogin"
)

// kafkaSecurityEnv is how the processor authenticates to Kafka and encrypts its connections.
// Setting any KAFKA_TLS_* file turns TLS on.
type kafkaSecurityEnv struct {
	TLS                bool   `envconfig:"KAFKA_TLS" default:"false"`
	TLSCAFile          string `envconfig:"KAFKA_TLS_CA_FILE"`
	TLSCertFile        string `envconfig:"KAFKA_TLS_CERT_FILE"`
	TLSKeyFile         string `envconfig:"KAFKA_TLS_KEY_FILE"`
	TLSServerName      string `envconfig:"KAFKA_TLS_SERVER_NAME"`
	TLSInsecureSkipVer bool   `envconfig:"KAFKA_TLS_INSECURE_SKIP_VERIFY" default:"false"`
	SASLMechanism      string `envconfig:"KAFKA_SASL_MECHANISM"`
	SASLUsername       string `envconfig:"KAFKA_SASL_USERNAME"`
	SASLPassword       string `envconfig:"KAFKA_SASL_PASSWORD"`
}

// options returns the franz-go options for TLS and SASL. Errors name the variable at fault and
// never contain the password.
func (e *kafkaSecurityEnv) options() ([]kgo.Opt, error) {
	var opts []kgo.Opt
	var errs []error
	if tlsCfg, err := e.tlsConfig(); err != nil {
		errs = append(errs, err)
	} else if tlsCfg != nil {
		opts = append(opts, kgo.DialTLSConfig(tlsCfg))
	}
	if mech, err := e.saslMechanism(); err != nil {
		errs = append(errs, err)
	} else if mech != nil {
		opts = append(opts, kgo.SASL(mech))
	}
	return opts, errors.Join(errs...)
}

func (e *kafkaSecurityEnv) tlsConfig() (*tls.Config, error) {
	if !e.TLS && e.TLSCAFile == "" && e.TLSCertFile == "" && e.TLSKeyFile == "" {
		if e.TLSServerName != "" || e.TLSInsecureSkipVer {
			return nil, errors.New("KAFKA_TLS_SERVER_NAME and KAFKA_TLS_INSECURE_SKIP_VERIFY need TLS: set KAFKA_TLS=true")
		}
		return nil, nil
	}
	cfg := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		ServerName:         e.TLSServerName,
		InsecureSkipVerify: e.TLSInsecureSkipVer, // #nosec G402 -- an explicit, documented opt-in
	}
	var errs []error
	if e.TLSCAFile != "" {
		pem, err := os.ReadFile(e.TLSCAFile)
		if err != nil {
			errs = append(errs, fmt.Errorf("KAFKA_TLS_CA_FILE: %w", err))
		} else {
			cfg.RootCAs = x509.NewCertPool()
			if !cfg.RootCAs.AppendCertsFromPEM(pem) {
				errs = append(errs, fmt.Errorf("KAFKA_TLS_CA_FILE=%q holds no PEM certificate", e.TLSCAFile))
			}
		}
	}
	switch {
	case e.TLSCertFile != "" && e.TLSKeyFile != "":
		cert, err := tls.LoadX509KeyPair(e.TLSCertFile, e.TLSKeyFile)
		if err != nil {
			errs = append(errs, fmt.Errorf("KAFKA_TLS_CERT_FILE/KAFKA_TLS_KEY_FILE: %w", err))
		}
		cfg.Certificates = []tls.Certificate{cert}
	case e.TLSCertFile != "" || e.TLSKeyFile != "":
		errs = append(errs, errors.New("KAFKA_TLS_CERT_FILE and KAFKA_TLS_KEY_FILE must be set together (client certificate)"))
	}
	return cfg, errors.Join(errs...)
}

func (e *kafkaSecurityEnv) saslMechanism() (sasl.Mechanism, error) {
	return kafkalogin.Mechanism(e.SASLMechanism, e.SASLUsername, e.SASLPassword)
}
