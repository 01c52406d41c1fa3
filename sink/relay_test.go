package sink_test

import (
	"context"
	"testing"

	"github.com/kafkapg/kafkapg/internal/testenv"
	"github.com/kafkapg/kafkapg/sink"
)

func TestRelayPublishesAndDeletes(t *testing.T) {
	t.Parallel()
	pool, s, pos := setup(t)
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 1)
	ctx := context.Background()
	msgs := []sink.Message{
		{Topic: topic, Key: []byte("a"), Value: []byte("1")},
		{Topic: topic, Key: nil, Value: []byte("2")},
		{Topic: topic, Key: []byte("c"), Value: []byte("3")},
	}
	if err := s.Apply(ctx, pos, 1, nil, msgs); err != nil {
		t.Fatal(err)
	}
	published := 0
	relay := sink.NewRelay(pool, k.Client(t), sink.RelayConfig{Schema: "kafkapg", Group: "g", BatchSize: 2,
		Published: func(string) { published++ }})
	n, err := relay.Drain(ctx)
	if err != nil || n != 3 || published != 3 {
		t.Fatalf("Drain = %d, %v (published %d); want 3", n, err, published)
	}
	if got := count(t, pool, "kafkapg.outbox"); got != 0 {
		t.Fatalf("%d outbox rows left after publishing", got)
	}
	recs := k.ReadAll(t, topic)
	if len(recs) != 3 {
		t.Fatalf("%d records on the topic, want 3", len(recs))
	}
	for i, r := range recs {
		if string(r.Value) != string(msgs[i].Value) || string(r.Key) != string(msgs[i].Key) {
			t.Errorf("record %d = %q/%q, want %q/%q (in order)", i, r.Key, r.Value, msgs[i].Key, msgs[i].Value)
		}
	}

	// Another group's rows are not this relay's.
	other := sink.NewRelay(pool, k.Client(t), sink.RelayConfig{Schema: "kafkapg", Group: "other"})
	if err := s.Apply(ctx, pos.Advanced(1), 2, nil, msgs[:1]); err != nil {
		t.Fatal(err)
	}
	if n, err := other.Drain(ctx); n != 0 || err != nil {
		t.Fatalf("relay of another group published %d rows (%v)", n, err)
	}

}
