package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/kafkalogin"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// cli runs the tool with args and stdin, and returns its exit status, stdout and stderr.
func cli(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(t.Context(), args, strings.NewReader(stdin), &out, &errOut)
	return code, out.String(), errOut.String()
}

// TestProduceAndConsume: records from flags, JSON lines and envelopes reach the topic with
// their keys and headers; consume prints them, bytes that are not text included; bad input is
// named by file and line, and nothing is produced.
func TestProduceAndConsume(t *testing.T) {
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 1)
	t.Setenv("KAFKA_BROKERS", strings.Join(k.Brokers, ","))
	lines := filepath.Join(t.TempDir(), "orders.jsonl")
	if err := os.WriteFile(lines, []byte("{\"order\":{\"id\":7},\"n\":1}\n\n{\"order\":{\"id\":\"o-8\"},\"n\":2}\r\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"produce", "-topic", topic, "-key", "k1", "-value", "plain", "-header", "h=v"},
		{"produce", "-topic", topic, "-key-field", "order.id", lines},
	} {
		if code, _, errOut := cli(t, "", args...); code != 0 {
			t.Fatalf("%q: exit %d: %s", args, code, errOut)
		}
	}
	if code, _, errOut := cli(t, `{"key":"e","value":"text","headers":{"a":"1"}}`+"\n"+`{"value":{"x":[1, 2]}}`, "produce", "-topic", topic, "-envelope"); code != 0 {
		t.Fatalf("envelopes: exit %d: %s", code, errOut)
	}
	k.Produce(t, &kgo.Record{Topic: topic, Key: []byte{0xff, 0}, Value: []byte{0x1b, 0xff}})

	code, out, errOut := cli(t, "", "consume", "-topic", topic)
	if code != 0 {
		t.Fatalf("consume: exit %d: %s", code, errOut)
	}
	want := []string{
		`"key":"k1","value":"plain","headers":{"h":"v"}`,
		`"key":"7","value":{"order":{"id":7},"n":1}`,
		`"key":"o-8","value":{"order":{"id":"o-8"},"n":2}`,
		`"key":"e","value":"text","headers":{"a":"1"}`,
		`"value":{"x":[1,2]}`,
		`"key_base64":"/wA=","value_base64":"G/8="`,
	}
	got := strings.Split(strings.TrimSpace(out), "\n")
	if len(got) != len(want) {
		t.Fatalf("consume printed %d records, want %d:\n%s", len(got), len(want), out)
	}
	for i, w := range want {
		if !strings.Contains(got[i], w) || !json.Valid([]byte(got[i])) {
			t.Errorf("record %d: %s\nwant it to hold %s", i, got[i], w)
		}
	}

	for _, tt := range []struct {
		stdin string
		args  []string
		want  string
	}{
		{"{\"id\":1}\nnot json\n", []string{"produce", "-topic", topic, "-key-field", "id"}, "-:2: -key-field id: the value is not a JSON object"},
		{"{\"key\":1}\n", []string{"produce", "-topic", topic, "-envelope"}, `-:1: not an envelope`},
		{"{\"kee\":\"a\"}\n", []string{"produce", "-topic", topic, "-envelope"}, `unknown field "kee"`},
		{"", []string{"produce", "-topic", "missing", "-value", "x"}, "topic missing does not exist: create it"},
		{"", []string{"produce", "-value", "x"}, "-topic is required"},
		{"", []string{"consume", "-topic", topic, "-from", "middle"}, `-from "middle": want start or end`},
	} {
		code, _, errOut := cli(t, tt.stdin, tt.args...)
		if code == 0 || !strings.Contains(errOut, tt.want) {
			t.Errorf("%q: exit %d, %s; want an error saying %q", tt.args, code, errOut, tt.want)
		}
	}
	if recs := k.ReadAll(t, topic); len(recs) != len(want) {
		t.Errorf("%d records in the topic after the refused input, want %d", len(recs), len(want))
	}
}

