package processor

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func testBreaker(t *testing.T) *breaker {
	t.Helper()
	m, err := newMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return newBreaker(breakerConfig{threshold: 0.5, window: time.Minute, minRecords: 10, probeMin: 300 * time.Millisecond, probeMax: 700 * time.Millisecond},
		slog.New(slog.DiscardHandler), m)
}

// TestBreakerOpensOnMostlyFailures checks the opening rule: not before minRecords records, not
// below the threshold, and at once when both are reached.
func TestBreakerOpensOnMostlyFailures(t *testing.T) {
	b := testBreaker(t)
	for i := range 9 {
		if b.failed() {
			t.Fatalf("opened after %d failures, fewer than the 10 records it needs", i+1)
		}
	}
	b.succeeded(20) // 9 of 29 failed
	for i := range 10 {
		if b.failed() {
			t.Fatalf("opened at %d of %d failed, below the threshold", 10+i, 30+i)
		}
	}
	if !b.failed() { // 20 of 40
		t.Fatal("still closed with half of the records failed")
	}
	if b.state() != breakerOpen {
		t.Fatalf("state %v, want open", b.state())
	}
}

// TestBreakerProbes checks that an open breaker lets one waiting record through as the probe once
// the probe interval has passed, holds the others, spaces failed probes further apart, and
// releases everyone when a probe succeeds.
func TestBreakerProbes(t *testing.T) {
	b := testBreaker(t)
	b.succeeded(0)
	for !b.failed() {
	}
	ctx := context.Background()
	opened := time.Now()
	probe, ok := b.wait(ctx, nil)
	if !ok || !probe {
		t.Fatalf("wait = %v, %v; want the probe", probe, ok)
	}
	if d := time.Since(opened); d < 250*time.Millisecond {
		t.Errorf("first probe after %v, want about the 300ms probe interval", d)
	}

	// While the probe runs, another held record waits for its outcome.
	other := make(chan bool, 1)
	go func() {
		p, _ := b.wait(ctx, nil)
		other <- p
	}()
	select {
	case <-other:
		t.Fatal("a second record was let through while the probe ran")
	case <-time.After(30 * time.Millisecond):
	}

	// A failed probe: the next one comes after a doubled interval, to the waiting record.
	failedAt := time.Now()
	b.probed(false)
	if p := recv(t, other); !p {
		t.Fatal("the waiting record was released without the breaker closing; want it as the next probe")
	}
	if d := time.Since(failedAt); d < 550*time.Millisecond {
		t.Errorf("second probe %v after the first failed, want about 600ms (doubled)", d)
	}

	// A successful probe closes the breaker and releases the waiting records.
	go func() {
		p, _ := b.wait(ctx, nil)
		other <- p
	}()
	waitWaiting(t, b, 1) // it is waiting, not yet started
	b.probed(true)
	if p := recv(t, other); p {
		t.Fatal("released as a probe after the breaker closed")
	}
	if b.state() != breakerClosed {
		t.Fatalf("state %v after a successful probe, want closed", b.state())
	}
	if b.failed() {
		t.Error("one failure reopened the breaker right after it closed")
	}
}

// recv receives from c, failing the test after 5 s rather than hanging it.
func recv(t *testing.T, c <-chan bool) bool {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(5 * time.Second):
		t.Fatal("no record was released within 5s")
		return false
	}
}

// waitWaiting waits until n records wait for the breaker.
func waitWaiting(t *testing.T, b *breaker, n float64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for testutil.ToFloat64(b.metrics.breakerWaiting) != n {
		if time.Now().After(deadline) {
			t.Fatalf("%v records waiting, want %v", testutil.ToFloat64(b.metrics.breakerWaiting), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestBreakerOff: with a negative threshold (BreakerDisabled) nothing is ever held.
func TestBreakerOff(t *testing.T) {
	m, err := newMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	b := newBreaker(breakerConfig{threshold: -1, window: time.Minute, minRecords: 1, probeMin: time.Second, probeMax: time.Second},
		slog.New(slog.DiscardHandler), m)
	for range 100 {
		if b.failed() {
			t.Fatal("a disabled breaker opened")
		}
	}
	if b.state() != breakerClosed {
		t.Fatalf("state %v", b.state())
	}
}

// TestBreakerClosesOnSuccess checks that any applied record closes an open breaker, and that
// a probe with no outcome hands the probe to the next held record at once.
func TestBreakerClosesOnSuccess(t *testing.T) {
	b := testBreaker(t)
	for !b.failed() {
	}
	if p, _ := b.wait(context.Background(), nil); !p {
		t.Fatal("want the probe")
	}
	b.done()
	start := time.Now()
	if p, _ := b.wait(context.Background(), nil); !p {
		t.Fatal("after an abandoned probe, want the next record as the probe")
	}
	if d := time.Since(start); d > 200*time.Millisecond {
		t.Errorf("the next probe waited %v after an abandoned one, want at once", d)
	}
	b.succeeded(1)
	if b.state() != breakerClosed {
		t.Fatalf("state %v after a record was applied, want closed", b.state())
	}
	stopping := make(chan struct{})
	close(stopping)
	if p, ok := b.wait(context.Background(), stopping); p || !ok {
		t.Fatalf("wait on a closed breaker = %v, %v; want false, true", p, ok)
	}
}
