package kafkacluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// SeedMetadata asks cl's first seed broker itself (not whichever broker the client picks) for
// the metadata of every topic, internal ones included. A broker's answer is its own view of the
// cluster: the brokers it lists are those it knows to be registered and unfenced.
func SeedMetadata(ctx context.Context, cl *kgo.Client) (*kmsg.MetadataResponse, error) {
	seeds := cl.SeedBrokers()
	if len(seeds) == 0 {
		return nil, errors.New("client has no seed broker")
	}
	req := kmsg.NewPtrMetadataRequest() // nil Topics: every topic
	resp, err := seeds[0].Request(ctx, req)
	if err != nil {
		return nil, err
	}
	m := resp.(*kmsg.MetadataResponse)
	if err := kerr.ErrorForCode(m.ErrorCode); err != nil {
		return nil, err
	}
	return m, nil
}

// InSync returns nil if every partition of every topic in m has a leader and an ISR equal to its
// replica set, and otherwise an error naming the first (by topic, partition) that does not.
func InSync(m *kmsg.MetadataResponse) error {
	topics := slices.Clone(m.Topics)
	slices.SortFunc(topics, func(a, b kmsg.MetadataResponseTopic) int {
		return cmp.Compare(topicName(a), topicName(b))
	})
	for _, t := range topics {
		name := topicName(t)
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
			return fmt.Errorf("topic %s: %w", name, err)
		}
		parts := slices.Clone(t.Partitions)
		slices.SortFunc(parts, func(a, b kmsg.MetadataResponseTopicPartition) int { return cmp.Compare(a.Partition, b.Partition) })
		for _, p := range parts {
			switch {
			case p.Leader < 0:
				return fmt.Errorf("partition %s/%d has no leader (replicas %v, ISR %v)", name, p.Partition, p.Replicas, p.ISR)
			case !sameSet(p.ISR, p.Replicas):
				return fmt.Errorf("partition %s/%d: ISR %v, replicas %v", name, p.Partition, sorted(p.ISR), sorted(p.Replicas))
			case p.ErrorCode != 0:
				return fmt.Errorf("partition %s/%d: %w", name, p.Partition, kerr.ErrorForCode(p.ErrorCode))
			}
		}
	}
	return nil
}

func topicName(t kmsg.MetadataResponseTopic) string {
	if t.Topic == nil {
		return ""
	}
	return *t.Topic
}

func sameSet(a, b []int32) bool {
	return slices.Equal(sorted(a), sorted(b))
}

