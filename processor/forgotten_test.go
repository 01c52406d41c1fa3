package processor_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
)

// TestForgottenPartitionsAreAppliedAgain: a database can forget what Kafka remembers. Here a group
// applies a workload (retries, dead letters and all) to one database, whose kafkapg tables and
// ledger are then lost: the database is restored from a backup taken before the partitions' first
// claim, or failed over to an asynchronous standby that never received them. Kafka still holds the
// offsets kafkapg committed after Postgres's commits. Resolving the partitions' start from those
// would skip every record the database lost (before the fix: 0 of them applied again); each must
// be applied again, exactly once, from where the partitions were first started.
func TestForgottenPartitionsAreAppliedAgain(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := testkit.New(t, k, 3)
		items := testkit.FlakyMix(300, 24, "forgot")
		cfg := h.Config(ledger.Handler{})
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond}
		r := h.Start(cfg)
		h.Produce(items)
		h.WaitSettled(items, testkit.TiersMaxAttempt, 90*time.Second)
		r.Stop(t) // its last act commits the offsets to Kafka

		adm := kadm.NewClient(k.Client(t))
		committed, err := adm.FetchOffsetsForTopics(context.Background(), h.Group, h.Topic)
		if err == nil {
			err = committed.Error()
		}
		if err != nil {
			t.Fatal(err)
		}
		for p := range int32(3) {
			o, ok := committed.Lookup(h.Topic, p)
			if !ok || o.At <= 0 {
				t.Fatalf("partition %d: kafka holds no committed offset (%+v): the scenario needs one", p, o)
			}
			if o.Metadata != "kafkapg start=0" {
				t.Errorf("partition %d: committed with metadata %q, want %q", p, o.Metadata, "kafkapg start=0")
			}
		}

		// The database that forgot: kafkapg's and the ledger's tables as they were before the
		// partitions were first claimed.
		forgot := testkit.New(t, k, 1)
		forgot.Topic, forgot.Group = h.Topic, h.Group
		cfg2 := forgot.Config(ledger.Handler{})
		cfg2.RetryTiers = cfg.RetryTiers
		r2 := forgot.Start(cfg2)
		forgot.WaitSettled(items, testkit.TiersMaxAttempt, 90*time.Second)
		// Every event applied once and in order, one dead_letters row each; the dead-letter topic
		// holds the first database's dead letters too.
		forgot.Verify(items, testkit.TiersMaxAttempt, true)
		if n := r2.Counter("kafkapg_forgotten_partitions_total"); n != 3+3*3 {
			t.Errorf("kafkapg_forgotten_partitions_total = %v, want 12 (3 source partitions, 3 of each of 3 tiers)", n)
		}
	})
}

// TestStartsFromAnotherConsumersCommits: a group that another consumer ran before kafkapg (the
// service kafkapg replaces) keeps its place: its committed offsets, which kafkapg did not make,
// are where the partitions start.
func TestStartsFromAnotherConsumersCommits(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := testkit.New(t, k, 2)
		before, after := beforeAndAfter()
		h.Produce(before)
		adm := kadm.NewClient(k.Client(t))
		ctx := context.Background()
		ends, err := adm.ListEndOffsets(ctx, h.Topic)
		if err == nil {
			err = ends.Error()
		}
		if err != nil {
			t.Fatal(err)
		}
		offs := kadm.Offsets{}
		ends.Each(func(o kadm.ListedOffset) {
			offs.Add(kadm.Offset{Topic: o.Topic, Partition: o.Partition, At: o.Offset, LeaderEpoch: -1, Metadata: "the old service"})
		})
		if resp, err := adm.CommitOffsets(ctx, h.Group, offs); err != nil || resp.Error() != nil {
			t.Fatalf("commit the old service's offsets: %v %v", err, resp.Error())
		}
		h.Start(h.Config(ledger.Handler{}))
		h.Produce(after)
		h.WaitApplied(len(after), 30*time.Second)
		expectOnly(t, h, "after", len(after))
	})
}

