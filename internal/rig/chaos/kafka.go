package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/kafkacluster"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// The three-broker cluster (-kafka-cluster): the source topic is created with three replicas and
// min.insync.replicas=2, as a team's would be; the cluster keeps Apache Kafka's own defaults for
// other topics (one replica), so the topics kafkapg creates show whether it replicates them itself.
const (
	clusterReplicas  = 3
	clusterMinInsync = "2"
	// freezeFor is how long broker-freeze stops a broker: past replica.lag.time.max.ms (10 s in
	// the cluster), so that it leaves the ISR, and past the broker session timeout (9 s), so that
	// the controller fences it.
	freezeFor = 12 * time.Second
)

// setupCluster attaches to the cluster that `scripts/kafka.sh cluster start` runs.
func (s *suite) setupCluster() error {
	script := os.Getenv("KAFKA_SCRIPT")
	if script == "" {
		script = "scripts/kafka.sh"
	}
	c, err := kafkacluster.Attach(script, s.cfg.kafkaCluster)
	if err != nil {
		return err
	}
	s.cluster = c
	s.brokerName = fmt.Sprintf("kafka-cluster(%d brokers)", len(c.Nodes()))
	s.clientSeeds = c.Brokers()
	s.procSeeds = s.clientSeeds
	return nil
}

// brokerFault takes one broker down the way do says, waits 2-5 s (or, frozen, freezeFor), brings
// it back and waits until every partition is fully in sync again, so that the next broker fault
// never takes a second replica of anything away.
func (s *suite) brokerFault(ctx context.Context, what string) error {
	nodes := s.cluster.Nodes()
	id := nodes[s.rng.IntN(len(nodes))]
	var err error
	switch what {
	case "kill":
		err = s.cluster.Kill(ctx, id)
	case "term":
		err = s.cluster.Stop(ctx, id)
	case "freeze":
		err = s.cluster.Freeze(id)
	}
	if err != nil {
		return err
	}
	s.count(func(st *stats) { st.brokerFaults[what]++ })
	if what == "freeze" {
		err = sleep(ctx, freezeFor)
		if terr := s.cluster.Thaw(id); err == nil {
			err = terr
		}
	} else {
		if err = sleep(ctx, time.Duration(2000+s.rng.IntN(3000))*time.Millisecond); err == nil {
			err = s.cluster.Start(ctx, id)
		}
	}
	if err != nil {
		return err
	}
	return s.cluster.WaitInSync(ctx, 3*time.Minute)
}

// killLeader measures, with nothing else broken, how long after the leader of a busy source
// partition is killed its records are applied again, then restarts the broker.
func (s *suite) killLeader(ctx context.Context) error {
	const part = 0
	leader, err := s.cluster.Leader(ctx, s.topic, part)
	if err != nil {
		return err
	}
	var next int64
	if err := s.pool.QueryRow(ctx, `SELECT coalesce(next_offset, -1) FROM offsets WHERE consumer_group = $1 AND topic = $2 AND partition = $3`,
		s.group, s.topic, part).Scan(&next); err != nil {
		return err
	}
	from := map[int32]int64{part: next}
	if err := s.cluster.Kill(ctx, leader); err != nil {
		return err
	}
	killed := time.Now()
	s.count(func(st *stats) { st.brokerFaults["kill"]++ })
	if s.waitAdvanced(ctx, s.stages[0], from, 90*time.Second) {
		d := time.Since(killed)
		s.count(func(st *stats) { st.alone.leaderKill = d })
	}
	if err := s.cluster.Start(ctx, leader); err != nil {
		return err
	}
	return s.cluster.WaitInSync(ctx, 3*time.Minute)
}

// rollingRestart restarts every broker in turn (a controlled shutdown, a start, all partitions in
// sync again before the next) while events flow, and keeps the window for rollingWait.
func (s *suite) rollingRestart(ctx context.Context) error {
	start := time.Now()
	err := s.cluster.RollingRestart(ctx)
	s.count(func(st *stats) {
		st.rolling = append(st.rolling, window{start, time.Now()})
	})
	return err
}

// window is a span of time.
type window struct{ from, to time.Time }

// rollingWaits returns the longest and the 99th percentile time from produce to applied of the
// events that were produced during a rolling restart and applied at their first delivery (the
// others waited in retry tiers by design), and how many there were.
func (s *suite) rollingWaits(ctx context.Context, items []ledger.Item) (longest, p99 time.Duration, n int, err error) {
	s.mu.Lock()
	windows := slices.Clone(s.stats.rolling)
	s.mu.Unlock()
	var ids []string
	sent := map[string]time.Time{}
	for i, it := range items {
		at := s.producedAt[i]
		if it.Kind != ledger.KindOK || it.Copy || at.IsZero() {
			continue
		}
		for _, w := range windows {
			if !at.Before(w.from) && !at.After(w.to) {
				ids = append(ids, it.Event.EventID)
				sent[it.Event.EventID] = at
			}
		}
	}
	if len(ids) == 0 {
		return 0, 0, 0, nil
	}
	rows, err := s.pool.Query(ctx, `SELECT event_id, applied_at FROM ledger_entries WHERE event_id = ANY($1)`, ids)
	if err != nil {
		return 0, 0, 0, err
	}
	defer rows.Close()
	var waits []time.Duration
	for rows.Next() {
		var id string
		var at time.Time
		if err := rows.Scan(&id, &at); err != nil {
			return 0, 0, 0, err
		}
		waits = append(waits, at.Sub(sent[id]))
	}
	if err := rows.Err(); err != nil {
		return 0, 0, 0, err
	}
	if len(waits) == 0 {
		return 0, 0, 0, nil
	}
	slices.Sort(waits)
	return waits[len(waits)-1], waits[len(waits)*99/100], len(waits), nil
}

// checkReplication checks that the topics kafkapg created (the tiers and the dead-letter topic)
// are replicated like the source topic, although the cluster's defaults would give them one
// replica.
func (s *suite) checkReplication(ctx context.Context) []string {
	var bad []string
	topics := []string{retrytopics.DLQTopic(s.topic, s.group)}
	for n := 1; n <= tierCount; n++ {
		topics = append(topics, retrytopics.TierTopic(s.topic, s.group, n))
	}
	for _, t := range topics {
		rf, minInsync, err := s.cluster.Describe(ctx, t)
		switch {
		case err != nil:
			bad = append(bad, fmt.Sprintf("%s: %v", t, err))
		case rf != clusterReplicas || minInsync != clusterMinInsync:
			bad = append(bad, fmt.Sprintf("%s has %d replicas and min.insync.replicas=%s; its source topic has %d and %s", t, rf, minInsync, clusterReplicas, clusterMinInsync))
		}
	}
	return bad
}
