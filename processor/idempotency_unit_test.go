package processor

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

func TestKeyFromJSON(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, path, value string
		want              string
		wantErr           bool
	}{
		{"string field", "event_id", `{"event_id":"e-1","x":1}`, "e-1", false},
		{"number field: its JSON, marked", "n", `{"n": 42}`, "\xff42", false},
		{"a string of digits: its text", "n", `{"n": "42"}`, "42", false},
		{"true, not \"true\"", "b", `{"b": true}`, "\xfftrue", false},
		{"nested field", "order.id", `{"order":{"id":"o-7"}}`, "o-7", false},
		{"object field: its JSON, compacted", "order", `{"order":{ "id" : "o-7" }}`, "\xff" + `{"id":"o-7"}`, false},
		{"escaped string", "id", `{"id":"a\"b\u00e9"}`, "a\"bé", false},
		{"missing field", "event_id", `{"id":"e-1"}`, "", true},
		{"null field", "event_id", `{"event_id":null}`, "", true},
		{"empty string", "event_id", `{"event_id":""}`, "", true},
		{"not JSON", "event_id", `not json`, "", true},
		{"not an object", "event_id", `["event_id"]`, "", true},
		{"nested through a string", "order.id", `{"order":"o-7"}`, "", true},
		{"field names are exact", "event_id", `{"Event_ID":"e-1"}`, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k, err := KeyFromJSON(tc.path)(&Record{Value: []byte(tc.value)})
			if tc.wantErr {
				if !errors.Is(err, ErrNoIdempotencyKey) {
					t.Fatalf("KeyFromJSON(%q) on %s = %q, %v; want ErrNoIdempotencyKey", tc.path, tc.value, k, err)
				}
				return
			}
			if err != nil || string(k) != tc.want {
				t.Fatalf("KeyFromJSON(%q) on %s = %q, %v; want %q", tc.path, tc.value, k, err, tc.want)
			}
		})
	}
}

func TestKeyFromHeader(t *testing.T) {
	t.Parallel()
	rec := &Record{Headers: []kgo.RecordHeader{{Key: "id", Value: []byte("first")}, {Key: "other", Value: []byte("x")}, {Key: "id", Value: []byte("last")}}}
	if k, err := KeyFromHeader("id")(rec); err != nil || string(k) != "last" {
		t.Fatalf("KeyFromHeader = %q, %v; want the last id header", k, err)
	}
	for _, hs := range [][]kgo.RecordHeader{nil, {{Key: "id"}}, {{Key: "ID", Value: []byte("x")}}} {
		if k, err := KeyFromHeader("id")(&Record{Headers: hs}); !errors.Is(err, ErrNoIdempotencyKey) {
			t.Errorf("KeyFromHeader on %v = %q, %v; want ErrNoIdempotencyKey", hs, k, err)
		}
	}
}

// FuzzKeyFromJSON: any value gives a key or ErrNoIdempotencyKey, never a panic nor an empty key;
// a key of a valid object's string field is that string.
func FuzzKeyFromJSON(f *testing.F) {
	for _, v := range []string{`{"event_id":"e-1"}`, `{"event_id":{"a":[1,2]}}`, `{"event_id":null}`, `{`, `"x"`, "\x00\xff"} {
		f.Add([]byte(v))
	}
	key := KeyFromJSON("event_id")
	f.Fuzz(func(t *testing.T, value []byte) {
		k, err := key(&Record{Value: value})
		if err != nil {
			if !errors.Is(err, ErrNoIdempotencyKey) {
				t.Fatalf("error %v is not ErrNoIdempotencyKey", err)
			}
			return
		}
		if len(k) == 0 {
			t.Fatal("an empty key without an error")
		}
		var obj map[string]json.RawMessage
		if json.Unmarshal(value, &obj) != nil {
			t.Fatalf("a key %q from a value that is not a JSON object", k)
		}
		var s string
		if json.Unmarshal(obj["event_id"], &s) == nil && !bytes.Equal(k, []byte(s)) {
			t.Fatalf("key %q, want the field's string %q", k, s)
		}
	})
}

// TestHumanBytes: the startup log's sizes, at the units' edges (999.7 bytes must not print as
// "1e+03 B").
func TestHumanBytes(t *testing.T) {
	for n, want := range map[float64]string{
		0: "0 B", 999: "999 B", 999.7: "1 kB", 1320: "1.32 kB", 1.32e6: "1.32 MB", 133.056e9: "133 GB", 4e15: "4000 TB",
	} {
		if got := humanBytes(n); got != want {
			t.Errorf("humanBytes(%v) = %q, want %q", n, got, want)
		}
	}
	if got := keySizing(168 * time.Hour); !strings.Contains(got, "at 1,000 keyed records/s that is up to 27.8 GB") {
		t.Errorf("keySizing(7 days) = %q, want the default's 27.8 GB", got)
	}
}

// TestLogPolicyNamesKey: the startup log names each topic's idempotency key as it was built.
func TestLogPolicyNamesKey(t *testing.T) {
	t.Parallel()
	var logs bytes.Buffer
	p := &Processor{cfg: &Config{Group: "g"}, log: slog.New(slog.NewJSONHandler(&logs, nil)), policies: map[string]*policy{
		"payments": {idempotencyKey: KeyFromJSON("payment_id")},
		"refunds":  {idempotencyKey: KeyFromHeader("x-id")},
		"orders":   {idempotencyKey: func(*Record) ([]byte, error) { panic("the user's key function was called") }},
		"returns":  {},
	}}
	for _, topic := range []string{"payments", "refunds", "orders", "returns"} {
		p.logPolicy(topic)
	}
	for _, want := range []string{
		`"topic":"payments",` + `.*"idempotency_key":"KeyFromJSON\(\\"payment_id\\"\)"`,
		`"topic":"refunds",` + `.*"idempotency_key":"KeyFromHeader\(\\"x-id\\"\)"`,
		`"topic":"orders",` + `.*"idempotency_key":"a function of yours"`,
		`"topic":"returns",` + `.*"idempotency_key":"none"`,
	} {
		if !regexp.MustCompile(want).MatchString(logs.String()) {
			t.Errorf("the startup log does not match %s:\n%s", want, logs.String())
		}
	}
}
