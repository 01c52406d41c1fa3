package ops

import (
	"encoding/hex"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/kafkapg/kafkapg/internal/safetext"
)

// FilterFromQuery reads a filter from query parameters, as the JSON API and the console take it:
// topic, key (as text) or key_hex, class, status (repeatable, or comma-separated), since and
// until (ParseWhen, relative to now), error, and id (repeatable, or comma-separated). An empty parameter means any, except key=,
// which is the empty key. Bad usage is an ErrUsage error that names the parameter.
func FilterFromQuery(q url.Values, now time.Time) (Filter, error) {
	f := Filter{Topic: q.Get("topic"), Class: q.Get("class"), Status: JoinStatuses(q["status"]), Error: q.Get("error")}
	switch {
	case q.Has("key") && q.Has("key_hex"):
		return f, usage("key and key_hex: give one of them")
	case q.Has("key"):
		f.Key, f.HasKey = []byte(q.Get("key")), true
	case q.Has("key_hex"):
		b, err := hex.DecodeString(q.Get("key_hex"))
		if err != nil {
			return f, usage("key_hex: %v", err)
		}
		f.Key, f.HasKey = b, true
	}
	for name, to := range map[string]*time.Time{"since": &f.Since, "until": &f.Until} {
		if q.Get(name) != "" {
			t, err := ParseWhen(name, q.Get(name), now)
			if err != nil {
				return f, err
			}
			*to = t
		}
	}
	for _, v := range q["id"] {
		ids, err := ParseIDs(v)
		if err != nil {
			return f, usage("id: %v", err)
		}
		f.IDs = append(f.IDs, ids...)
	}
	return f, f.Validate()
}

// Query returns f as the query parameters FilterFromQuery reads back to f: times absolute
// (RFC 3339 with nanoseconds), a key that is not text (a NUL byte or invalid UTF-8) as key_hex.
// The console carries a filter from the list to its confirmation and its task this way, so that
// they act on exactly what the list showed.
func (f Filter) Query() url.Values {
	q := url.Values{}
	for name, v := range map[string]string{"topic": f.Topic, "class": f.Class, "status": f.Status, "error": f.Error} {
		if v != "" {
			q.Set(name, v)
		}
	}
	if f.HasKey {
		if utf8.Valid(f.Key) && !strings.ContainsRune(string(f.Key), 0) {
			q.Set("key", string(f.Key))
		} else {
			q.Set("key_hex", hex.EncodeToString(f.Key))
		}
	}
	for name, t := range map[string]time.Time{"since": f.Since, "until": f.Until} {
		if !t.IsZero() {
			q.Set(name, t.UTC().Format(time.RFC3339Nano))
		}
	}
	for _, id := range f.IDs {
		q.Add("id", strconv.FormatInt(id, 10))
	}
	return q
}

// ParseWhen reads the time of a filter's field (Filter.Since, Filter.Until) called name: an
// RFC 3339 time, or a duration ago ("24h": 24 hours before now). Anything else is an ErrUsage
// error that names the field.
func ParseWhen(name, s string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return now.Add(-d), nil
	}
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	return time.Time{}, usage("%s %q: want an RFC 3339 time (2026-12-01T10:00:00Z) or a duration ago (24h)",
		name, safetext.Truncate(s, 64))
}

// ParseIDs reads a comma-separated list of dead letter ids (positive numbers).
func ParseIDs(s string) ([]int64, error) {
	var ids []int64
	for p := range strings.SplitSeq(s, ",") {
		n, err := strconv.ParseInt(strings.TrimSpace(p), 10, 64)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("%q is not an id", safetext.Truncate(p, 32))
		}
		ids = append(ids, n)
	}
	return ids, nil
}
