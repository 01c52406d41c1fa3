package processor_test

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/faultproxy"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// The promises of the retry path and of the logs that docs/retries.md, docs/guarantees.md and
// docs/operations.md make, each checked where it can break.

// logLine is one line of a processor's JSON log.
type logLine map[string]any

// captureLogs makes cfg log as JSON, every level, into the buffer it returns; the test's output
// shows the lines if it fails.
func captureLogs(t *testing.T, cfg *processor.Config) *syncBuffer {
	t.Helper()
	logs := &syncBuffer{}
	cfg.Logger = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		var own []string // franz-go's lines drown the rest
		for _, l := range strings.Split(logs.String(), "\n") {
			if !strings.Contains(l, `"component":"kafka"`) {
				own = append(own, l)
			}
		}
		t.Logf("processor logs (franz-go's left out):\n%s", strings.Join(own, "\n"))
	})
	return logs
}

// lines parses the captured log.
func (b *syncBuffer) lines(t *testing.T) []logLine {
	t.Helper()
	var out []logLine
	for _, s := range strings.Split(strings.TrimSpace(b.String()), "\n") {
		if s == "" {
			continue
		}
		var l logLine
		if err := json.Unmarshal([]byte(s), &l); err != nil {
			t.Fatalf("log line is not JSON: %v: %s", err, s)
		}
		out = append(out, l)
	}
	return out
}

// find returns the lines whose message is msg and whose key_hash is key's.
func (b *syncBuffer) find(t *testing.T, msg string, key []byte) []logLine {
	t.Helper()
	var out []logLine
	for _, l := range b.lines(t) {
		if l["msg"] == msg && l["key_hash"] == processor.KeyHash(key) {
			out = append(out, l)
		}
	}
	return out
}

// TestRetryRecordsAreNotHandledBeforeTheirDueTime: records that go through two retry tiers are
// handed to the handler no earlier than the due time their own tier record carries (the tier's
// delay plus that record's jitter), read back from the tier topics. Several records share each
// tier partition, with due times out of order (the jitter), so a tier that waited only the
// delay, or only for the first record of a batch, hands one over early.
func TestRetryRecordsAreNotHandledBeforeTheirDueTime(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := carelessHarness(t, k, 2)
		var mu sync.Mutex
		handled := map[string]time.Time{} // "value@attempt": the first time the handler saw it
		cfg := h.Config(careless{before: func(_ context.Context, _ pgx.Tx, rec *processor.Record) error {
			now := time.Now()
			at := fmt.Sprintf("%s@%d", rec.Value, rec.Attempt)
			mu.Lock()
			if _, ok := handled[at]; !ok {
				handled[at] = now
			}
			mu.Unlock()
			fails := 1
			if strings.HasSuffix(string(rec.Value), "-twice") {
				fails = 2
			}
			if rec.Attempt <= fails {
				return fmt.Errorf("attempt %d fails", rec.Attempt)
			}
			return nil
		}})
		delays := []time.Duration{500 * time.Millisecond, time.Second} // jitter up to 50 ms and 100 ms
		cfg.RetryTiers = delays
		cfg.LocalAttempts = 1
		h.Start(cfg)

		var recs []*kgo.Record
		var values []string
		want := map[string]int{} // attempt each value is applied at
		for i := range 12 {
			v, attempt := fmt.Sprintf("due-%d", i), 2
			if i%3 == 0 {
				v, attempt = v+"-twice", 3
			}
			values = append(values, v)
			want[v] = attempt
			recs = append(recs, &kgo.Record{Topic: h.Topic, Key: fmt.Appendf(nil, "k-%d", i), Value: []byte(v)})
		}
		h.K.Produce(t, recs...)
		at := h.waitEffects(values, 60*time.Second)
		for _, v := range values {
			if at[v] != want[v] {
				t.Errorf("%s applied at attempt %d, want %d", v, at[v], want[v])
			}
		}

		mu.Lock()
		defer mu.Unlock()
		var checked int
		var maxJitter time.Duration
		for n, delay := range delays {
			tier := retrytopics.TierTopic(h.Topic, h.Group, n+1)
			seen := map[string]bool{}
			for _, r := range k.ReadAll(t, tier) {
				f, err := retrytopics.ParseFailure(r.Headers)
				if err != nil {
					t.Fatalf("a record of %s: %v", tier, err)
				}
				if f.DueAt.IsZero() {
					t.Fatalf("%s in %s has no %s header", r.Value, tier, retrytopics.HeaderDueAt)
				}
				maxJitter = max(maxJitter, f.DueAt.Sub(f.FailedAt)-delay)
				next := fmt.Sprintf("%s@%d", r.Value, f.Attempt+1)
				handledAt, ok := handled[next]
				if !ok {
					t.Errorf("%s never handled, though %s holds it", next, tier)
					continue
				}
				if handledAt.Before(f.DueAt) {
					t.Errorf("%s handled at %s, %v before its due time %s (%s delay %v, jitter %v)", next,
						handledAt.Format(time.RFC3339Nano), f.DueAt.Sub(handledAt), f.DueAt.Format(time.RFC3339Nano),
						tier, delay, f.DueAt.Sub(f.FailedAt)-delay)
				}
				seen[string(r.Value)] = true
				checked++
			}
			wantIn := 0
			for _, v := range values {
				if want[v] > n+1 {
					wantIn++
				}
			}
			if len(seen) != wantIn {
				t.Errorf("%s holds %d of the records, want %d", tier, len(seen), wantIn)
			}
		}
		// Without jitter to speak of, a tier that ignored it would pass too.
		if maxJitter < 10*time.Millisecond {
			t.Errorf("the largest jitter of %d retry records is %v; the check needs records with jitter", checked, maxJitter)
		}
		t.Logf("%d retry records handled no earlier than their due times (jitter up to %v)", checked, maxJitter.Round(time.Millisecond))
	})
}

