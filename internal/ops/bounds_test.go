package ops_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// TestTraceReadsOnlyTheGroupsTopics: a trace reads a topic only if it is one of the group's (a
// source topic, configured or with a position in Postgres, a retry tier's topic of one, its
// dead-letter topic); any other topic the service's Kafka login can read is refused, by offset
// and by key, with an error naming it and the group's topics, and none of its keys is told (a
// viewer read hr.salaries's keys through /trace).
func TestTraceReadsOnlyTheGroupsTopics(t *testing.T) {
	k := testenv.NewKfake(t)
	e := newKeysEnv(t)
	ctx := context.Background()
	for _, topic := range []string{"orders", "payments", "hr.salaries"} {
		k.CreateTopicNamed(t, topic, 1)
	}
	k.Produce(t, &kgo.Record{Topic: "hr.salaries", Key: []byte("ceo"), Value: []byte("1000000")})
	kc := k.Client(t)
	e.position("orders", 0, 0)                                                        // consumed: a position in Postgres
	e.position(retrytopics.TierTopic("orders", keysGroup, 1), 0, 0)                   // its tier has one too
	o := e.ops.WithTopics("payments")                                                 // configured, no position yet
	allowed := "only its source topics (orders, payments), their retry tiers' topics" // the tier's position is not a source

	for _, tc := range []struct {
		topic   string
		wantErr bool
	}{
		{"orders", false},
		{"payments", false},
		{retrytopics.TierTopic("orders", keysGroup, 1), false},
		{retrytopics.TierTopic("payments", keysGroup, retrytopics.MaxTiers), false},
		{retrytopics.DLQTopic("orders", keysGroup), false},
		{"hr.salaries", true},
		{retrytopics.DLQTopic("orders", "other-group"), true},
		{retrytopics.TierTopic("orders", keysGroup, retrytopics.MaxTiers+1), true},
		{retrytopics.TierTopic("hr.salaries", keysGroup, 1), true},
		{"orders.kg.dlq.x", true},
		{"Orders", true},
	} {
		for _, q := range []ops.TraceQuery{{Topic: tc.topic, Partition: 0, Offset: 0}, {Topic: tc.topic, Key: []byte("ceo")}} {
			res, err := o.Trace(ctx, q, kc)
			if !tc.wantErr {
				if err != nil {
					t.Errorf("Trace(%+v): %v, want it traced", q, err)
				}
				continue
			}
			if !errors.Is(err, ops.ErrUsage) || !strings.Contains(err.Error(), fmt.Sprintf("topic %q is not one of group kg's topics", tc.topic)) ||
				!strings.Contains(err.Error(), allowed) {
				t.Errorf("Trace(%+v): %v, want bad usage naming the topic and the group's (%s)", q, err, allowed)
			}
			if len(res.Records) != 0 {
				t.Errorf("Trace(%+v) refused, yet told %d records: %+v", q, len(res.Records), res.Records)
			}
		}
	}
	// An Ops without WithTopics has the topics of its positions only; a group without any has none.
	if _, err := e.ops.Trace(ctx, ops.TraceQuery{Topic: "payments", Partition: 0, Offset: 0}, kc); !errors.Is(err, ops.ErrUsage) {
		t.Errorf("Trace of payments without WithTopics: %v, want it refused (no position)", err)
	}
	e.exec(`DELETE FROM kafkapg.offsets`)
	if _, err := e.ops.Trace(ctx, ops.TraceQuery{Topic: "orders", Partition: 0, Offset: 0}, nil); err == nil ||
		!strings.Contains(err.Error(), "the group has no source topic") {
		t.Errorf("Trace of a group with no topic: %v, want it refused, saying why", err)
	}
}

// fetchSizes records the byte limits of every fetch request kfake receives.
type fetchSizes struct {
	mu        sync.Mutex
	requests  int
	maxBytes  int32 // the largest MaxBytes asked for
	partBytes int32 // the largest PartitionMaxBytes
}

func watchFetches(k *testenv.Kafka) *fetchSizes {
	fs := &fetchSizes{}
	k.Cluster.ControlKey(kmsg.Fetch.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		r := req.(*kmsg.FetchRequest)
		fs.mu.Lock()
		defer fs.mu.Unlock()
		fs.requests++
		fs.maxBytes = max(fs.maxBytes, r.MaxBytes)
		for _, t := range r.Topics {
			for _, p := range t.Partitions {
				fs.partBytes = max(fs.partBytes, p.PartitionMaxBytes)
			}
		}
		return nil, nil, false
	})
	return fs
}

