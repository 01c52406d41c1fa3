package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

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
// of the dev loop running with -dir, and say what to do when none runs.
func TestBrokersFromTheDevLoop(t *testing.T) {
	t.Setenv("KAFKA_BROKERS", "")
	dir := t.TempDir()
	if _, err := brokersFor("", dir); err == nil || !strings.Contains(err.Error(), "start `go tool kafkapg dev`") {
		t.Errorf("no broker: %v", err)
	}
	if err := writeEnv(filepath.Join(dir, "env"), [][2]string{{"KAFKA_BROKERS", "127.0.0.1:1,127.0.0.1:2"}, {"DATABASE_URL", "postgres://x@h/d?a='b'"}}); err != nil {
		t.Fatal(err)
	}
	// Written by this process: not a running loop of another.
	if _, err := brokersFor("", dir); err == nil {
		t.Error("an env file of this process was taken for a running loop's")
	}
	pid, env, err := readEnv(filepath.Join(dir, "env"))
	if err != nil || pid != os.Getpid() || len(env) != 2 || env[1][1] != "postgres://x@h/d?a='b'" {
		t.Errorf("readEnv: %d %q %v", pid, env, err)
	}
	if got, err := brokersFor("a:1", dir); err != nil || strings.Join(got, ",") != "a:1" {
		t.Errorf("-brokers: %q %v", got, err)
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
