package processor

import (
	"errors"
	"testing"
	"time"
)

// TestTestClockDrivesTheRetryPath: with Config.Test.Now set, a failed record's due time is
// stamped from it, and a tier's partition reads due times against it, looking again within
// testClockPoll however far off the due time is (the clock moves without waking it); without it,
// the real clock, and a wait as long as the due time is off.
func TestTestClockDrivesTheRetryPath(t *testing.T) {
	t.Parallel()
	at := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	c := &Config{Group: "g", Topics: []string{"orders"}, Handler: HandlerFunc(nil), RetryTiers: []time.Duration{time.Hour},
		Test: TestConfig{Now: func() time.Time { return at }}}
	p := &Processor{cfg: c, policies: map[string]*policy{"orders": c.policy("orders")}}

	m := p.plan(&Record{Topic: "orders", Attempt: 1}, "orders", failure{cause: errors.New("down"), class: ClassRetryable})
	if m.tier != 1 || m.DueAt.Before(at.Add(time.Hour)) || m.DueAt.After(at.Add(66*time.Minute)) {
		t.Fatalf("tier %d due at %v, want tier 1 due an hour (and up to 10%%) after the test clock's %v", m.tier, m.DueAt, at)
	}
	if d := p.untilDue(at.Add(time.Hour)); d != testClockPoll {
		t.Errorf("untilDue(an hour on) = %v with a test clock, want %v", d, testClockPoll)
	}
	if d := p.untilDue(at.Add(-time.Second)); d > 0 {
		t.Errorf("untilDue(a second ago) = %v, want it due", d)
	}
	if !p.now().Equal(at) {
		t.Errorf("now = %v, want the test clock's %v", p.now(), at)
	}

	c.Test.Now = nil // production
	if d := p.untilDue(time.Now().Add(time.Hour)); d < 59*time.Minute {
		t.Errorf("untilDue(an hour on) = %v with the real clock, want about an hour", d)
	}
	if m := p.plan(&Record{Topic: "orders", Attempt: 1}, "orders", failure{cause: errors.New("down"), class: ClassRetryable}); time.Until(m.DueAt) < 59*time.Minute {
		t.Errorf("due at %v with the real clock, want an hour from now", m.DueAt)
	}
}
