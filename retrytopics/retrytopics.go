package retrytopics

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Header names added to dead-lettered records.
const (
	HeaderPrefix            = "kafkapg-"
	HeaderOriginalTopic     = "kafkapg-original-topic"
	HeaderOriginalPartition = "kafkapg-original-partition"
	HeaderOriginalOffset    = "kafkapg-original-offset"
	HeaderOriginalTimestamp = "kafkapg-original-timestamp" // milliseconds since the Unix epoch, as Kafka keeps it
	HeaderGroup             = "kafkapg-group"
	HeaderAttempt           = "kafkapg-attempt" // delivery attempt that failed last (1 = first delivery)
	HeaderTries             = "kafkapg-tries"   // handler invocations during that delivery
	HeaderErrorClass        = "kafkapg-error-class"
	HeaderErrorMessage      = "kafkapg-error-message" // at most MaxErrorMessage bytes
	HeaderFailedAt          = "kafkapg-failed-at"     // RFC 3339 with nanoseconds, UTC
)

// MaxErrorMessage bounds the error message carried in a header, in bytes.
const MaxErrorMessage = 1024

// DLQTopic returns the dead-letter topic for records of topic consumed by group.
func DLQTopic(topic, group string) string { return topic + "." + group + ".dlq" }

// Failure describes why and where a record failed.
type Failure struct {
	Topic     string
	Partition int32
	Offset    int64
	Timestamp time.Time
	Group     string
	Attempt   int
	Tries     int
	Class     string
	Message   string
	FailedAt  time.Time
}

// Headers returns orig (minus any kafkapg- headers) followed by headers describing f.
func Headers(orig []kgo.RecordHeader, f Failure) []kgo.RecordHeader {
	out := make([]kgo.RecordHeader, 0, len(orig)+11)
	for _, h := range orig {
		if !strings.HasPrefix(h.Key, HeaderPrefix) {
			out = append(out, h)
		}
	}
	add := func(k, v string) { out = append(out, kgo.RecordHeader{Key: k, Value: []byte(v)}) }
	add(HeaderOriginalTopic, f.Topic)
	add(HeaderOriginalPartition, strconv.FormatInt(int64(f.Partition), 10))
	add(HeaderOriginalOffset, strconv.FormatInt(f.Offset, 10))
	add(HeaderOriginalTimestamp, strconv.FormatInt(f.Timestamp.UnixMilli(), 10))
	add(HeaderGroup, f.Group)
	add(HeaderAttempt, strconv.Itoa(f.Attempt))
	add(HeaderTries, strconv.Itoa(f.Tries))
	add(HeaderErrorClass, f.Class)
	add(HeaderErrorMessage, Truncate(f.Message, MaxErrorMessage))
	add(HeaderFailedAt, f.FailedAt.UTC().Format(time.RFC3339Nano))
	return out
}

// ParseFailure reads the kafkapg- headers back. It reports an error naming the first header that
// is missing or malformed.
func ParseFailure(headers []kgo.RecordHeader) (Failure, error) {
	get := map[string]string{}
	for _, h := range headers {
		if strings.HasPrefix(h.Key, HeaderPrefix) {
			get[h.Key] = string(h.Value)
		}
	}
	var f Failure
	var errs []error
	str := func(k string) string {
		v, ok := get[k]
		if !ok {
			errs = append(errs, fmt.Errorf("header %s is missing", k))
		}
		return v
	}
	num := func(k string, bits int) int64 {
		s, ok := get[k]
		if !ok {
			errs = append(errs, fmt.Errorf("header %s is missing", k))
			return 0
		}
		n, err := strconv.ParseInt(s, 10, bits)
		if err != nil {
			errs = append(errs, fmt.Errorf("header %s: %q is not an integer", k, s))
		}
		return n
	}
	when := func(k string) time.Time {
		s, ok := get[k]
		if !ok {
			errs = append(errs, fmt.Errorf("header %s is missing", k))
			return time.Time{}
		}
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			errs = append(errs, fmt.Errorf("header %s: %q is not an RFC 3339 time", k, s))
		}
		return t
	}
	f.Topic = str(HeaderOriginalTopic)
	f.Partition = int32(num(HeaderOriginalPartition, 32))
	f.Offset = num(HeaderOriginalOffset, 64)
	f.Timestamp = time.UnixMilli(num(HeaderOriginalTimestamp, 64)).UTC()
	f.Group = str(HeaderGroup)
	f.Attempt = int(num(HeaderAttempt, 32))
	f.Tries = int(num(HeaderTries, 32))
	f.Class = str(HeaderErrorClass)
	f.Message = str(HeaderErrorMessage)
	f.FailedAt = when(HeaderFailedAt)
	if len(errs) > 0 {
		return f, errors.Join(errs...)
	}
	return f, nil
}

// Truncate shortens s to at most n bytes without splitting a UTF-8 sequence, marking the cut with
// "…" (which counts towards n) when there is room for it.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "…"
	if n < len(mark) {
		return cutAt(s, max(n, 0))
	}
	return cutAt(s, n-len(mark)) + mark
}

// cutAt returns the longest prefix of s of at most n bytes that ends on a rune boundary.
func cutAt(s string, n int) string {
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// EnsureDLQTopics creates the dead-letter topic of every source topic that lacks one, with the
// source topic's partition count and the broker's default replication factor. A source topic
// that does not exist yet is reported in missing and skipped; retry later.
func EnsureDLQTopics(ctx context.Context, adm *kadm.Client, group string, sources []string) (created, missing []string, err error) {
	want := map[string]string{} // dlq -> source
	for _, s := range sources {
		want[DLQTopic(s, group)] = s
	}
	all := append(slices.Clone(sources), slices.Collect(maps.Keys(want))...)
	details, err := adm.ListTopics(ctx, all...)
	if err != nil {
		return nil, nil, fmt.Errorf("list topics: %w", err)
	}
	for dlq, src := range want {
		if d, ok := details[dlq]; ok && d.Err == nil {
			continue
		}
		sd, ok := details[src]
		if !ok || sd.Err != nil || len(sd.Partitions) == 0 {
			missing = append(missing, src)
			continue
		}
		resp, err := adm.CreateTopic(ctx, int32(len(sd.Partitions)), -1, nil, dlq)
		if err == nil {
			err = resp.Err
		}
		if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return created, missing, fmt.Errorf("create dead-letter topic %s: %w", dlq, err)
		}
		if err == nil {
			created = append(created, dlq)
		}
	}
	return created, missing, nil
}
