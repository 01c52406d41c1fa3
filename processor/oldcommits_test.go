package processor_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
)

// TestNewBuildOnTheOldReleasesConsumerProtocolCommits: the release before the start was recorded
// (f433fb8) committed to Kafka with franz-go's default metadata, the member id, which under the
// consumer protocol (KIP-848, its default on Kafka 4) is a random id that does not name kafkapg.
// Upgraded, the new build finds the database forgot the partitions (restored from a backup taken
// before their first claim, or failed over to a standby that never received it) and Kafka holding
// the old release's commits past every record. It must take them for kafkapg's and apply every
// record again (before the fix: taken for another consumer's, 0 of 40 applied again, and no
// warning).
func TestNewBuildOnTheOldReleasesConsumerProtocolCommits(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := testkit.New(t, k, 2)
		var items []ledger.Item
		for i := range 40 {
			items = append(items, testkit.Event(fmt.Sprintf("old-%d", i), fmt.Sprintf("a%d", i%4), int64(i), 0, false))
		}
		h.Produce(items)
		member := commitAsTheReleaseBefore(t, k, h.Topic, h.Group, len(items))
		t.Logf("the release before committed as member %q", member)
		if strings.HasPrefix(member, "kafkapg") {
			t.Fatalf("member id %q names kafkapg: the scenario needs the consumer protocol's", member)
		}

		adm := kadm.NewClient(k.Client(t))
		committed, err := adm.FetchOffsetsForTopics(context.Background(), h.Group, h.Topic)
		if err == nil {
			err = committed.Error()
		}
		if err != nil {
			t.Fatal(err)
		}
		total := int64(0)
		for p := range int32(2) {
			o, ok := committed.Lookup(h.Topic, p)
			if !ok || o.At <= 0 || o.Metadata != member {
				t.Fatalf("partition %d: committed %+v; want an offset past its records, with the member id %q for metadata", p, o, member)
			}
			total += o.At
		}
		if total != int64(len(items)) {
			t.Fatalf("the release before committed past %d records, want all %d", total, len(items))
		}

		// The new build, on the database that forgot: kafkapg's and the ledger's tables as they
		// were before the partitions were first claimed.
		r := h.Start(h.Config(ledger.Handler{}))
		h.WaitApplied(len(items), 30*time.Second)
		expectOnly(t, h, "old-", len(items))
		if n := r.Counter("kafkapg_forgotten_partitions_total"); n != 2 {
			t.Errorf("kafkapg_forgotten_partitions_total = %v, want 2", n)
		}
	})
}

// commitAsTheReleaseBefore consumes n records of topic in group as the release before the start was
// recorded did, and commits them as it did, returning the member id it committed as. The options
// are those of f433fb8's newClient that decide the protocol and the commits' metadata: client id
// "kafkapg", the cooperative-sticky balancer with kgo.ServerSideBalancer (the consumer protocol,
// GroupProtocolAuto), offsets marked (MarkCommitOffsets) and committed by kgo.AutoCommitMarks and
// CommitMarkedOffsets, with no metadata of its own (no PreCommitFnContext). It checks that the group
// is a consumer-protocol group.
func commitAsTheReleaseBefore(t *testing.T, k *testenv.Kafka, topic, group string, n int) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cl := k.Client(t,
		kgo.ClientID("kafkapg"),
		kgo.ConsumerGroup(group),
		kgo.ConsumeTopics(topic),
		kgo.Balancers(kgo.CooperativeStickyBalancer()),
		kgo.ServerSideBalancer(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.AutoCommitMarks(),
		kgo.SessionTimeout(3*time.Second),
		kgo.HeartbeatInterval(500*time.Millisecond),
	)
	for seen := 0; seen < n; {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("the release before consumed %d of %d records: %v", seen, n, err)
		}
		fs.EachError(func(topic string, p int32, err error) { t.Logf("fetch %s/%d: %v", topic, p, err) })
		marks := map[string]map[int32]kgo.EpochOffset{}
		fs.EachRecord(func(r *kgo.Record) {
			seen++
			if marks[r.Topic] == nil {
				marks[r.Topic] = map[int32]kgo.EpochOffset{}
			}
			marks[r.Topic][r.Partition] = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset + 1}
		})
		cl.MarkCommitOffsets(marks)
	}
	if err := cl.CommitMarkedOffsets(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	member, _ := cl.GroupMetadata()

	req := kmsg.NewPtrListGroupsRequest()
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		t.Fatal(err)
	}
	groupType := "not listed"
	for _, g := range resp.Groups {
		if g.Group == group {
			groupType = g.GroupType
		}
	}
	if groupType != "consumer" {
		t.Fatalf("group %s is of type %q: the scenario needs the consumer protocol", group, groupType)
	}
	if err := cl.LeaveGroupContext(ctx); err != nil {
		t.Fatalf("leave: %v", err)
	}
	cl.Close()
	return member
}