// TestBrokersFromTheDevLoop: without -brokers or KAFKA_BROKERS, the commands take the broker
// of the dev loop running with -dir, and its login, and say what to do when none runs.
func TestBrokersFromTheDevLoop(t *testing.T) {
	for _, name := range []string{"KAFKA_BROKERS", "KAFKA_SASL_MECHANISM", "KAFKA_SASL_USERNAME", "KAFKA_SASL_PASSWORD"} {
		t.Setenv(name, "")
	}
	dir := t.TempDir()
	if _, err := kafkaFor("", dir); err == nil || !strings.Contains(err.Error(), "start `go tool kafkapg dev`") {
		t.Errorf("no broker: %v", err)
	}
	if err := writeEnv(filepath.Join(dir, "env"), [][2]string{{"KAFKA_BROKERS", "127.0.0.1:1,127.0.0.1:2"}, {"DATABASE_URL", "postgres://x@h/d?a='b'"}}); err != nil {
		t.Fatal(err)
	}
	// Written by this process: not a running loop of another.
	if _, err := kafkaFor("", dir); err == nil {
		t.Error("an env file of this process was taken for a running loop's")
	}
	pid, env, err := readEnv(filepath.Join(dir, "env"))
	if err != nil || pid != os.Getpid() || len(env) != 2 || env[1][1] != "postgres://x@h/d?a='b'" {
		t.Errorf("readEnv: %d %q %v", pid, env, err)
	}
	if got, err := kafkaFor("a:1", dir); err != nil || strings.Join(got.brokers, ",") != "a:1" || got.login != nil {
		t.Errorf("-brokers: %+v %v", got, err)
	}

	// A running loop's env file (its pid: our parent's, which runs): its broker and its login.
	loop := "# kafkapg dev, pid " + strconv.Itoa(os.Getppid()) + ": test\n" +
		"export KAFKA_BROKERS='127.0.0.1:3'\nexport KAFKA_SASL_MECHANISM='SCRAM-SHA-256'\n" +
		"export KAFKA_SASL_USERNAME='kafkapg'\nexport KAFKA_SASL_PASSWORD='pw'\n"
	if err := os.WriteFile(filepath.Join(dir, "env"), []byte(loop), 0o600); err != nil {
		t.Fatal(err)
	}
	if got, err := kafkaFor("", dir); err != nil || strings.Join(got.brokers, ",") != "127.0.0.1:3" || len(got.login) != 1 {
		t.Errorf("the dev loop's: %+v %v; want its broker and a SASL login", got, err)
	}
	// The broker named here: this environment's login (none), not the loop's.
	t.Setenv("KAFKA_BROKERS", "b:1")
	if got, err := kafkaFor("", dir); err != nil || strings.Join(got.brokers, ",") != "b:1" || got.login != nil {
		t.Errorf("KAFKA_BROKERS: %+v %v; want b:1 without the dev loop's login", got, err)
	}
}

// TestSASLLogin: KAFKA_SASL_* as the service takes them; what it would refuse is refused,
// naming the variable, never the password.
func TestSASLLogin(t *testing.T) {
	for _, tt := range []struct {
		name            string
		mech, user, pwd string
		wantLogin       bool
		wantErr         string
	}{
		{"none", "", "", "", false, ""},
		{"SCRAM-SHA-256", "SCRAM-SHA-256", "u", "secret", true, ""},
		{"SCRAM-SHA-512, lower case", "scram-sha-512", "u", "secret", true, ""},
		{"PLAIN", "PLAIN", "u", "secret", true, ""},
		{"unsupported", "GSSAPI", "u", "secret", false, `KAFKA_SASL_MECHANISM must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, got "GSSAPI"`},
		{"no password", "SCRAM-SHA-256", "u", "", false, "KAFKA_SASL_MECHANISM=SCRAM-SHA-256 needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD"},
		{"no mechanism", "", "u", "secret", false, "KAFKA_SASL_USERNAME/KAFKA_SASL_PASSWORD are set but KAFKA_SASL_MECHANISM is not"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			login, err := saslLogin(lookupIn([][2]string{
				{"KAFKA_SASL_MECHANISM", tt.mech}, {"KAFKA_SASL_USERNAME", tt.user}, {"KAFKA_SASL_PASSWORD", tt.pwd},
			}))
			switch {
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("error %v, want one saying %q", err, tt.wantErr)
			case tt.wantErr == "" && err != nil:
				t.Errorf("error %v", err)
			case err != nil && strings.Contains(err.Error(), "secret"):
				t.Errorf("the error shows the password: %v", err)
			case (len(login) == 1) != tt.wantLogin:
				t.Errorf("%d options, want a login: %v", len(login), tt.wantLogin)
			}
		})
	}
}

// TestSASLMechanismsAreTheService: the tool takes the KAFKA_SASL_MECHANISM values the service
// takes (both read them with internal/kafkalogin), so that one env works for both.
func TestSASLMechanismsAreTheService(t *testing.T) {
	for _, mech := range append(slices.Clone(kafkalogin.Mechanisms), "scram-sha-256") {
		env := map[string]string{"KAFKA_SASL_MECHANISM": mech, "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p"}
		if login, err := saslLogin(func(k string) string { return env[k] }); err != nil || len(login) != 1 {
			t.Errorf("KAFKA_SASL_MECHANISM=%s: %d options, %v; the service takes it", mech, len(login), err)
		}
	}
	env := map[string]string{"KAFKA_SASL_MECHANISM": "GSSAPI", "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p"}
	if _, err := saslLogin(func(k string) string { return env[k] }); err == nil {
		t.Error("KAFKA_SASL_MECHANISM=GSSAPI: taken; the service refuses it")
	}
}

func TestParseTopics(t *testing.T) {
	got, err := parseTopics(" orders, inventory.reserved:1,,", 3)
	if err != nil || len(got) != 2 || got[0] != (topicSpec{"orders", 3}) || got[1] != (topicSpec{"inventory.reserved", 1}) {
		t.Errorf("parseTopics: %v %v", got, err)
	}
	for _, bad := range []string{"a:0", "a:x", ":3"} {
		if _, err := parseTopics(bad, 3); err == nil {
			t.Errorf("parseTopics(%q): no error", bad)
		}
	}
	if code, _, errOut := cli(t, "", "dev", "go", "run", "."); code != 2 || !strings.Contains(errOut, "put the command to run after --") {
		t.Errorf("dev without --: exit %d, %s", code, errOut)
	}
}

func TestShellQuote(t *testing.T) {
	for _, s := range []string{"", "plain", "it's", "a b'c'd", `$HOME "x"`} {
		if got := shellUnquote(shellQuote(s)); got != s {
			t.Errorf("shellUnquote(shellQuote(%q)) = %q", s, got)
		}
	}
}
