package processor

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/retrytopics"
)

var nopHandler = HandlerFunc(func(context.Context, pgx.Tx, *Record) error { return nil })

// validConfig returns a Config that passes validate once defaults are applied.
func validConfig() *Config {
	return &Config{
		Brokers: []string{"localhost:9092"},
		Group:   "billing",
		Topics:  []string{"orders"},
		Handler: nopHandler,
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		modify func(c *Config) // applied after withDefaults
		// wantErr lists what the error must contain; none means no error.
		wantErr []string
	}{
		{name: "valid", modify: func(c *Config) {}},
		{name: "valid with two brokers and topics", modify: func(c *Config) {
			c.Brokers = []string{"a:1", "b:2"}
			c.Topics = []string{"orders", "refunds"}
		}},
		{name: "valid with latest and equal backoffs", modify: func(c *Config) {
			c.StartOffset = StartLatest
			c.BackoffBase, c.BackoffMax = time.Second, time.Second
		}},
		{name: "no brokers", modify: func(c *Config) { c.Brokers = nil },
			wantErr: []string{"Brokers: ", "required"}},
		{name: "empty broker address", modify: func(c *Config) { c.Brokers = []string{"a:1", ""} },
			wantErr: []string{"Brokers: ", "empty address"}},
		{name: "no group", modify: func(c *Config) { c.Group = "" },
			wantErr: []string{"Group: ", "required"}},
		{name: "no topics", modify: func(c *Config) { c.Topics = []string{} },
			wantErr: []string{"Topics: ", "required"}},
		{name: "empty topic name", modify: func(c *Config) { c.Topics = []string{"orders", ""} },
			wantErr: []string{"Topics: ", "empty topic name"}},
		{name: "topic listed twice", modify: func(c *Config) { c.Topics = []string{"orders", "refunds", "orders"} },
			wantErr: []string{"Topics: ", `"orders" twice`}},
		{name: "no handler", modify: func(c *Config) { c.Handler = nil },
			wantErr: []string{"Handler: required"}},
		{name: "bad start offset", modify: func(c *Config) { c.StartOffset = "middle" },
			wantErr: []string{"StartOffset: ", `"middle"`}},
		{name: "negative batch size", modify: func(c *Config) { c.BatchMaxRecords = -1 },
			wantErr: []string{"BatchMaxRecords: ", "-1"}},
		{name: "negative buffer", modify: func(c *Config) { c.MaxBufferedBytes = -5 },
			wantErr: []string{"MaxBufferedBytes", "-5"}},
		{name: "negative local attempts", modify: func(c *Config) { c.LocalAttempts = -2 },
			wantErr: []string{"LocalAttempts: ", "-2"}},
		{name: "negative backoff base", modify: func(c *Config) { c.BackoffBase = -time.Second },
			wantErr: []string{"BackoffBase", "-1s"}},
		{name: "backoff max below base", modify: func(c *Config) { c.BackoffBase, c.BackoffMax = 2*time.Second, time.Second },
			wantErr: []string{"BackoffMax: ", "BackoffBase", "1s", "2s"}},
		{name: "negative session timeout", modify: func(c *Config) { c.SessionTimeout = -time.Second },
			wantErr: []string{"SessionTimeout: ", "-1s"}},
		{name: "negative handoff timeout", modify: func(c *Config) { c.HandoffTimeout = -time.Second },
			wantErr: []string{"HandoffTimeout", "-1s"}},
		{name: "negative tx idle timeout", modify: func(c *Config) { c.TxIdleTimeout = -time.Second },
			wantErr: []string{"TxIdleTimeout: ", "-1s"}},
		{name: "negative shutdown timeout", modify: func(c *Config) { c.ShutdownTimeout = -time.Second },
			wantErr: []string{"ShutdownTimeout: ", "-1s"}},
		{name: "zero retry tier", modify: func(c *Config) { c.RetryTiers = []time.Duration{time.Second, 0} },
			wantErr: []string{"RetryTiers: ", "tier 2", "0s must be positive"}},
		{name: "too many retry tiers", modify: func(c *Config) { c.RetryTiers = make([]time.Duration, 21) },
			wantErr: []string{"RetryTiers: ", "21 tiers", "at most 20"}},
		{name: "unknown dead-letter policy", modify: func(c *Config) { c.OnDeadLetter = "drop" },
			wantErr: []string{"OnDeadLetter: ", `"skip" or "block"`, `"drop"`}},
		{name: "retry topic listed as a source", modify: func(c *Config) { c.Topics = []string{"orders", "orders." + c.Group + ".retry.1"} },
			wantErr: []string{"Topics: ", "retry or dead-letter topic"}},
		{name: "breaker threshold zero after defaults", modify: func(c *Config) { c.BreakerThreshold = -0.5 },
			wantErr: []string{"BreakerThreshold: ", "-0.5", "BreakerDisabled"}},
		{name: "policy for a topic not consumed", modify: func(c *Config) { c.TopicPolicies = map[string]TopicPolicy{"refunds": {LocalAttempts: 2}} },
			wantErr: []string{"TopicPolicies: ", `"refunds"`, "not one of Topics"}},
		{name: "bad topic policy", modify: func(c *Config) {
			c.TopicPolicies = map[string]TopicPolicy{"orders": {RetryTiers: []time.Duration{-time.Second}, OnDeadLetter: "drop", LocalAttempts: -1, MaxRecordBytes: -1}}
		}, wantErr: []string{`TopicPolicies["orders"].RetryTiers: tier 1`, `TopicPolicies["orders"].OnDeadLetter: `, `TopicPolicies["orders"].LocalAttempts: `, `TopicPolicies["orders"].MaxRecordBytes: `}},
		{name: "handlers only per topic", modify: func(c *Config) {
			c.Handler = nil
			c.Topics = []string{"orders", "refunds"}
			c.TopicPolicies = map[string]TopicPolicy{"orders": {Handler: nopHandler}, "refunds": {Handler: nopHandler}}
		}},
		{name: "a topic without a handler", modify: func(c *Config) {
			c.Handler = nil
			c.Topics = []string{"orders", "refunds"}
			c.TopicPolicies = map[string]TopicPolicy{"orders": {Handler: nopHandler}}
		}, wantErr: []string{"Handler: required", `"refunds"`}},
		{name: "every required field missing", modify: func(c *Config) { *c = *(&Config{}).withDefaults() },
			wantErr: []string{"Brokers: ", "Group: ", "Topics: ", "Handler: required"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := validConfig().withDefaults()
			tt.modify(c)
			err := c.validate()
			if len(tt.wantErr) == 0 {
				if err != nil {
					t.Fatalf("validate() = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("validate() = nil, want an error containing %q", tt.wantErr)
			}
			for _, s := range tt.wantErr {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("validate() = %q, want it to contain %q", err, s)
				}
			}
		})
	}
}

// TestConfigDefaultBackoffMaxFollowsBase: setting only BackoffBase above the 5s default max
// raises the default max with it instead of failing validation.
func TestConfigDefaultBackoffMaxFollowsBase(t *testing.T) {
	t.Parallel()
	c := validConfig()
	c.BackoffBase = 10 * time.Second
	d := c.withDefaults()
	if err := d.validate(); err != nil {
		t.Fatalf("validate() = %v, want nil", err)
	}
	if d.BackoffMax != 10*time.Second {
		t.Fatalf("BackoffMax = %v, want 10s (the base)", d.BackoffMax)
	}
}

func TestConfigWithDefaults(t *testing.T) {
	t.Parallel()
	host, _ := os.Hostname()
	z := validConfig().withDefaults()
	zeroDefaults := []struct {
		name      string
		got, want any
	}{
		{"Schema", z.Schema, "kafkapg"},
		{"StartOffset", z.StartOffset, StartEarliest},
		{"BatchMaxRecords", z.BatchMaxRecords, 500},
		{"BatchMaxWait", z.BatchMaxWait, 20 * time.Millisecond},
		{"MaxBufferedBytes", z.MaxBufferedBytes, 64 << 20},
		{"LocalAttempts", z.LocalAttempts, 3},
		{"BackoffBase", z.BackoffBase, 200 * time.Millisecond},
		{"BackoffMax", z.BackoffMax, 5 * time.Second},
		{"SessionTimeout", z.SessionTimeout, 45 * time.Second},
		{"HandoffTimeout", z.HandoffTimeout, 5 * time.Second},
		{"TxIdleTimeout", z.TxIdleTimeout, 30 * time.Second},
		{"ShutdownTimeout", z.ShutdownTimeout, 10 * time.Second},
		{"InstanceName", z.InstanceName, fmt.Sprintf("%s:%d", host, os.Getpid())},
		{"Logger", z.Logger, slog.Default()},
	}
	for _, d := range zeroDefaults {
		if d.got != d.want {
			t.Errorf("default %s = %v, want %v", d.name, d.got, d.want)
		}
	}
	if z.Registerer == nil {
		t.Error("default Registerer is nil, want a private registry")
	}
	if err := z.validate(); err != nil {
		t.Errorf("defaults do not validate: %v", err)
	}

	logger := slog.New(slog.DiscardHandler)
	reg := prometheus.NewRegistry()
	set := &Config{
		Brokers: []string{"b:1"}, Group: "g", Topics: []string{"t"}, Handler: nopHandler,
		Schema: "custom", StartOffset: StartLatest, BatchMaxRecords: 7, BatchMaxWait: time.Second,
		MaxBufferedBytes: 99, LocalAttempts: 1, BackoffBase: time.Millisecond, BackoffMax: time.Minute,
		SessionTimeout: 6 * time.Second, HandoffTimeout: time.Second, TxIdleTimeout: 2 * time.Second,
		ShutdownTimeout: 3 * time.Second, InstanceName: "me", Logger: logger, Registerer: reg,
	}
	got := set.withDefaults()
	kept := []struct {
		name      string
		got, want any
	}{
		{"Schema", got.Schema, "custom"},
		{"StartOffset", got.StartOffset, StartLatest},
		{"BatchMaxRecords", got.BatchMaxRecords, 7},
		{"BatchMaxWait", got.BatchMaxWait, time.Second},
		{"MaxBufferedBytes", got.MaxBufferedBytes, 99},
		{"LocalAttempts", got.LocalAttempts, 1},
		{"BackoffBase", got.BackoffBase, time.Millisecond},
		{"BackoffMax", got.BackoffMax, time.Minute},
		{"SessionTimeout", got.SessionTimeout, 6 * time.Second},
		{"HandoffTimeout", got.HandoffTimeout, time.Second},
		{"TxIdleTimeout", got.TxIdleTimeout, 2 * time.Second},
		{"ShutdownTimeout", got.ShutdownTimeout, 3 * time.Second},
		{"InstanceName", got.InstanceName, "me"},
		{"Logger", got.Logger, logger},
		{"Registerer", got.Registerer, prometheus.Registerer(reg)},
	}
	for _, d := range kept {
		if d.got != d.want {
			t.Errorf("set %s = %v became %v", d.name, d.want, d.got)
		}
	}
}

func TestConfigWithDefaultsSpecialValues(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		modify func(c *Config)
		check  func(c *Config) error
	}{
		{
			name:   "nil RetryTiers means the default tiers; empty means none",
			modify: func(c *Config) {},
			check: func(c *Config) error {
				if !slices.Equal(c.RetryTiers, DefaultRetryTiers) || c.OnDeadLetter != OnDeadLetterSkip {
					return fmt.Errorf("RetryTiers = %v, OnDeadLetter = %q; want %v, skip", c.RetryTiers, c.OnDeadLetter, DefaultRetryTiers)
				}
				none := (&Config{RetryTiers: []time.Duration{}}).withDefaults()
				if none.RetryTiers == nil || len(none.RetryTiers) != 0 {
					return fmt.Errorf("empty RetryTiers became %v, want it kept empty", none.RetryTiers)
				}
				return nil
			},
		},
		{
			name:   "negative BatchMaxWait means apply at once",
			modify: func(c *Config) { c.BatchMaxWait = NoBatchWait },
			check: func(c *Config) error {
				if c.BatchMaxWait != 0 {
					return fmt.Errorf("BatchMaxWait = %v, want 0", c.BatchMaxWait)
				}
				return nil
			},
		},
		{
			name:   "very negative BatchMaxWait means apply at once",
			modify: func(c *Config) { c.BatchMaxWait = -time.Hour },
			check: func(c *Config) error {
				if c.BatchMaxWait != 0 {
					return fmt.Errorf("BatchMaxWait = %v, want 0", c.BatchMaxWait)
				}
				return nil
			},
		},
		{
			name:   "negative numbers are kept for validate to reject",
			modify: func(c *Config) { c.BatchMaxRecords, c.LocalAttempts, c.MaxBufferedBytes = -1, -1, -1 },
			check: func(c *Config) error {
				if c.BatchMaxRecords != -1 || c.LocalAttempts != -1 || c.MaxBufferedBytes != -1 {
					return fmt.Errorf("got %d, %d, %d; want -1s kept", c.BatchMaxRecords, c.LocalAttempts, c.MaxBufferedBytes)
				}
				if c.validate() == nil {
					return fmt.Errorf("validate accepted negative sizes")
				}
				return nil
			},
		},
		{
			name:   "negative durations are kept for validate to reject",
			modify: func(c *Config) { c.SessionTimeout, c.TxIdleTimeout = -time.Second, -time.Second },
			check: func(c *Config) error {
				if c.SessionTimeout != -time.Second || c.TxIdleTimeout != -time.Second {
					return fmt.Errorf("got %v, %v; want -1s kept", c.SessionTimeout, c.TxIdleTimeout)
				}
				if c.validate() == nil {
					return fmt.Errorf("validate accepted negative timeouts")
				}
				return nil
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := validConfig()
			tt.modify(c)
			if err := tt.check(c.withDefaults()); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestConfigWithDefaultsCopies(t *testing.T) {
	t.Parallel()
	c := validConfig()
	d := c.withDefaults()
	if d == c {
		t.Fatal("withDefaults returned its receiver")
	}
	if c.Schema != "" || c.BatchMaxRecords != 0 || c.Logger != nil || c.Registerer != nil {
		t.Fatalf("withDefaults modified the caller's Config: %+v", c)
	}
}

func TestConfigNewRejectsInvalid(t *testing.T) {
	t.Parallel()
	// pgxpool connects lazily: New must reject the config before it needs Postgres.
	pool, err := pgxpool.New(context.Background(), "postgres://kafkapg@127.0.0.1:1/kafkapg?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := New(pool, nil); err == nil || !strings.Contains(err.Error(), "config is required") {
		t.Errorf("New(pool, nil) error = %v, want \"config is required\"", err)
	}
	c := validConfig()
	c.Topics = nil
	c.LocalAttempts = -1
	_, err = New(pool, c)
	for _, want := range []string{"invalid config", "Topics: ", "LocalAttempts: "} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("New with no topics and -1 attempts: error = %v, want it to contain %q", err, want)
		}
	}
}

func TestDuePrefix(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	rec := func(due string) *kgo.Record {
		if due == "" {
			return &kgo.Record{}
		}
		return &kgo.Record{Headers: []kgo.RecordHeader{{Key: retrytopics.HeaderDueAt, Value: []byte(due)}}}
	}
	past, future := now.Add(-time.Second).Format(time.RFC3339Nano), now.Add(time.Second).Format(time.RFC3339Nano)
	tests := []struct {
		name     string
		recs     []*kgo.Record
		want     int
		wantNext time.Time
	}{
		{"all due", []*kgo.Record{rec(past), rec(past)}, 2, time.Time{}},
		{"first not due", []*kgo.Record{rec(future), rec(past)}, 0, now.Add(time.Second)},
		{"due prefix", []*kgo.Record{rec(past), rec(future), rec(past)}, 1, now.Add(time.Second)},
		{"no or garbled due time: due at once", []*kgo.Record{rec(""), rec("soon")}, 2, time.Time{}},
		{"exactly due", []*kgo.Record{rec(now.Format(time.RFC3339Nano))}, 1, time.Time{}},
	}
	for _, tt := range tests {
		got, next := duePrefix(tt.recs, now)
		if got != tt.want || !next.Equal(tt.wantNext) {
			t.Errorf("%s: duePrefix = %d, %v; want %d, %v", tt.name, got, next, tt.want, tt.wantNext)
		}
	}
}