// TestTraceScanIsBoundedInBytes: a trace's reads from Kafka fetch a few megabytes at a time
// (franz-go's default is 50 MiB a fetch, which each of a trace's clients held), and what it keeps
// of a record it read is what it tells: not a key that is a slice of the fetched batch, which
// keeps the batch, values included, as long as the result. 20 traces by key of a topic of 256 KB
// records took a processor to 1 GB.
func TestTraceScanIsBoundedInBytes(t *testing.T) {
	k := testenv.NewKfake(t)
	e := newKeysEnv(t)
	ctx := context.Background()
	topic := k.CreateTopic(t, 3)
	value := strings.Repeat("v", 256<<10)
	var recs []*kgo.Record
	for i := range 60 {
		recs = append(recs, &kgo.Record{Topic: topic, Partition: int32(i % 3), Key: []byte(fmt.Sprintf("k%d", i%5)), Value: []byte(value)})
	}
	if err := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner())).ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	fetches := watchFetches(k)
	o := e.ops.WithTopics(topic)
	kc := k.Client(t)

	// What the result keeps alive, measured as the heap the result alone holds: the difference
	// made by dropping it, after the trace's clients closed. (The heap before and after the trace
	// is noise: kfake and the clients allocate and free megabytes around it.) A key that is a
	// slice of the fetched batch keeps the batch, values included (9 MB for these 12 records).
	// The least of three traces, so that a stray allocation elsewhere cannot fail it.
	retained := func(q ops.TraceQuery, check func(ops.TraceResult)) int64 {
		t.Helper()
		res, err := o.Trace(ctx, q, kc)
		if err != nil {
			t.Fatal(err)
		}
		check(res)
		var with, without runtime.MemStats
		runtime.GC()
		runtime.GC() // a sync.Pool's buffers (franz-go's) outlive one collection, then go
		runtime.ReadMemStats(&with)
		runtime.KeepAlive(res)
		res = ops.TraceResult{} // the only reference to what the trace told
		runtime.GC()
		runtime.ReadMemStats(&without)
		return int64(with.HeapAlloc) - int64(without.HeapAlloc)
	}
	keepsLittle := func(what string, q ops.TraceQuery, check func(ops.TraceResult)) {
		t.Helper()
		least := int64(math.MaxInt64)
		for range 3 {
			least = min(least, retained(q, check))
		}
		t.Logf("%s keeps %d bytes alive (the least of three)", what, least)
		if least > 256<<10 { // one record of 256 KB; a copy of the keys is a few KB
			t.Errorf("%s keeps %d bytes alive: its keys keep the fetched batches, values included", what, least)
		}
	}
	keepsLittle("the trace of key k1 (12 records of 256 KB)", ops.TraceQuery{Topic: topic, Key: []byte("k1")}, func(res ops.TraceResult) {
		if len(res.Records) != 12 || len(res.Notes) != 0 {
			t.Errorf("trace of key k1: %d records, notes %q; want 12, none", len(res.Records), res.Notes)
		}
	})
	keepsLittle("the trace of one offset", ops.TraceQuery{Topic: topic, Partition: 1, Offset: 7}, func(res ops.TraceResult) {
		if len(res.Records) != 1 || res.Records[0].KeyText != "k2" { // record 22 of 60
			t.Errorf("trace of %s[1]@7: %+v, want key k2", topic, res.Records)
		}
	})
	fetches.mu.Lock()
	defer fetches.mu.Unlock()
	if fetches.requests == 0 {
		t.Fatal("no fetch seen")
	}
	if fetches.maxBytes > 4<<20 || fetches.partBytes > 1<<20 {
		t.Errorf("a trace's fetch asked for up to %d bytes, %d of a partition; want at most 4 MiB and 1 MiB", fetches.maxBytes, fetches.partBytes)
	}
}

// TestTracesAtOnceAreBounded: a process runs at most ops.MaxTraces traces at once; one more is
// refused at once with ErrBusy (not queued), and the next one after a trace ended runs.
func TestTracesAtOnceAreBounded(t *testing.T) {
	k := testenv.NewKfake(t)
	e := newKeysEnv(t)
	topic := k.CreateTopic(t, 1)
	k.Produce(t, &kgo.Record{Topic: topic, Key: []byte("k"), Value: []byte("v")})
	o := e.ops.WithTopics(topic)
	// Each trace's first read from Kafka (its topic's offsets) waits until released.
	arrived, release := make(chan struct{}, 100), make(chan struct{})
	k.Cluster.ControlKey(kmsg.ListOffsets.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		select {
		case <-release:
			return nil, nil, false
		default:
		}
		arrived <- struct{}{}
		k.Cluster.SleepControl(func() { <-release })
		return nil, nil, false
	})
	var wg sync.WaitGroup
	for range ops.MaxTraces {
		kc := k.Client(t) // a client each: kfake answers a connection's requests in order
		wg.Go(func() {
			if _, err := o.Trace(context.Background(), ops.TraceQuery{Topic: topic, Key: []byte("k")}, kc); err != nil {
				t.Errorf("trace: %v", err)
			}
		})
	}
	for range ops.MaxTraces {
		select {
		case <-arrived:
		case <-time.After(30 * time.Second):
			t.Fatal("the traces did not reach Kafka")
		}
	}
	done := make(chan error, 1)
	kc := k.Client(t)
	go func() {
		_, err := o.Trace(context.Background(), ops.TraceQuery{Topic: topic, Partition: 0, Offset: 0}, kc)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, ops.ErrBusy) || !strings.Contains(err.Error(), fmt.Sprintf("%d traces are running", ops.MaxTraces)) {
			t.Errorf("trace number %d: %v, want ErrBusy", ops.MaxTraces+1, err)
		}
	case <-time.After(5 * time.Second):
		t.Errorf("trace number %d waits: want it refused at once", ops.MaxTraces+1)
		close(release)
		<-done
		release = nil
	}
	if release != nil {
		close(release)
	}
	wg.Wait()
	if _, err := o.Trace(context.Background(), ops.TraceQuery{Topic: topic, Partition: 0, Offset: 0}, kc); err != nil {
		t.Errorf("a trace after the others ended: %v", err)
	}
}

