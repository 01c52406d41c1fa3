// Package service is cmd/processor: environment configuration, the built-in handlers, and the
// wiring of Postgres, the processor and the HTTP endpoints. Environment variable names are a
// public contract; they are all parsed here and documented in the README.
package service

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/kelseyhightower/envconfig"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// DBEnv is the configuration `processor migrate` needs.
type DBEnv struct {
	DatabaseURL string `envconfig:"DATABASE_URL" required:"true"`
	DBSchema    string `envconfig:"DB_SCHEMA" default:"kafkapg"`
	DBMaxConns  int32  `envconfig:"DB_MAX_CONNS" default:"10"`
}

// Env is the whole configuration of `processor run`.
type Env struct {
	DBEnv
	KafkaSecurityEnv
	KafkaBrokers          []string      `envconfig:"KAFKA_BROKERS" required:"true"`
	KafkaGroupID          string        `envconfig:"KAFKA_GROUP_ID" required:"true"`
	KafkaTopics           []string      `envconfig:"KAFKA_TOPICS" required:"true"`
	KafkaStartOffset      string        `envconfig:"KAFKA_START_OFFSET" default:"earliest"`
	KafkaGroupProtocol    string        `envconfig:"KAFKA_GROUP_PROTOCOL" default:"auto"`
	KafkaSessionTimeout   time.Duration `envconfig:"KAFKA_SESSION_TIMEOUT" default:"45s"`
	KafkaRebalanceTimeout time.Duration `envconfig:"KAFKA_REBALANCE_TIMEOUT" default:"30s"`
	Handler               string        `envconfig:"HANDLER" required:"true"`
	HTTPAddr              string        `envconfig:"HTTP_ADDR" default:":9090"`
	BatchMaxRecords       int           `envconfig:"BATCH_MAX_RECORDS" default:"500"`
	BatchMaxWait          time.Duration `envconfig:"BATCH_MAX_WAIT" default:"20ms"`
	RetryLocalAttempts    int           `envconfig:"RETRY_LOCAL_ATTEMPTS" default:"3"`
	MaxRecordBytes        int           `envconfig:"MAX_RECORD_BYTES" default:"1048576"`
	MaxBufferedBytes      int           `envconfig:"MAX_BUFFERED_BYTES" default:"67108864"`
	RetryBackoffBase      time.Duration `envconfig:"RETRY_BACKOFF_BASE" default:"200ms"`
	RetryBackoffMax       time.Duration `envconfig:"RETRY_BACKOFF_MAX" default:"5s"`
	// RetryTiers is parsed by LoadEnv into Tiers. Set but empty means no retry tiers.
	RetryTiers        string        `envconfig:"RETRY_TIERS" default:"1s,10s,1m"`
	OnDeadLetter      string        `envconfig:"ON_DEAD_LETTER" default:"skip"`
	KafkaCreateTopics bool          `envconfig:"KAFKA_CREATE_TOPICS" default:"true"`
	ShutdownTimeout   time.Duration `envconfig:"SHUTDOWN_TIMEOUT" default:"10s"`
	// BreakerThreshold 0 disables the circuit breaker.
	BreakerThreshold     float64       `envconfig:"BREAKER_THRESHOLD" default:"0.5"`
	BreakerWindow        time.Duration `envconfig:"BREAKER_WINDOW" default:"30s"`
	BreakerMinRecords    int           `envconfig:"BREAKER_MIN_RECORDS" default:"20"`
	BreakerProbeInterval time.Duration `envconfig:"BREAKER_PROBE_INTERVAL" default:"1s"`
	BreakerProbeMax      time.Duration `envconfig:"BREAKER_PROBE_MAX" default:"30s"`
	DBTxIdleTimeout      time.Duration `envconfig:"DB_TX_IDLE_TIMEOUT" default:"30s"`
	StallTimeout         time.Duration `envconfig:"STALL_TIMEOUT" default:"2m"`
	LogLevel             string        `envconfig:"LOG_LEVEL" default:"info"`
	LogFormat            string        `envconfig:"LOG_FORMAT" default:"json"`

	Tiers     []time.Duration `ignored:"true"` // RETRY_TIERS, parsed
	KafkaOpts []kgo.Opt       `ignored:"true"` // KAFKA_TLS_*, KAFKA_SASL_*, parsed
}

