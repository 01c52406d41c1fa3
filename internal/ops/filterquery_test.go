package ops_test

import (
	"errors"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/kafkapg/kafkapg/internal/ops"
)

func TestFilterFromQuery(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		query string
		want  ops.Filter
	}{
		{"", ops.Filter{}},
		{"topic=orders&class=permanent&status=new&error=poison", ops.Filter{Topic: "orders", Class: "permanent", Status: "new", Error: "poison"}},
		{"key=acct-1", ops.Filter{Key: []byte("acct-1"), HasKey: true}},
		{"key=", ops.Filter{Key: []byte{}, HasKey: true}},
		{"key_hex=00ff41", ops.Filter{Key: []byte{0, 0xff, 'A'}, HasKey: true}},
		{"since=24h&until=2026-12-01T11:30:00Z", ops.Filter{Since: now.Add(-24 * time.Hour), Until: now.Add(-30 * time.Minute)}},
		{"since=&until=", ops.Filter{}},
		{"id=3,4&id=7", ops.Filter{IDs: []int64{3, 4, 7}}},
		{"status=new,+replaying&status=discarded&status=new", ops.Filter{Status: "new,replaying,discarded"}},
	} {
		q, err := url.ParseQuery(c.query)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ops.FilterFromQuery(q, now)
		if err != nil {
			t.Errorf("%q: %v", c.query, err)
			continue
		}
		if !got.Since.Equal(c.want.Since) || !got.Until.Equal(c.want.Until) {
			t.Errorf("%q: since %v until %v, want %v and %v", c.query, got.Since, got.Until, c.want.Since, c.want.Until)
		}
		got.Since, got.Until, c.want.Since, c.want.Until = time.Time{}, time.Time{}, time.Time{}, time.Time{}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%q: %+v, want %+v", c.query, got, c.want)
		}
	}
}

func TestFilterFromQueryRefuses(t *testing.T) {
	long := strings.Repeat("x", 100_000)
	for query, want := range map[string]string{
		"key=a&key_hex=61":               "key and key_hex: give one of them",
		"key_hex=zz":                     "key_hex: encoding/hex: invalid byte",
		"since=yesterday":                `since "yesterday": want an RFC 3339 time`,
		"until=-1h":                      `until "-1h": want`,
		"since=1h&until=2h":              "must be before until",
		"id=3,x":                         `id: "x" is not an id`,
		"id=0":                           `id: "0" is not an id`,
		"status=gone":                    `status "gone"`,
		"status=new,gone":                `status "gone"`,
		"error=a%00b":                    "error: not valid text",
		"topic=%ff%fe":                   "topic: not valid text",
		"since=%00%ff" + long:            `since "\x00\xff`,
		"id=" + long:                     `id: "xxxx`,
		"until=2026-12-01+10:00:00+0000": `until "2026-12-01 10:00:00 0000"`,
	} {
		q, err := url.ParseQuery(query)
		if err != nil {
			t.Fatal(err)
		}
		_, err = ops.FilterFromQuery(q, time.Now())
		if !errors.Is(err, ops.ErrUsage) || !strings.Contains(err.Error(), want) {
			t.Errorf("%.40q: %v, want a usage error saying %q", query, err, want)
		}
		if err != nil && len(err.Error()) > 300 {
			t.Errorf("%.40q: an error of %d bytes: the bad value must be cut short", query, len(err.Error()))
		}
	}
}

// TestFilterQueryRoundTrip: what the console carries from the list to the confirmation and the
// task (Filter.Query) is text a form can carry, and reads back as the same filter, binary keys and
// nanoseconds included.
func TestFilterQueryRoundTrip(t *testing.T) {
	at := time.Date(2026, 12, 1, 10, 11, 12, 123456789, time.UTC)
	for _, f := range []ops.Filter{
		{},
		{Topic: "orders", Class: "retryable", Status: "new", Error: "100% é"},
		{Key: []byte("acct-7"), HasKey: true},
		{Key: []byte{}, HasKey: true},
		{Key: []byte{'a', 0, 'b'}, HasKey: true},
		{Key: []byte{0xff, 0xfe}, HasKey: true},
		{Since: at, Until: at.Add(time.Hour)},
		{IDs: []int64{9, 2, 5}},
	} {
		// A browser's form carries text: each value must be valid UTF-8 without a NUL.
		for name, vs := range f.Query() {
			for _, v := range vs {
				if !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
					t.Errorf("%+v: %s=%q is not text a form can carry", f, name, v)
				}
			}
		}
		got, err := ops.FilterFromQuery(f.Query(), time.Now())
		if err != nil {
			t.Errorf("%+v: %v", f, err)
			continue
		}
		if !got.Since.Equal(f.Since) || !got.Until.Equal(f.Until) {
			t.Errorf("%+v: times read back as %v and %v", f, got.Since, got.Until)
		}
		got.Since, got.Until, f.Since, f.Until = time.Time{}, time.Time{}, time.Time{}, time.Time{}
		if f.HasKey && len(f.Key) == 0 {
			f.Key = []byte{} // the empty key reads back as an empty slice
		}
		if !reflect.DeepEqual(got, f) {
			t.Errorf("%+v read back as %+v (query %s)", f, got, f.Query().Encode())
		}
	}
}

func TestErrorText(t *testing.T) {
	for _, tc := range []struct{ class, msg, want string }{
		{"permanent", "permanent: invalid JSON", "permanent: invalid JSON"},
		{"retryable", "connection\nreset", "retryable: connection reset"},
		{"permanent", "permanently broken", "permanent: permanently broken"},
		{"", "no class", "no class"},
	} {
		if got := ops.ErrorText(tc.class, tc.msg); got != tc.want {
			t.Errorf("ErrorText(%q, %q) = %q, want %q", tc.class, tc.msg, got, tc.want)
		}
	}
}