func sorted(s []int32) []int32 {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// WaitInSync waits, for at most timeout or until ctx ends, until every node answers requests,
// every node's metadata lists every node as a registered broker, and every node sees every
// partition of every topic (internal topics included) with a leader and its ISR equal to its
// replica set. Every node must agree, so that a broker's stale view cannot pass for the
// cluster's. The error names the last thing that was not so.
func (c *Cluster) WaitInSync(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	for {
		err := c.inSync(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster not in sync after %s: %w", time.Since(start).Round(time.Second), err)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// inSync asks every node for its view, once.
func (c *Cluster) inSync(ctx context.Context) error {
	for _, id := range c.ids {
		n := c.nodes[id]
		rctx, cancel := context.WithTimeout(ctx, requestTimeout)
		m, err := SeedMetadata(rctx, n.cl)
		cancel()
		if err != nil {
			return fmt.Errorf("node %d (%s): metadata: %w", id, n.addr, err)
		}
		var listed []int32
		for _, b := range m.Brokers {
			listed = append(listed, b.NodeID)
		}
		for _, want := range c.ids {
			if !slices.Contains(listed, want) {
				return fmt.Errorf("node %d (%s) lists brokers %v: node %d is not registered", id, n.addr, sorted(listed), want)
			}
		}
		if err := InSync(m); err != nil {
			return fmt.Errorf("node %d (%s): %w", id, n.addr, err)
		}
	}
	return nil
}

// Partition returns the metadata of one partition (leader, replicas, ISR) as the first broker
// that answers sees it. Each attempt is bounded by a short timeout, and the next attempt goes to
// another broker, so a dead or frozen broker only costs time; it gives up after one attempt per
// node, or when ctx ends. A partition without a leader is returned with Leader -1 and its error
// in Err.
//
// A topic created a moment ago may be unknown to the broker asked, until the controller's
// metadata reaches it: that answer is asked again, for up to newTopicWait.
func (c *Cluster) Partition(ctx context.Context, topic string, partition int32) (kadm.PartitionDetail, error) {
	var lastErr error
	start := time.Now()
	for try := 0; try <= len(c.ids) || errors.Is(lastErr, kerr.UnknownTopicOrPartition) && time.Since(start) < newTopicWait; try++ {
		d, err := c.partitionOnce(ctx, topic, partition)
		if err == nil {
			return d, nil
		}
		lastErr = err
		if ctx.Err() != nil {
			break
		}
		if errors.Is(err, kerr.UnknownTopicOrPartition) {
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return kadm.PartitionDetail{}, fmt.Errorf("metadata of %s/%d: %w", topic, partition, lastErr)
}

// newTopicWait bounds how long Partition waits for brokers to learn of a new topic.
const newTopicWait = 10 * time.Second

func (c *Cluster) partitionOnce(ctx context.Context, topic string, partition int32) (kadm.PartitionDetail, error) {
	rctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	m, err := c.adm.Metadata(rctx, topic)
	if err != nil {
		return kadm.PartitionDetail{}, err
	}
	t, ok := m.Topics[topic]
	if !ok {
		return kadm.PartitionDetail{}, errors.New("topic missing from the metadata response")
	}
	if t.Err != nil {
		return kadm.PartitionDetail{}, t.Err
	}
	p, ok := t.Partitions[partition]
	if !ok {
		return kadm.PartitionDetail{}, fmt.Errorf("topic has %d partitions", len(t.Partitions))
	}
	return p, nil
}

// Leader returns the node that leads the partition, as the first broker that answers sees it
// (see Partition), or an error if the partition has no leader.
func (c *Cluster) Leader(ctx context.Context, topic string, partition int32) (int32, error) {
	p, err := c.Partition(ctx, topic, partition)
	if err != nil {
		return -1, err
	}
	if p.Leader < 0 {
		return -1, fmt.Errorf("partition %s/%d has no leader (ISR %v): %w", topic, partition, p.ISR, p.Err)
	}
	return p.Leader, nil
}

// Describe returns the replication factor of topic (the number of replicas of its partition 0)
// and its effective min.insync.replicas (the topic's own setting or, failing that, the broker's,
// as DescribeConfigs reports it), for checks that a topic was created as intended.
func (c *Cluster) Describe(ctx context.Context, topic string) (replicationFactor int, minInsync string, err error) {
	p, err := c.Partition(ctx, topic, 0)
	if err != nil {
		return 0, "", err
	}
	var lastErr error
	for range len(c.ids) + 1 {
		if minInsync, lastErr = c.minInsyncOnce(ctx, topic); lastErr == nil {
			return len(p.Replicas), minInsync, nil
		}
		if ctx.Err() != nil {
			break
		}
	}
	return 0, "", fmt.Errorf("describe configs of topic %s: %w", topic, lastErr)
}

func (c *Cluster) minInsyncOnce(ctx context.Context, topic string) (string, error) {
	rctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	rcs, err := c.adm.DescribeTopicConfigs(rctx, topic)
	if err != nil {
		return "", err
	}
	rc, err := rcs.On(topic, nil)
	if err != nil {
		return "", err
	}
	if rc.Err != nil {
		return "", rc.Err
	}
	for _, cfg := range rc.Configs {
		if cfg.Key == "min.insync.replicas" {
			return cfg.MaybeValue(), nil
		}
	}
	keys := make([]string, 0, len(rc.Configs))
	for _, cfg := range rc.Configs {
		keys = append(keys, cfg.Key)
	}
	return "", fmt.Errorf("no min.insync.replicas among the %d configs returned (%s)", len(keys), strings.Join(keys, ", "))
}
