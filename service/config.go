package service

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kelseyhightower/envconfig"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// dbEnv is the configuration `migrate` needs.
type dbEnv struct {
	DatabaseURL string `envconfig:"DATABASE_URL"` // required: see validate
	DBSchema    string `envconfig:"DB_SCHEMA" default:"kafkapg" field:"Schema"`
	DBMaxConns  int32  `envconfig:"DB_MAX_CONNS" default:"10"`
}

// env is the whole configuration of `run`. A field tagged `field` sets the processor.Config field
// of that name; processor errors about that field are reported under the variable's name.
type env struct {
	dbEnv
	kafkaSecurityEnv
	schemaRegistryEnv
	KafkaBrokers          []string      `envconfig:"KAFKA_BROKERS" field:"Brokers"` // required by run: see validate
	KafkaGroupID          string        `envconfig:"KAFKA_GROUP_ID" field:"Group"`  // required: see validate
	KafkaTopics           []string      `envconfig:"KAFKA_TOPICS" field:"Topics"`
	KafkaStartOffset      string        `envconfig:"KAFKA_START_OFFSET" default:"earliest" field:"StartOffset"`
	KafkaGroupProtocol    string        `envconfig:"KAFKA_GROUP_PROTOCOL" default:"auto" field:"GroupProtocol"`
	KafkaSessionTimeout   time.Duration `envconfig:"KAFKA_SESSION_TIMEOUT" default:"45s" field:"SessionTimeout"`
	KafkaRebalanceTimeout time.Duration `envconfig:"KAFKA_REBALANCE_TIMEOUT" default:"30s" field:"RebalanceTimeout"`
	// Handler names the handler of every topic without a TOPIC_<topic>_HANDLER; it defaults to
	// the binary's only handler, if it has one.
	Handler              string        `envconfig:"HANDLER" field:"Handler"`
	HTTPAddr             string        `envconfig:"HTTP_ADDR" default:":9090"`
	OperatorToken        string        `envconfig:"OPERATOR_TOKEN"`
	OperatorTokens       string        `envconfig:"OPERATOR_TOKENS"`
	PprofAddr            string        `envconfig:"PPROF_ADDR"`
	ConsoleAddr          string        `envconfig:"CONSOLE_ADDR"`
	ConsoleUsers         string        `envconfig:"CONSOLE_USERS"`
	ConsoleTokens        string        `envconfig:"CONSOLE_TOKENS"`
	ConsoleHideValues    bool          `envconfig:"CONSOLE_HIDE_VALUES" default:"false"`
	ConsoleSampleEvery   time.Duration `envconfig:"CONSOLE_SAMPLE_INTERVAL" default:"15s"`
	TraceURL             string        `envconfig:"TRACE_URL"`
	BatchMaxRecords      int           `envconfig:"BATCH_MAX_RECORDS" default:"500" field:"BatchMaxRecords"`
	BatchMaxWait         batchWait     `envconfig:"BATCH_MAX_WAIT" default:"20ms" field:"BatchMaxWait"`
	RetryLocalAttempts   int           `envconfig:"RETRY_LOCAL_ATTEMPTS" default:"3" field:"LocalAttempts"`
	MaxRecordBytes       int           `envconfig:"MAX_RECORD_BYTES" default:"1048576" field:"MaxRecordBytes"`
	Concurrency          int           `envconfig:"CONCURRENCY" default:"1" field:"Concurrency"`
	MaxBufferedBytes     int           `envconfig:"MAX_BUFFERED_BYTES" default:"67108864" field:"MaxBufferedBytes"`
	RetryBackoffBase     time.Duration `envconfig:"RETRY_BACKOFF_BASE" default:"200ms" field:"BackoffBase"`
	RetryBackoffMax      time.Duration `envconfig:"RETRY_BACKOFF_MAX" default:"5s" field:"BackoffMax"`
	RetryTiers           string        `envconfig:"RETRY_TIERS" default:"1s,10s,1m" field:"RetryTiers"` // set but empty: no tiers
	OnDeadLetter         string        `envconfig:"ON_DEAD_LETTER" default:"skip" field:"OnDeadLetter"`
	KafkaCreateTopics    bool          `envconfig:"KAFKA_CREATE_TOPICS" default:"true" field:"DisableTopicCreation"`
	KafkaTopicRF         int16         `envconfig:"KAFKA_TOPIC_REPLICATION_FACTOR" default:"0" field:"TopicReplicationFactor"`
	KafkaTopicMinInsync  int           `envconfig:"KAFKA_TOPIC_MIN_INSYNC_REPLICAS" default:"0" field:"TopicMinInsyncReplicas"`
	ShutdownTimeout      time.Duration `envconfig:"SHUTDOWN_TIMEOUT" default:"10s" field:"ShutdownTimeout"`
	BreakerEnabled       bool          `envconfig:"BREAKER_ENABLED" default:"true" field:"BreakerDisabled"`
	BreakerThreshold     float64       `envconfig:"BREAKER_THRESHOLD" default:"0.5" field:"BreakerThreshold"`
	BreakerWindow        time.Duration `envconfig:"BREAKER_WINDOW" default:"30s" field:"BreakerWindow"`
	BreakerMinRecords    int           `envconfig:"BREAKER_MIN_RECORDS" default:"20" field:"BreakerMinRecords"`
	BreakerProbeInterval time.Duration `envconfig:"BREAKER_PROBE_INTERVAL" default:"1s" field:"BreakerProbeInterval"`
	BreakerProbeMax      time.Duration `envconfig:"BREAKER_PROBE_MAX" default:"30s" field:"BreakerProbeMax"`
	DBTxIdleTimeout      time.Duration `envconfig:"DB_TX_IDLE_TIMEOUT" default:"30s" field:"TxIdleTimeout"`
	StallTimeout         time.Duration `envconfig:"STALL_TIMEOUT" default:"2m" field:"StallTimeout"`
	PausedTooLong        time.Duration `envconfig:"PAUSED_TOO_LONG" default:"4h" field:"PausedTooLong"`
	IdempotencyRetention time.Duration `envconfig:"IDEMPOTENCY_RETENTION" default:"168h" field:"IdempotencyRetention"`
	RelayOnly            bool          `envconfig:"RELAY_ONLY" default:"false" field:"RelayOnly"`
	OutboxPollInterval   time.Duration `envconfig:"OUTBOX_POLL_INTERVAL" default:"1s" field:"OutboxPollInterval"`
	OutboxListen         bool          `envconfig:"OUTBOX_LISTEN" default:"true" field:"OutboxListenDisabled"`
	OutboxRetention      time.Duration `envconfig:"OUTBOX_RETENTION" default:"0s" field:"OutboxRetention"`
	LogLevel             string        `envconfig:"LOG_LEVEL" default:"info"`
	LogFormat            string        `envconfig:"LOG_FORMAT" default:"json"`

	tiers     []time.Duration                 // RETRY_TIERS, parsed
	kafkaOpts []kgo.Opt                       // KAFKA_TLS_*, KAFKA_SASL_*, parsed
	tracing   tracingSetup                    // OTEL_*, parsed
	topics    map[string]topicPolicy          // TOPIC_<topic>_*, parsed, by topic
	sr        *schemaregistry.Registry        // SCHEMA_REGISTRY_*, or nil
	decoders  map[string][2]processor.Decoder // by topic: its values' and keys' (see buildDecoders)
	test      processor.TestConfig            // a test harness's hooks (package servicetest); zero in a service
}

