package service

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/processor"
)

// setEnv unsets every variable Env reads, then sets vars. The test must not be parallel.
func setEnv(t *testing.T, vars map[string]string) {
	t.Helper()
	names := append(envNames(), otelEnv...)
	for _, kv := range os.Environ() {
		if n, _, _ := strings.Cut(kv, "="); strings.HasPrefix(n, topicPrefix) {
			names = append(names, n)
		}
	}
	for _, n := range names {
		t.Setenv(n, "") // restores the old value after the test
		os.Unsetenv(n)
	}
	for k, v := range vars {
		t.Setenv(k, v)
	}
}

// minimal is the smallest valid environment of `processor run`.
func minimal() map[string]string {
	return map[string]string{
		"DATABASE_URL":   "postgres://kafkapg@localhost:5432/kafkapg",
		"KAFKA_BROKERS":  "localhost:9092",
		"KAFKA_GROUP_ID": "billing",
		"KAFKA_TOPICS":   "orders",
		"HANDLER":        "ledger",
	}
}

// with returns minimal() changed by kv (pairs of name, value); a value of "<unset>" removes the
// variable.
func with(kv ...string) map[string]string {
	m := minimal()
	for i := 0; i < len(kv); i += 2 {
		if kv[i+1] == "<unset>" {
			delete(m, kv[i])
		} else {
			m[kv[i]] = kv[i+1]
		}
	}
	return m
}

func TestEnvNamesCoverKnownVariables(t *testing.T) {
	t.Parallel()
	names := envNames()
	for _, n := range []string{"DATABASE_URL", "DB_MAX_CONNS", "KAFKA_BROKERS", "HANDLER", "LOG_FORMAT"} {
		if !slices.Contains(names, n) {
			t.Fatalf("envNames() = %v lacks %s: the test helpers would not clear it", names, n)
		}
	}
}

func TestLoadEnvDefaults(t *testing.T) {
	setEnv(t, minimal())
	e, err := loadEnv(builtins())
	if err != nil {
		t.Fatal(err)
	}
	want := &env{
		dbEnv:                 dbEnv{DatabaseURL: "postgres://kafkapg@localhost:5432/kafkapg", DBSchema: "kafkapg", DBMaxConns: 10},
		KafkaBrokers:          []string{"localhost:9092"},
		KafkaGroupID:          "billing",
		KafkaTopics:           []string{"orders"},
		KafkaStartOffset:      "earliest",
		KafkaSessionTimeout:   45 * time.Second,
		KafkaRebalanceTimeout: 30 * time.Second,
		Handler:               "ledger",
		HTTPAddr:              ":9090",
		ConsoleSampleEvery:    15 * time.Second,
		BatchMaxRecords:       500,
		BatchMaxWait:          batchWait(20 * time.Millisecond),
		RetryLocalAttempts:    3,
		MaxRecordBytes:        1 << 20,
		Concurrency:           1,
		RetryBackoffBase:      200 * time.Millisecond,
		RetryBackoffMax:       5 * time.Second,
		RetryTiers:            "1s,10s,1m",
		OnDeadLetter:          "skip",
		KafkaCreateTopics:     true,
		tiers:                 []time.Duration{time.Second, 10 * time.Second, time.Minute},
		ShutdownTimeout:       10 * time.Second,
		BreakerEnabled:        true,
		BreakerThreshold:      0.5,
		BreakerWindow:         30 * time.Second,
		BreakerMinRecords:     20,
		BreakerProbeInterval:  time.Second,
		BreakerProbeMax:       30 * time.Second,
		DBTxIdleTimeout:       30 * time.Second,
		StallTimeout:          2 * time.Minute,
		PausedTooLong:         4 * time.Hour,
		IdempotencyRetention:  7 * 24 * time.Hour,
		OutboxPollInterval:    time.Second,
		OutboxListen:          true,
		KafkaGroupProtocol:    "auto",
		MaxBufferedBytes:      64 << 20,
		LogLevel:              "info",
		LogFormat:             "json",
		tracing:               tracingSetup{exporter: "none"},
		topics:                map[string]topicPolicy{},
		schemaRegistryEnv:     schemaRegistryEnv{Timeout: 5 * time.Second},
		decoders:              map[string][2]processor.Decoder{"orders": {}},
	}
	if !reflect.DeepEqual(e, want) {
		t.Fatalf("loadEnv(builtins()) =\n %+v\nwant\n %+v", e, want)
	}
}

