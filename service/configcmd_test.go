package service

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
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
		"CONSOLE_ADDR", ":9091", "CONSOLE_USERS", "ann:operator:console-pw-123", "CONSOLE_TOKENS", "bot:viewer:console-token-456789",
		"OPERATOR_TOKENS", "ci:operator:operator-token-98765"))
	var out, errOut bytes.Buffer
	if code := run([]string{"config"}, &out, &errOut, goHandlers...); code != 0 {
		t.Fatalf("config: exit %d\n%s", code, errOut.String())
	}
	text := out.String()
	for _, secret := range []string{"s3cr3t-pw", "tok-0123456789abcdef", "sasl-pw-42", "console-pw-123", "console-token-456789", "operator-token-98765"} {
		if strings.Contains(text, secret) {
			t.Errorf("config prints the secret %q:\n%s", secret, text)
		}
	}
	for _, want := range []string{
		"host=db port=5432 user=app password=REDACTED dbname=orders sslmode=require  environment",
		"ann:operator:REDACTED",
		"ci:operator:REDACTED",
		"RETRY_BACKOFF_BASE               200ms",
		"topic returns",
		`retry tiers        1s, 2s, 4s`, "TOPIC_RETURNS_RETRY_TIERS",
		"returns.billing.retry.3 (due 4s after the failure",
		"dead-letter topic  returns.billing.dlq",
		"local attempts     7", "TOPIC_RETURNS_RETRY_LOCAL_ATTEMPTS",
		`retry tiers        2s, 30s`, `service.Handler{Name: "inventory"}.RetryTiers`,
		`idempotency key    KeyFromJSON("order_id")`, `service.Handler{Name: "inventory"}.IdempotencyKey`,
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

// TestRedactDSN: config shows DATABASE_URL as pgx reads it, and no secret pgx would use, whatever
// the spelling: the URLs net/url refuses but pgx takes (a '#' in the password, several hosts),
// parameters that carry passwords (sslpassword), key=value escapes, and strings pgx refuses,
// whose errors quote them.
func TestRedactDSN(t *testing.T) {
	for _, c := range []struct {
		name    string
		dsn     string
		secrets []string // none may be shown
		want    string
	}{
		{name: "url", dsn: "postgres://u:p%40ss-w0rd@h/db?sslmode=require", secrets: []string{"p@ss-w0rd", "p%40ss-w0rd"},
			want: "host=h port=5432 user=u password=REDACTED dbname=db sslmode=require"},
		{name: "hash in the password", dsn: "postgres://u:p#ss-w0rd@h/db", secrets: []string{"ss-w0rd"},
			want: "host=h port=5432 user=u password=REDACTED dbname=db sslmode=prefer"},
		{name: "several hosts", dsn: "postgres://u:s3cr3t-pw@h1:5432,h2:5433/db?sslmode=verify-full", secrets: []string{"s3cr3t-pw"},
			want: "host=h1,h2 port=5432,5433 user=u password=REDACTED dbname=db sslmode=verify-full"},
		{name: "password in the query", dsn: "postgres://u@h/db?password=query-pw-1&sslmode=disable&application_name=app", secrets: []string{"query-pw-1"},
			want: "host=h port=5432 user=u password=REDACTED dbname=db sslmode=disable application_name=app"},
		{name: "sslpassword in a URL", dsn: "postgres://u@h/db?sslpassword=key-pass-123&sslmode=disable", secrets: []string{"key-pass-123"},
			want: "host=h port=5432 user=u dbname=db sslmode=disable"},
		{name: "sslpassword in key=value", dsn: "host=h user=u sslpassword='key pass 456' sslmode=disable", secrets: []string{"key pass 456", "pass"}},
		{name: "key=value", dsn: "host=h user=u password=pw-1234 dbname=d sslmode=disable", secrets: []string{"pw-1234"},
			want: "host=h port=5432 user=u password=REDACTED dbname=d sslmode=disable"},
		{name: "quoted", dsn: "host=h user=u password='p w-5678' dbname=d", secrets: []string{"w-5678"}},
		{name: "escaped space", dsn: `host=h user=u password=pa\ ss-word123 dbname=d`, secrets: []string{"ss-word123"}},
		{name: "escaped quote", dsn: `host=h user=u password='it\'s-secret' dbname=d`, secrets: []string{"s-secret"}},
		{name: "refused: a space unescaped", dsn: "host=h user=u password=two words-secret dbname=d", secrets: []string{"words-secret"},
			want: "(not a connection string pgx accepts: "},
		{name: "refused: unterminated quote", dsn: "host=h password='unterminated-pw", secrets: []string{"unterminated-pw"},
			want: "(not a connection string pgx accepts: "},
		{name: "refused: a URL", dsn: "postgres://u:url-secret-9@h:notaport/db", secrets: []string{"url-secret-9"},
			want: "(not a connection string pgx accepts: "},
		{name: "refused by pgxpool", dsn: "postgres://u:pool-secret-7@h/db?pool_max_conns=many", secrets: []string{"pool-secret-7"},
			want: "(not a connection string pgx accepts: cannot parse pool_max_conns"},
		{name: "runtime parameters", dsn: "postgres://u@h/db?sslmode=disable&search_path=a%20b&pool_max_conns=4",
			want: "host=h port=5432 user=u dbname=db sslmode=disable pool_max_conns=4 search_path='a b'"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("PGPASSWORD", "") // ParseConfig reads the PG* environment too
			got := redact("DATABASE_URL", c.dsn)
			for _, secret := range c.secrets {
				if strings.Contains(got, secret) {
					t.Errorf("redact(%q) = %q: shows %q", c.dsn, got, secret)
				}
			}
			if !strings.Contains(got, c.want) {
				t.Errorf("redact(%q) = %q, want %q", c.dsn, got, c.want)
			}
		})
	}
}

