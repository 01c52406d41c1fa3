package ops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/schema"
)

// AllPartitions is the partition of a pause or position change that means every partition of
// the topic (for a pause: those added later too).
const AllPartitions int32 = -1

// Pause is a pause of a source topic's partition (or of all of them: Partition AllPartitions),
// as migration 15's table pauses keeps it: the group's processors take no new record of it until
// it is resumed.
type Pause struct {
	Topic     string    `json:"topic"`
	Partition int32     `json:"partition"` // AllPartitions: the whole topic
	At        time.Time `json:"paused_at"`
	By        string    `json:"paused_by"`
	Reason    string    `json:"reason"`
}

// PartitionStatus is where the group stands in a source partition: the position Postgres keeps
// (what the group applies next), the offset committed to Kafka (which kafkapg only reads for a
// partition it has no position in), the log's end, the owner and whether it is paused.
type PartitionStatus struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	// Stored is offsets.next_offset: nil until the partition's first batch commits.
	Stored *int64 `json:"stored_offset"`
	// Committed is the group's offset committed to Kafka; nil if none (or Kafka was not asked).
	Committed *int64 `json:"committed_offset"`
	// End is the log's end offset; nil if Kafka was not asked or did not answer.
	End *int64 `json:"end_offset"`
	// Lag is End - Stored, when both are known.
	Lag   *int64 `json:"lag"`
	Owner string `json:"owner"`
	// Paused is the pause that holds the partition (its own, or its topic's), nil if none.
	Paused *Pause `json:"paused"`
}

// Partitions lists the group's source partitions: every partition Kafka has of each source topic
// (when kc is given), and every one Postgres has a position in. Notes say what Kafka did not
// answer.
func (o *Ops) Partitions(ctx context.Context, kc *kgo.Client) (list []PartitionStatus, notes []string, err error) {
	positions, err := o.Positions(ctx)
	if err != nil {
		return nil, nil, err
	}
	pauses, err := o.Pauses(ctx)
	if err != nil {
		return nil, nil, err
	}
	sources, err := o.sourceTopics(ctx)
	if err != nil {
		return nil, nil, err
	}
	type tp struct {
		topic string
		p     int32
	}
	byTP := map[tp]*PartitionStatus{}
	add := func(topic string, p int32) *PartitionStatus {
		if s, ok := byTP[tp{topic, p}]; ok {
			return s
		}
		s := &PartitionStatus{Topic: topic, Partition: p}
		byTP[tp{topic, p}] = s
		return s
	}
	for _, pos := range positions {
		if !slices.Contains(sources, pos.Topic) {
			continue // a retry tier's position
		}
		s := add(pos.Topic, pos.Partition)
		s.Stored, s.Owner = pos.Next, pos.Owner
	}
	if kc != nil && len(sources) > 0 {
		adm := kadm.NewClient(kc)
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		ends, err := adm.ListEndOffsets(lctx, sources...)
		if err != nil {
			notes = append(notes, fmt.Sprintf("end offsets not read from Kafka: %v", err))
		}
		ends.Each(func(l kadm.ListedOffset) {
			if l.Err != nil {
				notes = append(notes, fmt.Sprintf("%s/%d: end offset not read from Kafka: %v", l.Topic, l.Partition, l.Err))
				return
			}
			end := l.Offset
			add(l.Topic, l.Partition).End = &end
		})
		committed, err := adm.FetchOffsetsForTopics(lctx, o.group, sources...)
		cancel()
		if err != nil && !errors.Is(err, kerr.GroupIDNotFound) { // not found: the group never committed to Kafka
			notes = append(notes, fmt.Sprintf("offsets committed to Kafka not read: %v", err))
		}
		committed.Each(func(r kadm.OffsetResponse) {
			if r.Err != nil || r.At < 0 {
				return
			}
			at := r.At
			add(r.Topic, r.Partition).Committed = &at
		})
	}
	for _, s := range byTP {
		if s.Stored != nil && s.End != nil {
			lag := max(*s.End-*s.Stored, 0)
			s.Lag = &lag
		}
		for i := range pauses {
			if pauses[i].Topic == s.Topic && (pauses[i].Partition == AllPartitions || pauses[i].Partition == s.Partition) {
				s.Paused = &pauses[i]
				break // Pauses lists a topic's pause before its partitions'
			}
		}
		list = append(list, *s)
	}
	slices.SortFunc(list, func(a, b PartitionStatus) int {
		if a.Topic != b.Topic {
			if a.Topic < b.Topic {
				return -1
			}
			return 1
		}
		return int(a.Partition - b.Partition)
	})
	return list, notes, nil
}

