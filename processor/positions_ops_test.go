package processor_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// TestProcessorObeysWhatOpsWrites: the positions commands' own code (ops.SetPositions,
// ops.Pause, ops.Resume), not SQL written for the test, against a running processor: a position
// set before the group ever ran (ops inserts the offsets row) is where the first owner starts;
// a pause stops the partition and a resume lets it go on, in order; a rewind applies the range
// again. The two sides of migration 15, checked together.
func TestProcessorObeysWhatOpsWrites(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		ctx := context.Background()
		h := newPositionsHarness(t, k, 1)
		o := ops.New(h.Pool, "kafkapg", h.Group).WithTopics(h.Topic)
		kc := k.Client(t)
		actor := ops.Actor{Name: "tester", Reason: "the test"}
		produceTo(h, 0, 10)

		six := int64(6)
		if _, err := o.SetPositions(ctx, kc, ops.PositionPlan{Topic: h.Topic, Partition: 0, Target: ops.Target{Offset: &six}}, true, actor); err != nil {
			t.Fatal(err)
		}
		h.Start(h.Config(recordApplications()))
		waitApplied(h, 0, 4, 30*time.Second)

		if _, err := o.Pause(ctx, kc, h.Topic, 0, true, actor); err != nil {
			t.Fatal(err)
		}
		produceTo(h, 0, 5) // offsets 10..14
		time.Sleep(2500 * time.Millisecond)
		if got := applied(h, 0); !slices.Equal(got, span(6, 10)) {
			t.Fatalf("applied %v while paused; want %v", got, span(6, 10))
		}
		if _, err := o.Resume(ctx, kc, h.Topic, 0, true, actor); err != nil {
			t.Fatal(err)
		}
		waitApplied(h, 0, 9, 30*time.Second)

		two := int64(2)
		if _, err := o.SetPositions(ctx, kc, ops.PositionPlan{Topic: h.Topic, Partition: 0, Target: ops.Target{Offset: &two}}, true, actor); err != nil {
			t.Fatal(err)
		}
		waitApplied(h, 0, 9+13, 30*time.Second)
		time.Sleep(1500 * time.Millisecond) // nothing more than the range
		want := append(span(6, 15), span(2, 15)...)
		if got := applied(h, 0); !slices.Equal(got, want) {
			t.Fatalf("applied %v; want %v", got, want)
		}
	})
}
