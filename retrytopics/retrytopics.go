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

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/internal/safetext"
)

// Header names added to records sent to a retry tier or to the dead-letter topic.
const (
	HeaderPrefix            = "kafkapg-"
	HeaderOriginalTopic     = "kafkapg-original-topic"
	HeaderOriginalPartition = "kafkapg-original-partition"
	HeaderOriginalOffset    = "kafkapg-original-offset"
	HeaderOriginalTimestamp = "kafkapg-original-timestamp" // milliseconds since the Unix epoch, as Kafka keeps it
	HeaderGroup             = "kafkapg-group"
	HeaderAttempt           = "kafkapg-attempt" // delivery attempts made so far (1 = the first delivery failed)
	HeaderTries             = "kafkapg-tries"   // handler invocations during the last delivery
	HeaderErrorClass        = "kafkapg-error-class"
	HeaderErrorMessage      = "kafkapg-error-message"   // at most MaxErrorMessage bytes
	HeaderFailedAt          = "kafkapg-failed-at"       // last failure; RFC 3339 with nanoseconds, UTC
	HeaderFirstFailedAt     = "kafkapg-first-failed-at" // first failure; RFC 3339 with nanoseconds, UTC
	HeaderDueAt             = "kafkapg-due-at"          // retry records only: not handled before; RFC 3339, UTC
	HeaderValueOmitted      = "kafkapg-value-omitted"   // dead letters of records too large to handle: the size of the value left out
)

// MaxErrorMessage bounds the error message carried in a header, in bytes.
const MaxErrorMessage = 1024

// DLQTopic returns the dead-letter topic for records of topic consumed by group.
func DLQTopic(topic, group string) string { return topic + "." + group + ".dlq" }

// TierTopic returns the topic of retry tier n (1-based) for records of topic consumed by group.
func TierTopic(topic, group string, n int) string {
	return topic + "." + group + ".retry." + strconv.Itoa(n)
}

// MaxTiers bounds the number of retry tiers.
const MaxTiers = 20

// ParseTiers parses a comma-separated list of tier delays such as "1s,10s,1m". An empty or
// all-blank string means no tiers. Every delay must be a positive Go duration.
func ParseTiers(s string) ([]time.Duration, error) {
	if strings.TrimSpace(s) == "" {
		return []time.Duration{}, nil
	}
	parts := strings.Split(s, ",")
	if len(parts) > MaxTiers {
		return nil, fmt.Errorf("%d retry tiers; at most %d are allowed", len(parts), MaxTiers)
	}
	tiers := make([]time.Duration, 0, len(parts))
	for i, p := range parts {
		p = strings.TrimSpace(p)
		d, err := time.ParseDuration(p)
		if err != nil {
			return nil, fmt.Errorf("tier %d: %q is not a duration like 10s or 1m", i+1, p)
		}
		if d <= 0 {
			return nil, fmt.Errorf("tier %d: delay %v must be positive", i+1, d)
		}
		tiers = append(tiers, d)
	}
	return tiers, nil
}

// jitterFraction is the most that DueAt adds to a tier's delay, as a fraction of it.
const jitterFraction = 0.1

// DueAt returns when a record that failed at failedAt may be tried again from a tier with the given
// delay: failedAt + delay + jitter, where jitter is u × jitterFraction × delay and u is in [0, 1)
// (pass a random number). The jitter spreads the retries of records that failed together; it never
// makes a record due earlier than its tier's delay.
func DueAt(failedAt time.Time, delay time.Duration, u float64) time.Time {
	return failedAt.Add(delay + time.Duration(u*jitterFraction*float64(delay)))
}

// Failure describes why and where a record failed. Topic, Partition, Offset and Timestamp are
// the record's coordinates in its source topic, whichever tier it failed in.
type Failure struct {
	Topic         string
	Partition     int32
	Offset        int64
	Timestamp     time.Time
	Group         string
	Attempt       int // delivery attempts made so far
	Tries         int // handler invocations during the last one
	Class         string
	Message       string
	FailedAt      time.Time
	FirstFailedAt time.Time
	DueAt         time.Time // zero for a dead letter
}

// StripHeaders returns headers without the kafkapg- ones: the record's own headers.
func StripHeaders(headers []kgo.RecordHeader) []kgo.RecordHeader {
	out := make([]kgo.RecordHeader, 0, len(headers))
	for _, h := range headers {
		if !strings.HasPrefix(h.Key, HeaderPrefix) {
			out = append(out, h)
		}
	}
	return out
}

