package processor_test

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/sink"
)

// TestIdempotencyKeyString: a key is named as it was built, from outside the package (where the
// compiler may copy an inlined constructor's function literal), and a function of the user's is
// named as such without being called.
func TestIdempotencyKeyString(t *testing.T) {
	t.Parallel()
	called := 0
	mine := func(*processor.Record) ([]byte, error) { called++; return []byte("k"), nil }
	for _, tc := range []struct {
		name string
		key  processor.IdempotencyKey
		want string
	}{
		{"none", nil, "none"},
		{"a JSON field", processor.KeyFromJSON("payment_id"), `KeyFromJSON("payment_id")`},
		{"a nested JSON field", processor.KeyFromJSON("a.b"), `KeyFromJSON("a.b")`},
		{"a header", processor.KeyFromHeader("h"), `KeyFromHeader("h")`},
		{"another header", processor.KeyFromHeader("x-id"), `KeyFromHeader("x-id")`},
		{"the message id", processor.KeyFromHeader(sink.HeaderMessageID), `KeyFromHeader("` + sink.HeaderMessageID + `")`},
		{"quoted as Go", processor.KeyFromJSON("a\"b\x1b"), `KeyFromJSON("a\"b\x1b")`},
		{"a function of yours", mine, "a function of yours"},
		{"a function of yours wrapping a built key", func(r *processor.Record) ([]byte, error) {
			called++
			return processor.KeyFromJSON("id")(r)
		}, "a function of yours"},
	} {
		if got := tc.key.String(); got != tc.want {
			t.Errorf("%s: String() = %s, want %s", tc.name, got, tc.want)
		}
	}
	if called != 0 {
		t.Errorf("String called a function of the user's %d times; want never", called)
	}
	// A built key still takes keys as before.
	k, err := processor.KeyFromJSON("a.b")(&processor.Record{Value: []byte(`{"a":{"b":"x"}}`)})
	if string(k) != "x" || err != nil {
		t.Errorf(`KeyFromJSON("a.b") = %q, %v; want "x"`, k, err)
	}
	k, err = processor.KeyFromHeader("h")(&processor.Record{Headers: []kgo.RecordHeader{{Key: "h", Value: []byte("y")}}})
	if string(k) != "y" || err != nil {
		t.Errorf(`KeyFromHeader("h") = %q, %v; want "y"`, k, err)
	}
}
