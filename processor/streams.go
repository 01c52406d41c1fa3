package processor

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/kafkapg/kafkapg/sink"
)

// Streams, the emitting side: Record.Emit numbers the events whose id it derives in their
// stream (sink.Event.Source), which needs each destination topic's partition count when the
// event is emitted. The consuming side is in streamdedupe.go.

// partitionCounts caches the partition counts of the topics the processor emits to. A count is
// asked of Kafka the first time, in the emitting transaction (once per topic), and again, in the
// background, once it is a minute old; the cached one serves meanwhile. Counts only grow: an
// event numbered for partition p of n is published to p, which still exists.
type partitionCounts struct {
	mu     sync.Mutex
	counts map[string]topicCount
	off    bool // the database cannot number events (sink.CheckStreams): every lookup fails
}

type topicCount struct {
	n          int
	at         time.Time
	refreshing bool
}

const partitionCountTTL = time.Minute

var errNotNumbering = errors.New("events are not numbered here")

// partitions reports topic's partition count, for sink.OutboxConfig.Partitions.
func (p *Processor) partitions(ctx context.Context, topic string) (int, error) {
	pc := &p.partCounts
	pc.mu.Lock()
	if pc.off {
		pc.mu.Unlock()
		return 0, errNotNumbering
	}
	c, ok := pc.counts[topic]
	if ok && (time.Since(c.at) < partitionCountTTL || c.refreshing) {
		pc.mu.Unlock()
		return c.n, nil
	}
	if ok {
		c.refreshing = true
		pc.counts[topic] = c
		pc.mu.Unlock()
		go func() {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			n, err := p.askPartitions(ctx, topic)
			pc.mu.Lock()
			defer pc.mu.Unlock()
			c := pc.counts[topic]
			c.refreshing = false
			if err == nil {
				c.n, c.at = max(n, c.n), time.Now()
			}
			pc.counts[topic] = c
		}()
		return c.n, nil
	}
	pc.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := p.askPartitions(ctx, topic)
	if err != nil {
		return 0, err
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.counts == nil {
		pc.counts = map[string]topicCount{}
	}
	pc.counts[topic] = topicCount{n: max(n, pc.counts[topic].n), at: time.Now()}
	return pc.counts[topic].n, nil
}

// askPartitions asks Kafka for topic's partition count.
func (p *Processor) askPartitions(ctx context.Context, topic string) (int, error) {
	cl := p.client.Load()
	if cl == nil {
		return 0, errors.New("no kafka client yet")
	}
	details, err := kadm.NewClient(cl).ListTopics(ctx, topic)
	if err != nil {
		return 0, err
	}
	d, ok := details[topic]
	switch {
	case !ok:
		return 0, fmt.Errorf("topic %s: not in the metadata", topic)
	case d.Err != nil:
		return 0, fmt.Errorf("topic %s: %w", topic, d.Err)
	case len(d.Partitions) == 0:
		return 0, fmt.Errorf("topic %s has no partitions", topic)
	}
	return len(d.Partitions), nil
}

// checkNumbering turns numbering off if the database cannot tell its identity (sink.CheckStreams),
// saying so: the events are then emitted by key with their message id only.
func (p *Processor) checkNumbering(ctx context.Context) {
	if err := sink.CheckStreams(ctx, p.pool); err != nil {
		p.partCounts.mu.Lock()
		p.partCounts.off = true
		p.partCounts.mu.Unlock()
		if ctx.Err() == nil {
			p.log.Warn("emitted events are not numbered in streams: consumers deduplicate them by message id, a key per event", "err", err)
		}
	}
}
