package retrytopics_test

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// failureHeaders lists the headers Headers writes, in the order it writes them.
var failureHeaders = []string{
	retrytopics.HeaderOriginalTopic,
	retrytopics.HeaderOriginalPartition,
	retrytopics.HeaderOriginalOffset,
	retrytopics.HeaderOriginalTimestamp,
	retrytopics.HeaderGroup,
	retrytopics.HeaderAttempt,
	retrytopics.HeaderTries,
	retrytopics.HeaderErrorClass,
	retrytopics.HeaderErrorMessage,
	retrytopics.HeaderFailedAt,
	retrytopics.HeaderFirstFailedAt,
	retrytopics.HeaderDueAt, // only when DueAt is set
}

// wantHeaders returns the kafkapg- headers Headers writes for f, in order.
func wantHeaders(f retrytopics.Failure) []string {
	if f.DueAt.IsZero() {
		return failureHeaders[:len(failureHeaders)-1]
	}
	return failureHeaders
}

func sampleFailure() retrytopics.Failure {
	return retrytopics.Failure{
		Topic:     "orders",
		Partition: 3,
		Offset:    1200,
		Timestamp: time.Date(2025, 3, 4, 5, 6, 7, 123456789, time.UTC),
		Group:     "billing",
		Attempt:   2,
		Tries:     3,
		Class:     "permanent",
		Message:   "ledger event e-1 has no account",
		FailedAt:  time.Date(2025, 3, 4, 5, 6, 8, 987654321, time.UTC),
		// A record that failed first at attempt 1 and is due again 10s after its last failure.
		FirstFailedAt: time.Date(2025, 3, 4, 5, 6, 1, 5, time.UTC),
		DueAt:         time.Date(2025, 3, 4, 5, 6, 18, 987654321, time.UTC),
	}
}

// normalized is what a Failure reads back as: times in UTC, the record timestamp in Kafka's
// millisecond precision, the message bounded.
func normalized(f retrytopics.Failure) retrytopics.Failure {
	f.Timestamp = time.UnixMilli(f.Timestamp.UnixMilli()).UTC()
	f.FailedAt = f.FailedAt.UTC()
	f.FirstFailedAt = f.FirstFailedAt.UTC()
	f.DueAt = f.DueAt.UTC()
	f.Message = safetext.Text(f.Message, retrytopics.MaxErrorMessage)
	return f
}

func hdr(k, v string) kgo.RecordHeader { return kgo.RecordHeader{Key: k, Value: []byte(v)} }

