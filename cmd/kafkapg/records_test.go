package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// TestConsumeEscapesControls: consume's lines are a record's bytes, anyone's; what a terminal
// takes for a command (ESC, C1 controls such as U+009B, a CSI of its own, bidirectional
// overrides such as U+202E) is printed as a JSON escape, never raw, and each line is still JSON
// that reads back the record.
func TestConsumeEscapesControls(t *testing.T) {
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 1)
	t.Setenv("KAFKA_BROKERS", strings.Join(k.Brokers, ","))
	records := []*kgo.Record{
		{Topic: topic, Key: []byte("k\u202egpj.exe"), Value: []byte("{\"a\":\"x\u009b31m\u2066\xff\"}"),
			Headers: []kgo.RecordHeader{{Key: "h\u202e", Value: []byte("v\u009b2J\x1b]0;t\x07")}}},
		{Topic: topic, Value: []byte("text \u202e\x1b[2J\u009b")},
	}
	k.Produce(t, records...)

	code, out, errOut := cli(t, "", "consume", "-topic", topic)
	if code != 0 {
		t.Fatalf("consume: exit %d: %s", code, errOut)
	}
	if bad := testenv.RawControl(out); bad != "" {
		t.Errorf("consume prints %s raw:\n%q", bad, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != len(records) {
		t.Fatalf("consume printed %d lines, want %d:\n%s", len(lines), len(records), out)
	}
	var first struct {
		Key     string
		Value   struct{ A string }
		Headers map[string]string
	}
	if err := json.Unmarshal([]byte(lines[0]), &first); err != nil {
		t.Fatalf("%q: %v", lines[0], err)
	}
	if first.Key != "k\u202egpj.exe" || first.Value.A != "x\u009b31m\u2066\ufffd" || first.Headers["h\u202e"] != "v\u009b2J\x1b]0;t\x07" {
		t.Errorf("the first record reads back as %+v", first)
	}
	var second struct{ Value string }
	if err := json.Unmarshal([]byte(lines[1]), &second); err != nil || second.Value != "text \u202e\x1b[2J\u009b" {
		t.Errorf("the second record reads back as %+v, %v", second, err)
	}
}