// Headers returns orig (minus any kafkapg- headers) followed by headers describing f.
func Headers(orig []kgo.RecordHeader, f Failure) []kgo.RecordHeader {
	out := append(make([]kgo.RecordHeader, 0, len(orig)+13), StripHeaders(orig)...)
	add := func(k, v string) { out = append(out, kgo.RecordHeader{Key: k, Value: []byte(v)}) }
	add(HeaderOriginalTopic, f.Topic)
	add(HeaderOriginalPartition, strconv.FormatInt(int64(f.Partition), 10))
	add(HeaderOriginalOffset, strconv.FormatInt(f.Offset, 10))
	add(HeaderOriginalTimestamp, strconv.FormatInt(f.Timestamp.UnixMilli(), 10))
	add(HeaderGroup, f.Group)
	add(HeaderAttempt, strconv.Itoa(f.Attempt))
	add(HeaderTries, strconv.Itoa(f.Tries))
	add(HeaderErrorClass, f.Class)
	add(HeaderErrorMessage, safetext.Text(f.Message, MaxErrorMessage))
	add(HeaderFailedAt, f.FailedAt.UTC().Format(time.RFC3339Nano))
	add(HeaderFirstFailedAt, f.FirstFailedAt.UTC().Format(time.RFC3339Nano))
	if !f.DueAt.IsZero() {
		add(HeaderDueAt, f.DueAt.UTC().Format(time.RFC3339Nano))
	}
	return out
}

// ParseFailure reads the kafkapg- headers back. It reports an error naming every header that is
// missing or malformed. HeaderDueAt is optional (dead letters have none).
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
			errs = append(errs, fmt.Errorf("header %s: %q is not an integer", k, safetext.Text(s, 64)))
		}
		return n
	}
	when := func(k string, optional bool) time.Time {
		s, ok := get[k]
		if !ok {
			if !optional {
				errs = append(errs, fmt.Errorf("header %s is missing", k))
			}
			return time.Time{}
		}
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			errs = append(errs, fmt.Errorf("header %s: %q is not an RFC 3339 time", k, safetext.Text(s, 64)))
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
	f.FailedAt = when(HeaderFailedAt, false)
	f.FirstFailedAt = when(HeaderFirstFailedAt, true) // absent from records of older releases
	if f.FirstFailedAt.IsZero() {
		f.FirstFailedAt = f.FailedAt
	}
	f.DueAt = when(HeaderDueAt, true)
	if len(errs) > 0 {
		return f, errors.Join(errs...)
	}
	return f, nil
}

// topicAbsent reports whether metadata says a topic does not exist. Any other error (a leader
// election, missing authorization) is returned: the topic may well exist, so it must be neither
// reported missing nor created.
func topicAbsent(d kadm.TopicDetail, ok bool) (bool, error) {
	switch {
	case !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition):
		return true, nil
	case d.Err != nil:
		return false, fmt.Errorf("topic %s: %w", d.Topic, d.Err)
	}
	return false, nil
}

// targets returns the topics that records of source consumed by group can be sent to: its retry
// tiers 1..tiers, then its dead-letter topic.
func targets(source, group string, tiers int) []string {
	out := make([]string, 0, tiers+1)
	for n := 1; n <= tiers; n++ {
		out = append(out, TierTopic(source, group, n))
	}
	return append(out, DLQTopic(source, group))
}

// ErrTopicMissing is returned by EnsureTopics, wrapped with the topic's name, when a retry or
// dead-letter topic does not exist and creating it is not allowed.
var ErrTopicMissing = errors.New("topic does not exist")

// EnsureOptions says what EnsureTopics may do about missing topics, and how it creates them.
type EnsureOptions struct {
	// Create lets it create missing retry-tier and dead-letter topics; without it, a missing one is
	// an error wrapping ErrTopicMissing.
	Create bool
	// ReplicationFactor of the topics it creates: 0 (the default) takes the source topic's (the
	// most replicas any of its partitions has), -1 the broker's default.replication.factor
	// (Apache Kafka's own default is 1: a tier or dead-letter topic on one broker loses its records
	// with that broker's disk).
	ReplicationFactor int16
	// MinInsyncReplicas of the topics it creates: 0 (the default) takes the source topic's own
	// min.insync.replicas if it sets one, and otherwise leaves the broker's default.
	MinInsyncReplicas int
	// UnderReplicated, if not nil, is told of each retry-tier or dead-letter topic that exists with
	// fewer replicas than its source topic (created by hand, or by a release that took the broker's
	// default).
	UnderReplicated func(topic string, replicas int, source string, sourceReplicas int)
}