// TestDatabaseURLRefusedWithoutSecret: run's refusal of a DATABASE_URL pgx cannot parse says why,
// and nothing of the string: pgx's own error quotes it, masking only what it recognizes.
func TestDatabaseURLRefusedWithoutSecret(t *testing.T) {
	for _, dsn := range []string{
		"host=h user=u password=two words-secret dbname=d",
		"postgres://u:words-secret@h:notaport/db",
		"host=h password='words-secret",
	} {
		_, _, err := openPool(t.Context(), &dbEnv{DatabaseURL: dsn})
		if err == nil || strings.Contains(err.Error(), "words-secret") || !strings.Contains(err.Error(), "DATABASE_URL is not a valid connection string") {
			t.Errorf("openPool(%q): %v; want a refusal without the secret", dsn, err)
		}
	}
}

// TestConfigOutputEscaped: config's values are anyone's text; its table escapes what a terminal
// would take for commands, and --json is valid JSON that reads back the values (a C1 control as
// \u009b, a byte that is not UTF-8 as U+FFFD).
func TestConfigOutputEscaped(t *testing.T) {
	const name = "broker\u009b31m\u202eevil\x1b]0;title\a\xff.example"
	setEnv(t, with("HANDLER", "<unset>", "KAFKA_TLS", "true", "KAFKA_TLS_SERVER_NAME", name,
		"DATABASE_URL", "postgres://u:pw@h/db?application_name=app\u009bx"))
	var out, errOut bytes.Buffer
	if code := run([]string{"config"}, &out, &errOut, goHandlers...); code != 0 {
		t.Fatalf("config: exit %d\n%s", code, errOut.String())
	}
	if bad := testenv.RawControl(out.String()); bad != "" {
		t.Errorf("config prints %s raw:\n%q", bad, out.String())
	}
	out.Reset()
	if code := run([]string{"config", "--json"}, &out, &errOut, goHandlers...); code != 0 {
		t.Fatalf("config --json: exit %d\n%s", code, errOut.String())
	}
	if !json.Valid(out.Bytes()) {
		t.Fatalf("config --json is not JSON:\n%q", out.String())
	}
	if bad := testenv.RawControl(out.String()); bad != "" {
		t.Errorf("config --json prints %s raw:\n%q", bad, out.String())
	}
	var shown configShown
	if err := json.Unmarshal(out.Bytes(), &shown); err != nil {
		t.Fatal(err)
	}
	for _, v := range shown.Variables {
		if v.Name == "KAFKA_TLS_SERVER_NAME" && v.Value != strings.ToValidUTF8(name, "\ufffd") {
			t.Errorf("KAFKA_TLS_SERVER_NAME reads back as %q, want %q", v.Value, strings.ToValidUTF8(name, "\ufffd"))
		}
	}
}