func TestLoadEnvValues(t *testing.T) {
	tests := []struct {
		name  string
		vars  map[string]string
		check func(e *env) bool
	}{
		{
			name:  "brokers list is trimmed and empty entries dropped",
			vars:  with("KAFKA_BROKERS", " a:1 , ,b:2"),
			check: func(e *env) bool { return slices.Equal(e.KafkaBrokers, []string{"a:1", "b:2"}) },
		},
		{
			name:  "topics list is trimmed and empty entries dropped",
			vars:  with("KAFKA_TOPICS", "orders,, refunds ,"),
			check: func(e *env) bool { return slices.Equal(e.KafkaTopics, []string{"orders", "refunds"}) },
		},
		{
			name:  "start offset latest",
			vars:  with("KAFKA_START_OFFSET", "latest"),
			check: func(e *env) bool { return e.KafkaStartOffset == "latest" },
		},
		{
			name:  "batch wait none means apply at once",
			vars:  with("BATCH_MAX_WAIT", "none"),
			check: func(e *env) bool { return time.Duration(e.BatchMaxWait) == processor.NoBatchWait },
		},
		{
			name: "durations and integers",
			vars: with("KAFKA_SESSION_TIMEOUT", "1m30s", "RETRY_BACKOFF_BASE", "1s", "RETRY_BACKOFF_MAX", "1s",
				"BATCH_MAX_RECORDS", "1", "RETRY_LOCAL_ATTEMPTS", "7", "DB_MAX_CONNS", "2147483647"),
			check: func(e *env) bool {
				return e.KafkaSessionTimeout == 90*time.Second && e.RetryBackoffBase == time.Second &&
					e.RetryBackoffMax == time.Second && e.BatchMaxRecords == 1 && e.RetryLocalAttempts == 7 &&
					e.DBMaxConns == 2147483647
			},
		},
		{
			name: "retry tiers",
			vars: with("RETRY_TIERS", "200ms, 500ms,1s"),
			check: func(e *env) bool {
				return slices.Equal(e.tiers, []time.Duration{200 * time.Millisecond, 500 * time.Millisecond, time.Second})
			},
		},
		{
			name:  "retry tiers set but empty: no tiers",
			vars:  with("RETRY_TIERS", ""),
			check: func(e *env) bool { return e.tiers != nil && len(e.tiers) == 0 },
		},
		{
			name:  "dead-letter policy and topic creation",
			vars:  with("ON_DEAD_LETTER", "block", "KAFKA_CREATE_TOPICS", "false"),
			check: func(e *env) bool { return e.OnDeadLetter == "block" && !e.KafkaCreateTopics },
		},
		{
			name:  "log settings",
			vars:  with("LOG_LEVEL", "debug", "LOG_FORMAT", "text"),
			check: func(e *env) bool { return e.LogLevel == "debug" && e.LogFormat == "text" },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			setEnv(t, tt.vars)
			e, err := loadEnv(builtins())
			if err != nil {
				t.Fatal(err)
			}
			if !tt.check(e) {
				t.Fatalf("loadEnv(builtins()) = %+v", e)
			}
		})
	}
}