// Pauses returns the group's pauses, by topic and partition (a topic's own pause first).
func (o *Ops) Pauses(ctx context.Context) ([]Pause, error) {
	rows, err := o.pool.Query(ctx, `SELECT topic, partition, paused_at, paused_by, reason FROM `+o.table("pauses")+`
		WHERE consumer_group = $1 ORDER BY topic, partition`, o.group)
	if err != nil {
		return nil, fmt.Errorf("read pauses: %w", err)
	}
	ps, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Pause])
	if err != nil {
		return nil, fmt.Errorf("read pauses: %w", err)
	}
	return ps, nil
}

// PauseChange is what Pause or Resume did, or would do without execute.
type PauseChange struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"` // AllPartitions: the whole topic
	// Changed is false when there was nothing to do: already paused (by the topic's pause or the
	// partition's own), or not paused.
	Changed  bool   `json:"changed"`
	Executed bool   `json:"executed"`
	Note     string `json:"note,omitempty"`
}

// Pause pauses a source topic of the group (partition AllPartitions) or one of its partitions:
// once executed, the group's processors take no new record of it and keep their place until
// Resume. Without execute it changes nothing and says what it would do. It is refused while the
// upgrade window is open (a processor of the release before would not obey it).
func (o *Ops) Pause(ctx context.Context, kc *kgo.Client, topic string, partition int32, execute bool, a Actor) (PauseChange, error) {
	c := PauseChange{Topic: topic, Partition: partition}
	err := o.changePause(ctx, kc, topic, partition, execute, a, func(tx pgx.Tx) error {
		var by string
		err := tx.QueryRow(ctx, `SELECT paused_by FROM `+o.table("pauses")+` WHERE consumer_group = $1 AND topic = $2 AND partition IN (-1, $3)
			ORDER BY partition LIMIT 1`, o.group, topic, partition).Scan(&by)
		switch {
		case err == nil:
			c.Note = fmt.Sprintf("already paused (by %s)", by)
			return nil
		case !errors.Is(err, pgx.ErrNoRows):
			return err
		}
		c.Changed = true
		if !execute {
			return nil
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+o.table("pauses")+` (consumer_group, topic, partition, paused_by, reason) VALUES ($1, $2, $3, $4, $5)`,
			o.group, topic, partition, a.Name, a.Reason); err != nil {
			return err
		}
		// Wait for the batches in flight on those partitions (their advances hold the rows), and
		// make those that come next wait for this commit: they check the pauses again once they
		// hold the row (offsets.Store.QueuePauseCheck), and see this one. Every position row of
		// the partitions, their retry tiers' included (named otherwise, numbered the same), in
		// one order.
		if _, err := tx.Exec(ctx, `SELECT 1 FROM `+o.table("offsets")+` WHERE consumer_group = $1 AND ($2 = -1 OR partition = $2)
			ORDER BY topic, partition FOR UPDATE`, o.group, partition); err != nil {
			return err
		}
		c.Executed = true
		return o.audit(ctx, tx, a, "pause_partition", 0, map[string]any{"topic": topic, "partition": partition})
	})
	if err != nil {
		return c, fmt.Errorf("pause %s: %w", partitionName(topic, partition), err)
	}
	return c, nil
}