// TestConfigNamesIdempotencyKeys: config names each topic's idempotency key as it was built —
// the processor's constructor with its argument, the variable's own form, or "a function of
// yours" for the user's own function, which config never calls — in text and in --json.
func TestConfigNamesIdempotencyKeys(t *testing.T) {
	called := false
	hs := []Handler{
		{Name: "by-json", Handler: ledger.Handler{}, IdempotencyKey: processor.KeyFromJSON("payment.id")},
		{Name: "by-header", Handler: ledger.Handler{}, IdempotencyKey: processor.KeyFromHeader("x-id")},
		{Name: "by-func", Handler: ledger.Handler{}, IdempotencyKey: func(*processor.Record) ([]byte, error) {
			called = true
			return []byte("k"), nil
		}},
	}
	setEnv(t, with("KAFKA_TOPICS", "payments,refunds,orders,returns", "HANDLER", "by-json",
		"TOPIC_REFUNDS_HANDLER", "by-header", "TOPIC_ORDERS_HANDLER", "by-func",
		"TOPIC_RETURNS_HANDLER", "by-func", "TOPIC_RETURNS_IDEMPOTENCY_KEY", "header:x-return-id"))
	want := map[string][2]string{ // topic: the key shown, its source
		"payments": {`KeyFromJSON("payment.id")`, `service.Handler{Name: "by-json"}.IdempotencyKey`},
		"refunds":  {`KeyFromHeader("x-id")`, `service.Handler{Name: "by-header"}.IdempotencyKey`},
		"orders":   {"a function of yours", `service.Handler{Name: "by-func"}.IdempotencyKey`},
		"returns":  {"header:x-return-id", "TOPIC_RETURNS_IDEMPOTENCY_KEY"},
	}
	var out, errOut bytes.Buffer
	if code := run([]string{"config"}, &out, &errOut, hs...); code != 0 {
		t.Fatalf("config: exit %d\n%s", code, errOut.String())
	}
	for topic, w := range want {
		_, section, _ := strings.Cut(out.String(), "topic "+topic+"\n")
		section, _, _ = strings.Cut(section, "\ntopic ")
		line := ""
		for l := range strings.Lines(section) {
			if strings.HasPrefix(strings.TrimSpace(l), "idempotency key ") {
				line = l
			}
		}
		if f := strings.Fields(line); len(f) < 3 || !strings.Contains(line, "key    "+w[0]+"  ") || !strings.HasSuffix(strings.TrimSpace(line), w[1]) {
			t.Errorf("config, topic %s: %q; want %s from %s\n%s", topic, line, w[0], w[1], out.String())
		}
	}

	out.Reset()
	if code := run([]string{"config", "--json"}, &out, &errOut, hs...); code != 0 {
		t.Fatalf("config --json: exit %d\n%s", code, errOut.String())
	}
	var shown configShown
	if err := json.Unmarshal(out.Bytes(), &shown); err != nil {
		t.Fatalf("config --json: %v\n%s", err, out.String())
	}
	for _, ts := range shown.Topics {
		if w := want[ts.Topic]; ts.IdempotencyKey != w[0] || ts.From["idempotency_key"] != w[1] {
			t.Errorf("config --json, topic %s: idempotency key %q from %q; want %q from %q", ts.Topic, ts.IdempotencyKey, ts.From["idempotency_key"], w[0], w[1])
		}
	}
	if len(shown.Topics) != len(want) {
		t.Errorf("config --json: %d topics, want %d", len(shown.Topics), len(want))
	}
	if called {
		t.Error("config called the user's idempotency key function")
	}
}
