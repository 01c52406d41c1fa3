package sink

import (
	"reflect"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

func TestHeadersRoundTrip(t *testing.T) {
	hs := []kgo.RecordHeader{{Key: "a", Value: []byte("1")}, {Key: "b", Value: nil}, {Key: "a", Value: []byte("2")},
		{Key: "\xff\x00k", Value: []byte{0}}}
	got, err := JoinHeaders(SplitHeaders(hs))
	if err != nil || !reflect.DeepEqual(got, hs) {
		t.Fatalf("JoinHeaders(SplitHeaders(%v)) = %v, %v", hs, got, err)
	}
	if got, err := JoinHeaders(nil, nil); got != nil || err != nil {
		t.Errorf("no headers: %v, %v", got, err)
	}
	if _, err := JoinHeaders([][]byte{[]byte("a"), []byte("b")}, [][]byte{nil}); err == nil {
		t.Error("2 keys and 1 value: no error (headers would be silently truncated)")
	}
}
