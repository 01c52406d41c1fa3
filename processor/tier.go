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