// TestInPlaceRetryCadenceIsCapped: while Postgres is down, a partition retries its transaction
// in place, the n-th retry after a wait drawn from [d/2, d], d = min(BackoffBase·2^(n-1),
// BackoffMax): a probe at least every BackoffMax (RETRY_BACKOFF_MAX), whatever the outage's
// length. The waits are those of a processor New built, from the defaults (200 ms, 5 s) and
// from set values.
func TestInPlaceRetryCadenceIsCapped(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	pool := testenv.Migrated(t)
	for _, tt := range []struct {
		name      string
		base, max time.Duration // as set; zero: the default
		wantBase  time.Duration
		wantMax   time.Duration
	}{
		{name: "defaults", wantBase: 200 * time.Millisecond, wantMax: 5 * time.Second},
		{name: "set", base: 10 * time.Millisecond, max: 40 * time.Millisecond, wantBase: 10 * time.Millisecond, wantMax: 40 * time.Millisecond},
		{name: "base above the default max", base: 8 * time.Second, wantBase: 8 * time.Second, wantMax: 8 * time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := processor.New(pool, &processor.Config{Brokers: k.Brokers, Group: "g", Topics: []string{"t"},
				Handler: careless{}, BackoffBase: tt.base, BackoffMax: tt.max, Registerer: prometheus.NewRegistry()})
			if err != nil {
				t.Fatal(err)
			}
			var longest time.Duration
			for n := 1; n <= 64; n++ {
				d := min(tt.wantBase<<min(n-1, 30), tt.wantMax)
				for range 100 {
					got := p.InPlaceDelay(n)
					if got < d/2 || got > d {
						t.Fatalf("retry %d in place waits %v, want within [%v, %v]", n, got, d/2, d)
					}
					longest = max(longest, got)
				}
			}
			if longest > tt.wantMax || longest < tt.wantMax/2 {
				t.Errorf("the longest wait between retries in place is %v, want at most %v and reaching at least half of it", longest, tt.wantMax)
			}
		})
	}
}

