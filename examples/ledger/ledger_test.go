package ledger_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/processor"
)

func TestParse(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		input string
		want  ledger.Event
		// wantErr, if set, must appear in the error; every error must be permanent.
		wantErr    string
		wantPoison bool
	}{
		{
			name:  "valid",
			input: `{"event_id":"e-1","account":"acct-7","amount":42,"seq":3}`,
			want:  ledger.Event{EventID: "e-1", Account: "acct-7", Amount: 42, Seq: 3},
		},
		{
			name:  "valid with every field",
			input: `{"event_id":"e-2","account":"acct-1","amount":-500,"seq":1,"fail_attempts":2,"poison":false}`,
			want:  ledger.Event{EventID: "e-2", Account: "acct-1", Amount: -500, Seq: 1, FailAttempts: 2},
		},
		{
			name:  "only the required fields",
			input: `{"event_id":"e-3","account":"a"}`,
			want:  ledger.Event{EventID: "e-3", Account: "a"},
		},
		{
			name:  "unknown fields and whitespace are ignored",
			input: " \n{\"event_id\":\"e-4\", \"account\":\"a\", \"note\":{\"x\":[1,2]}}\t",
			want:  ledger.Event{EventID: "e-4", Account: "a"},
		},
		{name: "empty value", input: ``, wantErr: "invalid ledger event JSON"},
		{name: "truncated JSON", input: `{"event_id":"e-5","account":`, wantErr: "invalid ledger event JSON"},
		{name: "not an object", input: `[1,2]`, wantErr: "invalid ledger event JSON"},
		{name: "amount is a string", input: `{"event_id":"e-6","account":"a","amount":"7"}`, wantErr: "invalid ledger event JSON"},
		{name: "amount overflows int64", input: `{"event_id":"e-7","account":"a","amount":9223372036854775808}`, wantErr: "invalid ledger event JSON"},
		{name: "trailing garbage", input: `{"event_id":"e-8","account":"a"} {}`, wantErr: "invalid ledger event JSON"},
		{name: "null", input: `null`, wantErr: "no event_id"},
		{name: "empty object", input: `{}`, wantErr: "no event_id"},
		{name: "missing event_id", input: `{"account":"a","amount":5}`, wantErr: "no event_id"},
		{name: "empty event_id", input: `{"event_id":"","account":"a"}`, wantErr: "no event_id"},
		{name: "missing account", input: `{"event_id":"e-9","amount":5}`, wantErr: "ledger event e-9 has no account"},
		{name: "empty account", input: `{"event_id":"e-10","account":""}`, wantErr: "ledger event e-10 has no account"},
		{name: "poison", input: `{"event_id":"e-11","account":"a","poison":true}`, wantErr: "ledger event e-11", wantPoison: true},
		{name: "poison without event_id is reported as missing event_id", input: `{"account":"a","poison":true}`, wantErr: "no event_id"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := ledger.Parse([]byte(tt.input))
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Parse(%q) error: %v", tt.input, err)
				}
				if got != tt.want {
					t.Fatalf("Parse(%q) = %+v, want %+v", tt.input, got, tt.want)
				}
				return
			}
			if err == nil {
				t.Fatalf("Parse(%q) = %+v, want an error containing %q", tt.input, got, tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %q does not contain %q", err, tt.wantErr)
			}
			if !processor.IsPermanent(err) {
				t.Errorf("error %q is not permanent", err)
			}
			if c := processor.Classify(err); c != processor.ClassPermanent {
				t.Errorf("Classify(%q) = %v, want permanent", err, c)
			}
			if errors.Is(err, ledger.ErrPoison) != tt.wantPoison {
				t.Errorf("errors.Is(%q, ErrPoison) = %v, want %v", err, !tt.wantPoison, tt.wantPoison)
			}
		})
	}
}

func TestParseJSONSyntaxErrorIsWrapped(t *testing.T) {
	t.Parallel()
	_, err := ledger.Parse([]byte(`{"event_id":`))
	var syn *json.SyntaxError
	if !errors.As(err, &syn) {
		t.Fatalf("err = %v, want it to wrap *json.SyntaxError", err)
	}
}

// FuzzParse: Parse never panics; it accepts only events with an id and an account that are not
// poison; every rejection is permanent; and what it accepts survives re-encoding.
func FuzzParse(f *testing.F) {
	for _, it := range ledger.Generate(ledger.GenConfig{
		Events: 40, Accounts: 3, PoisonPerMille: 150, MalformedPerMille: 150, FlakyPerMille: 150, MaxFailAttempts: 3, Seed: 1,
	}) {
		f.Add(it.Value)
	}
	f.Add([]byte(``))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"event_id":"e","account":"a","poison":true}`))
	f.Add([]byte(`{"EVENT_ID":"e","Account":"a","amount":1e3}`))
	f.Add([]byte("{\"event_id\":\"\xff\",\"account\":\"\\u0000\"}"))

	f.Fuzz(func(t *testing.T, value []byte) {
		ev, err := ledger.Parse(value)
		if err != nil {
			if !processor.IsPermanent(err) {
				t.Fatalf("Parse(%q) error %q is not permanent", value, err)
			}
			return
		}
		if ev.EventID == "" || ev.Account == "" || ev.Poison {
			t.Fatalf("Parse(%q) accepted %+v", value, ev)
		}
		b, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		again, err := ledger.Parse(b)
		if err != nil || again != ev {
			t.Fatalf("re-encoded %+v as %s, which parses to %+v, %v", ev, b, again, err)
		}
	})
}
