package ops_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// outboxCopy writes the outbox row of a copy of r bound for topic, as the processor does.
func (e *keysEnv) outboxCopy(r retrytopics.Rec, topic string) {
	e.t.Helper()
	hs := retrytopics.Headers(nil, retrytopics.Failure{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Timestamp: r.Timestamp,
		Group: keysGroup, Attempt: 1, Tries: 1, Class: "retryable", Message: "boom", FailedAt: time.Now(), FirstFailedAt: time.Now()})
	keys, vals := sink.SplitHeaders(hs)
	e.exec(`INSERT INTO kafkapg.outbox (consumer_group, topic, partition, key, value, header_keys, header_values)
		VALUES ($1, $2, $3, $4, $5, $6, $7)`, keysGroup, topic, r.Partition, r.Key, r.Value, keys, vals)
}

func (e *keysEnv) position(topic string, partition int32, next int64) time.Time {
	e.t.Helper()
	return scalar[time.Time](e, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ($1, $2, $3, $4)
		RETURNING updated_at`, keysGroup, topic, partition, next)
}

func (e *keysEnv) trace(q ops.TraceQuery, kc *kgo.Client) ops.TraceResult {
	e.t.Helper()
	res, err := e.ops.Trace(context.Background(), q, kc)
	if err != nil {
		e.t.Fatalf("Trace(%+v): %v", q, err)
	}
	return res
}

// hasSteps reports whether steps contain, in order, steps starting with each of want.
func hasSteps(steps []ops.TraceStep, want ...string) bool {
	i := 0
	for _, s := range steps {
		if i < len(want) && strings.HasPrefix(s.What, want[i]) {
			i++
		}
	}
	return i == len(want)
}

func stepTexts(steps []ops.TraceStep) string {
	var b strings.Builder
	for _, s := range steps {
		fmt.Fprintf(&b, "\n  %s  %s", s.At.Format(time.RFC3339Nano), s.What)
	}
	return b.String()
}

// TestTraceStates: Trace tells each place a record can be in Postgres, and how it got there,
// for one record and for the records of a key (Postgres only: no Kafka client).
func TestTraceStates(t *testing.T) {
	e := newKeysEnv(t)
	ctx := context.Background()
	passed := e.position("orders", 0, 100)

	e.toTier(rec("orders", 0, 60, "k1"), due)
	e.hold(rec("orders", 0, 61, "k1"))
	e.toTier(rec("orders", 0, 62, "k2"), due)
	e.outboxCopy(rec("orders", 0, 62, "k2"), retrytopics.TierTopic("orders", keysGroup, 1))
	dl63 := e.deadLetter(rec("orders", 0, 63, "k3"), false, false)
	e.outboxCopy(rec("orders", 0, 63, "k3"), retrytopics.DLQTopic("orders", keysGroup))
	dl64 := e.deadLetter(rec("orders", 0, 64, "k4"), false, false)
	e.tx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := e.store.Replay(ctx, tx, []int64{dl64}, 0)
		return err
	})
	e.outboxCopy(rec("orders", 0, 65, "k5"), retrytopics.DLQTopic("orders", keysGroup))
	dl66 := e.deadLetter(rec("orders", 0, 66, "k6"), true, true)

	tier1 := "in retry tier 1 (orders.kg.retry.1): attempt 2, due 2099-01-02T03:04:05Z, last error retryable: boom again"
	for _, tc := range []struct {
		name      string
		partition int32
		offset    int64
		state     string
		now       string
		key       string
		steps     []string
	}{
		{"not consumed", 0, 150, ops.TraceNotConsumed, "not consumed yet: the group's next offset in the partition is 100", "", nil},
		{"no position", 5, 0, ops.TraceNotConsumed, "not consumed yet: the group has no position in the partition yet", "", nil},
		{"applied", 0, 50, ops.TraceApplied, "applied (the partition's position passed it by " + passed.UTC().Format(time.RFC3339) + ")", "",
			[]string{"the partition's position passed it (the group's next offset is now 100)"}},
		{"in a tier", 0, 60, ops.TraceInTier, tier1, "k1",
			[]string{"first failed", "attempt 1 failed (retryable: boom again): sent to retry tier 1 (orders.kg.retry.1), due 2099-01-02T03:04:05Z"}},
		{"held", 0, 61, ops.TraceHeld, "held behind its key; its key is retrying: record at offset 60 is in retry tier 1 (orders.kg.retry.1), attempt 2, due 2099-01-02T03:04:05Z, last error retryable: boom again", "k1",
			[]string{"produced (record timestamp)", "held behind the record at offset 60 of its key"}},
		{"outbox to its tier", 0, 62, ops.TraceOutbox,
			"waits in the outbox to be published to orders.kg.retry.1 (retry tier 1): attempt 2, due 2099-01-02T03:04:05Z, last error retryable: boom again", "k2",
			[]string{"first failed", "attempt 1 failed", "copy written to the outbox, to be published to orders.kg.retry.1 (retry tier 1)"}},
		{"dead-lettered", 0, 63, ops.TraceDeadLettered,
			fmt.Sprintf("dead-lettered: dead letter #%d, permanent: bad, status new, after 1 attempts; its copy waits in the outbox to be published to orders.kg.dlq (the dead-letter topic)", dl63), "k3",
			[]string{"produced (record timestamp)", "first failed", fmt.Sprintf("dead-lettered at attempt 1 (permanent: bad) as dead letter #%d", dl63),
				"copy written to the outbox, to be published to orders.kg.dlq (the dead-letter topic)"}},
		{"replayed, waiting", 0, 64, ops.TraceHeld,
			fmt.Sprintf("replayed dead letter #%d waits in held_records to be applied as attempt 2; its key is ready: its held records are being applied", dl64), "k4",
			[]string{fmt.Sprintf("dead-lettered at attempt 1 (permanent: bad) as dead letter #%d", dl64), "replay queued: back in held_records, to be handled as attempt 2"}},
		{"only in the outbox", 0, 65, ops.TraceOutbox, "its copy waits in the outbox to be published to orders.kg.dlq (the dead-letter topic)", "k5",
			[]string{"copy written to the outbox"}},
		{"blocking its key", 0, 66, ops.TraceDeadLettered,
			fmt.Sprintf("dead-lettered: dead letter #%d, permanent: bad, status new, after 1 attempts; its key is blocked behind it with 0 held records (keys release)", dl66), "k6",
			[]string{fmt.Sprintf("dead-lettered at attempt 1 (permanent: bad) as dead letter #%d", dl66)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := e.trace(ops.TraceQuery{Topic: "orders", Partition: tc.partition, Offset: tc.offset}, nil)
			if len(res.Records) != 1 {
				t.Fatalf("Trace = %+v, want one record", res)
			}
			r := res.Records[0]
			if r.Topic != "orders" || r.Partition != tc.partition || r.Offset != tc.offset || r.State != tc.state || r.Now != tc.now || r.KeyText != tc.key {
				t.Errorf("trace:\n got %s[%d]@%d key=%q %s: %s\nwant %s[%d]@%d key=%q %s: %s",
					r.Topic, r.Partition, r.Offset, r.KeyText, r.State, r.Now, "orders", tc.partition, tc.offset, tc.key, tc.state, tc.now)
			}
			if !hasSteps(r.Steps, tc.steps...) {
				t.Errorf("steps:%s\nwant, in order: %q", stepTexts(r.Steps), tc.steps)
			}
			if len(res.Notes) != 1 || !strings.Contains(res.Notes[0], "Kafka was not consulted") {
				t.Errorf("notes %q, want one saying Kafka was not consulted", res.Notes)
			}
		})
	}

	// The release of a stuck key shows in its head's trace, which is dead-lettered as lost.
	e.backdate("orders", 0, []byte("k1"))
	scope := retrytopics.StuckScope{Older: time.Minute, Tiers: map[string]int{"orders": 3}}
	if _, err := e.ops.ReleaseKey(ctx, "orders", 0, []byte("k1"), scope, true, operator); err != nil {
		t.Fatal(err)
	}
	r := e.trace(ops.TraceQuery{Topic: "orders", Partition: 0, Offset: 60}, nil).Records[0]
	if r.State != ops.TraceDeadLettered || !strings.Contains(r.Now, "lost: lost in the retry path (overdue since") ||
		!hasSteps(r.Steps, "its key was released by alice (overdue): INC-42") {
		t.Errorf("trace of a released head: %s: %s%s", r.State, r.Now, stepTexts(r.Steps))
	}

	// A key: its records Postgres keeps, newest first.
	res := e.trace(ops.TraceQuery{Topic: "orders", Key: []byte("k1")}, nil)
	var got []string
	for _, r := range res.Records {
		got = append(got, fmt.Sprintf("%d:%s", r.Offset, r.State))
	}
	if want := "61:held 60:dead_lettered"; strings.Join(got, " ") != want {
		t.Errorf("trace of key k1: %s, want %s", strings.Join(got, " "), want)
	}
	if res := e.trace(ops.TraceQuery{Topic: "orders", Key: []byte("k1"), Limit: 1}, nil); len(res.Records) != 1 || res.Records[0].Offset != 61 {
		t.Errorf("trace of key k1, limit 1: %+v, want offset 61 only", res.Records)
	}
	if res := e.trace(ops.TraceQuery{Topic: "orders", Key: []byte("k5")}, nil); len(res.Records) != 1 || res.Records[0].State != ops.TraceOutbox {
		t.Errorf("trace of key k5 (only a copy in the outbox): %+v", res.Records)
	}
	if res := e.trace(ops.TraceQuery{Topic: "orders", Key: []byte("nobody")}, nil); len(res.Records) != 0 {
		t.Errorf("trace of an unknown key: %+v", res.Records)
	}

	for _, q := range []ops.TraceQuery{{}, {Topic: "orders", Partition: -1}, {Topic: "orders", Offset: -1}, {Topic: "orders", Key: []byte("k"), Limit: -1}} {
		if _, err := e.ops.Trace(ctx, q, nil); !errors.Is(err, ops.ErrUsage) {
			t.Errorf("Trace(%+v): %v, want ErrUsage", q, err)
		}
	}
}

// TestTraceKafka: with a broker, Trace tells records the broker's retention deleted from those
// applied or not yet consumed, reads a record's key from Kafka, and finds a key's records among
// the last Scan records of each partition.
func TestTraceKafka(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		e := newKeysEnv(t)
		ctx := context.Background()
		topic := k.CreateTopic(t, 1)
		e.ops = e.ops.WithTopics(topic, topic+"-absent") // the group's topics (KAFKA_TOPICS): all a trace may read
		var recs []*kgo.Record
		for i := range 10 {
			key := "x"
			if i%3 == 0 {
				key = "k"
			}
			recs = append(recs, &kgo.Record{Topic: topic, Partition: 0, Key: []byte(key), Value: []byte(fmt.Sprint(i))})
		}
		k.Produce(t, recs...)
		kc := k.Client(t)
		var os kadm.Offsets
		os.Add(kadm.Offset{Topic: topic, Partition: 0, At: 2})
		if resp, err := kadm.NewClient(kc).DeleteRecords(ctx, os); err != nil || resp.Error() != nil {
			t.Fatalf("delete records: %v, %v", err, resp.Error())
		}
		passed := e.position(topic, 0, 8).UTC().Format(time.RFC3339)
		e.deadLetter(rec(topic, 0, 6, "k"), false, false)

		for _, tc := range []struct {
			offset int64
			state  string
			now    string
			key    string
		}{
			{1, ops.TraceBeyondRetention, "applied (the partition's position passed it by " + passed + "); beyond the broker's retention now: the log starts at offset 2", ""},
			{5, ops.TraceApplied, "applied (the partition's position passed it by " + passed + ")", "x"},
			{9, ops.TraceNotConsumed, "not consumed yet: the group's next offset in the partition is 8", "k"},
			{12, ops.TraceNotConsumed, "not produced yet: the partition ends at offset 10", ""},
		} {
			res := e.trace(ops.TraceQuery{Topic: topic, Partition: 0, Offset: tc.offset}, kc)
			r := res.Records[0]
			if r.State != tc.state || r.Now != tc.now || r.KeyText != tc.key || len(res.Notes) != 0 {
				t.Errorf("offset %d: %s %q key=%q, notes %q; want %s %q key=%q", tc.offset, r.State, r.Now, r.KeyText, res.Notes, tc.state, tc.now, tc.key)
			}
			if tc.key != "" && !hasSteps(r.Steps, "produced (record timestamp)") {
				t.Errorf("offset %d: steps%s, want the record's timestamp from Kafka", tc.offset, stepTexts(r.Steps))
			}
		}

		// With the topic's CONCURRENCY known, a record produced but not applied may be in its
		// partition's window: the trace says so.
		r9 := e.trace(ops.TraceQuery{Topic: topic, Partition: 0, Offset: 9, Concurrency: 100}, kc).Records[0]
		if r9.State != ops.TraceNotConsumed || !strings.Contains(r9.Now, "with CONCURRENCY=100 its partition's owner prepares it ahead of the position") {
			t.Errorf("offset 9 with Concurrency 100: %s %q, want it said to be possibly prepared ahead", r9.State, r9.Now)
		}

		// Not consumed and beyond retention: a partition the group has no position in yet.
		e.exec(`DELETE FROM kafkapg.offsets WHERE consumer_group = $1`, keysGroup)
		r := e.trace(ops.TraceQuery{Topic: topic, Partition: 0, Offset: 1}, kc).Records[0]
		if want := "not consumed (the group has no position in the partition yet) and beyond the broker's retention: the log starts at offset 2, so it can no longer be consumed"; r.State != ops.TraceBeyondRetention || r.Now != want {
			t.Errorf("offset 1 without a position: %s %q, want %s %q", r.State, r.Now, ops.TraceBeyondRetention, want)
		}

		offsetsOf := func(res ops.TraceResult) string {
			var s []string
			for _, r := range res.Records {
				s = append(s, fmt.Sprintf("%d:%s", r.Offset, r.State))
			}
			return strings.Join(s, " ")
		}
		// The last 3 records hold offset 9 of key k; the dead letter at 6 is in Postgres; offset 3 is
		// beyond the scan of 3 (but not of 100), offset 0 beyond retention.
		if got, want := offsetsOf(e.trace(ops.TraceQuery{Topic: topic, Key: []byte("k"), Scan: 3}, kc)), "9:not_consumed 6:dead_lettered"; got != want {
			t.Errorf("key k, scan 3: %s, want %s", got, want)
		}
		if got, want := offsetsOf(e.trace(ops.TraceQuery{Topic: topic, Key: []byte("k"), Scan: 100}, kc)), "9:not_consumed 6:dead_lettered 3:not_consumed"; got != want {
			t.Errorf("key k, scan 100: %s, want %s", got, want)
		}
		if got, want := offsetsOf(e.trace(ops.TraceQuery{Topic: topic, Key: []byte("k"), Scan: 100, Limit: 2}, kc)), "9:not_consumed 6:dead_lettered"; got != want {
			t.Errorf("key k, limit 2: %s, want %s", got, want)
		}

		// A topic Kafka does not have: Postgres answers, and a note says what was not checked.
		res := e.trace(ops.TraceQuery{Topic: topic + "-absent", Partition: 0, Offset: 1}, kc)
		if len(res.Notes) != 1 || !strings.Contains(res.Notes[0], "could not be read from Kafka") || res.Records[0].State != ops.TraceNotConsumed {
			t.Errorf("absent topic: %+v", res)
		}
	})
}