// Resume ends the pause of a topic (partition AllPartitions: its own pause and its partitions')
// or of a partition. A partition of a topic paused as a whole is refused: resume the topic.
func (o *Ops) Resume(ctx context.Context, kc *kgo.Client, topic string, partition int32, execute bool, a Actor) (PauseChange, error) {
	c := PauseChange{Topic: topic, Partition: partition}
	err := o.changePause(ctx, kc, topic, partition, execute, a, func(tx pgx.Tx) error {
		var whole bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM `+o.table("pauses")+` WHERE consumer_group = $1 AND topic = $2 AND partition = -1)`,
			o.group, topic).Scan(&whole); err != nil {
			return err
		}
		if whole && partition != AllPartitions {
			return usage("topic %s is paused as a whole: resume the topic (without --partition), then pause the partitions to keep paused", topic)
		}
		var n int64
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+o.table("pauses")+` WHERE consumer_group = $1 AND topic = $2 AND ($3 = -1 OR partition = $3)`,
			o.group, topic, partition).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			c.Note = "not paused"
			return nil
		}
		c.Changed = true
		if !execute {
			return nil
		}
		if _, err := tx.Exec(ctx, `DELETE FROM `+o.table("pauses")+` WHERE consumer_group = $1 AND topic = $2 AND ($3 = -1 OR partition = $3)`,
			o.group, topic, partition); err != nil {
			return err
		}
		c.Executed = true
		return o.audit(ctx, tx, a, "resume_partition", 0, map[string]any{"topic": topic, "partition": partition, "pauses_ended": n})
	})
	if err != nil {
		return c, fmt.Errorf("resume %s: %w", partitionName(topic, partition), err)
	}
	return c, nil
}

// changePause runs change, Pause's or Resume's, in a transaction, once the target is checked
// (checkTarget) and, to execute, the actor; executed, the upgrade window is read again first, as
// setPosition does: a release before started since the check would not obey a pause.
func (o *Ops) changePause(ctx context.Context, kc *kgo.Client, topic string, partition int32, execute bool, a Actor, change func(pgx.Tx) error) error {
	if err := o.checkTarget(ctx, kc, topic, partition); err != nil {
		return err
	}
	if execute {
		if err := a.check(); err != nil {
			return err
		}
	}
	return pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		if execute {
			if err := o.checkWindow(ctx); err != nil {
				return err
			}
		}
		return change(tx)
	})
}

func partitionName(topic string, partition int32) string {
	if partition == AllPartitions {
		return topic
	}
	return fmt.Sprintf("%s/%d", topic, partition)
}

// checkWindow refuses, as bad usage, while the schema's upgrade window is open: processors of
// the release before know neither pauses nor position changes, and would apply on.
func (o *Ops) checkWindow(ctx context.Context) error {
	_, pending, err := schema.Window(ctx, o.pool, o.schema)
	if err != nil {
		return fmt.Errorf("read the upgrade window: %w", err)
	}
	if len(pending) > 0 {
		return usage("the upgrade window of schema %s is open (migrations %v pending): processors of the release before may run, and they would not obey; finalize the upgrade first (kafkapg upgrade status, kafkapg upgrade finalize)", o.schema, pending)
	}
	return nil
}

// checkTarget refuses, as bad usage naming why, a topic that is not a source topic of the group,
// a partition Kafka does not have (when kc is given), and anything while the upgrade window is
// open.
func (o *Ops) checkTarget(ctx context.Context, kc *kgo.Client, topic string, partition int32) error {
	if err := o.checkWindow(ctx); err != nil {
		return err
	}
	if err := text("topic", topic); err != nil {
		return err
	}
	sources, err := o.sourceTopics(ctx)
	if err != nil {
		return err
	}
	if !slices.Contains(sources, topic) {
		return usage("topic %q is not a source topic of group %s (its source topics: %v)", topic, o.group, sources)
	}
	if partition < AllPartitions {
		return usage("partition %d: not a partition", partition)
	}
	if kc == nil || partition == AllPartitions {
		return nil
	}
	bounds, err := partitionBounds(ctx, kc, topic)
	if err != nil {
		return err
	}
	if _, ok := bounds[partition]; !ok {
		return usage("topic %s has no partition %d (it has %d)", topic, partition, len(bounds))
	}
	return nil
}

// partitionBounds returns the start and end offsets of each of topic's partitions.
func partitionBounds(ctx context.Context, kc *kgo.Client, topic string) (map[int32]logBounds, error) {
	b, err := topicBounds(ctx, kc, topic)
	if err != nil {
		return nil, fmt.Errorf("read %s's offsets from Kafka: %w", topic, err)
	}
	if len(b) == 0 {
		return nil, usage("topic %s: Kafka has no partition of it", topic)
	}
	return b, nil
}