// proxiedPool returns a pool (at most 4 connections) that reaches the database at dbURL through
// a proxy that can cut it off, the proxy, and the pool's URL.
func proxiedPool(t *testing.T, dbURL string) (*pgxpool.Pool, *faultproxy.Proxy, string) {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewProxy(t, u.Host)
	u.Host = proxy.Addr()
	poolCfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	poolCfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), poolCfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, proxy, u.String()
}

// TestRetryInPlaceResumesAtTheFirstProbeAfterPostgresReturns: a transaction that fails because
// Postgres is unreachable (connections cut, new ones refused) is retried in place, each retry a
// probe, counted as an infrastructure retry and not as an internal error; Postgres returns
// between two probes, and the very next probe commits. The retries are counted, not timed.
func TestRetryInPlaceResumesAtTheFirstProbeAfterPostgresReturns(t *testing.T) {
	t.Parallel()
	k := testenv.NewKfake(t)
	_, dbURL := testenv.Postgres(t)
	pool, proxy, _ := proxiedPool(t, dbURL)
	reg := prometheus.NewRegistry()
	p, err := processor.New(pool, &processor.Config{Brokers: k.Brokers, Group: "g", Topics: []string{"t"}, Handler: careless{},
		BackoffBase: 5 * time.Millisecond, BackoffMax: 20 * time.Millisecond, Registerer: reg, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	commit := func() error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		})
	}
	// The pool keeps the connection this opens: the cut leaves it stale, as an outage does.
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	proxy.Cut()
	const lastDown = 6 // Postgres returns after this probe failed
	probes := 0
	err = p.RetryInPlace(ctx, func() error {
		probes++
		err := commit()
		switch {
		case probes <= lastDown && err == nil:
			t.Errorf("probe %d committed while Postgres was unreachable", probes)
		case probes == lastDown:
			proxy.Restore()
		case probes > lastDown && err != nil:
			t.Errorf("probe %d, after Postgres returned, failed: %v", probes, err)
		}
		return err
	})
	if err != nil {
		t.Fatalf("retrying in place: %v", err)
	}
	if probes != lastDown+1 {
		t.Errorf("committed at probe %d, want %d: the first after Postgres returned", probes, lastDown+1)
	}
	infra, internal := counter(t, reg, "kafkapg_infrastructure_retries_total"), counter(t, reg, "kafkapg_internal_errors_total")
	if infra != lastDown || internal != 0 {
		t.Errorf("kafkapg_infrastructure_retries_total = %v, kafkapg_internal_errors_total = %v; want %d and 0 (an outage, not kafkapg's fault)", infra, internal, lastDown)
	}
}