// ConfigError is a missing or malformed setting; cmd/processor exits with status 2 on it.
type ConfigError struct{ Err error }

func (e *ConfigError) Error() string { return e.Err.Error() }
func (e *ConfigError) Unwrap() error { return e.Err }

// LoadDBEnv reads the database settings from the environment.
func LoadDBEnv() (*DBEnv, error) {
	var e DBEnv
	if err := process(&e); err != nil {
		return nil, err
	}
	if err := e.validate(); err != nil {
		return nil, &ConfigError{err}
	}
	return &e, nil
}

// LoadEnv reads the whole configuration from the environment and validates it. Every error names
// the variable at fault.
func LoadEnv() (*Env, error) {
	var e Env
	if err := process(&e); err != nil {
		return nil, err
	}
	e.KafkaBrokers = cleanList(e.KafkaBrokers)
	e.KafkaTopics = cleanList(e.KafkaTopics)
	if err := e.validate(); err != nil {
		return nil, &ConfigError{err}
	}
	return &e, nil
}

func process(spec any) error {
	err := envconfig.Process("", spec)
	var pe *envconfig.ParseError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &pe):
		return &ConfigError{fmt.Errorf("%s=%q is not a valid %s (%v)", pe.KeyName, pe.Value, typeName(pe.TypeName), pe.Err)}
	case strings.HasPrefix(err.Error(), "required key "):
		// envconfig: "required key X missing value"
		name := strings.TrimSuffix(strings.TrimPrefix(err.Error(), "required key "), " missing value")
		return &ConfigError{fmt.Errorf("%s is required", name)}
	}
	return &ConfigError{err}
}

func typeName(t string) string {
	switch t {
	case "time.Duration":
		return "duration (e.g. 250ms, 10s, 1m)"
	case "int", "int32":
		return "integer"
	case "bool":
		return "boolean (true or false)"
	case "float64":
		return "number (e.g. 0.5)"
	}
	return t
}

