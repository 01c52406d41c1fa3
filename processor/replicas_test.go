package processor_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// TestReplicasBeyondSourcePartitionsOwnTiers: a group subscribes to its source topics and their
// retry tiers, and the partitions of all of them are balanced among its members. With a source
// topic of 2 partitions and 3 tiers (8 partitions in all), a third replica is not idle: it owns
// tier partitions, and takes part in delivering the retry tiers. deploy/README.md sizes replicas
// and KEDA's maximum from this.
func TestReplicasBeyondSourcePartitionsOwnTiers(t *testing.T) {
	k := testenv.NewKfake(t)
	const sources, tiers, replicas = 2, 3, 3
	h := newHarness(t, k, sources)
	var rs []*running
	for i := range replicas {
		cfg := h.Config(processor.HandlerFunc(func(context.Context, pgx.Tx, *processor.Record) error { return nil }))
		cfg.RetryTiers = []time.Duration{time.Second, 2 * time.Second, 3 * time.Second}
		cfg.InstanceName = fmt.Sprintf("replica-%d", i)
		rs = append(rs, h.Start(cfg))
	}
	tierTopics := map[string]bool{}
	for n := 1; n <= tiers; n++ {
		tierTopics[retrytopics.TierTopic(h.Topic, h.Group, n)] = true
	}

	// Each replica's partitions as it claimed them in Postgres (the offsets table's owner column
	// starts with its instance name), once all three are in the group, all 8 partitions are owned,
	// each by a replica that reports it, and that has not changed for two seconds (a rebalance
	// moves partitions in steps).
	var owned, before [][]string
	var since time.Time
	testenv.Eventually(t, 90*time.Second, func() error {
		for i, r := range rs {
			if err := r.P.Ready(context.Background()); err != nil {
				return fmt.Errorf("replica %d: %w", i, err)
			}
		}
		rows, err := h.Pool.Query(context.Background(), `SELECT topic, partition, owner FROM kafkapg.offsets WHERE consumer_group = $1`, h.Group)
		if err != nil {
			return err
		}
		defer rows.Close()
		owned = make([][]string, replicas)
		total := 0
		for rows.Next() {
			var topic, owner string
			var partition int32
			if err := rows.Scan(&topic, &partition, &owner); err != nil {
				return err
			}
			for i := range replicas {
				if strings.HasPrefix(owner, fmt.Sprintf("replica-%d ", i)) {
					owned[i] = append(owned[i], fmt.Sprintf("%s/%d", topic, partition))
					total++
				}
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		reported := 0
		for i, r := range rs {
			n := int(r.Gauge("kafkapg_assigned_partitions"))
			if n != len(owned[i]) {
				return fmt.Errorf("replica %d reports %d partitions, has claimed %v", i, n, owned[i])
			}
			reported += n
		}
		if want := sources * (1 + tiers); total != want || reported != want {
			return fmt.Errorf("%d partitions claimed, %d reported; want all %d: %v", total, reported, want, owned)
		}
		if fmt.Sprint(owned) != fmt.Sprint(before) {
			before, since = owned, time.Now()
		}
		if time.Since(since) < 2*time.Second {
			return fmt.Errorf("assignment changed less than two seconds ago: %v", owned)
		}
		return nil
	})

	// The replicas that own no source partition (at least one of the three) own tier partitions.
	idle := 0
	for i, parts := range owned {
		source, tier := 0, 0
		for _, p := range parts {
			topic := p[:strings.LastIndexByte(p, '/')]
			switch {
			case topic == h.Topic:
				source++
			case tierTopics[topic]:
				tier++
			default:
				t.Errorf("replica %d owns %s, neither the source topic nor one of its tiers", i, p)
			}
		}
		t.Logf("replica %d: %d source and %d tier partitions: %v", i, source, tier, parts)
		if source == 0 {
			idle++
			if tier == 0 {
				t.Errorf("replica %d owns no partition at all", i)
			}
		}
	}
	if idle == 0 {
		t.Errorf("every replica owns a source partition, with %d source partitions among %d replicas: %v", sources, replicas, owned)
	}
}
