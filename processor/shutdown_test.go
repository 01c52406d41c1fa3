package processor_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// TestShutdownDuringStuckRebalanceLeavesTheGroup stops processor A while its group is in a
// rebalance that waits for a member: C went silent (cut off from Kafka) and B has just joined.
// Under the classic protocol the join waits for C until C's session times out, and a clean leave
// waits for the join; under the consumer protocol there is no such barrier. Either way A must
// stop within 5 s and leave the group, so that its partitions flow through B long before A's own
// 60 s session timeout would hand them over.
func TestShutdownDuringStuckRebalanceLeavesTheGroup(t *testing.T) {
	for _, protocol := range []processor.GroupProtocol{processor.GroupProtocolClassic, processor.GroupProtocolAuto} {
		t.Run(string(protocol), func(t *testing.T) {
			t.Parallel()
			testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
				if !k.Real() {
					// kfake (2026-09) sometimes never completes a classic join whose member went
					// silent (1 run in 6 here; the same bug makes the chaos suite wait for
					// readiness after restarts on kfake), and under a loaded machine its
					// consumer-protocol coordinator sometimes never hands the silent member's
					// partitions on (2 runs in about 10 with the race detector).
					t.Skip("kfake's group coordinator can keep a silent member's partitions for ever; needs KAFKA_BROKERS")
				}
				t.Parallel()
				stopsWhileAMemberIsSilent(t, k, protocol)
			})
		})
	}
}

func stopsWhileAMemberIsSilent(t *testing.T, k *testenv.Kafka, protocol processor.GroupProtocol) {
	h := newHarness(t, k, 4)
	items := ledger.Generate(ledger.GenConfig{Events: 400, Accounts: 20, Seed: 31, Prefix: "sd"})
	first, second := items[:200], items[200:]
	config := func(name string, session time.Duration) *processor.Config {
		cfg := h.Config(ledger.Handler{})
		cfg.InstanceName = name // so that the positions say whose they are
		cfg.GroupProtocol = protocol
		cfg.SessionTimeout = session
		return cfg
	}

	cfgA := config("A", 60*time.Second)
	cfgA.RebalanceTimeout = 40 * time.Second
	cfgA.ShutdownTimeout = 30 * time.Second
	a := h.Start(cfgA)
	// Under the consumer protocol the session timeout is the group's, and each processor sets
	// it as it starts: A must have set its 60 s before C and B set 8 s, or the group may keep
	// A's, and C's partitions would stay with the silent C for a minute. (Replicas of one
	// Deployment share their settings; only this test gives them different ones.)
	waitJoined(t, a)

	net := testenv.NewNetFault()
	cfgC := config("C", 8*time.Second)
	cfgC.ShutdownTimeout = 3 * time.Second
	cfgC.KafkaOptions = append(slices.Clone(cfgC.KafkaOptions), kgo.Dialer(net.Dial))
	c := h.Start(cfgC)

	h.Produce(first)
	h.WaitApplied(len(first), 60*time.Second)
	gtype := groupType(t, k, h.Group)
	if (protocol == processor.GroupProtocolClassic) != (gtype == "classic") {
		t.Errorf("KAFKA_GROUP_PROTOCOL=%s: the group's type is %q", protocol, gtype)
	}
	if gtype == "consumer" {
		// C's session is the group's: it must be C's 8 s, not A's 60 s, before C goes silent, or C
		// keeps its partitions for a minute (the likeliest cause of a CI flake, 2026-12-01).
		waitGroupSession(t, k, h.Group, 8*time.Second)
		// And C must have heartbeated since: the broker sets a member's session timer at each
		// heartbeat, from the group's setting at that moment. C starts shortly before the cut,
		// and a CI run (2026-12-02) cut it before any heartbeat under the 8 s setting: the broker
		// kept the silent C, with C's partitions, for A's 60 s. Waiting for the group to settle
		// (A has handed C its partitions, which takes heartbeats of both) and then for a few
		// more of C's heartbeats makes the silent member the one the test means.
		waitGroupSettled(t, k, h.Group)
		time.Sleep(2 * time.Second) // members heartbeat every 500 ms (processor.heartbeatInterval)
	}

	// C goes silent; B joins.
	t.Logf("before the cut: %s", h.Positions())
	if gtype == "consumer" {
		t.Logf("before the cut, the group: %s", describeConsumerGroup(t, k, h.Group))
	}
	net.Cut()
	cut := time.Now()
	b := h.Start(config("B", 8*time.Second))
	time.Sleep(4 * time.Second) // A learns of the rebalance at its next heartbeat and rejoins

	stopStart := time.Now()
	a.Cancel()
	select {
	case <-a.Done:
	case <-time.After(cfgA.ShutdownTimeout + 5*time.Second):
		t.Fatalf("A did not stop within its shutdown timeout %v", cfgA.ShutdownTimeout)
	}
	if a.Err != nil {
		t.Errorf("A's Run returned %v", a.Err)
	}
	stopped := time.Now()
	took := stopped.Sub(stopStart)
	t.Logf("%s: A stopped %v after SIGTERM (C cut %v before)", protocol, took.Round(time.Millisecond), stopStart.Sub(cut).Round(time.Millisecond))
	if took > 5*time.Second {
		t.Errorf("A took %v to stop; the target is 5 s", took)
	}

	// Should the events not flow, say who holds what: each partition's position in Postgres, and
	// the group as the broker sees it (a flake on real Kafka's consumer protocol, 2026-12-01,
	// left no trace of which partitions stuck, or where).
	defer func() {
		if t.Failed() {
			t.Logf("positions in Postgres: %s", h.Positions())
			t.Logf("the group, as the broker describes it: %s", describeConsumerGroup(t, k, h.Group))
			t.Logf("the group's session timeout: %s", groupSessionTimeout(k.Client(t), h.Group))
		}
	}()

	// Everything, A's old partitions included, must now flow through B well within A's
	// session timeout.
	h.Produce(second)
	h.WaitApplied(len(first)+len(second), cfgA.SessionTimeout/2-time.Since(stopped))
	t.Logf("%s: all events applied %v after A stopped", protocol, time.Since(stopped).Round(time.Millisecond))

	net.Restore()
	c.Cancel()
	<-c.Done
	if c.Err != nil && !errors.Is(c.Err, context.Canceled) {
		t.Logf("zombie C's Run returned %v", c.Err)
	}
	b.Stop(t)
	h.Verify(items, 1, false)
}

