package processor_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/testenv"
)

// TestShutdownDuringStuckRebalanceLeavesTheGroup stops processor A while its group is stuck in a
// rebalance: member C went silent (cut off from Kafka), B has just joined, and the join waits
// for C until C's session times out. A must still leave the group cleanly once the join lets it
// (its final Kafka commit must not eat the shutdown timeout, and it must not just walk away): B
// then gets A's partitions at once, long before A's own 60 s session timeout would hand them
// over. Exiting without leaving would stall A's partitions for those 60 s.
func TestShutdownDuringStuckRebalanceLeavesTheGroup(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		if !k.Real() {
			// kfake (2026-09) sometimes never completes a join whose member went silent: 1 run
			// in 6 here, A then waits its whole shutdown timeout. The same bug makes the chaos
			// suite wait for readiness after restarts on kfake. This runs on real Kafka only.
			t.Skip("kfake can leave a join with a silent member pending for ever; needs KAFKA_BROKERS")
		}
		t.Parallel()
		h := newHarness(t, k, 4)
		items := ledger.Generate(ledger.GenConfig{Events: 400, Accounts: 20, Seed: 31, Prefix: "sd"})
		first, second := items[:200], items[200:]

		cfgA := h.config(ledger.Handler{})
		cfgA.SessionTimeout = 60 * time.Second
		cfgA.RebalanceTimeout = 40 * time.Second
		cfgA.ShutdownTimeout = 30 * time.Second // long enough for a slow broker to end the join
		a := h.start(cfgA)

		net := testenv.NewNetFault()
		cfgC := h.config(ledger.Handler{})
		cfgC.SessionTimeout = 8 * time.Second
		cfgC.ShutdownTimeout = 3 * time.Second
		cfgC.KafkaOptions = append(slices.Clone(cfgC.KafkaOptions), kgo.Dialer(net.Dial))
		c := h.start(cfgC)

		h.produce(first)
		h.waitApplied(len(first), 60*time.Second)

		// C goes silent; B's join starts a rebalance that waits for C until its session expires.
		net.Cut()
		cut := time.Now()
		b := h.start(h.config(ledger.Handler{}))
		time.Sleep(4 * time.Second) // A learns of the rebalance at its next heartbeat (<= 3 s) and rejoins

		stopStart := time.Now()
		a.cancel()
		select {
		case <-a.done:
		case <-time.After(cfgA.ShutdownTimeout + 5*time.Second):
			t.Fatalf("A did not stop within its shutdown timeout %v", cfgA.ShutdownTimeout)
		}
		if a.err != nil {
			t.Errorf("A's Run returned %v", a.err)
		}
		stopped := time.Now()
		t.Logf("A stopped %v after SIGTERM (C cut %v before)", stopped.Sub(stopStart).Round(time.Millisecond), stopStart.Sub(cut).Round(time.Millisecond))

		// Everything, A's old partitions included, must now flow through B well within A's
		// session timeout.
		h.produce(second)
		// h.waitApplied's timeout is measured from now, after the produce: still well within.
		h.waitApplied(len(first)+len(second), cfgA.SessionTimeout/2-time.Since(stopped))
		t.Logf("all events applied %v after A stopped", time.Since(stopped).Round(time.Millisecond))

		net.Restore()
		c.cancel()
		<-c.done
		if c.err != nil && !errors.Is(c.err, context.Canceled) {
			t.Logf("zombie C's Run returned %v", c.err)
		}
		b.stop(t)
		h.verify(items, 1, false)
	})
}

// TestShutdownIsLameDuckFirst stops a processor whose handler is stuck: while it drains (up to
// its drain timeout), it must already report not ready.
func TestShutdownIsLameDuckFirst(t *testing.T) {
	k := testenv.NewKfake(t)
	h := newHarness(t, k, 1)
	items := ledger.Generate(ledger.GenConfig{Events: 5, Accounts: 2, Seed: 33, Prefix: "ld"})
	g := newGate(t, 1)
	r := h.start(h.config(g))
	h.produce(items)
	g.waitStalled(t, 1)
	if err := r.p.Ready(context.Background()); err != nil {
		t.Fatalf("Ready before shutdown: %v", err)
	}
	r.cancel()
	testenv.Eventually(t, 5*time.Second, func() error {
		err := r.p.Ready(context.Background())
		if err == nil || !strings.Contains(err.Error(), "shutting down") {
			return fmt.Errorf("Ready = %v during shutdown, want shutting down", err)
		}
		return nil
	})
	select {
	case <-r.done:
		t.Fatal("Run returned before the stuck handler's drain timeout: the check above proved nothing")
	default:
	}
	g.open()
	<-r.done
}