func cleanList(in []string) []string {
	var out []string
	for _, s := range in {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func (e *DBEnv) validate() error {
	var errs []error
	if strings.TrimSpace(e.DatabaseURL) == "" {
		errs = append(errs, errors.New("DATABASE_URL is required"))
	}
	if e.DBSchema == "" {
		errs = append(errs, errors.New("DB_SCHEMA must not be empty"))
	}
	if e.DBMaxConns < 1 {
		errs = append(errs, fmt.Errorf("DB_MAX_CONNS must be at least 1, got %d", e.DBMaxConns))
	}
	return errors.Join(errs...)
}

func (e *Env) validate() error {
	errs := []error{e.DBEnv.validate()}
	req := func(name string, empty bool) {
		if empty {
			errs = append(errs, fmt.Errorf("%s is required", name))
		}
	}
	req("KAFKA_BROKERS", len(e.KafkaBrokers) == 0)
	req("KAFKA_GROUP_ID", strings.TrimSpace(e.KafkaGroupID) == "")
	req("KAFKA_TOPICS", len(e.KafkaTopics) == 0)
	req("HANDLER", e.Handler == "")
	if e.Handler != "" {
		if _, ok := handlers[e.Handler]; !ok {
			errs = append(errs, fmt.Errorf("HANDLER=%q is not a built-in handler (have: %s)", e.Handler, strings.Join(HandlerNames(), ", ")))
		}
	}
	if e.KafkaGroupProtocol != "auto" && e.KafkaGroupProtocol != "classic" {
		errs = append(errs, fmt.Errorf("KAFKA_GROUP_PROTOCOL must be auto or classic, got %q", e.KafkaGroupProtocol))
	}
	if e.KafkaStartOffset != "earliest" && e.KafkaStartOffset != "latest" {
		errs = append(errs, fmt.Errorf("KAFKA_START_OFFSET must be earliest or latest, got %q", e.KafkaStartOffset))
	}
	positive := func(name string, v time.Duration) {
		if v <= 0 {
			errs = append(errs, fmt.Errorf("%s must be positive, got %v", name, v))
		}
	}
	positive("KAFKA_SESSION_TIMEOUT", e.KafkaSessionTimeout)
	positive("KAFKA_REBALANCE_TIMEOUT", e.KafkaRebalanceTimeout)
	positive("RETRY_BACKOFF_BASE", e.RetryBackoffBase)
	positive("RETRY_BACKOFF_MAX", e.RetryBackoffMax)
	positive("SHUTDOWN_TIMEOUT", e.ShutdownTimeout)
	positive("DB_TX_IDLE_TIMEOUT", e.DBTxIdleTimeout)
	positive("STALL_TIMEOUT", e.StallTimeout)
	if e.BatchMaxWait < 0 {
		errs = append(errs, fmt.Errorf("BATCH_MAX_WAIT must not be negative, got %v", e.BatchMaxWait))
	}
	if e.RetryBackoffMax < e.RetryBackoffBase {
		errs = append(errs, fmt.Errorf("RETRY_BACKOFF_MAX (%v) must not be less than RETRY_BACKOFF_BASE (%v)", e.RetryBackoffMax, e.RetryBackoffBase))
	}
	if e.BatchMaxRecords < 1 {
		errs = append(errs, fmt.Errorf("BATCH_MAX_RECORDS must be at least 1, got %d", e.BatchMaxRecords))
	}
	if e.MaxRecordBytes < 1 {
		errs = append(errs, fmt.Errorf("MAX_RECORD_BYTES must be at least 1, got %d", e.MaxRecordBytes))
	}
	if e.MaxBufferedBytes < 1<<20 {
		errs = append(errs, fmt.Errorf("MAX_BUFFERED_BYTES must be at least 1048576 (1 MiB), got %d", e.MaxBufferedBytes))
	}
	if e.BreakerThreshold < 0 || e.BreakerThreshold > 1 {
		errs = append(errs, fmt.Errorf("BREAKER_THRESHOLD is a share of records between 0 and 1 (0 disables the breaker), got %v", e.BreakerThreshold))
	}
	if e.BreakerMinRecords < 1 {
		errs = append(errs, fmt.Errorf("BREAKER_MIN_RECORDS must be at least 1, got %d", e.BreakerMinRecords))
	}
	positive("BREAKER_WINDOW", e.BreakerWindow)
	positive("BREAKER_PROBE_INTERVAL", e.BreakerProbeInterval)
	if e.BreakerProbeMax < e.BreakerProbeInterval {
		errs = append(errs, fmt.Errorf("BREAKER_PROBE_MAX (%v) must not be less than BREAKER_PROBE_INTERVAL (%v)", e.BreakerProbeMax, e.BreakerProbeInterval))
	}
	if e.RetryLocalAttempts < 1 {
		errs = append(errs, fmt.Errorf("RETRY_LOCAL_ATTEMPTS must be at least 1, got %d", e.RetryLocalAttempts))
	}
	if _, err := parseLevel(e.LogLevel); err != nil {
		errs = append(errs, err)
	}
	tiers, err := retrytopics.ParseTiers(e.RetryTiers)
	if err != nil {
		errs = append(errs, fmt.Errorf("RETRY_TIERS=%q: %w", e.RetryTiers, err))
	}
	e.Tiers = tiers
	if e.OnDeadLetter != "skip" && e.OnDeadLetter != "block" {
		errs = append(errs, fmt.Errorf("ON_DEAD_LETTER must be skip or block, got %q", e.OnDeadLetter))
	}
	opts, err := e.KafkaSecurityEnv.options()
	if err != nil {
		errs = append(errs, err)
	}
	e.KafkaOpts = opts
	if e.LogFormat != "json" && e.LogFormat != "text" {
		errs = append(errs, fmt.Errorf("LOG_FORMAT must be json or text, got %q", e.LogFormat))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	// What only the processor knows (how settings relate, topic names): checked here too, so
	// it exits with status 2 before any connection is tried.
	return e.processorConfig(handlers[e.Handler].handler, nil, nil).Validate()
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("LOG_LEVEL must be debug, info, warn or error, got %q", s)
	}
	return l, nil
}