// TestShowReadsOnlyWhatItShows: Show reads a dead letter's value only when it is shown, and
// then only its first ValueBytes, saying how long it is; with HideValues it reads neither the
// value nor the headers' values (a page of a 16 MB dead letter read it whole, even to hide it: 40
// requests took 786 MB). Measured in bytes allocated by the reads.
func TestShowReadsOnlyWhatItShows(t *testing.T) {
	e := newKeysEnv(t)
	ctx := context.Background()
	const size = 16 << 20
	r := rec("orders", 0, 5, "k")
	r.Value = []byte(strings.Repeat("v", size))
	id := e.deadLetter(r, false, false)
	e.exec(`UPDATE kafkapg.dead_letters SET header_keys = ARRAY['big'::bytea, 'small'::bytea], header_values = ARRAY[$2::bytea, 'x'::bytea] WHERE id = $1`,
		id, []byte(strings.Repeat("h", 4<<20)))

	allocated := func(opt ops.ShowOptions) (ops.DeadLetter, uint64) {
		t.Helper()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		dl, err := e.ops.Show(ctx, id, opt)
		runtime.ReadMemStats(&after)
		if err != nil {
			t.Fatalf("Show(%+v): %v", opt, err)
		}
		return dl, after.TotalAlloc - before.TotalAlloc
	}
	for _, tc := range []struct {
		name      string
		opt       ops.ShowOptions
		wantValue int
		wantHVal  int // bytes of the big header's value read
		maxAlloc  uint64
	}{
		{"hidden", ops.ShowOptions{HideValues: true}, 0, 0, 1 << 20},
		{"shown", ops.ShowOptions{}, ops.ShownValueBytes, ops.ShownHeaderBytes, 2 << 20},
		{"more shown", ops.ShowOptions{ValueBytes: ops.MaxShownValueBytes}, ops.MaxShownValueBytes, ops.ShownHeaderBytes, 8 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dl, alloc := allocated(tc.opt)
			t.Logf("Show(%+v) of a %d-byte dead letter allocated %d bytes", tc.opt, size, alloc)
			if len(dl.Value) != tc.wantValue || dl.ValueSize != size || dl.ValueTruncated != !tc.opt.HideValues {
				t.Errorf("value: %d bytes of %d, truncated %v; want %d bytes of %d", len(dl.Value), dl.ValueSize, dl.ValueTruncated, tc.wantValue, size)
			}
			if len(dl.Headers) != 2 || dl.Headers[0].Key != "big" || len(dl.Headers[0].Value) != tc.wantHVal || dl.Headers[0].ValueSize != 4<<20 ||
				dl.Headers[1].Key != "small" || dl.Headers[1].ValueSize != 1 {
				t.Errorf("headers: %d, first %q of %d bytes read (size %d); want big with %d bytes read of %d, then small", len(dl.Headers),
					dl.Headers[0].Key, len(dl.Headers[0].Value), dl.Headers[0].ValueSize, tc.wantHVal, 4<<20)
			}
			if dl.ValueHidden != tc.opt.HideValues {
				t.Errorf("value_hidden %v, want %v: a hidden value and an empty one are both absent from the JSON", dl.ValueHidden, tc.opt.HideValues)
			}
			if alloc > tc.maxAlloc {
				t.Errorf("Show allocated %d bytes for a %d-byte dead letter; want at most %d", alloc, size, tc.maxAlloc)
			}
		})
	}
	if _, err := e.ops.Show(ctx, id, ops.ShowOptions{ValueBytes: ops.MaxShownValueBytes + 1}); !errors.Is(err, ops.ErrUsage) {
		t.Errorf("Show of more than MaxShownValueBytes: %v, want bad usage", err)
	}
}