// groupType asks the broker which protocol a group runs: "classic" or "consumer".
func groupType(t *testing.T, k *testenv.Kafka, group string) string {
	t.Helper()
	resp, err := kmsg.NewPtrListGroupsRequest().RequestWith(context.Background(), k.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range resp.Groups {
		if g.Group == group {
			return g.GroupType
		}
	}
	t.Fatalf("group %s is not listed", group)
	return ""
}

// TestShutdownIsLameDuckFirst stops a processor whose handler is stuck: while it drains (up to
// its drain timeout), it must already report not ready.
func TestShutdownIsLameDuckFirst(t *testing.T) {
	k := testenv.NewKfake(t)
	h := newHarness(t, k, 1)
	items := ledger.Generate(ledger.GenConfig{Events: 5, Accounts: 2, Seed: 33, Prefix: "ld"})
	g := newGate(t, 1)
	r := h.Start(h.Config(g))
	h.Produce(items)
	g.waitStalled(t, 1)
	if err := r.P.Ready(context.Background()); err != nil {
		t.Fatalf("Ready before shutdown: %v", err)
	}
	r.Cancel()
	testenv.Eventually(t, 5*time.Second, func() error {
		err := r.P.Ready(context.Background())
		if err == nil || !strings.Contains(err.Error(), "shutting down") {
			return fmt.Errorf("Ready = %v during shutdown, want shutting down", err)
		}
		return nil
	})
	select {
	case <-r.Done:
		t.Fatal("Run returned before the stuck handler's drain timeout: the check above proved nothing")
	default:
	}
	g.open()
	<-r.Done
}

// TestShutdownIsBoundedWhateverIsStuck stops a processor while everything that can hold up a
// shutdown does: a handler ignores its context, and the outbox relay is in the middle of
// publishing a dead letter to a broker it cannot reach (its network is cut). Run must still
// return within SHUTDOWN_TIMEOUT (plus a little): what is left over is the next owner's.
func TestShutdownIsBoundedWhateverIsStuck(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 2)
		stuck, poison := make(chan struct{}), make(chan struct{})
		var once sync.Once
		t.Cleanup(func() { once.Do(func() { close(stuck) }) })
		entered := make(chan string, 2)
		handler := processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			switch string(rec.Value) {
			case "ignores its context":
				entered <- "stuck"
				<-stuck
			case "poison, later":
				entered <- "poison"
				<-poison
				return processor.Permanent(errors.New("poison"))
			}
			return nil
		})
		net := testenv.NewNetFault()
		cfg := h.Config(handler)
		cfg.ShutdownTimeout = 4 * time.Second
		// A session longer than the test: with the harness's 3 s, the member's heartbeats fail
		// soon after the cut and it loses its partitions, sometimes before the poison record's
		// dead letter commits (then nothing is left for the relay to be stuck on).
		cfg.SessionTimeout = 20 * time.Second
		cfg.KafkaOptions = append(slices.Clone(cfg.KafkaOptions), kgo.Dialer(net.Dial))
		r := h.Start(cfg)
		manual := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
		if err := manual.ProduceSync(context.Background(),
			&kgo.Record{Topic: h.Topic, Partition: 0, Value: []byte("ignores its context")},
			&kgo.Record{Topic: h.Topic, Partition: 1, Value: []byte("poison, later")}).FirstErr(); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			select {
			case <-entered:
			case <-time.After(30 * time.Second):
				t.Fatal("the handlers were not called")
			}
		}
		net.Cut()
		close(poison) // dead-lettered now: the relay publishes to a broker it cannot reach
		testenv.Eventually(t, 10*time.Second, func() error {
			var n int
			if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.dead_letters`).Scan(&n); err != nil || n != 1 {
				return fmt.Errorf("%d dead letters (%v)", n, err)
			}
			return nil
		})
		time.Sleep(500 * time.Millisecond) // the relay is in its produce

		began := time.Now()
		r.Cancel()
		select {
		case <-r.Done:
		case <-time.After(30 * time.Second):
			t.Fatal("Run did not return within 30 s")
		}
		took := time.Since(began)
		t.Logf("stopped %v after the signal (SHUTDOWN_TIMEOUT %v)", took.Round(time.Millisecond), cfg.ShutdownTimeout)
		if took > cfg.ShutdownTimeout+500*time.Millisecond {
			t.Errorf("the shutdown took %v, more than SHUTDOWN_TIMEOUT (%v)", took, cfg.ShutdownTimeout)
		}
		var outbox int
		if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.outbox`).Scan(&outbox); err != nil || outbox != 1 {
			t.Errorf("%d outbox rows after the shutdown (%v); the dead letter's row must be left for the next processor", outbox, err)
		}
		net.Restore()
	})
}

