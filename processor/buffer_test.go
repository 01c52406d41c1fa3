package processor

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// TestDetach: a detached record equals the fetched one, keeps null keys and values null, and
// shares no byte with franz-go's buffers (which it would keep alive).
func TestDetach(t *testing.T) {
	t.Parallel()
	fetch := []byte("keyvalue\x00hv")
	r := &kgo.Record{Topic: "t", Partition: 3, Offset: 42, LeaderEpoch: 7, Timestamp: time.UnixMilli(123),
		Key: fetch[0:3], Value: fetch[3:8], Headers: []kgo.RecordHeader{{Key: "h\xff", Value: fetch[8:11]}, {Key: "n"}}}
	d := detach([]*kgo.Record{r})[0]
	if string(d.Key) != "key" || string(d.Value) != "value" || d.Offset != 42 || d.LeaderEpoch != 7 || d.Partition != 3 || d.Topic != "t" ||
		!d.Timestamp.Equal(r.Timestamp) || len(d.Headers) != 2 || d.Headers[0].Key != "h\xff" || string(d.Headers[0].Value) != "\x00hv" ||
		d.Headers[1].Value != nil {
		t.Fatalf("detach(%+v) = %+v", r, d)
	}
	for i := range fetch {
		fetch[i] = 'X'
	}
	if string(d.Key) != "key" || string(d.Value) != "value" || string(d.Headers[0].Value) != "\x00hv" {
		t.Errorf("the detached record changed with franz-go's buffer: %q %q %q", d.Key, d.Value, d.Headers[0].Value)
	}
	if d.Key = append(d.Key, '!'); string(d.Value) != "value" {
		t.Errorf("appending to the key overwrote the value: %q", d.Value)
	}
	var many []*kgo.Record
	for i := range 200 { // several chunks
		many = append(many, &kgo.Record{Offset: int64(i), Value: []byte(fmt.Sprint(i))})
	}
	for i, d := range detach(many) {
		if d.Offset != int64(i) || string(d.Value) != fmt.Sprint(i) {
			t.Fatalf("record %d detached as offset %d, value %q", i, d.Offset, d.Value)
		}
	}
	null := detach([]*kgo.Record{{Key: nil, Value: []byte{}}})[0]
	if null.Key != nil || null.Value == nil {
		t.Errorf("null key and empty value came back as %#v and %#v", null.Key, null.Value)
	}
}

// TestBufferWaitsForRelease: the poll loop waits while the buffer is at its limit and goes on as
// soon as a release brings it under.
func TestBufferWaitsForRelease(t *testing.T) {
	t.Parallel()
	b := newBuffer(1000)
	b.add(999)
	if !b.wait(context.Background()) {
		t.Fatal("wait under the limit did not return at once")
	}
	b.add(1)
	waited := make(chan bool)
	go func() { waited <- b.wait(context.Background()) }()
	select {
	case <-waited:
		t.Fatal("wait returned at the limit")
	case <-time.After(50 * time.Millisecond):
	}
	b.release(1)
	if ok := <-waited; !ok {
		t.Fatal("wait returned false")
	}
	ctx, cancel := context.WithCancel(context.Background())
	b.add(5)
	cancel()
	if b.wait(ctx) {
		t.Error("wait over the limit with a cancelled context returned true")
	}
	if got := b.share(1000); got != minPartitionShare {
		t.Errorf("share of 1000 partitions = %d, want the minimum %d", got, minPartitionShare)
	}
}

// TestHeaderOverheadIsWhatAHeaderCosts: the buffer budget counts a header as its key and value
// plus headerOverhead (56 bytes), and docs/configuration.md says so. Measured here as the heap
// that detached records keep: records with eight headers each, less the same records without
// them, per header. A traceparent header (an 11-byte key) costs the most a short key does: its
// struct (40 bytes) and its key's allocation (16).
func TestHeaderOverheadIsWhatAHeaderCosts(t *testing.T) {
	const records, headers = 4096, 8
	fetched := func(withHeaders bool) []*kgo.Record {
		recs := make([]*kgo.Record, records)
		for i := range recs {
			recs[i] = &kgo.Record{Topic: "t", Key: []byte("key"), Value: []byte("value")}
			if withHeaders {
				for range headers {
					recs[i].Headers = append(recs[i].Headers, kgo.RecordHeader{Key: "traceparent", Value: []byte("00-0123456789abcdef")})
				}
			}
		}
		return recs
	}
	// kept is the heap that detach's copies of recs keep alive.
	kept := func(recs []*kgo.Record) int64 {
		var with, without runtime.MemStats
		d := detach(recs)
		runtime.GC()
		runtime.ReadMemStats(&with)
		runtime.KeepAlive(d)
		d = nil
		runtime.GC()
		runtime.ReadMemStats(&without)
		return int64(with.HeapAlloc) - int64(without.HeapAlloc)
	}
	plain, withHeaders := fetched(false), fetched(true)
	var valueBytes int64 // the headers' values, which the budget counts by their length
	for _, r := range withHeaders {
		for _, h := range r.Headers {
			valueBytes += int64(len(h.Value))
		}
	}
	perHeader := float64(kept(withHeaders)-kept(plain)-valueBytes) / (records * headers)
	t.Logf("a detached header keeps %.1f bytes besides its value (counted as %d and its key's %d)", perHeader, headerOverhead, len("traceparent"))
	if perHeader > float64(headerOverhead+len("traceparent")) {
		t.Errorf("a header keeps %.1f bytes besides its value, more than the %d + its key's length the budget counts", perHeader, headerOverhead)
	}
	if perHeader < 40 {
		t.Errorf("a header keeps %.1f bytes besides its value: less than its struct (40), so the measure is wrong", perHeader)
	}
}
