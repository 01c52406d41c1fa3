package processor

import (
	"context"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/kafkapg/kafkapg/offsets"
)

// refreshLag sets kafkapg_consumer_lag_records for every partition of the source topics: the
// broker's end offset minus the next offset stored in Postgres, the position that counts (the
// offsets committed to Kafka are advisory and lag behind). A partition with no stored offset
// yet counts from its start offset (StartOffset earliest) or as 0 (latest). Every
// processor of the group reports every partition, so a partition nobody owns still shows.
func (p *Processor) refreshLag(ctx context.Context, adm *kadm.Client) error {
	ends, err := adm.ListEndOffsets(ctx, p.cfg.Topics...)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return fmt.Errorf("list end offsets: %w", err)
	}
	stored, err := p.store.Positions(ctx, p.pool, p.cfg.Topics)
	if err != nil {
		return err
	}
	// Start offsets matter only for partitions never applied (usually none, after the first run).
	var starts kadm.ListedOffsets
	if p.cfg.StartOffset == StartEarliest && len(stored) < partitionCount(ends) {
		if starts, err = adm.ListStartOffsets(ctx, p.cfg.Topics...); err == nil {
			err = starts.Error()
		}
		if err != nil {
			return fmt.Errorf("list start offsets: %w", err)
		}
	}
	ends.Each(func(end kadm.ListedOffset) {
		next, ok := stored[offsets.Partition{Topic: end.Topic, Partition: end.Partition}]
		if !ok {
			next = end.Offset
			if start, found := starts.Lookup(end.Topic, end.Partition); found {
				next = start.Offset
			}
		}
		p.metrics.lag.WithLabelValues(end.Topic, strconv.Itoa(int(end.Partition))).Set(float64(max(end.Offset-next, 0)))
	})
	return nil
}

func partitionCount(l kadm.ListedOffsets) int {
	n := 0
	for _, ps := range l {
		n += len(ps)
	}
	return n
}
