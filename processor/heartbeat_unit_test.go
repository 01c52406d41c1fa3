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