// batchWait is BATCH_MAX_WAIT: a duration, or none (processor.NoBatchWait).
type batchWait time.Duration

// Decode implements envconfig.Decoder.
func (w *batchWait) Decode(value string) error {
	if strings.TrimSpace(value) == "none" {
		*w = batchWait(processor.NoBatchWait)
		return nil
	}
	d, err := time.ParseDuration(strings.TrimSpace(value))
	*w = batchWait(d)
	return err
}

// topicPolicy is a topic's TOPIC_<topic>_* variables (see topicSettings).
type topicPolicy struct {
	handler string
	// idempotencyKeySet says TOPIC_<topic>_IDEMPOTENCY_KEY was set: it overrides the handler's.
	idempotencyKeySet bool
	// values and keys are TOPIC_<topic>_VALUE_FORMAT and _KEY_FORMAT; nil for none (also when
	// set to none, which overrides the handler's).
	values, keys schemaregistry.Format
	policy       processor.TopicPolicy
	vars         map[string]string // processor.TopicPolicy field -> the variable that set it
}

// topicSettings are the per-topic variables, TOPIC_<topic>_<setting>, and the TopicPolicy field
// each sets.
var topicSettings = []struct{ name, field string }{
	{"HANDLER", "Handler"},
	{"RETRY_TIERS", "RetryTiers"},
	{"RETRY_LOCAL_ATTEMPTS", "LocalAttempts"},
	{"ON_DEAD_LETTER", "OnDeadLetter"},
	{"MAX_RECORD_BYTES", "MaxRecordBytes"},
	{"IDEMPOTENCY_KEY", "IdempotencyKey"},
	{"CONCURRENCY", "Concurrency"},
	{"VALUE_FORMAT", "Values"},
	{"KEY_FORMAT", "Keys"},
}

