// Package topicread reads a whole topic, for tools, the demo and tests that check what ended up in
// a dead-letter topic.
package topicread

import (
	"context"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// All returns every record of topic from the start up to the end offsets as of the call.
func All(ctx context.Context, brokers []string, topic string) ([]*kgo.Record, error) {
	adm, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return nil, err
	}
	defer adm.Close()
	ends, err := kadm.NewClient(adm).ListEndOffsets(ctx, topic)
	if err != nil {
		return nil, err
	}
	if err := ends.Error(); err != nil {
		return nil, err
	}
	want := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			want[o.Partition] = o.Offset
		}
	})
	if len(want) == 0 {
		return nil, nil
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: startOffsets(want)}),
		kgo.FetchMaxWait(200*time.Millisecond))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	var out []*kgo.Record
	for len(want) > 0 {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return out, err
		}
		for _, e := range fs.Errors() {
			return out, e.Err
		}
		fs.EachRecord(func(r *kgo.Record) {
			end, ok := want[r.Partition]
			if !ok || r.Offset >= end {
				return
			}
			out = append(out, r)
			if r.Offset == end-1 {
				delete(want, r.Partition)
			}
		})
	}
	return out, nil
}

func startOffsets(parts map[int32]int64) map[int32]kgo.Offset {
	m := map[int32]kgo.Offset{}
	for p := range parts {
		m[p] = kgo.NewOffset().AtStart()
	}
	return m
}
