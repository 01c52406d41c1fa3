// Package kafkalogin reads a Kafka SASL login from KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME and
// KAFKA_SASL_PASSWORD: one parser for the service and the kafkapg tool, so one environment (the
// dev loop's .kafkapg/env) works for both.
package kafkalogin

import (
	"fmt"
	"strings"

	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// Mechanisms are the accepted KAFKA_SASL_MECHANISM values (in any case).
var Mechanisms = []string{"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"}

// Mechanism returns the SASL mechanism mech, user and pass name; nil without a mechanism. Its
// errors name the variable at fault, never the password.
func Mechanism(mech, user, pass string) (sasl.Mechanism, error) {
	if mech == "" {
		if user != "" || pass != "" {
			return nil, fmt.Errorf("KAFKA_SASL_USERNAME/KAFKA_SASL_PASSWORD are set but KAFKA_SASL_MECHANISM is not (one of %s)", strings.Join(Mechanisms, ", "))
		}
		return nil, nil
	}
	if user == "" || pass == "" {
		return nil, fmt.Errorf("KAFKA_SASL_MECHANISM=%s needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD", mech)
	}
	switch strings.ToUpper(mech) {
	case "PLAIN":
		return plain.Auth{User: user, Pass: pass}.AsMechanism(), nil
	case "SCRAM-SHA-256":
		return scram.Auth{User: user, Pass: pass}.AsSha256Mechanism(), nil
	case "SCRAM-SHA-512":
		return scram.Auth{User: user, Pass: pass}.AsSha512Mechanism(), nil
	}
	return nil, fmt.Errorf("KAFKA_SASL_MECHANISM must be one of %s, got %q", strings.Join(Mechanisms, ", "), mech)
}