func TestHeadersRoundTrip(t *testing.T) {
	t.Parallel()
	plus2 := time.FixedZone("UTC+2", 2*60*60)
	minus5 := time.FixedZone("UTC-5", -5*60*60)
	tests := []struct {
		name     string
		orig     []kgo.RecordHeader
		failure  retrytopics.Failure
		wantKept []kgo.RecordHeader // orig headers expected first, in order
	}{
		{
			name:    "no original headers",
			failure: sampleFailure(),
		},
		{
			name:     "original headers kept first in order",
			orig:     []kgo.RecordHeader{hdr("trace-id", "abc"), hdr("content-type", "json"), hdr("trace-id", "dup")},
			failure:  sampleFailure(),
			wantKept: []kgo.RecordHeader{hdr("trace-id", "abc"), hdr("content-type", "json"), hdr("trace-id", "dup")},
		},
		{
			name: "pre-existing kafkapg headers replaced, not duplicated",
			orig: []kgo.RecordHeader{
				hdr("a", "1"),
				hdr(retrytopics.HeaderGroup, "old-group"),
				hdr(retrytopics.HeaderAttempt, "9"),
				hdr(retrytopics.HeaderPrefix+"custom", "stale"),
				hdr("b", "2"),
				hdr(retrytopics.HeaderErrorMessage, "old message"),
			},
			failure:  sampleFailure(),
			wantKept: []kgo.RecordHeader{hdr("a", "1"), hdr("b", "2")},
		},
		{
			name: "non-UTC times with nanoseconds",
			failure: func() retrytopics.Failure {
				f := sampleFailure()
				f.Timestamp = time.Date(2024, 12, 31, 23, 59, 59, 1, plus2)
				f.FailedAt = time.Date(2025, 1, 1, 0, 0, 0, 999999999, minus5)
				return f
			}(),
		},
		{
			name: "times with a monotonic clock reading",
			failure: func() retrytopics.Failure {
				f := sampleFailure()
				f.Timestamp = time.Now()
				f.FailedAt = time.Now().Add(time.Second)
				return f
			}(),
		},
		{
			// Producers set record timestamps (int64 ms) freely; one past 9999-12-31 must still
			// give headers that ParseFailure reads.
			name: "record timestamp after year 9999",
			failure: func() retrytopics.Failure {
				f := sampleFailure()
				f.Timestamp = time.UnixMilli(253402300800000) // 10000-01-01T00:00:00Z
				return f
			}(),
		},
		{
			name:    "zero failure",
			failure: retrytopics.Failure{},
		},
		{
			name: "extreme numbers",
			failure: func() retrytopics.Failure {
				f := sampleFailure()
				f.Partition = math.MaxInt32
				f.Offset = math.MinInt64
				f.Attempt = math.MaxInt32
				f.Tries = -1
				return f
			}(),
		},
		{
			name: "multibyte and separator characters in strings",
			failure: func() retrytopics.Failure {
				f := sampleFailure()
				f.Topic = "tópico.ü"
				f.Group = "grupo=1,2;3"
				f.Message = "échec: 日本語\nsecond line"
				return f
			}(),
		},
		{
			name: "long message is truncated",
			failure: func() retrytopics.Failure {
				f := sampleFailure()
				f.Message = strings.Repeat("é", retrytopics.MaxErrorMessage)
				return f
			}(),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := retrytopics.Headers(tt.orig, tt.failure)

			added := wantHeaders(tt.failure)
			if len(got) != len(tt.wantKept)+len(added) {
				t.Fatalf("got %d headers, want %d kept + %d added: %v", len(got), len(tt.wantKept), len(added), got)
			}
			for i, want := range tt.wantKept {
				if got[i].Key != want.Key || string(got[i].Value) != string(want.Value) {
					t.Errorf("header %d = %s=%q, want %s=%q", i, got[i].Key, got[i].Value, want.Key, want.Value)
				}
			}
			for i, key := range added {
				if h := got[len(tt.wantKept)+i]; h.Key != key {
					t.Errorf("header %d is %q, want %q", len(tt.wantKept)+i, h.Key, key)
				}
			}
			counts := map[string]int{}
			for _, h := range got {
				counts[h.Key]++
			}
			for k, n := range counts {
				if strings.HasPrefix(k, retrytopics.HeaderPrefix) && n != 1 {
					t.Errorf("header %s appears %d times, want once", k, n)
				}
			}
			if counts[retrytopics.HeaderPrefix+"custom"] != 0 {
				t.Errorf("stale header %scustom was kept", retrytopics.HeaderPrefix)
			}

			back, err := retrytopics.ParseFailure(got)
			if err != nil {
				t.Fatalf("ParseFailure: %v", err)
			}
			if want := normalized(tt.failure); back != want {
				t.Errorf("round trip:\n got %+v\nwant %+v", back, want)
			}
			if back.Timestamp.Location() != time.UTC || back.FailedAt.Location() != time.UTC {
				t.Errorf("times read back in %v and %v, want UTC", back.Timestamp.Location(), back.FailedAt.Location())
			}
			if back.Timestamp.UnixMilli() != tt.failure.Timestamp.UnixMilli() || !back.FailedAt.Equal(tt.failure.FailedAt) {
				t.Errorf("times lost precision: got %v, %v; want %v, %v",
					back.Timestamp, back.FailedAt, tt.failure.Timestamp, tt.failure.FailedAt)
			}
			if len(back.Message) > retrytopics.MaxErrorMessage {
				t.Errorf("message header is %d bytes, want at most %d", len(back.Message), retrytopics.MaxErrorMessage)
			}
		})
	}
}

func TestHeadersDoesNotModifyOrig(t *testing.T) {
	t.Parallel()
	orig := []kgo.RecordHeader{hdr("a", "1"), hdr(retrytopics.HeaderGroup, "old"), hdr("b", "2")}
	retrytopics.Headers(orig[:3:3], sampleFailure())
	if len(orig) != 3 || orig[0].Key != "a" || orig[1].Key != retrytopics.HeaderGroup || string(orig[1].Value) != "old" || orig[2].Key != "b" {
		t.Fatalf("Headers modified its input: %v", orig)
	}
}