// topicPrefix starts every per-topic variable.
const topicPrefix = "TOPIC_"

// topicVarName returns the name topic has in per-topic variables: upper case, with every
// character other than a letter or digit (Kafka allows '.', '_' and '-') written '_'.
func topicVarName(topic string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z':
			return r - 'a' + 'A'
		case r >= 'A' && r <= 'Z', r >= '0' && r <= '9':
			return r
		}
		return '_'
	}, topic)
}

// configError is a missing or malformed setting: the service exits with status 2 on it.
type configError struct{ Err error }

func (e *configError) Error() string { return e.Err.Error() }
func (e *configError) Unwrap() error { return e.Err }

// loadDBEnv reads the database settings from the environment.
func loadDBEnv() (*dbEnv, error) {
	var e dbEnv
	if err := process(&e); err != nil {
		return nil, err
	}
	if err := e.validate(); err != nil {
		return nil, &configError{err}
	}
	return &e, nil
}

// loadEnv reads the whole configuration from the environment and checks it, as far as it can
// without connecting anywhere, against the handlers the binary has. Every error names the
// variable at fault.
func loadEnv(hs *registry) (*env, error) {
	var e env
	// envconfig skips unexported embedded structs: they are read on their own.
	if err := errors.Join(process(&e.dbEnv), process(&e.kafkaSecurityEnv), process(&e.schemaRegistryEnv), process(&e)); err != nil {
		return nil, &configError{err}
	}
	e.KafkaBrokers = cleanList(e.KafkaBrokers)
	e.KafkaTopics = cleanList(e.KafkaTopics)
	if e.Handler == "" && len(hs.names) == 1 {
		e.Handler = hs.names[0]
	}
	if err := errors.Join(append([]error{e.validate(hs)}, misspelt(environ())...)...); err != nil {
		return nil, &configError{err}
	}
	return &e, nil
}

// loadOpsEnv reads the configuration an operator command (dlq, keys, trace) works with: the
// database and the group are required, and whatever else is set is read and checked as for run.
// What only run needs is not required: a command that reads Kafka says so when KAFKA_BROKERS is
// unset (see opsCmd.kafka), and without KAFKA_TOPICS the commands take the group's topics from
// Postgres (see operate). HANDLER is not needed: the commands apply nothing.
func loadOpsEnv(hs *registry) (*env, error) {
	var e env
	if err := errors.Join(process(&e.dbEnv), process(&e.kafkaSecurityEnv), process(&e.schemaRegistryEnv), process(&e)); err != nil {
		return nil, &configError{err}
	}
	e.KafkaBrokers = cleanList(e.KafkaBrokers)
	e.KafkaTopics = cleanList(e.KafkaTopics)
	errs := []error{e.dbEnv.validate()}
	if strings.TrimSpace(e.KafkaGroupID) == "" {
		errs = append(errs, errors.New("KAFKA_GROUP_ID is required: the commands act on that group's records"))
	}
	tiers, err := retrytopics.ParseTiers(e.RetryTiers)
	if err != nil {
		errs = append(errs, fmt.Errorf("RETRY_TIERS=%q: %w", e.RetryTiers, err))
	}
	e.tiers = tiers
	if e.StallTimeout <= 0 {
		errs = append(errs, fmt.Errorf("STALL_TIMEOUT must be positive, got %v", e.StallTimeout))
	}
	opts, err := e.kafkaSecurityEnv.options()
	errs = append(errs, err, tracing.CheckViewerURL(e.TraceURL))
	e.kafkaOpts = opts
	sr, err := e.schemaRegistryEnv.registry() // values in the wire format are shown decoded
	errs = append(errs, err)
	e.sr = sr
	if len(e.KafkaTopics) > 0 { // per-topic variables name topics of KAFKA_TOPICS
		topics, err := topicEnv(e.KafkaTopics, hs)
		errs = append(errs, err)
		e.topics = topics
	}
	if err := errors.Join(append(errs, misspelt(environ())...)...); err != nil {
		return nil, &configError{err}
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
		return &configError{fmt.Errorf("%s=%q is not a valid %s (%v)", pe.KeyName, pe.Value, typeName(pe.TypeName), pe.Err)}
	case strings.HasPrefix(err.Error(), "required key "):
		// envconfig: "required key X missing value"
		name := strings.TrimSuffix(strings.TrimPrefix(err.Error(), "required key "), " missing value")
		return &configError{fmt.Errorf("%s is required", name)}
	}
	return &configError{err}
}