func TestLoadEnvErrors(t *testing.T) {
	tests := []struct {
		name string
		vars map[string]string
		// want must all appear in the error.
		want []string
	}{
		{name: "nothing set: the first missing variable", vars: nil, want: []string{"DATABASE_URL is required"}},
		{name: "only the database set", vars: map[string]string{"DATABASE_URL": "postgres://x@y/z"}, want: []string{"KAFKA_BROKERS is required"}},
		{name: "group missing", vars: with("KAFKA_GROUP_ID", "<unset>"), want: []string{"KAFKA_GROUP_ID is required"}},
		{name: "topics missing", vars: with("KAFKA_TOPICS", "<unset>"), want: []string{"KAFKA_TOPICS is required"}},
		{name: "handler missing", vars: with("HANDLER", "<unset>"), want: []string{"HANDLER is required: this binary has handlers ledger, ledger-careless", "TOPIC_ORDERS_HANDLER"}},
		{name: "database URL blank", vars: with("DATABASE_URL", "   "), want: []string{"DATABASE_URL is required"}},
		{name: "brokers only separators", vars: with("KAFKA_BROKERS", " , ,"), want: []string{"KAFKA_BROKERS is required"}},
		{name: "group blank", vars: with("KAFKA_GROUP_ID", "  "), want: []string{"KAFKA_GROUP_ID is required"}},
		{name: "handler empty", vars: with("HANDLER", ""), want: []string{"HANDLER is required"}},
		{name: "a topic without its handler", vars: with("HANDLER", "", "KAFKA_TOPICS", "orders,refunds", "TOPIC_ORDERS_HANDLER", "ledger"), want: []string{"HANDLER is required", "set TOPIC_REFUNDS_HANDLER"}},

		{name: "session timeout without unit", vars: with("KAFKA_SESSION_TIMEOUT", "45"), want: []string{"KAFKA_SESSION_TIMEOUT", `"45"`, "duration"}},
		{name: "batch wait garbled", vars: with("BATCH_MAX_WAIT", "soon"), want: []string{"BATCH_MAX_WAIT", `"soon"`, "duration (e.g. 20ms), or none"}},
		{name: "backoff base garbled", vars: with("RETRY_BACKOFF_BASE", "2x"), want: []string{"RETRY_BACKOFF_BASE", `"2x"`, "duration"}},
		{name: "backoff max garbled", vars: with("RETRY_BACKOFF_MAX", "five"), want: []string{"RETRY_BACKOFF_MAX", `"five"`, "duration"}},
		{name: "shutdown timeout garbled", vars: with("SHUTDOWN_TIMEOUT", "10 s"), want: []string{"SHUTDOWN_TIMEOUT", `"10 s"`, "duration"}},
		{name: "tx idle timeout garbled", vars: with("DB_TX_IDLE_TIMEOUT", "-"), want: []string{"DB_TX_IDLE_TIMEOUT", `"-"`, "duration"}},
		{name: "duration set but empty", vars: with("RETRY_BACKOFF_MAX", ""), want: []string{"RETRY_BACKOFF_MAX", `""`}},
		{name: "batch size not a number", vars: with("BATCH_MAX_RECORDS", "ten"), want: []string{"BATCH_MAX_RECORDS", `"ten"`, "integer"}},
		{name: "local attempts fractional", vars: with("RETRY_LOCAL_ATTEMPTS", "1.5"), want: []string{"RETRY_LOCAL_ATTEMPTS", `"1.5"`, "integer"}},
		{name: "max conns overflows int32", vars: with("DB_MAX_CONNS", "2147483648"), want: []string{"DB_MAX_CONNS", `"2147483648"`, "integer"}},

		{name: "retry tier garbled", vars: with("RETRY_TIERS", "1s,soon"), want: []string{`RETRY_TIERS="1s,soon"`, `tier 2: "soon" is not a duration`}},
		{name: "retry tier zero", vars: with("RETRY_TIERS", "0s"), want: []string{`RETRY_TIERS="0s": tier 1: delay 0s must be positive`}},
		{name: "dead-letter policy unknown", vars: with("ON_DEAD_LETTER", "drop"), want: []string{`ON_DEAD_LETTER must be "skip" or "block", got "drop"`}},
		{name: "topic creation not a boolean", vars: with("KAFKA_CREATE_TOPICS", "maybe"), want: []string{"KAFKA_CREATE_TOPICS", `"maybe"`, "boolean"}},
		{name: "max record bytes zero", vars: with("MAX_RECORD_BYTES", "0"), want: []string{"MAX_RECORD_BYTES must be at least 1"}},
		{name: "unknown handler", vars: with("HANDLER", "nope"), want: []string{`HANDLER="nope"`, "not a handler of this binary (it has: ledger, ledger-careless, ledger-careless-slow, ledger-keyed)"}},
		{name: "start offset middle", vars: with("KAFKA_START_OFFSET", "middle"), want: []string{`KAFKA_START_OFFSET must be "earliest" or "latest", got "middle"`}},
		{name: "backoff max below base", vars: with("RETRY_BACKOFF_BASE", "2s", "RETRY_BACKOFF_MAX", "1s"), want: []string{"RETRY_BACKOFF_MAX 1s is less than RETRY_BACKOFF_BASE (2s)"}},
		{name: "backoff base above default max", vars: with("RETRY_BACKOFF_BASE", "10s"), want: []string{"RETRY_BACKOFF_MAX 5s is less than RETRY_BACKOFF_BASE (10s)"}},
		{name: "zero session timeout", vars: with("KAFKA_SESSION_TIMEOUT", "0s"), want: []string{"KAFKA_SESSION_TIMEOUT must be positive"}},
		{name: "zero backoff base", vars: with("RETRY_BACKOFF_BASE", "0"), want: []string{"RETRY_BACKOFF_BASE must be positive"}},
		{name: "negative shutdown timeout", vars: with("SHUTDOWN_TIMEOUT", "-1s"), want: []string{"SHUTDOWN_TIMEOUT must be positive", "-1s"}},
		{name: "zero tx idle timeout", vars: with("DB_TX_IDLE_TIMEOUT", "0ms"), want: []string{"DB_TX_IDLE_TIMEOUT must be positive"}},
		{name: "zero stall timeout", vars: with("STALL_TIMEOUT", "0s"), want: []string{"STALL_TIMEOUT must be positive"}},
		{name: "unknown group protocol", vars: with("KAFKA_GROUP_PROTOCOL", "consumer-v2"), want: []string{`KAFKA_GROUP_PROTOCOL must be "auto" or "classic", got "consumer-v2"`}},
		{name: "buffer under a mebibyte", vars: with("MAX_BUFFERED_BYTES", "1000"), want: []string{"MAX_BUFFERED_BYTES must be at least 1 MiB (1048576), got 1000"}},
		{name: "buffer garbled", vars: with("MAX_BUFFERED_BYTES", "64MiB"), want: []string{"MAX_BUFFERED_BYTES", `"64MiB"`, "integer"}},
		{name: "negative batch wait", vars: with("BATCH_MAX_WAIT", "-1ms"), want: []string{"BATCH_MAX_WAIT must be positive, or none to apply records as they arrive, got -1ms"}},
		{name: "zero batch wait", vars: with("BATCH_MAX_WAIT", "0"), want: []string{"BATCH_MAX_WAIT must be positive, or none", "got 0s"}},
		{name: "zero batch size", vars: with("BATCH_MAX_RECORDS", "0"), want: []string{"BATCH_MAX_RECORDS must be at least 1, got 0"}},
		{name: "zero local attempts", vars: with("RETRY_LOCAL_ATTEMPTS", "0"), want: []string{"RETRY_LOCAL_ATTEMPTS must be at least 1, got 0"}},
		{name: "zero max conns", vars: with("DB_MAX_CONNS", "0"), want: []string{"DB_MAX_CONNS must be at least 1, got 0"}},
		{name: "empty schema", vars: with("DB_SCHEMA", ""), want: []string{"DB_SCHEMA must not be empty"}},
		{name: "bad log level", vars: with("LOG_LEVEL", "loud"), want: []string{"LOG_LEVEL", `"loud"`}},
		{name: "bad log format", vars: with("LOG_FORMAT", "xml"), want: []string{"LOG_FORMAT must be json or text", `"xml"`}},
		{name: "unknown SASL mechanism", vars: with("KAFKA_SASL_MECHANISM", "GSSAPI", "KAFKA_SASL_USERNAME", "u", "KAFKA_SASL_PASSWORD", "p"),
			want: []string{"KAFKA_SASL_MECHANISM must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512", `"GSSAPI"`}},
		{name: "SASL without password", vars: with("KAFKA_SASL_MECHANISM", "PLAIN", "KAFKA_SASL_USERNAME", "u"),
			want: []string{"KAFKA_SASL_MECHANISM=PLAIN needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD"}},
		{name: "SASL credentials without mechanism", vars: with("KAFKA_SASL_USERNAME", "u", "KAFKA_SASL_PASSWORD", "p"),
			want: []string{"KAFKA_SASL_MECHANISM is not"}},
		{name: "TLS CA file missing", vars: with("KAFKA_TLS_CA_FILE", "/nonexistent/ca.pem"), want: []string{"KAFKA_TLS_CA_FILE", "/nonexistent/ca.pem"}},
		{name: "TLS client cert without key", vars: with("KAFKA_TLS_CERT_FILE", "/x/cert.pem"), want: []string{"KAFKA_TLS_CERT_FILE and KAFKA_TLS_KEY_FILE must be set together"}},
		{name: "TLS skip-verify without TLS", vars: with("KAFKA_TLS_INSECURE_SKIP_VERIFY", "true"), want: []string{"set KAFKA_TLS=true"}},
		{name: "TLS not a boolean", vars: with("KAFKA_TLS", "yes please"), want: []string{"KAFKA_TLS", "boolean"}},
		{name: "breaker threshold above 1", vars: with("BREAKER_THRESHOLD", "50"), want: []string{"BREAKER_THRESHOLD is a share of records, above 0 and at most 1, got 50"}},
		{name: "breaker threshold zero", vars: with("BREAKER_THRESHOLD", "0"), want: []string{"BREAKER_THRESHOLD is a share of records", "got 0", "BREAKER_ENABLED=false turns the breaker off"}},
		{name: "breaker threshold not a number", vars: with("BREAKER_THRESHOLD", "half"), want: []string{"BREAKER_THRESHOLD", `"half"`, "number"}},
		{name: "breaker probe max below interval", vars: with("BREAKER_PROBE_INTERVAL", "10s", "BREAKER_PROBE_MAX", "1s"), want: []string{"BREAKER_PROBE_MAX 1s is less than BREAKER_PROBE_INTERVAL (10s)"}},
		{name: "rebalance timeout within the handoff", vars: with("KAFKA_REBALANCE_TIMEOUT", "5s"), want: []string{"KAFKA_REBALANCE_TIMEOUT 5s must be longer than HandoffTimeout (5s)"}},
		{name: "topic listed twice", vars: with("KAFKA_TOPICS", "orders,orders"), want: []string{`KAFKA_TOPICS lists "orders" twice`}},
		{name: "a retry topic as a source", vars: with("KAFKA_TOPICS", "orders.billing.retry.1"), want: []string{"KAFKA_TOPICS lists", "looks like a retry or dead-letter topic"}},
		{name: "per-topic variable for a topic not consumed", vars: with("TOPIC_REFUNDS_RETRY_TIERS", "1s"),
			want: []string{"TOPIC_REFUNDS_RETRY_TIERS names no topic of KAFKA_TOPICS (orders → TOPIC_ORDERS_RETRY_TIERS)"}},
		{name: "per-topic variable with an unknown setting", vars: with("TOPIC_ORDERS_RETRY_TIER", "1s"),
			want: []string{"TOPIC_ORDERS_RETRY_TIER is not a per-topic setting", "TOPIC_<topic>_{HANDLER,RETRY_TIERS,"}},
		{name: "per-topic handler unknown", vars: with("TOPIC_ORDERS_HANDLER", "nope"),
			want: []string{`TOPIC_ORDERS_HANDLER="nope": not a handler of this binary`}},
		{name: "per-topic tiers garbled", vars: with("TOPIC_ORDERS_RETRY_TIERS", "1s,later"),
			want: []string{`TOPIC_ORDERS_RETRY_TIERS="1s,later"`, `"later" is not a duration`}},
		{name: "per-topic attempts zero", vars: with("TOPIC_ORDERS_RETRY_LOCAL_ATTEMPTS", "0"),
			want: []string{`TOPIC_ORDERS_RETRY_LOCAL_ATTEMPTS="0": must be at least 1, got 0`}},
		{name: "per-topic max record bytes garbled", vars: with("TOPIC_ORDERS_MAX_RECORD_BYTES", "1MiB"),
			want: []string{`TOPIC_ORDERS_MAX_RECORD_BYTES="1MiB": not an integer`}},
		{name: "per-topic dead-letter policy unknown", vars: with("TOPIC_ORDERS_ON_DEAD_LETTER", "drop"),
			want: []string{`TOPIC_ORDERS_ON_DEAD_LETTER must be "skip" or "block", got "drop"`}},
		{name: "per-topic idempotency key garbled", vars: with("TOPIC_ORDERS_IDEMPOTENCY_KEY", "field:id"),
			want: []string{`TOPIC_ORDERS_IDEMPOTENCY_KEY="field:id": must be header:<name>, json:<field>`}},
		{name: "per-topic idempotency key with an empty JSON field", vars: with("TOPIC_ORDERS_IDEMPOTENCY_KEY", "json:order..id"),
			want: []string{`TOPIC_ORDERS_IDEMPOTENCY_KEY="json:order..id": must be`}},
		{name: "idempotency retention zero", vars: with("IDEMPOTENCY_RETENTION", "0s"), want: []string{"IDEMPOTENCY_RETENTION must be positive"}},
		{name: "outbox retention negative", vars: with("OUTBOX_RETENTION", "-1s"), want: []string{"OUTBOX_RETENTION must not be negative"}},
		{name: "console without users", vars: with("CONSOLE_ADDR", ":9091"),
			want: []string{"CONSOLE_ADDR is set but CONSOLE_USERS is not"}},
		{name: "console user with an unknown role", vars: with("CONSOLE_ADDR", ":9091", "CONSOLE_USERS", "ann:admin:a-long-password"),
			want: []string{`CONSOLE_USERS: entry 1: its second field, the role, must be viewer or operator (want name:role:password)`}},
		{name: "console user with a short password, not echoed", vars: with("CONSOLE_ADDR", ":9091", "CONSOLE_USERS", "ann:viewer:short"),
			want: []string{`CONSOLE_USERS: user "ann": the password must be at least 12 characters`}},
		{name: "console entry garbled, not echoed", vars: with("CONSOLE_USERS", "ann:viewer:a-long-password,ann-secret-password"),
			want: []string{`CONSOLE_USERS: entry 2: want name:role:password`}},
		{name: "console token too short, not echoed", vars: with("CONSOLE_ADDR", ":9091", "CONSOLE_TOKENS", "bot:operator:short-token"),
			want: []string{`CONSOLE_TOKENS: token "bot": the token must be at least 16 characters`}},
		{name: "operator token too short", vars: with("OPERATOR_TOKENS", "ci:operator:short-token"),
			want: []string{`OPERATOR_TOKENS: token "ci": the token must be at least 16 characters`}},
		{name: "operator token without a role", vars: with("OPERATOR_TOKENS", "ci:0123456789abcdef-token"),
			want: []string{`OPERATOR_TOKENS: entry 1: want name:role:token`}},
		{name: "console sample interval out of range", vars: with("CONSOLE_SAMPLE_INTERVAL", "100ms"),
			want: []string{"CONSOLE_SAMPLE_INTERVAL=100ms: want 1s to 5m"}},
		{name: "relay only with topics", vars: with("RELAY_ONLY", "true"),
			want: []string{"KAFKA_TOPICS must be empty with RELAY_ONLY=true"}},
		{name: "no topics and not relay only", vars: with("KAFKA_TOPICS", ""),
			want: []string{"KAFKA_TOPICS is required (or RELAY_ONLY=true"}},
		{name: "two topics with one variable name", vars: with("KAFKA_TOPICS", "a.b,a-b"),
			want: []string{`KAFKA_TOPICS: topics "a.b" and "a-b" have the same name in per-topic variables (TOPIC_A_B_*)`}},
		{name: "problems the processor finds are reported with the environment's", vars: with("BATCH_MAX_WAIT", "0", "TOPIC_ORDERS_ON_DEAD_LETTER", "drop", "RETRY_BACKOFF_BASE", "2s", "RETRY_BACKOFF_MAX", "1s"),
			want: []string{"BATCH_MAX_WAIT must be positive", `TOPIC_ORDERS_ON_DEAD_LETTER must be "skip" or "block"`, "RETRY_BACKOFF_MAX 1s is less than RETRY_BACKOFF_BASE (2s)"}},
		{name: "several problems are all reported", vars: with("HANDLER", "nope", "LOG_FORMAT", "xml", "BATCH_MAX_RECORDS", "0"),
			want: []string{"HANDLER", "LOG_FORMAT", "BATCH_MAX_RECORDS"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			setEnv(t, tt.vars)
			e, err := loadEnv(builtins())
			if err == nil {
				t.Fatalf("loadEnv(builtins()) = %+v, want an error", e)
			}
			var ce *configError
			if !errors.As(err, &ce) {
				t.Errorf("error %T %q is not a *configError", err, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			// Each variable is named once: the processor's check of a value the environment
			// refused must not add a second, confusing message.
			seen := map[string]bool{}
			for _, line := range strings.Split(err.Error(), "\n") {
				name := varOf(errors.New(line))
				if seen[name] {
					t.Errorf("%s is named twice in %q", name, err)
				}
				seen[name] = true
			}
		})
	}
}

func TestLoadDBEnv(t *testing.T) {
	tests := []struct {
		name    string
		vars    map[string]string
		want    *dbEnv
		wantErr []string
	}{
		{
			name: "defaults",
			vars: map[string]string{"DATABASE_URL": "postgres://a@b/c"},
			want: &dbEnv{DatabaseURL: "postgres://a@b/c", DBSchema: "kafkapg", DBMaxConns: 10},
		},
		{
			name: "set",
			vars: map[string]string{"DATABASE_URL": "postgres://a@b/c", "DB_SCHEMA": "kp", "DB_MAX_CONNS": "3"},
			want: &dbEnv{DatabaseURL: "postgres://a@b/c", DBSchema: "kp", DBMaxConns: 3},
		},
		{
			// migrate needs only the database: Kafka settings, good or bad, are not read.
			name: "ignores the rest of the configuration",
			vars: map[string]string{"DATABASE_URL": "postgres://a@b/c", "HANDLER": "nope", "BATCH_MAX_WAIT": "soon"},
			want: &dbEnv{DatabaseURL: "postgres://a@b/c", DBSchema: "kafkapg", DBMaxConns: 10},
		},
		{name: "url missing", vars: nil, wantErr: []string{"DATABASE_URL is required"}},
		{name: "url blank", vars: map[string]string{"DATABASE_URL": " "}, wantErr: []string{"DATABASE_URL is required"}},
		{name: "max conns garbled", vars: map[string]string{"DATABASE_URL": "postgres://a@b/c", "DB_MAX_CONNS": "many"},
			wantErr: []string{"DB_MAX_CONNS", `"many"`, "integer"}},
		{name: "max conns negative", vars: map[string]string{"DATABASE_URL": "postgres://a@b/c", "DB_MAX_CONNS": "-1"},
			wantErr: []string{"DB_MAX_CONNS must be at least 1, got -1"}},
		{name: "schema empty", vars: map[string]string{"DATABASE_URL": "postgres://a@b/c", "DB_SCHEMA": ""},
			wantErr: []string{"DB_SCHEMA must not be empty"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			setEnv(t, tt.vars)
			got, err := loadDBEnv()
			if tt.wantErr == nil {
				if err != nil {
					t.Fatal(err)
				}
				if *got != *tt.want {
					t.Fatalf("loadDBEnv() = %+v, want %+v", got, tt.want)
				}
				return
			}
			if err == nil {
				t.Fatalf("loadDBEnv() = %+v, want an error", got)
			}
			var ce *configError
			if !errors.As(err, &ce) {
				t.Errorf("error %T %q is not a *configError", err, err)
			}
			for _, w := range tt.wantErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestRegistryRefusesBadHandlers(t *testing.T) {
	t.Parallel()
	h := Handler{Name: "a", Handler: ledger.Handler{}}
	for _, tt := range []struct {
		name string
		hs   []Handler
		want string
	}{
		{"none", nil, "no handlers"},
		{"no name", []Handler{{Handler: ledger.Handler{}}}, "handler 1 has no Name"},
		{"no handler", []Handler{{Name: "x"}}, `handler "x" has no Handler`},
		{"twice", []Handler{h, h}, `two handlers are named "a"`},
	} {
		var out strings.Builder
		if code := Run([]string{"run"}, &out, tt.hs...); code != 2 || !strings.Contains(out.String(), tt.want) {
			t.Errorf("%s: Run = %d, %q; want 2 and %q", tt.name, code, out.String(), tt.want)
		}
	}
}

// TestDocsDocumentEveryVariable keeps docs/configuration.md's tables complete: a row for every
// variable and every per-topic setting.
func TestDocsDocumentEveryVariable(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range envNames() {
		if !strings.Contains(string(doc), "| `"+n+"`") && !strings.Contains(string(doc), "/ `"+n+"`") {
			t.Errorf("docs/configuration.md has no row for %s", n)
		}
	}
	for _, s := range topicSettings {
		if !strings.Contains(string(doc), "| `"+topicPrefix+"<topic>_"+s.name+"` |") {
			t.Errorf("docs/configuration.md has no row for %s<topic>_%s", topicPrefix, s.name)
		}
	}
}

// TestProcessorConfig checks the translations between the environment and processor.Config
// where they spell a setting differently: a mistake there would silently leave the breaker on,
// or make BATCH_MAX_WAIT=none wait the default.
func TestProcessorConfig(t *testing.T) {
	for _, tt := range []struct {
		name  string
		vars  map[string]string
		check func(c *processor.Config) string
	}{
		{"defaults", minimal(), func(c *processor.Config) string {
			if c.BreakerThreshold != 0.5 || c.BatchMaxWait != 20*time.Millisecond || c.StartOffset != processor.StartEarliest {
				return fmt.Sprintf("breaker %v, batch wait %v, start %q", c.BreakerThreshold, c.BatchMaxWait, c.StartOffset)
			}
			return ""
		}},
		{"BREAKER_ENABLED=false turns the breaker off", with("BREAKER_ENABLED", "false"), func(c *processor.Config) string {
			if !c.BreakerDisabled {
				return "BreakerDisabled = false"
			}
			return ""
		}},
		{"per-topic settings", with("KAFKA_TOPICS", "orders,pay.ments-v1", "HANDLER", "ledger",
			"TOPIC_PAY_MENTS_V1_HANDLER", "ledger-careless", "TOPIC_PAY_MENTS_V1_RETRY_TIERS", "5s",
			"TOPIC_PAY_MENTS_V1_RETRY_LOCAL_ATTEMPTS", "9", "TOPIC_ORDERS_ON_DEAD_LETTER", "block",
			"TOPIC_ORDERS_MAX_RECORD_BYTES", "2048", "TOPIC_ORDERS_RETRY_TIERS", ""), func(c *processor.Config) string {
			want := map[string]processor.TopicPolicy{
				"pay.ments-v1": {Handler: ledger.Careless{}, RetryTiers: []time.Duration{5 * time.Second}, LocalAttempts: 9},
				"orders":       {OnDeadLetter: processor.OnDeadLetterBlock, MaxRecordBytes: 2048, RetryTiers: []time.Duration{}},
			}
			if !reflect.DeepEqual(c.TopicPolicies, want) || c.Handler != (ledger.Handler{}) {
				return fmt.Sprintf("TopicPolicies = %+v, Handler = %T; want %+v", c.TopicPolicies, c.Handler, want)
			}
			return ""
		}},
		{"idempotency keys: the environment's, else the handler's", with("KAFKA_TOPICS", "orders,postings,refunds", "HANDLER", "ledger-keyed",
			"TOPIC_ORDERS_IDEMPOTENCY_KEY", "json:order.id", "TOPIC_REFUNDS_IDEMPOTENCY_KEY", "none"), func(c *processor.Config) string {
			rec := &processor.Record{Value: []byte(`{"order":{"id":"o-7"},"event_id":"e-1"}`)}
			key := func(topic string) string {
				f := c.TopicPolicies[topic].IdempotencyKey
				if f == nil {
					return "none"
				}
				k, err := f(rec)
				return fmt.Sprintf("%s%v", k, err)
			}
			if got := key("orders") + " " + key("postings") + " " + key("refunds"); got != "o-7<nil> e-1<nil> none" {
				return fmt.Sprintf("keys %s, want o-7 (TOPIC_ORDERS_IDEMPOTENCY_KEY), e-1 (the handler's), none", got)
			}
			return ""
		}},
		{"RELAY_ONLY needs no topics and no handler", with("KAFKA_TOPICS", "", "RELAY_ONLY", "true", "HANDLER", ""), func(c *processor.Config) string {
			if !c.RelayOnly || len(c.Topics) != 0 {
				return fmt.Sprintf("RelayOnly %v, Topics %q", c.RelayOnly, c.Topics)
			}
			return ""
		}},
		{"BATCH_MAX_WAIT=none applies at once", with("BATCH_MAX_WAIT", "none"), func(c *processor.Config) string {
			if c.BatchMaxWait != processor.NoBatchWait {
				return fmt.Sprintf("BatchMaxWait = %v, want NoBatchWait", c.BatchMaxWait)
			}
			return ""
		}},
		{"KAFKA_START_OFFSET=latest", with("KAFKA_START_OFFSET", "latest"), func(c *processor.Config) string {
			if c.StartOffset != processor.StartLatest {
				return fmt.Sprintf("StartOffset = %q", c.StartOffset)
			}
			return ""
		}},
		{"STALL_TIMEOUT", with("STALL_TIMEOUT", "45s"), func(c *processor.Config) string {
			if c.StallTimeout != 45*time.Second {
				return fmt.Sprintf("StallTimeout = %v", c.StallTimeout)
			}
			return ""
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			setEnv(t, tt.vars)
			e, err := loadEnv(builtins())
			if err != nil {
				t.Fatal(err)
			}
			if msg := tt.check(e.processorConfig(builtins(), nil, nil)); msg != "" {
				t.Error(msg)
			}
		})
	}
}

// builtinHandlers are cmd/processor's handlers.
var builtinHandlers = []Handler{
	{Name: "ledger-keyed", Handler: ledger.Handler{}, IdempotencyKey: processor.KeyFromJSON("event_id")},
	{Name: "ledger", Handler: ledger.Handler{}, Setup: SetupSQL(ledger.Schema)},
	{Name: "ledger-careless", Handler: ledger.Careless{}, Setup: SetupSQL(ledger.CarelessSchema)},
	{Name: "ledger-careless-slow", Handler: ledger.NewPrepared(ledger.Careless{}, 5*time.Millisecond), Setup: SetupSQL(ledger.CarelessSchema + ledger.PreparedSchema)},
}

// builtins returns the registry of builtinHandlers.
func builtins() *registry {
	r, err := newRegistry(builtinHandlers)
	if err != nil {
		panic(err)
	}
	return r
}

// TestMisspeltVariablesStopTheService: RETRY_TIER=5s was ignored (the service started with the
// default tiers). A name a letter or two from one the service reads is refused, naming the one
// meant; other programs' variables (Kubernetes' KAFKA_PORT for a Service named kafka) are not.
func TestMisspeltVariablesStopTheService(t *testing.T) {
	base := map[string]string{"DATABASE_URL": "postgres://x/y", "KAFKA_BROKERS": "k:9092", "KAFKA_GROUP_ID": "g", "KAFKA_TOPICS": "orders", "HANDLER": "ledger"}
	for _, tc := range []struct{ name, want string }{
		{"RETRY_TIER", "RETRY_TIER is not a variable kafkapg reads: did you mean RETRY_TIERS?"},
		{"SHUTDOWN_TIMOUT", "did you mean SHUTDOWN_TIMEOUT?"},
		{"BATCH_MAX_RECORD", "did you mean BATCH_MAX_RECORDS?"},
		{"KAFKA_GROUP_IDS", ""}, // KAFKA_GROUP_ID is set: not a misspelling of it
		{"DB_MAX_CON", "did you mean DB_MAX_CONNS?"},
		{"KAFKA_PORT", ""},
		{"KAFKA_SERVICE_HOST", ""},
		{"CONSOLE_PORT", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vars := maps.Clone(base)
			vars[tc.name] = "5s"
			setEnv(t, vars)
			_, err := loadEnv(builtins())
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("%s set: %v; want no error", tc.name, err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("%s set: %v; want an error saying %q", tc.name, err, tc.want)
			}
		})
	}
}