// describeConsumerGroup is the broker's account of a consumer-protocol group: its state and
// epochs, and each member's assignment and target assignment. For a classic group it says why
// it could not.
// waitGroupSession waits until the broker says that the consumer group's session timeout is want.
func waitGroupSession(t *testing.T, k *testenv.Kafka, group string, want time.Duration) {
	t.Helper()
	cl := k.Client(t)
	testenv.Eventually(t, 20*time.Second, func() error {
		got := groupSessionTimeout(cl, group)
		if got != fmt.Sprint(want.Milliseconds()) {
			return fmt.Errorf("the group's consumer.session.timeout.ms is %s, want %d", got, want.Milliseconds())
		}
		return nil
	})
}

// waitGroupSettled waits until every member of a consumer-protocol group has its target
// assignment at the group's epoch.
func waitGroupSettled(t *testing.T, k *testenv.Kafka, group string) {
	t.Helper()
	cl := k.Client(t)
	testenv.Eventually(t, 30*time.Second, func() error {
		req := kmsg.NewPtrConsumerGroupDescribeRequest()
		req.Groups = []string{group}
		resp, err := req.RequestWith(context.Background(), cl)
		if err != nil {
			return err
		}
		for _, g := range resp.Groups {
			if err := kerr.ErrorForCode(g.ErrorCode); err != nil {
				return err
			}
			for _, m := range g.Members {
				if m.MemberEpoch != g.Epoch || assignmentString(m.Assignment) != assignmentString(m.TargetAssignment) {
					return fmt.Errorf("the group has not settled: %s", describeConsumerGroup(t, k, group))
				}
			}
		}
		return nil
	})
}

// groupSessionTimeout is the group's consumer.session.timeout.ms as the broker describes it, or
// what kept the broker from describing it.
func groupSessionTimeout(cl *kgo.Client, group string) string {
	req := kmsg.NewPtrDescribeConfigsRequest()
	res := kmsg.NewDescribeConfigsRequestResource()
	res.ResourceType, res.ResourceName = kmsg.ConfigResourceTypeGroupConfig, group
	res.ConfigNames = []string{"consumer.session.timeout.ms"}
	req.Resources = append(req.Resources, res)
	resp, err := req.RequestWith(context.Background(), cl)
	if err != nil {
		return "describe: " + err.Error()
	}
	for _, r := range resp.Resources {
		for _, c := range r.Configs {
			return derefStr(c.Value)
		}
	}
	return "not described"
}

func derefStr(s *string) string {
	if s == nil {
		return "unset"
	}
	return *s
}

func describeConsumerGroup(t *testing.T, k *testenv.Kafka, group string) string {
	t.Helper()
	req := kmsg.NewPtrConsumerGroupDescribeRequest()
	req.Groups = []string{group}
	resp, err := req.RequestWith(context.Background(), k.Client(t))
	if err != nil {
		return "describe: " + err.Error()
	}
	var b strings.Builder
	for _, g := range resp.Groups {
		if err := kerr.ErrorForCode(g.ErrorCode); err != nil {
			fmt.Fprintf(&b, "%s: %v; ", g.Group, err)
			continue
		}
		fmt.Fprintf(&b, "state %s, epoch %d, assignment epoch %d;", g.State, g.Epoch, g.AssignmentEpoch)
		for _, m := range g.Members {
			fmt.Fprintf(&b, " member %s (%s, epoch %d): assigned %s, target %s;", m.MemberID, m.ClientID, m.MemberEpoch,
				assignmentString(m.Assignment), assignmentString(m.TargetAssignment))
		}
	}
	return b.String()
}

func assignmentString(a kmsg.Assignment) string {
	var parts []string
	for _, tp := range a.TopicPartitions {
		parts = append(parts, fmt.Sprintf("%s%v", tp.Topic, slices.Sorted(slices.Values(tp.Partitions))))
	}
	slices.Sort(parts)
	return "[" + strings.Join(parts, " ") + "]"
}
