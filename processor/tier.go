package processor

import (
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// tierRef says which source topic a retry-tier topic belongs to, and which tier it is.
type tierRef struct {
	source string
	n      int
}

// duePrefix returns how many of recs, from the first, are due at now, and when the first one that
// is not is due.
func duePrefix(recs []*kgo.Record, now time.Time) (int, time.Time) {
	for i, r := range recs {
		if due := dueAt(r); due.After(now) {
			return i, due
		}
	}
	return len(recs), time.Time{}
}

// now is the retry path's clock: Config.Test.Now, or time.Now.
func (p *Processor) now() time.Time {
	if p.cfg.Test.Now != nil {
		return p.cfg.Test.Now()
	}
	return time.Now()
}

// testClockPoll is how often, at least, a tier's partition waiting for a record to be due looks
// at a test's clock (Config.Test.Now), which moves without waking it.
const testClockPoll = 20 * time.Millisecond

// untilDue returns how long, by the retry path's clock, until due; with a test's clock, at most
// testClockPoll.
func (p *Processor) untilDue(due time.Time) time.Duration {
	d := due.Sub(p.now())
	if p.cfg.Test.Now != nil && d > 0 {
		d = min(d, testClockPoll)
	}
	return d
}

// dueAt reads a retry record's due time; a record without a valid one is due at once.
func dueAt(r *kgo.Record) time.Time {
	for _, h := range r.Headers {
		if h.Key == retrytopics.HeaderDueAt {
			t, err := time.Parse(time.RFC3339Nano, string(h.Value))
			if err != nil {
				return time.Time{}
			}
			return t
		}
	}
	return time.Time{}
}
