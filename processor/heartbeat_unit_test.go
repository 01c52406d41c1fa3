package processor

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// TestHeartbeatInterval: members heartbeat every min(500 ms, SessionTimeout/3), 500 ms at the
// default 45 s (not 15 s): the classic protocol's client is given that interval, and under the
// consumer protocol it is what the processor asks the broker to set for the group
// (TestGroupTimeoutsAreTheGroups checks that the group gets it). docs/configuration.md's
// KAFKA_SESSION_TIMEOUT row states the rule and the default's interval as rendered here.
func TestHeartbeatInterval(t *testing.T) {
	t.Parallel()
	interval := func(session time.Duration) time.Duration {
		c := validConfig()
		c.SessionTimeout = session
		return (&Processor{cfg: c.withDefaults()}).heartbeatInterval()
	}
	for _, tt := range []struct {
		name    string
		session time.Duration
		want    time.Duration
	}{
		{"the default, 45s", 0, 500 * time.Millisecond},
		{"4.5s", 4500 * time.Millisecond, 500 * time.Millisecond},
		{"1.5s, a third is the cap", 1500 * time.Millisecond, 500 * time.Millisecond},
		{"900ms, a third", 900 * time.Millisecond, 300 * time.Millisecond},
	} {
		if got := interval(tt.session); got != tt.want {
			t.Errorf("%s: heartbeat interval %v, want %v", tt.name, got, tt.want)
		}
	}

	// The classic protocol's client heartbeats at the interval.
	def := interval(0)
	if got := promiseClient(t, 64<<20).OptValue(kgo.HeartbeatInterval); got != def {
		t.Errorf("the client's heartbeat interval is %v, want %v", got, def)
	}

	// The doc states the rule: its cap (the interval of a long session) and its share of the
	// session (the interval of a short one).
	capped := interval(time.Hour)
	share := int(300 * time.Millisecond / interval(300*time.Millisecond))
	b, err := os.ReadFile("../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, phrase := range []string{
		fmt.Sprintf("`min(%s, %s of it)`", durText(capped), partText(share)),
		fmt.Sprintf("every %s at the default", durText(def)),
	} {
		if !strings.Contains(oneLine(string(b)), phrase) {
			t.Errorf("docs/configuration.md does not say %q, which is what the code does", phrase)
		}
	}
}

// TestGroupTimeoutsWithinTheBrokersLimits: the session timeout and heartbeat interval asked of the
// brokers under the consumer protocol are within their group.consumer.min/max limits, the
// heartbeat below a third of the session where the limits allow, and never at or above it.
func TestGroupTimeoutsWithinTheBrokersLimits(t *testing.T) {
	t.Parallel()
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	stock := groupLimits{minSession: ms(45000), maxSession: ms(60000), minHeartbeat: ms(5000), maxHeartbeat: ms(15000)}
	lowered := groupLimits{minSession: ms(1000), maxSession: ms(60000), minHeartbeat: ms(100), maxHeartbeat: ms(15000)}
	for _, tt := range []struct {
		name          string
		session       time.Duration
		lim           groupLimits
		wantS, wantHB time.Duration
		fits          bool
	}{
		{"stock broker, the default 45 s", ms(45000), stock, ms(45000), ms(5000), true},
		{"stock broker, 10 s asked: its minimum applies", ms(10000), stock, ms(45000), ms(5000), true},
		{"stock broker, 90 s asked: its maximum applies", ms(90000), stock, ms(60000), ms(5000), true},
		{"lowered minimums, 45 s", ms(45000), lowered, ms(45000), ms(500), true},
		{"lowered minimums, 1.2 s: heartbeat a third", ms(1200), lowered, ms(1200), ms(400), true},
		{"no limits known (kfake)", ms(45000), groupLimits{}, ms(45000), ms(500), true},
		{"heartbeat minimum above a third: session raised to three", ms(6000), groupLimits{minHeartbeat: ms(5000)}, ms(15000), ms(5000), true},
		{"no pair fits: heartbeat minimum above the session maximum", ms(6000), groupLimits{minHeartbeat: ms(5000), maxSession: ms(4000)}, ms(4000), ms(5000), false},
	} {
		s, hb, fits := groupTimeouts(tt.session, tt.lim)
		if s != tt.wantS || hb != tt.wantHB || fits != tt.fits {
			t.Errorf("%s: groupTimeouts(%v, %s) = %v, %v, %v; want %v, %v, %v", tt.name, tt.session, tt.lim, s, hb, fits, tt.wantS, tt.wantHB, tt.fits)
		}
		if fits && (hb >= s || (tt.lim.minSession > 0 && s < tt.lim.minSession) || (tt.lim.maxSession > 0 && s > tt.lim.maxSession) ||
			(tt.lim.minHeartbeat > 0 && hb < tt.lim.minHeartbeat) || (tt.lim.maxHeartbeat > 0 && hb > tt.lim.maxHeartbeat)) {
			t.Errorf("%s: %v, %v said to fit %s", tt.name, s, hb, tt.lim)
		}
	}
}