// EnsureTopics checks that the retry-tier and dead-letter topics of every source topic exist (see
// targets); tiers gives each source topic's number of retry tiers. Missing ones are created, if
// o.Create, with the source topic's partition count and the replication o asks for (by default the
// source topic's replication factor and min.insync.replicas: records in a tier or the dead-letter
// topic are worth as much as the source's); otherwise a missing one is an error wrapping
// ErrTopicMissing. A source topic that does not exist yet is reported in missing and skipped:
// retry later.
func EnsureTopics(ctx context.Context, adm *kadm.Client, group string, tiers map[string]int, o EnsureOptions) (created, missing []string, err error) {
	sources := slices.Sorted(maps.Keys(tiers))
	want := map[string]string{} // target -> source
	for _, s := range sources {
		for _, t := range targets(s, group, tiers[s]) {
			want[t] = s
		}
	}
	all := append(slices.Clone(sources), slices.Collect(maps.Keys(want))...)
	details, err := adm.ListTopics(ctx, all...)
	if err != nil {
		return nil, nil, fmt.Errorf("list topics: %w", err)
	}
	var absent []string
	for _, s := range sources {
		sd, ok := details[s]
		gone, err := topicAbsent(sd, ok)
		if err != nil {
			return nil, nil, err
		}
		if gone || len(sd.Partitions) == 0 {
			missing = append(missing, s)
		}
	}
	configs := map[string]map[string]*string{} // by source, read once
	for _, t := range slices.Sorted(maps.Keys(want)) {
		src := want[t]
		d, ok := details[t]
		gone, err := topicAbsent(d, ok)
		if err != nil {
			return nil, nil, err
		}
		if !gone {
			if have, srcHave := replicas(d), replicas(details[src]); o.UnderReplicated != nil && !slices.Contains(missing, src) && have < srcHave {
				o.UnderReplicated(t, have, src, srcHave)
			}
			continue
		}
		if slices.Contains(missing, src) {
			continue
		}
		if !o.Create {
			absent = append(absent, t)
			continue
		}
		rf := o.ReplicationFactor
		if rf == 0 {
			rf = int16(replicas(details[src]))
		}
		cfg, ok := configs[src]
		if !ok {
			if cfg, err = topicConfigs(ctx, adm, src, o); err != nil {
				return created, missing, err
			}
			configs[src] = cfg
		}
		resp, err := adm.CreateTopic(ctx, int32(len(details[src].Partitions)), rf, cfg, t)
		if err == nil {
			err = resp.Err
		}
		if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return created, missing, fmt.Errorf("create topic %s (replication factor %d%s): %w", t, rf, describeMinInsync(cfg), err)
		}
		if err == nil {
			created = append(created, t)
		}
	}
	if len(absent) > 0 {
		return created, missing, fmt.Errorf("%w: %s (creating topics is disabled)", ErrTopicMissing, strings.Join(absent, ", "))
	}
	return created, missing, nil
}

// replicas returns the most replicas any partition of a topic has.
func replicas(d kadm.TopicDetail) int {
	n := 0
	for _, p := range d.Partitions {
		n = max(n, len(p.Replicas))
	}
	return n
}

// minInsync is the topic configuration EnsureTopics sets on the topics it creates.
const minInsync = "min.insync.replicas"

// topicConfigs returns the configuration of the topics EnsureTopics creates for source: o's
// min.insync.replicas, or the source topic's own, if it sets one.
func topicConfigs(ctx context.Context, adm *kadm.Client, source string, o EnsureOptions) (map[string]*string, error) {
	if o.MinInsyncReplicas > 0 {
		return map[string]*string{minInsync: kadm.StringPtr(strconv.Itoa(o.MinInsyncReplicas))}, nil
	}
	rcs, err := adm.DescribeTopicConfigs(ctx, source)
	if err == nil {
		var rc kadm.ResourceConfig
		if rc, err = rcs.On(source, nil); err == nil {
			err = rc.Err
		}
		for _, c := range rc.Configs {
			if c.Key == minInsync && c.Source == kmsg.ConfigSourceDynamicTopicConfig && c.Value != nil {
				return map[string]*string{minInsync: kadm.StringPtr(*c.Value)}, nil
			}
		}
	}
	if err != nil {
		return nil, fmt.Errorf("read the configuration of topic %s (to create its retry and dead-letter topics alike): %w", source, err)
	}
	return nil, nil
}

// describeMinInsync describes the min.insync.replicas of configs, for an error.
func describeMinInsync(configs map[string]*string) string {
	if v := configs[minInsync]; v != nil {
		return ", " + minInsync + " " + *v
	}
	return ""
}
