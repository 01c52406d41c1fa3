package processor

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// refused takes back a retry or dead-letter record that Kafka refuses for good (too large,
// invalid), inside the relay's transaction (sink.RelayConfig.Refused). A record whose copy for a
// retry tier cannot be published cannot travel through the tiers: it is dead-lettered where it
// stands (its dead_letters row keeps it whole) and its DLQ copy, without its value, is published
// instead. A DLQ copy that is refused is published again without its value, then without the
// record's own headers; its dead_letters row has it all. What this cannot place is set aside in
// the outbox by the relay.
func (p *Processor) refused(ctx context.Context, tx pgx.Tx, m sink.Message, refusal error) (*sink.Message, error) {
	f, err := retrytopics.ParseFailure(m.Headers)
	if err != nil {
		return nil, fmt.Errorf("not a retry or dead-letter record of kafkapg: %w", err)
	}
	own := retrytopics.StripHeaders(m.Headers)
	if t, tier := p.tierOf[m.Topic]; tier {
		now := time.Now()
		mv := retrytopics.Move{
			Rec: retrytopics.Rec{
				Origin:    retrytopics.Origin{Topic: f.Topic, Partition: f.Partition, Offset: f.Offset},
				Key:       m.Key,
				Value:     m.Value,
				Headers:   own,
				Timestamp: f.Timestamp,
			},
			Held:          m.Key != nil,
			From:          retrytopics.FromRetryCopy,
			Attempt:       f.Attempt,
			Class:         f.Class,
			Message:       fmt.Sprintf("its copy for retry tier %s was refused by Kafka (%v); the delivery before failed with: %s", m.Topic, refusal, f.Message),
			FirstFailedAt: f.FirstFailedAt,
			Block:         p.policy(t.source).onDeadLetter == OnDeadLetterBlock,
		}
		if err := p.retry.DeadLetter(ctx, tx, mv); errors.Is(err, retrytopics.ErrStale) {
			return nil, nil // the record moved on without this copy (a copy published twice): nothing to do
		} else if err != nil {
			return nil, err
		}
		p.metrics.deadLettered.WithLabelValues(f.Topic, f.Class).Inc()
		p.heldApplier.notify() // its key may be ready
		p.log.Warn("record dead-lettered: kafka refused its retry copy", "topic", f.Topic, "partition", f.Partition, "offset", f.Offset,
			"key_hash", keyHash(m.Key), "attempt", f.Attempt, "tier_topic", m.Topic, "refusal", refusal)
		f.Message, f.FailedAt, f.DueAt = mv.Message, now, time.Time{}
		return withoutValue(sink.Message{
			Topic:     retrytopics.DLQTopic(f.Topic, p.cfg.Group),
			Partition: m.Partition,
			Key:       m.Key,
			Value:     m.Value,
			Headers:   retrytopics.Headers(own, f),
		}), nil
	}
	if m.Value != nil {
		return withoutValue(m), nil
	}
	if len(own) > 0 {
		m.Headers = slices.DeleteFunc(slices.Clone(m.Headers), func(h kgo.RecordHeader) bool { return !strings.HasPrefix(h.Key, retrytopics.HeaderPrefix) })
		return &m, nil
	}
	p.log.Error("a dead letter could not be published to its DLQ topic, even without its value and headers; its dead_letters row has it",
		"topic", f.Topic, "partition", f.Partition, "offset", f.Offset, "dlq_topic", m.Topic, "refusal", refusal)
	return nil, nil
}

// withoutValue returns m without its value, saying so in the kafkapg-value-omitted header.
func withoutValue(m sink.Message) *sink.Message {
	m.Headers = append(slices.Clone(m.Headers), kgo.RecordHeader{Key: retrytopics.HeaderValueOmitted, Value: []byte(strconv.Itoa(len(m.Value)))})
	m.Value = nil
	return &m
}
