package main

import (
	"os"
	"path/filepath"
	"strings"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/kafkalogin"
)

// Which broker the tool's clients reach, and how they log in to it.
//
// The dev loop's broker asks for SASL (SCRAM-SHA-256, user devKafkaUser, the password of
// <dir>/kafka-password), and its env file carries the login as the service reads it:
// KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD. produce, consume and topics
// take the login from the same place as the broker: this process's environment when -brokers
// or KAFKA_BROKERS names it, else the running dev loop's env file.

// The dev loop's broker's login: a superuser, for want of anyone else on a dev machine.
const (
	devKafkaMechanism = "SCRAM-SHA-256"
	devKafkaUser      = "kafkapg"
)

// kafkaConn is how a command reaches a broker: its addresses and its login.
type kafkaConn struct {
	brokers []string
	login   []kgo.Opt // kgo.SASL, or nothing
}

// client returns a client of the broker, logged in, with opts.
func (c kafkaConn) client(opts ...kgo.Opt) (*kgo.Client, error) {
	all := append([]kgo.Opt{kgo.SeedBrokers(c.brokers...)}, c.login...)
	return kgo.NewClient(append(all, opts...)...)
}

// kafkaFor returns how a command reaches its broker: -brokers (flagValue), else KAFKA_BROKERS,
// with the login of this process's KAFKA_SASL_*; else the running dev loop's broker and login,
// from dir's env file.
func kafkaFor(flagValue, dir string) (kafkaConn, error) {
	getenv, pick, from := os.Getenv, flagValue, "the environment"
	if pick == "" {
		pick = os.Getenv("KAFKA_BROKERS")
	}
	if pick == "" {
		path := filepath.Join(dir, "env")
		if _, ok := runningLoop(path); ok {
			_, env, err := readEnv(path)
			if err != nil {
				return kafkaConn{}, err
			}
			getenv, from = lookupIn(env), path
			pick = getenv("KAFKA_BROKERS")
		}
	}
	var c kafkaConn
	for _, b := range strings.Split(pick, ",") {
		if b = strings.TrimSpace(b); b != "" {
			c.brokers = append(c.brokers, b)
		}
	}
	if len(c.brokers) == 0 {
		return kafkaConn{}, usagef("no broker: give -brokers, set KAFKA_BROKERS, or start `go tool kafkapg dev` (its %s/env is read)", dir)
	}
	login, err := saslLogin(getenv)
	if err != nil {
		return kafkaConn{}, usagef("%s: %v", from, err)
	}
	c.login = login
	return c, nil
}

// lookupIn returns a getenv of the variables env (the env file's) sets.
func lookupIn(env [][2]string) func(string) string {
	return func(name string) string {
		v := ""
		for _, kv := range env {
			if kv[0] == name {
				v = kv[1]
			}
		}
		return v
	}
}

// saslLogin returns the client options that log in as KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME
// and KAFKA_SASL_PASSWORD of getenv say: none without a mechanism. Its errors name the
// variable at fault, never the password.
func saslLogin(getenv func(string) string) ([]kgo.Opt, error) {
	m, err := kafkalogin.Mechanism(getenv("KAFKA_SASL_MECHANISM"), getenv("KAFKA_SASL_USERNAME"), getenv("KAFKA_SASL_PASSWORD"))
	if err != nil || m == nil {
		return nil, err
	}
	return []kgo.Opt{kgo.SASL(m)}, nil
}