// TestForgottenPartitionsKeepTheirLatestStart: with KAFKA_START_OFFSET=latest a partition starts
// at the end of its log the first time the group is assigned it. When the database forgets it,
// it starts there again: the records before that point were never the group's to apply, and
// those after it are applied again (the start of the log would apply the former; the end of the
// log now, or Kafka's commit, would skip the latter).
func TestForgottenPartitionsKeepTheirLatestStart(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := testkit.New(t, k, 2)
		before, after := beforeAndAfter()
		h.Produce(before)
		cfg := h.Config(ledger.Handler{})
		cfg.StartOffset = processor.StartLatest
		r := h.Start(cfg)
		testenv.Eventually(t, 30*time.Second, func() error {
			var n int
			if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.offsets
				WHERE consumer_group = $1 AND topic = $2 AND next_offset IS NOT NULL`, h.Group, h.Topic).Scan(&n); err != nil {
				return err
			}
			if n < 2 {
				return fmt.Errorf("%d of 2 partitions have a position: %s", n, h.Positions())
			}
			return nil
		})
		h.Produce(after)
		h.WaitApplied(len(after), 30*time.Second)
		r.Stop(t)

		forgot := testkit.New(t, k, 1)
		forgot.Topic, forgot.Group = h.Topic, h.Group
		cfg2 := forgot.Config(ledger.Handler{})
		cfg2.StartOffset = processor.StartLatest
		forgot.Start(cfg2)
		forgot.WaitApplied(len(after), 30*time.Second)
		expectOnly(t, forgot, "after", len(after))
	})
}

// beforeAndAfter returns two sets of 20 events of four accounts, "before-*" and "after-*".
func beforeAndAfter() (before, after []ledger.Item) {
	for i := range 20 {
		before = append(before, testkit.Event(fmt.Sprintf("before-%d", i), fmt.Sprintf("a%d", i%4), int64(i), 0, false))
		after = append(after, testkit.Event(fmt.Sprintf("after-%d", i), fmt.Sprintf("a%d", i%4), int64(100+i), 0, false))
	}
	return before, after
}

// expectOnly checks, after a moment for anything else to arrive, that the ledger holds n events,
// all with ids starting with prefix.
func expectOnly(t *testing.T, h *testkit.Harness, prefix string, n int) {
	t.Helper()
	time.Sleep(500 * time.Millisecond)
	rows, err := h.Pool.Query(context.Background(), `SELECT event_id FROM ledger_entries ORDER BY event_id`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	bad := 0
	for _, id := range ids {
		if !strings.HasPrefix(id, prefix) {
			bad++
		}
	}
	if len(ids) != n || bad > 0 {
		t.Errorf("applied %d events, %d of them not %s-*: want the %d %s-* events", len(ids), bad, prefix, n, prefix)
	}
}

// TestOwnerGoesOnAfterTheDatabaseLostItsLastCommits: a failover to an asynchronous standby that
// lacked an owner's last commits leaves the owner running, with a position ahead of the stored
// one and no rebalance to come. Its next transaction finds the stored position moved. It is no
// zombie: it must start again from the stored position, applying again what the database lost
// (their effects vanished with it), and go on (before the fix: it stopped as if fenced, and the
// partition stayed stuck until a rebalance; the async-failover chaos run hung on 95 keys). The
// same if the database lost its claim (a lower token), or the partition's row; and the owner
// finds out with nothing more to apply (a retry tier's partition whose copies the database lost:
// the chaos run hung again on 9 keys).
func TestOwnerGoesOnAfterTheDatabaseLostItsLastCommits(t *testing.T) {
	for _, tt := range []struct {
		name string
		lose string // SQL run on kafkapg.offsets, $1 the group, $2 the topic
	}{
		{"its last commits", `UPDATE kafkapg.offsets SET next_offset = 10 WHERE consumer_group = $1 AND topic = $2`},
		{"its claim and its last commits", `UPDATE kafkapg.offsets SET next_offset = 10, owner_token = owner_token - 1 WHERE consumer_group = $1 AND topic = $2`},
		{"the partition's row", `DELETE FROM kafkapg.offsets WHERE consumer_group = $1 AND topic = $2`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			k := testenv.NewKfake(t)
			h := testkit.New(t, k, 1)
			ctx := context.Background()
			if _, err := h.Pool.Exec(ctx, `CREATE TABLE seen (off bigint PRIMARY KEY)`); err != nil {
				t.Fatal(err)
			}
			handler := processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
				_, err := tx.Exec(ctx, `INSERT INTO seen VALUES ($1)`, r.Offset)
				return err // a second apply would fail on the primary key, and be dead-lettered
			})
			r := h.Start(h.Config(handler))
			produce := func(from, n int) {
				var recs []*kgo.Record
				for i := from; i < from+n; i++ {
					recs = append(recs, &kgo.Record{Topic: h.Topic, Key: []byte(fmt.Sprint(i)), Value: []byte("v")})
				}
				k.Produce(t, recs...)
			}
			seen := func() (n, distinct, max int64) {
				if err := h.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT off), coalesce(max(off), -1) FROM seen`).Scan(&n, &distinct, &max); err != nil {
					t.Fatal(err)
				}
				return
			}
			produce(0, 30)
			testenv.Eventually(t, 30*time.Second, func() error {
				if n, _, _ := seen(); n != 30 {
					return fmt.Errorf("%d of 30 applied", n)
				}
				return nil
			})
			// The database forgets: the effects and the offset together, as a failover does.
			keep := int64(10)
			if strings.Contains(tt.lose, "DELETE") {
				keep = 0
			}
			if _, err := h.Pool.Exec(ctx, `DELETE FROM seen WHERE off >= $1`, keep); err != nil {
				t.Fatal(err)
			}
			if _, err := h.Pool.Exec(ctx, tt.lose, h.Group, h.Topic); err != nil {
				t.Fatal(err)
			}
			// Nothing more arrives: the owner must find out by itself (a retry tier's partition
			// whose copies the database lost gets nothing more either).
			testenv.Eventually(t, 30*time.Second, func() error {
				if n, distinct, max := seen(); n != 30 || distinct != 30 || max != 29 {
					return fmt.Errorf("seen %d rows (%d distinct, up to offset %d), want offsets 0-29 once each, with nothing more produced", n, distinct, max)
				}
				return nil
			})
			produce(30, 20)
			testenv.Eventually(t, 30*time.Second, func() error {
				if n, distinct, max := seen(); n != 50 || distinct != 50 || max != 49 {
					return fmt.Errorf("seen %d rows (%d distinct, up to offset %d), want offsets 0-49 once each", n, distinct, max)
				}
				return nil
			})
			var dead int
			if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.dead_letters`).Scan(&dead); err != nil || dead != 0 {
				t.Errorf("%d dead letters (%v), want none: a record was applied twice", dead, err)
			}
			if got := r.Counter("kafkapg_forgotten_partitions_total"); got < 1 {
				t.Errorf("kafkapg_forgotten_partitions_total = %v, want it counted", got)
			}
		})
	}
}
