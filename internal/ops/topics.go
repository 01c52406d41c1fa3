package ops

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// WithTopics returns the operations of o's group that also count sources as the group's source
// topics: those configured (KAFKA_TOPICS), which Postgres may not have a position in yet. The
// topics an operation reads from Kafka are limited to the group's own (see CheckTopic).
func (o *Ops) WithTopics(sources ...string) *Ops {
	c := *o
	c.sources = slices.Clone(sources)
	return &c
}

// CheckTopic refuses, as bad usage naming the topic and the allowed ones, a topic that is not
// one of the group's: a source topic (one given to WithTopics, or one the group has a position
// in), a retry tier's topic of one, or the dead-letter topic of one. Whatever reads a topic from
// Kafka for a person (Trace) checks it first: the service's Kafka login may read topics the
// group has nothing to do with, which no operator surface should show.
func (o *Ops) CheckTopic(ctx context.Context, topic string) error {
	sources, err := o.sourceTopics(ctx)
	if err != nil {
		return err
	}
	for _, s := range sources {
		if topic == s || topic == retrytopics.DLQTopic(s, o.group) {
			return nil
		}
		for n := 1; n <= retrytopics.MaxTiers; n++ {
			if topic == retrytopics.TierTopic(s, o.group, n) {
				return nil
			}
		}
	}
	if len(sources) == 0 {
		return usage("topic %q is not one of group %s's topics: the group has no source topic (none configured, no position in Postgres), so no topic may be read", topic, o.group)
	}
	return usage("topic %q is not one of group %s's topics: only its source topics (%s), their retry tiers' topics (<source>.%s.retry.<n>) and dead-letter topics (<source>.%s.dlq) may be read",
		topic, o.group, strings.Join(sources, ", "), o.group, o.group)
}

// sourceTopics returns the group's source topics: those given to WithTopics and those it has a
// position in (but its retry tiers' topics, which have positions too).
func (o *Ops) sourceTopics(ctx context.Context) ([]string, error) {
	rows, err := o.pool.Query(ctx, `SELECT DISTINCT topic FROM `+o.table("offsets")+` WHERE consumer_group = $1`, o.group)
	if err != nil {
		return nil, fmt.Errorf("read the group's topics: %w", err)
	}
	known, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read the group's topics: %w", err)
	}
	tier := regexp.MustCompile(retrytopics.TierTopicPattern(o.group))
	known = slices.DeleteFunc(known, tier.MatchString)
	all := slices.Concat(o.sources, known)
	slices.Sort(all)
	return slices.Compact(all), nil
}
