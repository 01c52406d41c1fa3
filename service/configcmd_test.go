package service

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/processor"
)

// goHandlers is a binary whose handler sets its topics' retry settings in Go.
var goHandlers = []Handler{{
	Name:           "inventory",
	Handler:        ledger.Handler{},
	IdempotencyKey: processor.KeyFromJSON("order_id"),
	RetryTiers:     []time.Duration{2 * time.Second, 30 * time.Second},
	LocalAttempts:  5,
	OnDeadLetter:   processor.OnDeadLetterBlock,
	MaxRecordBytes: 4096,
}}

// TestHandlerGoSettings: a Handler's Go settings are its topics' policy, under the per-topic
// variables and over the service-wide ones.
func TestHandlerGoSettings(t *testing.T) {
	hs, err := newRegistry(goHandlers)
	if err != nil {
		t.Fatal(err)
	}
	setEnv(t, with("KAFKA_TOPICS", "orders,returns", "HANDLER", "<unset>", "RETRY_TIERS", "1s", "RETRY_LOCAL_ATTEMPTS", "2",
		"TOPIC_RETURNS_RETRY_TIERS", "", "TOPIC_RETURNS_IDEMPOTENCY_KEY", "none"))
	e, err := loadEnv(hs)
	if err != nil {
		t.Fatal(err)
	}
	c := e.processorConfig(hs, nil, nil)
	orders, returns := c.TopicPolicies["orders"], c.TopicPolicies["returns"]
	if !reflect.DeepEqual(orders.RetryTiers, goHandlers[0].RetryTiers) || orders.LocalAttempts != 5 || orders.OnDeadLetter != processor.OnDeadLetterBlock ||
		orders.MaxRecordBytes != 4096 || orders.IdempotencyKey == nil {
		t.Errorf("orders: %+v; want the handler's Go settings", orders)
	}
	if returns.RetryTiers == nil || len(returns.RetryTiers) != 0 || returns.IdempotencyKey != nil || returns.LocalAttempts != 5 {
		t.Errorf("returns: %+v; want no tiers and no key (its variables), 5 local attempts (Go)", returns)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}

	// A bad Go setting is named as such.
	bad := []Handler{{Name: "x", Handler: ledger.Handler{}, OnDeadLetter: "later"}}
	hs, _ = newRegistry(bad)
	setEnv(t, with("HANDLER", "x"))
	if _, err := loadEnv(hs); err == nil || !strings.Contains(err.Error(), `service.Handler{Name: "x"}.OnDeadLetter`) {
		t.Errorf("a bad Handler.OnDeadLetter: %v; want it named", err)
	}
}

// TestConfigCommand: `config` prints what run would use, where each value came from, the topics
// failures go to, and no secret.
func TestConfigCommand(t *testing.T) {
	setEnv(t, with("DATABASE_URL", "postgres://app:s3cr3t-pw@db:5432/orders?sslmode=require",
		"KAFKA_TOPICS", "orders,returns", "HANDLER", "<unset>",
		"TOPIC_RETURNS_RETRY_TIERS", "1s,2s,4s", "TOPIC_RETURNS_RETRY_LOCAL_ATTEMPTS", "7",
		"OPERATOR_TOKEN", "tok-0123456789abcdef", "KAFKA_SASL_MECHANISM", "PLAIN", "KAFKA_SASL_USERNAME", "svc",
		"KAFKA_SASL_PASSWORD", "sasl-pw-42", "KAFKA_TLS", "true",
		"CONSOLE_ADDR", ":9091", "CONSOLE_USERS", "ann:operator:console-pw-123", "CONSOLE_TOKENS", "bot:viewer:console-token-456789"))
	var out, errOut bytes.Buffer
	if code := run([]string{"config"}, &out, &errOut, goHandlers...); code != 0 {
		t.Fatalf("config: exit %d\n%s", code, errOut.String())
	}
	text := out.String()
	for _, secret := range []string{"s3cr3t-pw", "tok-0123456789abcdef", "sasl-pw-42", "console-pw-123", "console-token-456789"} {
		if strings.Contains(text, secret) {
			t.Errorf("config prints the secret %q:\n%s", secret, text)
		}
	}
	for _, want := range []string{
		"postgres://app:REDACTED@db:5432/orders?sslmode=require  environment",
		"ann:operator:REDACTED",
		"RETRY_BACKOFF_BASE               200ms",
		"topic returns",
		`retry tiers        1s, 2s, 4s`, "TOPIC_RETURNS_RETRY_TIERS",
		"returns.billing.retry.3 (due 4s after the failure",
		"dead-letter topic  returns.billing.dlq",
		"local attempts     7", "TOPIC_RETURNS_RETRY_LOCAL_ATTEMPTS",
		`retry tiers        2s, 30s`, `service.Handler{Name: "inventory"}.RetryTiers`,
		`idempotency key    a Go function`, `service.Handler{Name: "inventory"}.IdempotencyKey`,
		"HANDLER                          inventory",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("config does not say %q:\n%s", want, text)
		}
	}

	out.Reset()
	if code := run([]string{"config", "--json"}, &out, &errOut, goHandlers...); code != 0 {
		t.Fatalf("config --json: exit %d\n%s", code, errOut.String())
	}
	var shown configShown
	if err := json.Unmarshal(out.Bytes(), &shown); err != nil {
		t.Fatalf("config --json: %v\n%s", err, out.String())
	}
	if len(shown.Topics) != 2 || shown.Topics[0].Topic != "orders" || shown.Topics[0].LocalAttempts != 5 ||
		shown.Topics[1].From["local_attempts"] != "TOPIC_RETURNS_RETRY_LOCAL_ATTEMPTS" || shown.Topics[0].From["max_record_bytes"] != `service.Handler{Name: "inventory"}.MaxRecordBytes` {
		t.Errorf("config --json topics: %+v", shown.Topics)
	}

	// A wrong configuration is reported as run reports it.
	setEnv(t, with("RETRY_TIERS", "soon"))
	errOut.Reset()
	if code := run([]string{"config"}, &out, &errOut, builtinHandlers...); code != 2 || !strings.Contains(errOut.String(), `RETRY_TIERS="soon"`) {
		t.Errorf("config with a bad RETRY_TIERS: exit %d, %s", code, errOut.String())
	}
}

func TestRedactDSN(t *testing.T) {
	for in, want := range map[string]string{
		"postgres://u:p%40ss@h/db":                      "postgres://u:REDACTED@h/db",
		"postgres://u@h/db?password=pw&sslmode=disable": "postgres://u@h/db?password=REDACTED&sslmode=disable",
		"host=h user=u password=pw dbname=d":            "host=h user=u password=REDACTED dbname=d",
		"host=h password='p w' dbname=d":                "host=h password=REDACTED dbname=d",
		"postgres://u@h/db":                             "postgres://u@h/db",
	} {
		if got := redactDSN(in); got != want {
			t.Errorf("redactDSN(%q) = %q, want %q", in, got, want)
		}
	}
}