func typeName(t string) string {
	switch t {
	case "service.batchWait":
		return "duration (e.g. 20ms), or none"
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

func (e *dbEnv) validate() error {
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

// validate checks what only the environment knows (variables that must not be zero, words,
// handler names, per-topic variables), then the processor configuration the variables make,
// with processor.Config.Validate, naming the variables at fault.
func (e *env) validate(hs *registry) error {
	errs := []error{e.dbEnv.validate()}
	if len(e.KafkaBrokers) == 0 {
		errs = append(errs, errors.New("KAFKA_BROKERS is required"))
	}
	if strings.TrimSpace(e.KafkaGroupID) == "" {
		errs = append(errs, errors.New("KAFKA_GROUP_ID is required"))
	}
	switch {
	case len(e.KafkaTopics) == 0 && !e.RelayOnly:
		errs = append(errs, errors.New("KAFKA_TOPICS is required (or RELAY_ONLY=true to run the outbox relay alone)"))
	case len(e.KafkaTopics) > 0 && e.RelayOnly:
		errs = append(errs, errors.New("KAFKA_TOPICS must be empty with RELAY_ONLY=true: a relay alone consumes nothing"))
	}
	if t := e.OperatorToken; t != "" && len(strings.TrimSpace(t)) < 16 {
		errs = append(errs, errors.New("OPERATOR_TOKEN must be at least 16 characters (it guards replays of records): generate one, e.g. openssl rand -hex 32"))
	}
	if _, err := e.operatorTokens(); err != nil {
		errs = append(errs, err)
	}
	switch {
	case e.ConsoleAddr != "" && e.ConsoleUsers == "" && e.ConsoleTokens == "":
		errs = append(errs, errors.New("CONSOLE_ADDR is set but CONSOLE_USERS is not: every console page needs a user (name:role:password, role viewer or operator) or a token of CONSOLE_TOKENS"))
	default:
		if _, _, err := e.consoleLogins(); err != nil {
			errs = append(errs, err)
		}
	}
	if e.ConsoleSampleEvery < time.Second || e.ConsoleSampleEvery > 5*time.Minute {
		errs = append(errs, fmt.Errorf("CONSOLE_SAMPLE_INTERVAL=%s: want 1s to 5m (the console keeps an hour of samples)", e.ConsoleSampleEvery))
	}
	if e.Handler != "" && hs.get(e.Handler) == nil {
		errs = append(errs, fmt.Errorf("HANDLER=%q is not a handler of this binary (it has: %s)", e.Handler, strings.Join(hs.names, ", ")))
	}
	// Zero is no setting for these: in processor.Config it would mean "the default", so the
	// environment refuses it instead of quietly reading it that way.
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
	positive("PAUSED_TOO_LONG", e.PausedTooLong)
	positive("IDEMPOTENCY_RETENTION", e.IdempotencyRetention)
	positive("OUTBOX_POLL_INTERVAL", e.OutboxPollInterval)
	if e.OutboxRetention < 0 {
		errs = append(errs, fmt.Errorf("OUTBOX_RETENTION must not be negative, got %v (0 deletes published rows at once)", e.OutboxRetention))
	}
	positive("BREAKER_WINDOW", e.BreakerWindow)
	positive("BREAKER_PROBE_INTERVAL", e.BreakerProbeInterval)
	positive("BREAKER_PROBE_MAX", e.BreakerProbeMax)
	atLeast1 := func(name string, v int) {
		if v < 1 {
			errs = append(errs, fmt.Errorf("%s must be at least 1, got %d", name, v))
		}
	}
	atLeast1("BATCH_MAX_RECORDS", e.BatchMaxRecords)
	atLeast1("RETRY_LOCAL_ATTEMPTS", e.RetryLocalAttempts)
	atLeast1("MAX_RECORD_BYTES", e.MaxRecordBytes)
	atLeast1("CONCURRENCY", e.Concurrency)
	atLeast1("MAX_BUFFERED_BYTES", e.MaxBufferedBytes)
	atLeast1("BREAKER_MIN_RECORDS", e.BreakerMinRecords)
	if e.BatchMaxWait == 0 || time.Duration(e.BatchMaxWait) < processor.NoBatchWait {
		errs = append(errs, fmt.Errorf("BATCH_MAX_WAIT must be positive, or none to apply records as they arrive, got %v", time.Duration(e.BatchMaxWait)))
	}
	if e.BreakerThreshold <= 0 || e.BreakerThreshold > 1 {
		errs = append(errs, fmt.Errorf("BREAKER_THRESHOLD is a share of records, above 0 and at most 1, got %v (BREAKER_ENABLED=false turns the breaker off)", e.BreakerThreshold))
	}
	if _, err := parseLevel(e.LogLevel); err != nil {
		errs = append(errs, err)
	}
	if e.LogFormat != "json" && e.LogFormat != "text" {
		errs = append(errs, fmt.Errorf("LOG_FORMAT must be json or text, got %q", e.LogFormat))
	}
	tiers, err := retrytopics.ParseTiers(e.RetryTiers)
	if err != nil {
		errs = append(errs, fmt.Errorf("RETRY_TIERS=%q: %w", e.RetryTiers, err))
	}
	e.tiers = tiers
	opts, err := e.kafkaSecurityEnv.options()
	if err != nil {
		errs = append(errs, err)
	}
	e.kafkaOpts = opts
	tr, err := readTracing(os.Getenv)
	errs = append(errs, err, tracing.CheckViewerURL(e.TraceURL))
	e.tracing = tr
	topics, err := topicEnv(e.KafkaTopics, hs)
	errs = append(errs, err)
	e.topics = topics
	sr, err := e.schemaRegistryEnv.registry()
	errs = append(errs, err)
	e.sr = sr
	errs = append(errs, e.buildDecoders(hs))
	if e.Handler == "" && !e.RelayOnly {
		var without []string
		for _, t := range e.KafkaTopics {
			if e.topics[t].handler == "" {
				without = append(without, topicPrefix+topicVarName(t)+"_HANDLER")
			}
		}
		if len(without) > 0 {
			errs = append(errs, fmt.Errorf("HANDLER is required: this binary has handlers %s; choose one (or set %s)", strings.Join(hs.names, ", "), strings.Join(without, ", ")))
		}
	}
	// Then what the processor checks, so that every variable at fault is named at once; a
	// variable already named above is not named twice (its value was not taken, and the
	// processor saw a default or nothing in its place).
	named := map[string]bool{}
	for _, err := range errs {
		if err != nil {
			for _, err := range unjoin(err) {
				named[varOf(err)] = true
			}
		}
	}
	if err := e.processorConfig(hs, nil, nil).Validate(); err != nil {
		for _, err := range e.rename(hs, err) {
			if !named[varOf(err)] {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// varOf returns the variable a configuration error names first: its message up to a space,
// '=' or ':'.
func varOf(err error) string {
	msg := err.Error()
	if i := strings.IndexAny(msg, " =:"); i >= 0 {
		return msg[:i]
	}
	return msg
}

// topicEnv reads the per-topic variables, TOPIC_<topic>_<setting>, of topics. A variable that
// names no topic of topics, or no setting, is an error: a typo must not go unnoticed.
func topicEnv(topics []string, hs *registry) (map[string]topicPolicy, error) {
	byVar := map[string]string{} // topicVarName -> topic
	var errs []error
	for _, t := range topics {
		n := topicVarName(t)
		if other, ok := byVar[n]; ok && other != t { // the same topic twice: processor.Config.Validate says so
			errs = append(errs, fmt.Errorf("KAFKA_TOPICS: topics %q and %q have the same name in per-topic variables (%s%s_*)", other, t, topicPrefix, n))
		}
		byVar[n] = t
	}
	out := map[string]topicPolicy{}
	for _, kv := range os.Environ() {
		name, value, _ := strings.Cut(kv, "=")
		rest, ok := strings.CutPrefix(name, topicPrefix)
		if !ok {
			continue
		}
		var setting, field, topicVar string
		for _, s := range topicSettings {
			if tv, ok := strings.CutSuffix(rest, "_"+s.name); ok && tv != "" {
				setting, field, topicVar = s.name, s.field, tv
				break
			}
		}
		if setting == "" {
			errs = append(errs, fmt.Errorf("%s is not a per-topic setting: they are %s<topic>_{%s}", name, topicPrefix, strings.Join(settingNames(), ",")))
			continue
		}
		topic, ok := byVar[topicVar]
		if !ok {
			var known []string
			for _, t := range topics {
				known = append(known, fmt.Sprintf("%s → %s%s_%s", t, topicPrefix, topicVarName(t), setting))
			}
			errs = append(errs, fmt.Errorf("%s names no topic of KAFKA_TOPICS (%s)", name, strings.Join(known, ", ")))
			continue
		}
		tp := out[topic]
		if tp.vars == nil {
			tp.vars = map[string]string{}
		}
		tp.vars[field] = name
		if err := tp.set(setting, value, hs); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q: %w", name, value, err))
		}
		out[topic] = tp
	}
	return out, errors.Join(errs...)
}

func settingNames() []string {
	var out []string
	for _, s := range topicSettings {
		out = append(out, s.name)
	}
	return out
}

// set parses value as the per-topic setting.
func (tp *topicPolicy) set(setting, value string, hs *registry) error {
	switch setting {
	case "HANDLER":
		if hs.get(value) == nil {
			return fmt.Errorf("not a handler of this binary (it has: %s)", strings.Join(hs.names, ", "))
		}
		tp.handler = value
	case "RETRY_TIERS":
		tiers, err := retrytopics.ParseTiers(value)
		if err != nil {
			return err
		}
		tp.policy.RetryTiers = tiers
	case "RETRY_LOCAL_ATTEMPTS", "MAX_RECORD_BYTES", "CONCURRENCY":
		n, err := strconv.Atoi(strings.TrimSpace(value))
		if err != nil {
			return errors.New("not an integer")
		}
		if n < 1 {
			return fmt.Errorf("must be at least 1, got %d", n)
		}
		switch setting {
		case "RETRY_LOCAL_ATTEMPTS":
			tp.policy.LocalAttempts = n
		case "CONCURRENCY":
			tp.policy.Concurrency = n
		default:
			tp.policy.MaxRecordBytes = n
		}
	case "ON_DEAD_LETTER":
		tp.policy.OnDeadLetter = processor.OnDeadLetter(value)
	case "VALUE_FORMAT", "KEY_FORMAT":
		var f schemaregistry.Format
		if v := strings.TrimSpace(value); v != "none" {
			var err error
			if f, err = schemaregistry.FormatNamed(v); err != nil {
				return fmt.Errorf("%w, or none", err)
			}
		}
		if setting == "VALUE_FORMAT" {
			tp.values = f
		} else {
			tp.keys = f
		}
	case "IDEMPOTENCY_KEY":
		key, err := parseIdempotencyKey(value)
		if err != nil {
			return err
		}
		tp.policy.IdempotencyKey = key
		tp.idempotencyKeySet = true
	}
	return nil
}

// parseIdempotencyKey parses TOPIC_<topic>_IDEMPOTENCY_KEY: header:<name>, json:<field.path>, or
// none (no key, even if the topic's handler has one).
func parseIdempotencyKey(value string) (processor.IdempotencyKey, error) {
	value = strings.TrimSpace(value)
	kind, arg, _ := strings.Cut(value, ":")
	switch {
	case value == "none":
		return nil, nil
	case kind == "header" && arg != "":
		return processor.KeyFromHeader(arg), nil
	case kind == "json" && arg != "" && !slices.Contains(strings.Split(arg, "."), ""):
		return processor.KeyFromJSON(arg), nil
	}
	return nil, errors.New("must be header:<name>, json:<field> (dots for nested fields: json:order.id) or none")
}

// rename rewrites the processor's configuration errors to name the variables that set the fields
// at fault.
func (e *env) rename(hs *registry, err error) []error {
	names := fieldVars()
	// Fields named in a message ("less than BackoffBase"), longest first: no field's name is
	// then rewritten inside another's.
	fields := slices.SortedFunc(maps.Keys(names), func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, err := range unjoin(err) {
		var ce *processor.ConfigError
		if !errors.As(err, &ce) {
			errs = append(errs, err)
			continue
		}
		name := names[ce.Field]
		if ce.Topic != "" {
			name = e.settingSource(hs, ce.Topic, ce.Field)
		}
		if name == "" {
			name = "(processor." + ce.Field + ")" // a field no variable sets: a bug of the service
		}
		msg := ce.Err.Error()
		for _, field := range fields {
			msg = strings.ReplaceAll(msg, field+" ", names[field]+" ")
		}
		errs = append(errs, fmt.Errorf("%s %s", name, msg))
	}
	return errs
}

// unjoin returns the errors err joins (errors.Join, through any wrapping), or err alone.
func unjoin(err error) []error {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if j, ok := e.(interface{ Unwrap() []error }); ok {
			return j.Unwrap()
		}
	}
	return []error{err}
}

// fieldVars maps each processor.Config field the environment sets to its variable.
func fieldVars() map[string]string {
	out := map[string]string{}
	var walk func(t reflect.Type)
	walk = func(t reflect.Type) {
		for f := range t.Fields() {
			if f.Anonymous {
				walk(f.Type)
			} else if field := f.Tag.Get("field"); field != "" {
				out[field] = f.Tag.Get("envconfig")
			}
		}
	}
	walk(reflect.TypeFor[env]())
	return out
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("LOG_LEVEL must be debug, info, warn or error, got %q", s)
	}
	return l, nil
}

// processorConfig is the processor configuration the environment describes, with the handlers
// of hs.
func (e *env) processorConfig(hs *registry, log *slog.Logger, reg prometheus.Registerer) *processor.Config {
	c := &processor.Config{
		Brokers:                e.KafkaBrokers,
		Group:                  e.KafkaGroupID,
		Topics:                 e.KafkaTopics,
		Schema:                 e.DBSchema,
		StartOffset:            processor.StartOffset(e.KafkaStartOffset),
		GroupProtocol:          processor.GroupProtocol(e.KafkaGroupProtocol),
		BatchMaxRecords:        e.BatchMaxRecords,
		BatchMaxWait:           time.Duration(e.BatchMaxWait),
		LocalAttempts:          e.RetryLocalAttempts,
		MaxRecordBytes:         e.MaxRecordBytes,
		Concurrency:            e.Concurrency,
		MaxBufferedBytes:       e.MaxBufferedBytes,
		RetryTiers:             e.tiers,
		OnDeadLetter:           processor.OnDeadLetter(e.OnDeadLetter),
		DisableTopicCreation:   !e.KafkaCreateTopics,
		TopicReplicationFactor: e.KafkaTopicRF,
		TopicMinInsyncReplicas: e.KafkaTopicMinInsync,
		BackoffBase:            e.RetryBackoffBase,
		BackoffMax:             e.RetryBackoffMax,
		SessionTimeout:         e.KafkaSessionTimeout,
		RebalanceTimeout:       e.KafkaRebalanceTimeout,
		ShutdownTimeout:        e.ShutdownTimeout,
		BreakerDisabled:        !e.BreakerEnabled,
		BreakerThreshold:       e.BreakerThreshold,
		BreakerWindow:          e.BreakerWindow,
		BreakerMinRecords:      e.BreakerMinRecords,
		BreakerProbeInterval:   e.BreakerProbeInterval,
		BreakerProbeMax:        e.BreakerProbeMax,
		TxIdleTimeout:          e.DBTxIdleTimeout,
		StallTimeout:           e.StallTimeout,
		PausedTooLong:          e.PausedTooLong,
		IdempotencyRetention:   e.IdempotencyRetention,
		RelayOnly:              e.RelayOnly,
		OutboxPollInterval:     e.OutboxPollInterval,
		OutboxListenDisabled:   !e.OutboxListen,
		OutboxRetention:        e.OutboxRetention,
		KafkaOptions:           e.kafkaOpts,
		Logger:                 log,
		Registerer:             reg,
		Test:                   e.test,
	}
	if h := hs.get(e.Handler); h != nil {
		c.Handler = h.Handler
	}
	for _, t := range e.KafkaTopics {
		if tp, set := e.topicPolicy(hs, t); set {
			if c.TopicPolicies == nil {
				c.TopicPolicies = map[string]processor.TopicPolicy{}
			}
			c.TopicPolicies[t] = tp
		}
	}
	return c
}

// topicPolicy returns topic's TopicPolicy: the TOPIC_<topic>_* variables, and for each setting
// they leave out, its handler's (Handler.RetryTiers and the rest, set in Go). set says the policy
// sets anything; otherwise the service-wide settings apply.
func (e *env) topicPolicy(hs *registry, topic string) (tp processor.TopicPolicy, set bool) {
	te, set := e.topics[topic]
	tp = te.policy
	if h := hs.get(te.handler); h != nil {
		tp.Handler = h.Handler
	}
	h := hs.get(cmp.Or(te.handler, e.Handler))
	if h == nil {
		return tp, set
	}
	fromGo := func(field string, isSet bool, apply func()) {
		if isSet && te.vars[field] == "" {
			apply()
			set = true
		}
	}
	fromGo("IdempotencyKey", h.IdempotencyKey != nil && !te.idempotencyKeySet, func() { tp.IdempotencyKey = h.IdempotencyKey })
	fromGo("RetryTiers", h.RetryTiers != nil, func() { tp.RetryTiers = h.RetryTiers })
	fromGo("LocalAttempts", h.LocalAttempts != 0, func() { tp.LocalAttempts = h.LocalAttempts })
	fromGo("OnDeadLetter", h.OnDeadLetter != "", func() { tp.OnDeadLetter = h.OnDeadLetter })
	fromGo("MaxRecordBytes", h.MaxRecordBytes != 0, func() { tp.MaxRecordBytes = h.MaxRecordBytes })
	fromGo("Concurrency", h.Concurrency != 0, func() { tp.Concurrency = h.Concurrency })
	if d := e.decoders[topic]; d[0] != nil || d[1] != nil {
		tp.Values, tp.Keys = d[0], d[1]
		set = true
	}
	return tp, set
}

// settingSource says where topic's TopicPolicy field got its value: the TOPIC_<topic>_*
// variable, the handler's Go field (Handler.<field> of the handler named), or "" when neither
// sets it.
func (e *env) settingSource(hs *registry, topic, field string) string {
	te := e.topics[topic]
	if v := te.vars[field]; v != "" {
		return v
	}
	name := cmp.Or(te.handler, e.Handler)
	h := hs.get(name)
	if h == nil {
		return ""
	}
	var isSet bool
	switch field {
	case "IdempotencyKey":
		isSet = h.IdempotencyKey != nil
	case "RetryTiers":
		isSet = h.RetryTiers != nil
	case "LocalAttempts":
		isSet = h.LocalAttempts != 0
	case "OnDeadLetter":
		isSet = h.OnDeadLetter != ""
	case "MaxRecordBytes":
		isSet = h.MaxRecordBytes != 0
	case "Concurrency":
		isSet = h.Concurrency != 0
	case "Values":
		isSet = h.Values != nil
	case "Keys":
		isSet = h.Keys != nil
	}
	if !isSet {
		return ""
	}
	return fmt.Sprintf("service.Handler{Name: %q}.%s", name, field)
}

// concurrency returns the source topics whose records are prepared concurrently (CONCURRENCY
// above 1, in whichever way it is set) and their concurrency.
func (e *env) concurrency(hs *registry) map[string]int {
	out := map[string]int{}
	for _, t := range e.KafkaTopics {
		tp, _ := e.topicPolicy(hs, t)
		if n := cmp.Or(tp.Concurrency, e.Concurrency); n > 1 {
			out[t] = n
		}
	}
	return out
}

// handlersUsed returns the names of the handlers the configuration runs, each once.
func (e *env) handlersUsed() []string {
	used := map[string]bool{}
	for _, t := range e.KafkaTopics {
		if h := cmp.Or(e.topics[t].handler, e.Handler); h != "" {
			used[h] = true
		}
	}
	return slices.Sorted(maps.Keys(used))
}

// operatorTokens parses OPERATOR_TOKENS (name:role:token entries, as CONSOLE_TOKENS's); nil if
// it is empty.
func (e *env) operatorTokens() ([]console.User, error) {
	if e.OperatorTokens == "" {
		return nil, nil
	}
	tokens, err := console.ParseTokens(e.OperatorTokens)
	if err != nil {
		return nil, fmt.Errorf("OPERATOR_TOKENS: %w", err)
	}
	return tokens, nil
}

// consoleLogins parses CONSOLE_USERS and CONSOLE_TOKENS (either may be empty).
func (e *env) consoleLogins() (users, tokens []console.User, err error) {
	if e.ConsoleUsers != "" {
		if users, err = console.ParseUsers(e.ConsoleUsers); err != nil {
			return nil, nil, fmt.Errorf("CONSOLE_USERS: %w", err)
		}
	}
	if e.ConsoleTokens != "" {
		if tokens, err = console.ParseTokens(e.ConsoleTokens); err != nil {
			return nil, nil, fmt.Errorf("CONSOLE_TOKENS: %w", err)
		}
	}
	return users, tokens, nil
}
