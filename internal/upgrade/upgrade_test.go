package upgrade_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
	"github.com/kafkapg/kafkapg/internal/upgrade"
)

// TestFinalizeWaitsForTheReleaseBefore (issue 40): the upgrade window is not finalized while a
// member of the release before (a member of the schema's group that never said its release) runs,
// under either group protocol; once every member says this release, it is.
func TestFinalizeWaitsForTheReleaseBefore(t *testing.T) {
	for _, proto := range []string{"classic", "consumer"} {
		t.Run(proto, func(t *testing.T) {
			t.Parallel()
			pool, _ := testenv.Postgres(t)
			ctx := context.Background()
			if _, err := schema.MigrateTo(ctx, pool, "kafkapg", schema.PreviousSchema); err != nil {
				t.Fatal(err)
			}
			if _, err := schema.Migrate(ctx, pool, "kafkapg"); err != nil { // the window opens
				t.Fatal(err)
			}
			k := testenv.NewKfake(t)
			topic, group := k.CreateTopic(t, 2), k.Group(t)
			if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ($1, $2, 0, 0)`, group, topic); err != nil {
				t.Fatal(err)
			}
			opts := []kgo.Opt{kgo.ConsumerGroup(group), kgo.ConsumeTopics(topic), kgo.ClientID("kafkapg")}
			if proto == "consumer" {
				opts = append(opts, kgo.Balancers(kgo.CooperativeStickyBalancer()))
			} else {
				opts = append(opts, kgo.Balancers(kgo.RoundRobinBalancer()))
			}
			before := k.Client(t, opts...) // a processor of the release before: it says nothing
			var member string
			testenv.Eventually(t, 20*time.Second, func() error {
				pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
				before.PollRecords(pctx, 1) // joins the group
				cancel()
				if member, _ = before.GroupMetadata(); member == "" {
					return fmt.Errorf("not in the group yet")
				}
				return nil
			})
			adm := kadm.NewClient(k.Client(t))
			var s upgrade.Status
			testenv.Eventually(t, 20*time.Second, func() error {
				var err error
				if s, err = upgrade.Read(ctx, pool, "kafkapg", adm); err != nil {
					return err
				}
				if len(s.Before()) != 1 {
					return fmt.Errorf("members %+v; want the one of the release before", s.Members)
				}
				return nil
			})
			if !s.Open() || s.Before()[0].MemberID != member {
				t.Fatalf("status %+v; want the window open and member %s of the release before", s, member)
			}
			if _, err := upgrade.Finalize(ctx, pool, "kafkapg", adm); !errors.Is(err, upgrade.ErrBeforeRuns) {
				t.Fatalf("Finalize with a member of the release before running = %v; want ErrBeforeRuns", err)
			}
			if fin, pending, _ := schema.Window(ctx, pool, "kafkapg"); fin != schema.PreviousSchema || len(pending) == 0 {
				t.Fatalf("the refused Finalize changed the window: %d, %v", fin, pending)
			}
			// The member is replaced by one of this release, which says so.
			if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.group_members (consumer_group, member_id, release, schema_version, instance, seen_at)
				VALUES ($1, $2, 'v0.2.0', $3, 'test', now())`, group, member, schema.Version()); err != nil {
				t.Fatal(err)
			}
			moved, err := upgrade.Finalize(ctx, pool, "kafkapg", adm)
			if err != nil || len(moved) == 0 {
				t.Fatalf("Finalize with every member on this release = %v, %v", moved, err)
			}
		})
	}
}