// TestHeadersValues pins the wire format, which operators and replay tools read.
func TestHeadersValues(t *testing.T) {
	t.Parallel()
	got := map[string]string{}
	for _, h := range retrytopics.Headers(nil, sampleFailure()) {
		got[h.Key] = string(h.Value)
	}
	want := map[string]string{
		retrytopics.HeaderOriginalTopic:     "orders",
		retrytopics.HeaderOriginalPartition: "3",
		retrytopics.HeaderOriginalOffset:    "1200",
		retrytopics.HeaderOriginalTimestamp: "1741064767123",
		retrytopics.HeaderGroup:             "billing",
		retrytopics.HeaderAttempt:           "2",
		retrytopics.HeaderTries:             "3",
		retrytopics.HeaderErrorClass:        "permanent",
		retrytopics.HeaderErrorMessage:      "ledger event e-1 has no account",
		retrytopics.HeaderFailedAt:          "2025-03-04T05:06:08.987654321Z",
		retrytopics.HeaderFirstFailedAt:     "2025-03-04T05:06:01.000000005Z",
		retrytopics.HeaderDueAt:             "2025-03-04T05:06:18.987654321Z",
	}
	if len(got) != len(want) {
		t.Errorf("got %d distinct headers, want %d: %v", len(got), len(want), got)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
}

func TestParseTiers(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in      string
		want    []time.Duration
		wantErr string
	}{
		{in: "1s,10s,1m", want: []time.Duration{time.Second, 10 * time.Second, time.Minute}},
		{in: " 200ms , 500ms,1s ", want: []time.Duration{200 * time.Millisecond, 500 * time.Millisecond, time.Second}},
		{in: "", want: []time.Duration{}},
		{in: "  ", want: []time.Duration{}},
		{in: "1s,,2s", wantErr: `tier 2: "" is not a duration`},
		{in: "1s,ten", wantErr: `tier 2: "ten" is not a duration`},
		{in: "0s", wantErr: "tier 1: delay 0s must be positive"},
		{in: "-1s", wantErr: "tier 1: delay -1s must be positive"},
		{in: strings.Repeat("1s,", retrytopics.MaxTiers) + "1s", wantErr: "at most 20"},
	}
	for _, tt := range tests {
		got, err := retrytopics.ParseTiers(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("ParseTiers(%q) error = %v, want one containing %q", tt.in, err, tt.wantErr)
			}
			continue
		}
		if err != nil || got == nil || !slices.Equal(got, tt.want) {
			t.Errorf("ParseTiers(%q) = %v, %v; want %v (non-nil)", tt.in, got, err, tt.want)
		}
	}
}

func TestDueAt(t *testing.T) {
	t.Parallel()
	failed := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, u := range []float64{0, 0.5, 0.999999} {
		due := retrytopics.DueAt(failed, 10*time.Second, u)
		if due.Before(failed.Add(10*time.Second)) || !due.Before(failed.Add(11*time.Second)) {
			t.Errorf("DueAt(u=%v) = %v, want in [+10s, +11s)", u, due.Sub(failed))
		}
	}
}

// validHeaders returns the headers of sampleFailure with edit applied to the value of key; a nil
// edit result removes the header.
func validHeaders(key string, value *string) []kgo.RecordHeader {
	var out []kgo.RecordHeader
	for _, h := range retrytopics.Headers(nil, sampleFailure()) {
		if h.Key == key {
			if value == nil {
				continue
			}
			h.Value = []byte(*value)
		}
		out = append(out, h)
	}
	return out
}

func ptr(s string) *string { return &s }

func TestParseFailureErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		headers []kgo.RecordHeader
		// wantFirst must be in the first line of the error: the first header at fault.
		wantFirst []string
		// wantNot must appear nowhere in the error.
		wantNot []string
	}{
		{
			name:      "no headers at all",
			headers:   nil,
			wantFirst: []string{retrytopics.HeaderOriginalTopic, "missing"},
		},
		{
			name:      "only foreign headers",
			headers:   []kgo.RecordHeader{hdr("trace-id", "x"), hdr("KAFKAPG-ORIGINAL-TOPIC", "orders")},
			wantFirst: []string{retrytopics.HeaderOriginalTopic, "missing"},
		},
		{
			name:      "attempt missing",
			headers:   validHeaders(retrytopics.HeaderAttempt, nil),
			wantFirst: []string{retrytopics.HeaderAttempt, "missing"},
			wantNot:   []string{retrytopics.HeaderTries, retrytopics.HeaderGroup, retrytopics.HeaderOriginalTopic},
		},
		{
			name:      "failed-at missing",
			headers:   validHeaders(retrytopics.HeaderFailedAt, nil),
			wantFirst: []string{retrytopics.HeaderFailedAt, "missing"},
		},
		{
			name:      "error message missing",
			headers:   validHeaders(retrytopics.HeaderErrorMessage, nil),
			wantFirst: []string{retrytopics.HeaderErrorMessage, "missing"},
		},
		{
			name:      "partition not a number",
			headers:   validHeaders(retrytopics.HeaderOriginalPartition, ptr("three")),
			wantFirst: []string{retrytopics.HeaderOriginalPartition, `"three"`},
			wantNot:   []string{"missing"},
		},
		{
			name:      "partition overflows int32",
			headers:   validHeaders(retrytopics.HeaderOriginalPartition, ptr("2147483648")),
			wantFirst: []string{retrytopics.HeaderOriginalPartition, "2147483648"},
		},
		{
			name:      "offset is fractional",
			headers:   validHeaders(retrytopics.HeaderOriginalOffset, ptr("1.5")),
			wantFirst: []string{retrytopics.HeaderOriginalOffset, "1.5"},
		},
		{
			name:      "tries garbled",
			headers:   validHeaders(retrytopics.HeaderTries, ptr("3x")),
			wantFirst: []string{retrytopics.HeaderTries, "3x"},
		},
		{
			name:      "timestamp not an integer",
			headers:   validHeaders(retrytopics.HeaderOriginalTimestamp, ptr("yesterday")),
			wantFirst: []string{retrytopics.HeaderOriginalTimestamp, "yesterday"},
		},
		{
			name:      "failed-at as unix millis",
			headers:   validHeaders(retrytopics.HeaderFailedAt, ptr("1741064768000")),
			wantFirst: []string{retrytopics.HeaderFailedAt, "1741064768000"},
		},
		{
			name: "two problems: the first one is named first",
			headers: func() []kgo.RecordHeader {
				h := validHeaders(retrytopics.HeaderGroup, nil)
				for i := range h {
					if h[i].Key == retrytopics.HeaderOriginalOffset {
						h[i].Value = []byte("-")
					}
				}
				return h
			}(),
			wantFirst: []string{retrytopics.HeaderOriginalOffset},
		},
		// The doc promises an error for a malformed header; an empty value is not a number.
		{
			name:      "attempt present but empty",
			headers:   validHeaders(retrytopics.HeaderAttempt, ptr("")),
			wantFirst: []string{retrytopics.HeaderAttempt},
		},
		{
			name:      "failed-at present but empty",
			headers:   validHeaders(retrytopics.HeaderFailedAt, ptr("")),
			wantFirst: []string{retrytopics.HeaderFailedAt},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := retrytopics.ParseFailure(tt.headers)
			if err == nil {
				t.Fatal("ParseFailure returned no error")
			}
			first, _, _ := strings.Cut(err.Error(), "\n")
			for _, s := range tt.wantFirst {
				if !strings.Contains(first, s) {
					t.Errorf("first error %q does not mention %q (whole error: %q)", first, s, err)
				}
			}
			for _, s := range tt.wantNot {
				if strings.Contains(err.Error(), s) {
					t.Errorf("error %q mentions %q", err, s)
				}
			}
		})
	}
}

func TestParseFailureLastDuplicateWins(t *testing.T) {
	t.Parallel()
	h := retrytopics.Headers(nil, sampleFailure())
	h = append(h, hdr(retrytopics.HeaderGroup, "later"))
	f, err := retrytopics.ParseFailure(h)
	if err != nil {
		t.Fatal(err)
	}
	if f.Group != "later" {
		t.Fatalf("Group = %q, want the last header's value %q", f.Group, "later")
	}
}

// TestTruncateProperties checks Truncate's contract for every n on a set of valid UTF-8 strings:
// at most n bytes, valid UTF-8, unchanged when it fits, otherwise a prefix of s plus the marker.
// TestTruncateSmallerThanMarker: Truncate promises at most n bytes even when the marker itself
// does not fit.
func TestDLQTopic(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, topic, group, want string
	}{
		{name: "simple", topic: "orders", group: "billing", want: "orders.billing.dlq"},
		{name: "dotted names", topic: "shop.orders", group: "svc.billing-v2", want: "shop.orders.svc.billing-v2.dlq"},
		{name: "underscores", topic: "ledger_events", group: "ledger_writer", want: "ledger_events.ledger_writer.dlq"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := retrytopics.DLQTopic(tt.topic, tt.group); got != tt.want {
				t.Errorf("DLQTopic(%q, %q) = %q, want %q", tt.topic, tt.group, got, tt.want)
			}
		})
	}
}

func ExampleDLQTopic() {
	fmt.Println(retrytopics.DLQTopic("payments", "ledger-writer"))
	// Output: payments.ledger-writer.dlq
}

