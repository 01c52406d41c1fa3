package sink

import (
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// TestStreamHeaderRoundTrip: what an event's stream header says is what ParseStream reads back,
// for a stream created afresh and for a fork.
func TestStreamHeaderRoundTrip(t *testing.T) {
	t.Parallel()
	root := Stream{ID: [16]byte{1, 2}, Seq: 7, Root: [16]byte{3}, SourceOffset: 1234, DestPartition: 5, DestTopic: topicHash("orders")}
	fork := Stream{ID: [16]byte{4}, Seq: 1, Root: [16]byte{3}, SourceOffset: 99, DestPartition: 0, DestTopic: topicHash("x"),
		Parent: [16]byte{1, 2}, ForkSeq: 6, Since: time.UnixMilli(1764800000123)}
	keyedRoot, keyedFork := root, fork
	keyedRoot.Keyed, keyedFork.Keyed = true, true
	for _, want := range []Stream{root, fork, keyedRoot, keyedFork} {
		h := want.header()
		got, ok := ParseStream([]kgo.RecordHeader{{Key: "x", Value: []byte("y")}, h})
		if !ok || got != want {
			t.Errorf("ParseStream(%q) = %+v, %v; want %+v", h.Value, got, ok, want)
		}
	}
	if !root.IsRoot() || fork.IsRoot() {
		t.Error("IsRoot: want a stream created afresh to be a root, and a fork not")
	}
	if !root.Fits("orders", 5) || root.Fits("orders", 4) || root.Fits("orders.v2", 5) {
		t.Error("Fits: want the stream to fit its own topic and partition only")
	}
}

// TestParseStreamRejects: a header that is not exactly one of the two forms is no stream: the
// consumer deduplicates the record by its message id instead.
func TestParseStreamRejects(t *testing.T) {
	t.Parallel()
	const u, v, d = "0a000000-0000-4000-8000-000000000001", "0a000000-0000-4000-8000-000000000002", " 3@0a1b2c3d"
	for _, value := range []string{
		"",
		u,
		u + " 1 " + v,                       // no source offset
		u + " 1 " + v + " 5",                // no destination (the form before migration 11)
		u + " 1 " + v + " 5 " + u + " 3 17", // a fork in the form before migration 11
		u + " 0 " + v + " 5" + d,            // number 0
		u + " -1 " + v + " 5" + d,           // negative
		u + " 1 " + v + " -5" + d,           // negative offset
		u + " x " + v + " 5" + d,            // not a number
		u + " 1 " + v + " 5 3",              // a destination without its topic
		u + " 1 " + v + " 5 -3@0a1b2c3d",    // a negative partition
		u + " 1 " + v + " 5 3@0a1b2c",       // a topic hash too short
		u + " 1 " + v + " 5 3@0A1B2C3D",     // not as written
		"0a000000-0000-4000-8000-00000000000 1 " + v + " 5" + d, // 35 characters
		"{" + u[1:] + "} 1 " + v + " 5" + d,                     // not canonical
		u + " 1 " + v + " 5" + d + " " + u,                      // a fork cut short
		u + " 1 " + v + " 5" + d + " " + u + " 0 17",            // a fork at 0
		u + " 1 " + v + " 5" + d + " " + u + " 3 0",             // a fork with no time
		u + " 1 " + v + " 5" + d + " " + u + " 3 17 x",          // too many fields
		u + " 1 " + v + " 5" + d + " K",                         // not the Keyed mark
		u + " 1 " + v + " 5" + d + " k k",                       // marked twice
		"\xff\x00 1 " + v + " 5" + d,                            // binary
	} {
		if s, ok := ParseStream([]kgo.RecordHeader{{Key: HeaderStream, Value: []byte(value)}}); ok {
			t.Errorf("ParseStream(%q) = %+v, want no stream", value, s)
		}
	}
	if _, ok := ParseStream(nil); ok {
		t.Error("ParseStream of no headers: want no stream")
	}
}

// FuzzParseStream: any bytes in the header are either no stream or one whose header reads back
// to the same stream.
func FuzzParseStream(f *testing.F) {
	f.Add([]byte("0a000000-0000-4000-8000-000000000001 3 0a000000-0000-4000-8000-000000000002 10 0@0a1b2c3d"))
	f.Add([]byte("0a000000-0000-4000-8000-000000000001 3 0a000000-0000-4000-8000-000000000002 10 7@0a1b2c3d 0a000000-0000-4000-8000-000000000003 2 1764800000123"))
	f.Fuzz(func(t *testing.T, value []byte) {
		s, ok := ParseStream([]kgo.RecordHeader{{Key: HeaderStream, Value: value}})
		if !ok {
			return
		}
		back, ok := ParseStream([]kgo.RecordHeader{s.header()})
		if !ok || back != s {
			t.Fatalf("%q parsed as %+v, whose header %q reads back as %+v, %v", value, s, s.header().Value, back, ok)
		}
	})
}
