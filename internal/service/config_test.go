package service

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/processor"
)

// envNames returns every environment variable Env reads, from its struct tags, so that a new
// variable is cleared by the tests too.
func envNames() []string {
	var names []string
	var walk func(t reflect.Type)
	walk = func(t reflect.Type) {
		for f := range t.Fields() {
			if f.Anonymous {
				walk(f.Type)
				continue
			}
			if n := f.Tag.Get("envconfig"); n != "" {
				names = append(names, n)
			}
		}
	}
	walk(reflect.TypeFor[Env]())
	return names
}

// setEnv unsets every variable Env reads, then sets vars. The test must not be parallel.
func setEnv(t *testing.T, vars map[string]string) {
	t.Helper()
	for _, n := range envNames() {
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
	env, err := LoadEnv()
	if err != nil {
		t.Fatal(err)
	}
	want := &Env{
		DBEnv:                 DBEnv{DatabaseURL: "postgres://kafkapg@localhost:5432/kafkapg", DBSchema: "kafkapg", DBMaxConns: 10},
		KafkaBrokers:          []string{"localhost:9092"},
		KafkaGroupID:          "billing",
		KafkaTopics:           []string{"orders"},
		KafkaStartOffset:      "earliest",
		KafkaSessionTimeout:   45 * time.Second,
		KafkaRebalanceTimeout: 30 * time.Second,
		Handler:               "ledger",
		HTTPAddr:              ":9090",
		BatchMaxRecords:       500,
		BatchMaxWait:          20 * time.Millisecond,
		RetryLocalAttempts:    3,
		MaxRecordBytes:        1 << 20,
		RetryBackoffBase:      200 * time.Millisecond,
		RetryBackoffMax:       5 * time.Second,
		RetryTiers:            "1s,10s,1m",
		OnDeadLetter:          "skip",
		KafkaCreateTopics:     true,
		Tiers:                 []time.Duration{time.Second, 10 * time.Second, time.Minute},
		ShutdownTimeout:       10 * time.Second,
		BreakerThreshold:      0.5,
		BreakerWindow:         30 * time.Second,
		BreakerMinRecords:     20,
		BreakerProbeInterval:  time.Second,
		BreakerProbeMax:       30 * time.Second,
		DBTxIdleTimeout:       30 * time.Second,
		StallTimeout:          2 * time.Minute,
		KafkaGroupProtocol:    "auto",
		MaxBufferedBytes:      64 << 20,
		LogLevel:              "info",
		LogFormat:             "json",
	}
	if !reflect.DeepEqual(env, want) {
		t.Fatalf("LoadEnv() =\n %+v\nwant\n %+v", env, want)
	}
}

func TestLoadEnvValues(t *testing.T) {
	tests := []struct {
		name  string
		vars  map[string]string
		check func(e *Env) bool
	}{
		{
			name:  "brokers list is trimmed and empty entries dropped",
			vars:  with("KAFKA_BROKERS", " a:1 , ,b:2"),
			check: func(e *Env) bool { return slices.Equal(e.KafkaBrokers, []string{"a:1", "b:2"}) },
		},
		{
			name:  "topics list is trimmed and empty entries dropped",
			vars:  with("KAFKA_TOPICS", "orders,, refunds ,"),
			check: func(e *Env) bool { return slices.Equal(e.KafkaTopics, []string{"orders", "refunds"}) },
		},
		{
			name:  "start offset latest",
			vars:  with("KAFKA_START_OFFSET", "latest"),
			check: func(e *Env) bool { return e.KafkaStartOffset == "latest" },
		},
		{
			name:  "zero batch wait means apply at once",
			vars:  with("BATCH_MAX_WAIT", "0"),
			check: func(e *Env) bool { return e.BatchMaxWait == 0 },
		},
		{
			name: "durations and integers",
			vars: with("KAFKA_SESSION_TIMEOUT", "1m30s", "RETRY_BACKOFF_BASE", "1s", "RETRY_BACKOFF_MAX", "1s",
				"BATCH_MAX_RECORDS", "1", "RETRY_LOCAL_ATTEMPTS", "7", "DB_MAX_CONNS", "2147483647"),
			check: func(e *Env) bool {
				return e.KafkaSessionTimeout == 90*time.Second && e.RetryBackoffBase == time.Second &&
					e.RetryBackoffMax == time.Second && e.BatchMaxRecords == 1 && e.RetryLocalAttempts == 7 &&
					e.DBMaxConns == 2147483647
			},
		},
		{
			name: "retry tiers",
			vars: with("RETRY_TIERS", "200ms, 500ms,1s"),
			check: func(e *Env) bool {
				return slices.Equal(e.Tiers, []time.Duration{200 * time.Millisecond, 500 * time.Millisecond, time.Second})
			},
		},
		{
			name:  "retry tiers set but empty: no tiers",
			vars:  with("RETRY_TIERS", ""),
			check: func(e *Env) bool { return e.Tiers != nil && len(e.Tiers) == 0 },
		},
		{
			name:  "dead-letter policy and topic creation",
			vars:  with("ON_DEAD_LETTER", "block", "KAFKA_CREATE_TOPICS", "false"),
			check: func(e *Env) bool { return e.OnDeadLetter == "block" && !e.KafkaCreateTopics },
		},
		{
			name:  "log settings",
			vars:  with("LOG_LEVEL", "debug", "LOG_FORMAT", "text"),
			check: func(e *Env) bool { return e.LogLevel == "debug" && e.LogFormat == "text" },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			setEnv(t, tt.vars)
			env, err := LoadEnv()
			if err != nil {
				t.Fatal(err)
			}
			if !tt.check(env) {
				t.Fatalf("LoadEnv() = %+v", env)
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
		{name: "handler missing", vars: with("HANDLER", "<unset>"), want: []string{"HANDLER is required"}},
		{name: "database URL blank", vars: with("DATABASE_URL", "   "), want: []string{"DATABASE_URL is required"}},
		{name: "brokers only separators", vars: with("KAFKA_BROKERS", " , ,"), want: []string{"KAFKA_BROKERS is required"}},
		{name: "group blank", vars: with("KAFKA_GROUP_ID", "  "), want: []string{"KAFKA_GROUP_ID is required"}},
		{name: "handler empty", vars: with("HANDLER", ""), want: []string{"HANDLER is required"}},

		{name: "session timeout without unit", vars: with("KAFKA_SESSION_TIMEOUT", "45"), want: []string{"KAFKA_SESSION_TIMEOUT", `"45"`, "duration"}},
		{name: "batch wait garbled", vars: with("BATCH_MAX_WAIT", "soon"), want: []string{"BATCH_MAX_WAIT", `"soon"`, "duration"}},
		{name: "backoff base garbled", vars: with("RETRY_BACKOFF_BASE", "2x"), want: []string{"RETRY_BACKOFF_BASE", `"2x"`, "duration"}},
		{name: "backoff max garbled", vars: with("RETRY_BACKOFF_MAX", "five"), want: []string{"RETRY_BACKOFF_MAX", `"five"`, "duration"}},
		{name: "shutdown timeout garbled", vars: with("SHUTDOWN_TIMEOUT", "10 s"), want: []string{"SHUTDOWN_TIMEOUT", `"10 s"`, "duration"}},
		{name: "tx idle timeout garbled", vars: with("DB_TX_IDLE_TIMEOUT", "-"), want: []string{"DB_TX_IDLE_TIMEOUT", `"-"`, "duration"}},
		{name: "duration set but empty", vars: with("RETRY_BACKOFF_MAX", ""), want: []string{"RETRY_BACKOFF_MAX", `""`}},
		{name: "batch size not a number", vars: with("BATCH_MAX_RECORDS", "ten"), want: []string{"BATCH_MAX_RECORDS", `"ten"`, "integer"}},
		{name: "local attempts fractional", vars: with("RETRY_LOCAL_ATTEMPTS", "1.5"), want: []string{"RETRY_LOCAL_ATTEMPTS", `"1.5"`, "integer"}},
		{name: "max conns overflows int32", vars: with("DB_MAX_CONNS", "2147483648"), want: []string{"DB_MAX_CONNS", `"2147483648"`, "integer"}},

		{name: "retry tier garbled", vars: with("RETRY_TIERS", "1s,soon"), want: []string{`RETRY_TIERS="1s,soon"`, `tier 2: "soon" is not a duration`}},
		{name: "retry tier zero", vars: with("RETRY_TIERS", "0s"), want: []string{"RETRY_TIERS", "tier 1: delay 0s must be positive"}},
		{name: "dead-letter policy unknown", vars: with("ON_DEAD_LETTER", "drop"), want: []string{"ON_DEAD_LETTER must be skip or block", `"drop"`}},
		{name: "topic creation not a boolean", vars: with("KAFKA_CREATE_TOPICS", "maybe"), want: []string{"KAFKA_CREATE_TOPICS", `"maybe"`, "boolean"}},
		{name: "max record bytes zero", vars: with("MAX_RECORD_BYTES", "0"), want: []string{"MAX_RECORD_BYTES must be at least 1"}},
		{name: "unknown handler", vars: with("HANDLER", "nope"), want: []string{`HANDLER="nope"`, "not a built-in handler", "(have: ledger, ledger-careless)"}},
		{name: "start offset middle", vars: with("KAFKA_START_OFFSET", "middle"), want: []string{"KAFKA_START_OFFSET", "earliest or latest", `"middle"`}},
		{name: "backoff max below base", vars: with("RETRY_BACKOFF_BASE", "2s", "RETRY_BACKOFF_MAX", "1s"), want: []string{"RETRY_BACKOFF_MAX (1s)", "RETRY_BACKOFF_BASE (2s)"}},
		{name: "backoff base above default max", vars: with("RETRY_BACKOFF_BASE", "10s"), want: []string{"RETRY_BACKOFF_MAX (5s)", "RETRY_BACKOFF_BASE (10s)"}},
		{name: "zero session timeout", vars: with("KAFKA_SESSION_TIMEOUT", "0s"), want: []string{"KAFKA_SESSION_TIMEOUT must be positive"}},
		{name: "zero backoff base", vars: with("RETRY_BACKOFF_BASE", "0"), want: []string{"RETRY_BACKOFF_BASE must be positive"}},
		{name: "negative shutdown timeout", vars: with("SHUTDOWN_TIMEOUT", "-1s"), want: []string{"SHUTDOWN_TIMEOUT must be positive", "-1s"}},
		{name: "zero tx idle timeout", vars: with("DB_TX_IDLE_TIMEOUT", "0ms"), want: []string{"DB_TX_IDLE_TIMEOUT must be positive"}},
		{name: "zero stall timeout", vars: with("STALL_TIMEOUT", "0s"), want: []string{"STALL_TIMEOUT must be positive"}},
		{name: "unknown group protocol", vars: with("KAFKA_GROUP_PROTOCOL", "consumer-v2"), want: []string{"KAFKA_GROUP_PROTOCOL must be auto or classic", `"consumer-v2"`}},
		{name: "buffer under a mebibyte", vars: with("MAX_BUFFERED_BYTES", "1000"), want: []string{"MAX_BUFFERED_BYTES must be at least 1048576", "1000"}},
		{name: "buffer garbled", vars: with("MAX_BUFFERED_BYTES", "64MiB"), want: []string{"MAX_BUFFERED_BYTES", `"64MiB"`, "integer"}},
		{name: "negative batch wait", vars: with("BATCH_MAX_WAIT", "-1ms"), want: []string{"BATCH_MAX_WAIT must not be negative"}},
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
		{name: "breaker threshold above 1", vars: with("BREAKER_THRESHOLD", "50"), want: []string{"BREAKER_THRESHOLD is a share of records between 0 and 1", "50"}},
		{name: "breaker threshold not a number", vars: with("BREAKER_THRESHOLD", "half"), want: []string{"BREAKER_THRESHOLD", `"half"`, "number"}},
		{name: "breaker probe max below interval", vars: with("BREAKER_PROBE_INTERVAL", "10s", "BREAKER_PROBE_MAX", "1s"), want: []string{"BREAKER_PROBE_MAX (1s)", "BREAKER_PROBE_INTERVAL (10s)"}},
		{name: "rebalance timeout within the drain", vars: with("KAFKA_REBALANCE_TIMEOUT", "5s"), want: []string{"KAFKA_REBALANCE_TIMEOUT", "must be longer than DrainTimeout 5s"}},
		{name: "topic listed twice", vars: with("KAFKA_TOPICS", "orders,orders"), want: []string{"KAFKA_TOPICS", `lists "orders" twice`}},
		{name: "a retry topic as a source", vars: with("KAFKA_TOPICS", "orders.billing.retry.1"), want: []string{"KAFKA_TOPICS", "looks like a retry or dead-letter topic"}},
		{name: "several problems are all reported", vars: with("HANDLER", "nope", "LOG_FORMAT", "xml", "BATCH_MAX_RECORDS", "0"),
			want: []string{"HANDLER", "LOG_FORMAT", "BATCH_MAX_RECORDS"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			setEnv(t, tt.vars)
			env, err := LoadEnv()
			if err == nil {
				t.Fatalf("LoadEnv() = %+v, want an error", env)
			}
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Errorf("error %T %q is not a *ConfigError", err, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestLoadDBEnv(t *testing.T) {
	tests := []struct {
		name    string
		vars    map[string]string
		want    *DBEnv
		wantErr []string
	}{
		{
			name: "defaults",
			vars: map[string]string{"DATABASE_URL": "postgres://a@b/c"},
			want: &DBEnv{DatabaseURL: "postgres://a@b/c", DBSchema: "kafkapg", DBMaxConns: 10},
		},
		{
			name: "set",
			vars: map[string]string{"DATABASE_URL": "postgres://a@b/c", "DB_SCHEMA": "kp", "DB_MAX_CONNS": "3"},
			want: &DBEnv{DatabaseURL: "postgres://a@b/c", DBSchema: "kp", DBMaxConns: 3},
		},
		{
			// migrate needs only the database: Kafka settings, good or bad, are not read.
			name: "ignores the rest of the configuration",
			vars: map[string]string{"DATABASE_URL": "postgres://a@b/c", "HANDLER": "nope", "BATCH_MAX_WAIT": "soon"},
			want: &DBEnv{DatabaseURL: "postgres://a@b/c", DBSchema: "kafkapg", DBMaxConns: 10},
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
			got, err := LoadDBEnv()
			if tt.wantErr == nil {
				if err != nil {
					t.Fatal(err)
				}
				if *got != *tt.want {
					t.Fatalf("LoadDBEnv() = %+v, want %+v", got, tt.want)
				}
				return
			}
			if err == nil {
				t.Fatalf("LoadDBEnv() = %+v, want an error", got)
			}
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Errorf("error %T %q is not a *ConfigError", err, err)
			}
			for _, w := range tt.wantErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestHandlerNames(t *testing.T) {
	t.Parallel()
	got := HandlerNames()
	if !slices.Equal(got, []string{"ledger", "ledger-careless"}) {
		t.Fatalf("HandlerNames() = %q, want [ledger ledger-careless]", got)
	}
	for _, n := range got {
		if handlers[n].handler == nil || handlers[n].setup == nil {
			t.Errorf("built-in handler %s lacks a handler or a setup", n)
		}
	}
}

// TestReadmeDocumentsEveryVariable keeps the README's configuration table complete.
func TestReadmeDocumentsEveryVariable(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range envNames() {
		if !strings.Contains(string(readme), "| `"+n+"`") && !strings.Contains(string(readme), "/ `"+n+"`") {
			t.Errorf("README.md has no configuration row for %s", n)
		}
	}
}

// TestProcessorConfig checks the translations between the environment and processor.Config
// where they spell "off" differently: a mistake there would silently leave the breaker on, or
// make BATCH_MAX_WAIT=0 wait the default.
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
		{"BREAKER_THRESHOLD=0 turns the breaker off", with("BREAKER_THRESHOLD", "0"), func(c *processor.Config) string {
			if c.BreakerThreshold >= 0 {
				return fmt.Sprintf("BreakerThreshold = %v, want negative (off)", c.BreakerThreshold)
			}
			return ""
		}},
		{"BATCH_MAX_WAIT=0 applies at once", with("BATCH_MAX_WAIT", "0"), func(c *processor.Config) string {
			if c.BatchMaxWait >= 0 {
				return fmt.Sprintf("BatchMaxWait = %v, want negative (no wait)", c.BatchMaxWait)
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
			env, err := LoadEnv()
			if err != nil {
				t.Fatal(err)
			}
			if msg := tt.check(env.processorConfig(nil, nil, nil)); msg != "" {
				t.Error(msg)
			}
		})
	}
}