// counter returns the value of an unlabelled counter of reg.
func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// TestPartitionResumesAtTheNextProbe: the same for a partition of a running processor. During an
// outage of Postgres a partition with a record to apply retries in place, each wait at most
// BackoffMax (the retry_in of its log lines); once Postgres is back each loop retrying in place
// (the partition's, the held records' applier) fails at most once more, the retry under way when
// Postgres returned, and the record is applied.
func TestPartitionResumesAtTheNextProbe(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := carelessHarness(t, k, 1)
		proxied, proxy, proxiedURL := proxiedPool(t, h.DBURL)
		cfg := h.Config(careless{})
		cfg.BackoffBase, cfg.BackoffMax = 5*time.Millisecond, 40*time.Millisecond
		logs := captureLogs(t, cfg)
		// The processor reaches Postgres through the proxy; the test checks it directly.
		through := &harness{&testkit.Harness{T: t, K: k, Pool: proxied, DBURL: proxiedURL, Topic: h.Topic, Group: h.Group}}
		r := through.Start(cfg)
		h.K.Produce(t, &kgo.Record{Topic: h.Topic, Value: []byte("before")})
		h.waitEffects([]string{"before"}, 30*time.Second)

		proxy.Cut()
		h.K.Produce(t, &kgo.Record{Topic: h.Topic, Value: []byte("during")})
		// The partition's tenth failed retry: its wait is the longest, BackoffMax's [1/2, 1], and
		// every connection the pool had (MaxConns 4) has been thrown out, so what follows the
		// outage starts on fresh ones.
		const stalled = "transaction failed for a reason outside the record; retrying in place"
		testenv.Eventually(t, 30*time.Second, func() error {
			for _, l := range logs.lines(t) {
				if l["msg"] == stalled && l["partition"] != nil && l["failures"] == float64(10) {
					return nil
				}
			}
			return errors.New("the partition has not failed ten times yet")
		})
		if n := len(h.effects()); n != 1 {
			t.Fatalf("%d records applied while Postgres was unreachable, want only the one before", n)
		}
		proxy.Restore()
		atReturn := r.Counter("kafkapg_infrastructure_retries_total")
		h.waitEffects([]string{"before", "during"}, 30*time.Second)

		const resumes = "transactions succeed again; processing resumes"
		var loops int
		var total float64
		testenv.Eventually(t, 30*time.Second, func() error { // every loop that retried has resumed
			loops, total = 0, 0
			for _, l := range logs.lines(t) {
				if l["msg"] == resumes {
					loops++
					n, _ := l["after_failures"].(float64)
					total += n
				}
			}
			if n := r.Counter("kafkapg_infrastructure_retries_total"); total != n {
				return fmt.Errorf("%d loops resumed after %v failures in all, of %v retries in place", loops, total, n)
			}
			return nil
		})
		after := total - atReturn
		t.Logf("%v retries in place before Postgres returned, %v after, in %d loops", atReturn, after, loops)
		if after > float64(loops) {
			t.Errorf("%v retries in place failed after Postgres returned, in %d loops; each loop's first retry after its return must succeed (one under way may fail)", after, loops)
		}
		var worker, stalls int
		for _, l := range logs.lines(t) {
			switch {
			case l["msg"] == resumes && l["partition"] != nil:
				worker++
			case l["msg"] == stalled:
				stalls++
				in, _ := l["retry_in"].(float64)
				if d := time.Duration(in); d > cfg.BackoffMax || d <= 0 {
					t.Errorf("retry %v in place waits %v, want at most BackoffMax (%v)", l["failures"], d, cfg.BackoffMax)
				}
			}
		}
		if worker != 1 || stalls == 0 {
			t.Errorf("%d lines about the partition resuming and %d about retries in place; want one and some", worker, stalls)
		}
	})
}

// garbledHeaders are the kafkapg headers of a retry record of the harness's topic, valid but
// for header key, set to value.
func garbledHeaders(t *testing.T, h *harness, key, value string) []kgo.RecordHeader {
	t.Helper()
	now := time.Now()
	hs := retrytopics.Headers(nil, retrytopics.Failure{Topic: h.Topic, Partition: 0, Offset: 7, Timestamp: now, Group: h.Group,
		Attempt: 1, Tries: 1, Class: "retryable", Message: "it failed", FailedAt: now, FirstFailedAt: now, DueAt: now})
	if _, err := retrytopics.ParseFailure(hs); err != nil {
		t.Fatalf("the valid headers do not parse: %v", err)
	}
	found := false
	for i := range hs {
		if hs[i].Key == key {
			hs[i].Value, found = []byte(value), true
		}
	}
	if !found {
		t.Fatalf("retry records have no %s header", key)
	}
	return hs
}