func ExampleParseFailure() {
	orig := []kgo.RecordHeader{{Key: "trace-id", Value: []byte("4bf92f35")}}
	headers := retrytopics.Headers(orig, retrytopics.Failure{
		Topic:     "payments",
		Partition: 2,
		Offset:    41,
		Timestamp: time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC),
		Group:     "ledger-writer",
		Attempt:   1,
		Tries:     3,
		Class:     "permanent",
		Message:   "ledger event e-41 has no account",
		FailedAt:  time.Date(2025, 6, 1, 12, 0, 1, 500, time.UTC),
	})
	f, err := retrytopics.ParseFailure(headers)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%s[%d]@%d failed after %d tries: %s\n", f.Topic, f.Partition, f.Offset, f.Tries, f.Message)
	fmt.Println(headers[0].Key, f.FailedAt.Format(time.RFC3339Nano))
	// Output:
	// payments[2]@41 failed after 3 tries: ledger event e-41 has no account
	// trace-id 2025-06-01T12:00:01.0000005Z
}

// FuzzParseFailure feeds ParseFailure arbitrary headers. The input is lines of key=value; a key
// that is a single digit stands for the digit-th kafkapg- header, so that the fuzzer reaches the
// value parsers. ParseFailure must not panic, and whatever it accepts must survive a round trip
// through Headers.
func FuzzParseFailure(f *testing.F) {
	var valid strings.Builder
	for i, h := range retrytopics.Headers(nil, sampleFailure()) {
		fmt.Fprintf(&valid, "%d=%s\n", i, h.Value)
	}
	f.Add(valid.String())
	var zero strings.Builder
	for i, h := range retrytopics.Headers([]kgo.RecordHeader{hdr("x", "y")}, retrytopics.Failure{}) {
		if i > 0 {
			fmt.Fprintf(&zero, "%d=%s\n", i-1, h.Value)
		}
	}
	f.Add(zero.String())
	f.Add("")
	f.Add("kafkapg-original-topic=t\n0=\n1=-0\n2=+7\n3=2025-01-01T00:00:00+14:00\n4=g\n5=0\n6=0\n7=\n8=\n9=2025-01-01T00:00:00,5Z")
	f.Add("1=99999999999\n3=not a time\n=\nkafkapg-=x")
	// Accepted, but in UTC it is year 10000, which Headers writes and ParseFailure rejects.
	f.Add("0=t\n1=0\n2=0\n3=9999-12-31T23:59:59-23:59\n4=g\n5=1\n6=1\n7=c\n8=m\n9=2025-01-01T00:00:00Z")

	f.Fuzz(func(t *testing.T, input string) {
		var headers []kgo.RecordHeader
		for line := range strings.SplitSeq(input, "\n") {
			k, v, _ := strings.Cut(line, "=")
			if len(k) == 1 && k[0] >= '0' && k[0] <= '9' {
				k = failureHeaders[k[0]-'0']
			}
			headers = append(headers, hdr(k, v))
		}
		got, err := retrytopics.ParseFailure(headers)
		if err != nil {
			if err.Error() == "" || !strings.Contains(err.Error(), retrytopics.HeaderPrefix) {
				t.Fatalf("error %q names no header", err)
			}
			return
		}
		back, err := retrytopics.ParseFailure(retrytopics.Headers(nil, got))
		if err != nil {
			t.Fatalf("ParseFailure accepted %+v, but not Headers of it: %v", got, err)
		}
		if want := normalized(got); back != want {
			t.Fatalf("round trip:\n got %+v\nwant %+v", back, want)
		}
	})
}

// TestParseFailureWithoutFirstFailedAt: records written before kafkapg-first-failed-at existed
// still parse; their first failure is their only known one.
func TestParseFailureWithoutFirstFailedAt(t *testing.T) {
	t.Parallel()
	f, err := retrytopics.ParseFailure(validHeaders(retrytopics.HeaderFirstFailedAt, nil))
	if err != nil {
		t.Fatalf("ParseFailure: %v", err)
	}
	if !f.FirstFailedAt.Equal(f.FailedAt) || f.FailedAt.IsZero() {
		t.Errorf("FirstFailedAt = %v, want FailedAt %v", f.FirstFailedAt, f.FailedAt)
	}
}

// FuzzText: whatever bytes an error message carries, Text makes text Postgres's text type and a
// Kafka header reader take: valid UTF-8, no NUL, at most n bytes; text that was fine is unchanged.