// TestGarbledRetryRecordWarningNamesTheHeader: a record in a retry tier whose kafkapg headers are
// missing or garbled is handled as a fresh attempt-1 record, and the warning names the header:
// every missing one for a record with none, the garbled one (and no other) for one whose
// attempt or due time is not what kafkapg writes.
func TestGarbledRetryRecordWarningNamesTheHeader(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := carelessHarness(t, k, 1)
		cfg := h.Config(careless{})
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond}
		logs := captureLogs(t, cfg)
		r := h.Start(cfg)
		waitJoined(t, r) // the tier topic exists
		tier := retrytopics.TierTopic(h.Topic, h.Group, 1)
		required := []string{retrytopics.HeaderOriginalTopic, retrytopics.HeaderOriginalPartition, retrytopics.HeaderOriginalOffset,
			retrytopics.HeaderOriginalTimestamp, retrytopics.HeaderGroup, retrytopics.HeaderAttempt, retrytopics.HeaderTries,
			retrytopics.HeaderErrorClass, retrytopics.HeaderErrorMessage, retrytopics.HeaderFailedAt}
		cases := []struct {
			name    string
			headers []kgo.RecordHeader
			want    []string // what the warning must say
			garbled string   // the one header named, if not all
		}{
			{name: "no-headers", want: append([]string{"is missing"}, required...)},
			{name: "garbled-attempt", headers: garbledHeaders(t, h, retrytopics.HeaderAttempt, "two"),
				want: []string{retrytopics.HeaderAttempt + `: "two" is not an integer`}, garbled: retrytopics.HeaderAttempt},
			{name: "garbled-due", headers: garbledHeaders(t, h, retrytopics.HeaderDueAt, "soon"),
				want: []string{retrytopics.HeaderDueAt + `: "soon" is not an RFC 3339 time`}, garbled: retrytopics.HeaderDueAt},
		}
		var values []string
		for _, c := range cases {
			h.K.Produce(t, &kgo.Record{Topic: tier, Key: []byte(c.name), Value: []byte(c.name), Headers: c.headers})
			values = append(values, c.name)
		}
		at := h.waitEffects(values, 30*time.Second)
		const warning = "record in a retry tier has missing or garbled kafkapg headers; handling it as a fresh record (attempt 1, no key order, dead-lettered if it fails)"
		for _, c := range cases {
			if at[c.name] != 1 {
				t.Errorf("%s applied at attempt %d, want 1 (a fresh record)", c.name, at[c.name])
			}
			lines := logs.find(t, warning, []byte(c.name))
			if len(lines) != 1 {
				t.Errorf("%s: %d warnings about its headers, want 1", c.name, len(lines))
				continue
			}
			if lines[0]["level"] != "WARN" {
				t.Errorf("%s: logged at %v, want a warning", c.name, lines[0]["level"])
			}
			msg, _ := lines[0]["err"].(string)
			for _, w := range c.want {
				if !strings.Contains(msg, w) {
					t.Errorf("%s: the warning says %q, which does not say %q", c.name, msg, w)
				}
			}
			if c.garbled == "" {
				continue
			}
			for _, other := range append(required, retrytopics.HeaderFirstFailedAt, retrytopics.HeaderDueAt) {
				if other != c.garbled && strings.Contains(msg, other) {
					t.Errorf("%s: the warning %q names %s too; only %s is garbled", c.name, msg, other, c.garbled)
				}
			}
		}
	})
}

// TestRecordLogsShowTheKeyHashNeverTheKey: the log lines about a record (sent to a tier,
// dead-lettered by the handler or for its size, its handler panicking, a garbled retry record)
// carry key_hash, and no line at any level holds the key: not its bytes, nor their hex or base64,
// for a printable key and a binary one. Records held behind those keys go through the log too.
func TestRecordLogsShowTheKeyHashNeverTheKey(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := carelessHarness(t, k, 1)
		var panicked sync.Map
		cfg := h.Config(careless{before: func(_ context.Context, _ pgx.Tx, rec *processor.Record) error {
			v := string(rec.Value)
			switch {
			case strings.HasPrefix(v, "tier") && rec.Attempt == 1:
				return errors.New("fails once, goes to the tier")
			case strings.HasPrefix(v, "dlq"):
				return errors.New("fails every time")
			case strings.HasPrefix(v, "malformed"):
				return processor.Permanent(errors.New("cannot parse the value"))
			case strings.HasPrefix(v, "panic"):
				if _, done := panicked.LoadOrStore(v, true); !done {
					panic("a handler bug")
				}
			}
			return nil
		}})
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond}
		cfg.LocalAttempts = 1
		cfg.MaxRecordBytes = 4096
		logs := captureLogs(t, cfg)
		r := h.Start(cfg)
		waitJoined(t, r)

		secrets := map[string][]byte{ // a readable part of each key, which must never show
			"secret-key-4711": []byte("secret-key-4711"),
			"bin-secret-0815": {0xff, 0x00, 'b', 'i', 'n', '-', 's', 'e', 'c', 'r', 'e', 't', '-', '0', '8', '1', '5', 0xfe, 0xc3, 0x28},
		}
		type want struct {
			msg string
			key []byte
		}
		var wants []want
		var keys [][]byte
		var applied []string
		tier := retrytopics.TierTopic(h.Topic, h.Group, 1)
		for name, secret := range secrets {
			key := func(path string) []byte { return append(append([]byte{}, secret...), "/"+path...) }
			rec := func(path, value string) *kgo.Record {
				return &kgo.Record{Topic: h.Topic, Key: key(path), Value: []byte(value + "-" + name)}
			}
			h.K.Produce(t,
				rec("tier", "tier"), rec("tier", "held"), // held behind its key while the first is in the tier
				rec("dlq", "dlq"),
				rec("malformed", "malformed"),
				&kgo.Record{Topic: h.Topic, Key: key("huge"), Value: []byte(strings.Repeat("x", 5000))},
				rec("panic", "panic"))
			h.K.Produce(t, &kgo.Record{Topic: tier, Key: key("garbled"), Value: []byte("garbled-" + name)})
			applied = append(applied, "tier-"+name, "held-"+name, "panic-"+name, "garbled-"+name)
			for _, p := range []string{"tier", "dlq", "malformed", "huge", "panic", "garbled"} {
				keys = append(keys, key(p))
			}
			wants = append(wants,
				want{"record sent to a retry tier", key("tier")},
				want{"record sent to a retry tier", key("dlq")},
				want{"record dead-lettered", key("dlq")},
				want{"record dead-lettered", key("malformed")},
				want{"record dead-lettered", key("huge")},
				want{"handler panicked; the record will be retried", key("panic")},
				want{"record in a retry tier has missing or garbled kafkapg headers; handling it as a fresh record (attempt 1, no key order, dead-lettered if it fails)", key("garbled")},
			)
		}
		h.waitEffects(applied, 60*time.Second)
		testenv.Eventually(t, 30*time.Second, func() error {
			if n := len(h.K.ReadAll(t, h.DLQ())); n != 6 {
				return fmt.Errorf("%d dead letters, want 6", n)
			}
			return nil
		})
		if n := r.Counter("kafkapg_records_held_total"); n < 2 {
			t.Errorf("kafkapg_records_held_total = %v, want the two records held behind their keys", n)
		}

		for _, w := range wants {
			if len(logs.find(t, w.msg, w.key)) == 0 {
				t.Errorf("no line %q with the key_hash of %q (%s)", w.msg, w.key, processor.KeyHash(w.key))
			}
		}
		all := logs.String()
		forbidden := map[string]string{}
		for name, secret := range secrets {
			forbidden[name] = name
			forbidden["hex of "+name] = hex.EncodeToString([]byte(name))
			forbidden[fmt.Sprintf("hex of %q", secret)] = hex.EncodeToString(secret)
		}
		for _, key := range keys {
			for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
				forbidden[fmt.Sprintf("base64 of %q", key)] = enc.EncodeToString(key)
			}
			forbidden[fmt.Sprintf("hex of %q", key)] = hex.EncodeToString(key)
		}
		for what, s := range forbidden {
			if strings.Contains(all, s) {
				t.Errorf("the logs hold the %s: %q", what, s)
			}
		}
	})
}
