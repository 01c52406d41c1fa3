package console

import (
	"context"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// process registers the metrics the sampler reads under the names and labels the processor (and
// the service, for kafkapg_ready) uses.
type process struct {
	reg                                  *prometheus.Registry
	applied, consumed                    *prometheus.CounterVec
	failures, deadLettered               *prometheus.CounterVec
	fenced, infraRetries, internalErrors prometheus.Counter
	lag, stalled, stuck, tierLag         *prometheus.GaugeVec
	ready, breaker, newDeadLetters       prometheus.Gauge
	oldestNew                            prometheus.Gauge
	oldestHeld, interrupted              prometheus.Gauge
	outboxSetAside, outboxOldest         prometheus.Gauge
	idempotencyBytes                     prometheus.Gauge
	paused                               *prometheus.GaugeVec
	pausedTooLong                        prometheus.Gauge
}

func newProcess() *process {
	reg := prometheus.NewRegistry()
	f := promauto.With(reg)
	counter := func(name string, labels ...string) *prometheus.CounterVec {
		return f.NewCounterVec(prometheus.CounterOpts{Name: name, Help: name}, labels)
	}
	gauge := func(name string, labels ...string) *prometheus.GaugeVec {
		return f.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: name}, labels)
	}
	p := &process{
		reg:              reg,
		applied:          counter("kafkapg_records_applied_total", "topic"),
		consumed:         counter("kafkapg_records_consumed_total", "topic"),
		failures:         counter("kafkapg_record_failures_total", "topic", "class"),
		deadLettered:     counter("kafkapg_records_dead_lettered_total", "topic", "class"),
		fenced:           counter("kafkapg_fenced_transactions_total").WithLabelValues(),
		infraRetries:     counter("kafkapg_infrastructure_retries_total").WithLabelValues(),
		internalErrors:   counter("kafkapg_internal_errors_total").WithLabelValues(),
		lag:              gauge("kafkapg_consumer_lag_records", "topic", "partition"),
		paused:           gauge("kafkapg_partition_paused_seconds", "topic", "partition"),
		pausedTooLong:    gauge("kafkapg_paused_too_long_seconds").WithLabelValues(),
		stalled:          gauge("kafkapg_stalled_partitions", "cause"),
		stuck:            gauge("kafkapg_stuck_keys", "reason"),
		tierLag:          gauge("kafkapg_retry_tier_lag_seconds", "tier"),
		ready:            gauge("kafkapg_ready").WithLabelValues(),
		breaker:          gauge("kafkapg_circuit_breaker_open").WithLabelValues(),
		newDeadLetters:   gauge("kafkapg_dead_letters_new").WithLabelValues(),
		oldestNew:        gauge("kafkapg_dead_letter_oldest_new_seconds").WithLabelValues(),
		oldestHeld:       gauge("kafkapg_oldest_held_record_age_seconds").WithLabelValues(),
		interrupted:      gauge("kafkapg_tasks_interrupted").WithLabelValues(),
		outboxSetAside:   gauge("kafkapg_outbox_set_aside_records").WithLabelValues(),
		outboxOldest:     gauge("kafkapg_outbox_oldest_record_age_seconds").WithLabelValues(),
		idempotencyBytes: gauge("kafkapg_idempotency_keys_bytes").WithLabelValues(),
	}
	p.ready.Set(1)
	return p
}

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func TestSamplerReadsTheMetrics(t *testing.T) {
	t.Parallel()
	p := newProcess()
	p.lag.WithLabelValues("orders", "0").Set(700)
	p.lag.WithLabelValues("orders", "1").Set(300)
	p.lag.WithLabelValues("payments", "0").Set(5)
	p.applied.WithLabelValues("orders").Add(90)
	p.applied.WithLabelValues("payments").Add(10)
	p.consumed.WithLabelValues("orders").Add(120)
	p.failures.WithLabelValues("orders", "retryable").Add(4)
	p.failures.WithLabelValues("orders", "permanent").Add(2)
	p.failures.WithLabelValues("orders", "infrastructure").Add(50)
	p.deadLettered.WithLabelValues("orders", "permanent").Add(2)
	p.breaker.Set(1)
	p.stalled.WithLabelValues("breaker").Set(2)
	p.stalled.WithLabelValues("handler").Set(0)
	p.stuck.WithLabelValues("orphaned").Set(3)
	p.stuck.WithLabelValues("overdue").Set(1)
	p.newDeadLetters.Set(7)
	p.oldestHeld.Set(90)
	p.tierLag.WithLabelValues("1").Set(12)
	p.tierLag.WithLabelValues("2").Set(400)
	p.interrupted.Set(1)
	p.ready.Set(0)

	s := NewSampler(p.reg, 0, 0)
	s.Sample(t0)
	got := s.Samples()
	if len(got) != 1 {
		t.Fatalf("%d samples, want 1", len(got))
	}
	g := got[0]
	checks := []struct {
		name      string
		got, want any
	}{
		{"At", g.At, t0},
		{"HasLag", g.HasLag, true},
		{"Lag", g.Lag, int64(1005)},
		{"TopicLag[orders]", g.TopicLag["orders"], int64(1000)},
		{"PartitionLag[orders 1]", g.PartitionLag[TopicPartition{"orders", "1"}], int64(300)},
		{"Applied", g.Applied, 100.0},
		{"ByTopic[orders].Applied", g.ByTopic["orders"].Applied, 90.0},
		{"Consumed", g.Consumed, 120.0},
		{"Failed (infrastructure not counted)", g.Failed, 6.0},
		{"DeadLettered", g.DeadLettered, 2.0},
		{"BreakerOpen", g.BreakerOpen, true},
		{"NotReady", g.NotReady, true},
		{"Stalled[breaker]", g.Stalled["breaker"], int64(2)},
		{"StalledTotal", g.StalledTotal(), int64(2)},
		{"StuckTotal", g.StuckTotal(), int64(4)},
		{"NewDeadLetters", g.NewDeadLetters, int64(7)},
		{"OldestHeld", g.OldestHeld, 90 * time.Second},
		{"MaxTierOverdue", g.MaxTierOverdue(), 400 * time.Second},
		{"TasksInterrupted", g.TasksInterrupted, int64(1)},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
}

func TestSamplerWithoutMetrics(t *testing.T) {
	t.Parallel()
	s := NewSampler(prometheus.NewRegistry(), 0, 0)
	s.Sample(t0)
	g := s.Samples()[0]
	if g.HasLag || g.Lag != 0 || g.Applied != 0 || g.BreakerOpen || g.NotReady || g.StalledTotal() != 0 {
		t.Errorf("sample of an empty registry = %+v, want zeros", g)
	}
	if a := Alerts(s.Samples(), t0); len(a) != 0 {
		t.Errorf("alerts of an empty registry: %+v", a)
	}
}

// failing is a collector that fails.
type failing struct{ desc *prometheus.Desc }

func (f failing) Describe(ch chan<- *prometheus.Desc) { ch <- f.desc }
func (f failing) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.NewInvalidMetric(f.desc, errors.New("collector down"))
}

func TestSamplerKeepsWhatItGathers(t *testing.T) {
	t.Parallel()
	p := newProcess()
	p.newDeadLetters.Set(2)
	p.reg.MustRegister(failing{prometheus.NewDesc("failing", "fails", nil, nil)})
	if _, err := p.reg.Gather(); err == nil {
		t.Fatal("the failing collector does not fail")
	}
	s := NewSampler(p.reg, 0, 0)
	s.Sample(t0)
	if got := s.Samples()[0].NewDeadLetters; got != 2 {
		t.Errorf("NewDeadLetters = %d, want 2 despite the failing collector", got)
	}
}

func TestSamplerDropsOldSamples(t *testing.T) {
	t.Parallel()
	s := NewSampler(newProcess().reg, 15*time.Second, time.Minute)
	for i := range 9 { // two minutes
		s.Sample(t0.Add(time.Duration(i) * 15 * time.Second))
	}
	got := s.Samples()
	if len(got) != 5 || !got[0].At.Equal(t0.Add(time.Minute)) || !got[4].At.Equal(t0.Add(2*time.Minute)) {
		t.Fatalf("kept %d samples from %v to %v, want 5 from t0+1m to t0+2m", len(got), got[0].At, got[len(got)-1].At)
	}
	got[0].At = time.Time{}
	if s.Samples()[0].At.IsZero() {
		t.Error("Samples returned the sampler's own slice")
	}
}

func TestSamplerRunSamplesAtOnce(t *testing.T) {
	t.Parallel()
	s := NewSampler(newProcess().reg, time.Hour, 0)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	s.Run(ctx) // returns: ctx has ended
	if n := len(s.Samples()); n != 1 {
		t.Errorf("%d samples after Run, want 1", n)
	}
}

// series returns samples every 15 s from t0 whose counters follow applied, failed and dead(i).
func series(n int, applied, failed, dead func(i int) float64) []Sample {
	var out []Sample
	for i := range n {
		out = append(out, Sample{At: t0.Add(time.Duration(i) * 15 * time.Second), Applied: applied(i), Failed: failed(i), DeadLettered: dead(i)})
	}
	return out
}

func TestRates(t *testing.T) {
	t.Parallel()
	linear := func(perStep float64) func(int) float64 { return func(i int) float64 { return perStep * float64(i) } }
	tests := []struct {
		name                        string
		samples                     []Sample
		window                      time.Duration
		applied, failed, deadLetter float64
		ok                          bool
	}{
		{name: "no sample", window: time.Minute},
		{name: "one sample", samples: series(1, linear(1), linear(1), linear(1)), window: time.Minute},
		{
			name:    "steady",
			samples: series(21, linear(150), linear(15), linear(3)), window: 5 * time.Minute,
			applied: 10, failed: 1, deadLetter: 0.2, ok: true,
		},
		{
			name: "the window only", window: time.Minute,
			samples: series(21, func(i int) float64 { return float64(max(0, i-16)) * 150 }, linear(0), linear(0)),
			applied: 10, ok: true,
		},
		{
			// 0, 150, 300, then a restart: 60, 210. The increase is 150+150+60+150 = 510 in 60 s.
			name: "counter reset", window: time.Minute,
			samples: series(5, func(i int) float64 { return []float64{0, 150, 300, 60, 210}[i] }, linear(0), linear(0)),
			applied: 8.5, ok: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			applied, failed, dead, ok := Rates(tt.samples, tt.window)
			if ok != tt.ok || !near(applied, tt.applied) || !near(failed, tt.failed) || !near(dead, tt.deadLetter) {
				t.Errorf("Rates = %v, %v, %v, %v; want %v, %v, %v, %v", applied, failed, dead, ok, tt.applied, tt.failed, tt.deadLetter, tt.ok)
			}
		})
	}
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

func TestChart(t *testing.T) {
	t.Parallel()
	var samples []Sample
	for i := range 240 {
		samples = append(samples, Sample{
			At:      t0.Add(time.Duration(i) * 15 * time.Second),
			HasLag:  true,
			Lag:     int64(2500 - math.Abs(float64(i-120))*10), // peaks at 2.5k
			Applied: float64(i * 300),                          // 20 per second
		})
	}
	now := samples[len(samples)-1].At
	svg := string(Chart(samples, now, time.Hour))
	wellFormed(t, svg)
	for _, want := range []string{
		`<svg id="chart"`, `role="img"`, `<title id="chart-title">Lag and throughput, last hour</title>`,
		`class="lag area" d="M`, `class="lag line" d="M`, `class="throughput" d="M`,
		`>2.5k</text>`, `>20/s</text>`, `>-60m</text>`, `>-45m</text>`, `>-30m</text>`, `>-15m</text>`, `>now</text>`,
	} {
		if !strings.Contains(svg, want) {
			t.Errorf("the chart lacks %s:\n%s", want, svg)
		}
	}
	if strings.Contains(svg, "Collecting samples") || strings.Contains(svg, "NaN") || strings.Contains(svg, "style=") {
		t.Errorf("the chart has no business saying that:\n%s", svg)
	}

	for _, samples := range [][]Sample{nil, samples[:1], samples[:30]} { // the last is out of span
		svg := string(Chart(samples, now.Add(2*time.Hour), time.Hour))
		wellFormed(t, svg)
		if !strings.Contains(svg, `<svg id="chart"`) || !strings.Contains(svg, "Collecting samples: the chart fills in") || strings.Contains(svg, `class="throughput"`) {
			t.Errorf("chart of %d samples:\n%s", len(samples), svg)
		}
	}
}

func wellFormed(t *testing.T, svg string) {
	t.Helper()
	d := xml.NewDecoder(strings.NewReader(svg))
	for {
		if _, err := d.Token(); err == io.EOF {
			return
		} else if err != nil {
			t.Fatalf("the chart is not well-formed: %v\n%s", err, svg)
		}
	}
}

func TestHumanNum(t *testing.T) {
	t.Parallel()
	for v, want := range map[float64]string{0: "0", 0.24: "0.2", 0.25: "0.3", 12: "12", 999: "999", 1234: "1.2k", 999_960: "1M", 3_400_000: "3.4M", 2e9: "2G"} {
		if got := humanNum(v); got != want {
			t.Errorf("humanNum(%v) = %q, want %q", v, got, want)
		}
	}
}

// TestAlerts drives each rule's metrics a sample every 15 s: when its condition holds, the alert
// must be pending until it has held for the rule's for-duration and firing from then on; when it
// does not, the alert must not be there.
func TestAlerts(t *testing.T) {
	t.Parallel()
	const every = 15 * time.Second
	tests := []struct {
		name    string
		alert   string
		for_    time.Duration
		step    func(p *process, i int) // sets the metrics for sample i
		holds   bool
		summary string // a part of the summary, if it holds
	}{
		{name: "lag over 1000 and growing", alert: "KafkapgLagGrowing", for_: 15 * time.Minute, holds: true, summary: "Lag on orders keeps growing: 2",
			step: func(p *process, i int) { p.lag.WithLabelValues("orders", "0").Set(float64(2000 + 5*i)) }},
		{name: "lag over 1000, not growing", alert: "KafkapgLagGrowing",
			step: func(p *process, i int) { p.lag.WithLabelValues("orders", "0").Set(2000) }},
		{name: "lag growing under 1000", alert: "KafkapgLagGrowing",
			step: func(p *process, i int) { p.lag.WithLabelValues("orders", "0").Set(float64(10 + i)) }},

		// A partition an operator paused (or its whole topic): its lag grows on purpose.
		{name: "lag growing on a paused partition", alert: "KafkapgLagGrowing",
			step: func(p *process, i int) {
				p.lag.WithLabelValues("orders", "0").Set(float64(2000 + 5*i))
				p.lag.WithLabelValues("orders", "1").Set(10)
				p.paused.WithLabelValues("orders", "0").Set(float64(i) * 15)
			}},
		{name: "lag growing beside a paused partition", alert: "KafkapgLagGrowing", for_: 15 * time.Minute, holds: true, summary: "Lag on orders keeps growing: 2",
			step: func(p *process, i int) {
				p.lag.WithLabelValues("orders", "0").Set(float64(2000 + 5*i))
				p.lag.WithLabelValues("orders", "1").Set(float64(2000 + 5*i))
				p.paused.WithLabelValues("orders", "0").Set(float64(i) * 15)
			}},
		{name: "lag growing on a paused topic", alert: "KafkapgLagGrowing",
			step: func(p *process, i int) {
				p.lag.WithLabelValues("orders", "0").Set(float64(2000 + 5*i))
				p.paused.WithLabelValues("orders", "all").Set(float64(i) * 15)
			}},
		{name: "lag and nothing applied, paused", alert: "KafkapgPartitionStuck",
			step: func(p *process, i int) {
				p.lag.WithLabelValues("orders", "3").Set(50)
				p.applied.WithLabelValues("orders")
				p.paused.WithLabelValues("orders", "3").Set(float64(i) * 15)
			}},
		{name: "paused longer than PAUSED_TOO_LONG", alert: "KafkapgPausedTooLong", holds: true, summary: "orders partition 3 has been paused for",
			step: func(p *process, i int) {
				p.pausedTooLong.Set(3600)
				p.paused.WithLabelValues("orders", "3").Set(3600 + float64(i)*15 + 1)
			}},
		{name: "paused, not for long", alert: "KafkapgPausedTooLong",
			step: func(p *process, i int) {
				p.pausedTooLong.Set(3600)
				p.paused.WithLabelValues("orders", "3").Set(60)
			}},

		{name: "lag and nothing applied", alert: "KafkapgPartitionStuck", for_: 30 * time.Minute, holds: true, summary: "nothing from orders partition 3: 50 records wait",
			step: func(p *process, i int) {
				p.lag.WithLabelValues("orders", "3").Set(50)
				p.applied.WithLabelValues("orders")
			}},
		{name: "lag and records applied", alert: "KafkapgPartitionStuck",
			step: func(p *process, i int) {
				p.lag.WithLabelValues("orders", "3").Set(50)
				p.applied.WithLabelValues("orders").Inc()
			}},
		{name: "no lag", alert: "KafkapgPartitionStuck",
			step: func(p *process, i int) {
				p.lag.WithLabelValues("orders", "3").Set(0)
				p.applied.WithLabelValues("orders")
			}},

		{name: "6% of the records fail", alert: "KafkapgFailureRateHigh", for_: 10 * time.Minute, holds: true, summary: "6.0%",
			step: func(p *process, i int) {
				p.consumed.WithLabelValues("orders").Add(100)
				p.failures.WithLabelValues("orders", "retryable").Add(6)
			}},
		{name: "4% of the records fail", alert: "KafkapgFailureRateHigh",
			step: func(p *process, i int) {
				p.consumed.WithLabelValues("orders").Add(100)
				p.failures.WithLabelValues("orders", "retryable").Add(4)
			}},
		{name: "infrastructure failures", alert: "KafkapgFailureRateHigh",
			step: func(p *process, i int) {
				p.consumed.WithLabelValues("orders").Add(100)
				p.failures.WithLabelValues("orders", "infrastructure").Add(50)
			}},

		{name: "records dead-lettered", alert: "KafkapgDeadLettersGrowing", holds: true, summary: "of orders were dead-lettered",
			step: func(p *process, i int) { p.deadLettered.WithLabelValues("orders", "permanent").Inc() }},
		{name: "no record dead-lettered", alert: "KafkapgDeadLettersGrowing",
			step: func(p *process, i int) { p.deadLettered.WithLabelValues("orders", "permanent") }},

		{name: "a dead letter new for over a day", alert: "KafkapgDeadLettersUnhandled", for_: 10 * time.Minute, holds: true, summary: "A dead letter has waited 25h",
			step: func(p *process, i int) {
				p.newDeadLetters.Set(3)
				p.oldestNew.Set((25*time.Hour + time.Duration(i)*every).Seconds())
			}},
		// A steady trickle handled within the hour: there are always new dead letters, none old.
		{name: "new dead letters, none a day old", alert: "KafkapgDeadLettersUnhandled",
			step: func(p *process, i int) { p.newDeadLetters.Set(3); p.oldestNew.Set(float64(i%60) * 60) }},
		{name: "no new dead letter", alert: "KafkapgDeadLettersUnhandled",
			step: func(p *process, i int) { p.newDeadLetters.Set(0); p.oldestNew.Set(0) }},

		{name: "a task interrupted", alert: "KafkapgReplayTaskInterrupted", for_: 10 * time.Minute, holds: true, summary: "1 replay",
			step: func(p *process, i int) { p.interrupted.Set(1) }},
		{name: "no task interrupted", alert: "KafkapgReplayTaskInterrupted",
			step: func(p *process, i int) { p.interrupted.Set(0) }},

		{name: "a key held over an hour", alert: "KafkapgKeyHeldTooLong", for_: 5 * time.Minute, holds: true, summary: "for 1h01m",
			step: func(p *process, i int) { p.oldestHeld.Set(3700) }},
		{name: "a key held under an hour", alert: "KafkapgKeyHeldTooLong",
			step: func(p *process, i int) { p.oldestHeld.Set(3500) }},

		{name: "a tier behind", alert: "KafkapgRetryTierBehind", for_: 10 * time.Minute, holds: true, summary: "Retry tier 2 is 6m40s behind",
			step: func(p *process, i int) {
				p.tierLag.WithLabelValues("1").Set(10)
				p.tierLag.WithLabelValues("2").Set(400)
			}},
		{name: "tiers on time", alert: "KafkapgRetryTierBehind",
			step: func(p *process, i int) { p.tierLag.WithLabelValues("2").Set(200) }},

		{name: "not ready", alert: "KafkapgNotReady", for_: 10 * time.Minute, holds: true,
			step: func(p *process, i int) { p.ready.Set(0) }},
		{name: "ready", alert: "KafkapgNotReady",
			step: func(p *process, i int) { p.ready.Set(1) }},

		{name: "breaker open", alert: "KafkapgCircuitBreakerOpen", for_: 5 * time.Minute, holds: true, summary: "circuit breaker is open",
			step: func(p *process, i int) { p.breaker.Set(1) }},
		{name: "breaker closed", alert: "KafkapgCircuitBreakerOpen",
			step: func(p *process, i int) { p.breaker.Set(0) }},

		{name: "transactions fenced", alert: "KafkapgFencedTransactions", holds: true,
			step: func(p *process, i int) { p.fenced.Add(20) }},
		{name: "a few transactions fenced", alert: "KafkapgFencedTransactions",
			step: func(p *process, i int) {
				if i%10 == 0 {
					p.fenced.Inc()
				}
			}},

		{name: "retries in place", alert: "KafkapgInfrastructureRetries", for_: 10 * time.Minute, holds: true, summary: "0.3 transactions per second",
			step: func(p *process, i int) { p.infraRetries.Add(5) }},
		{name: "a few retries in place", alert: "KafkapgInfrastructureRetries",
			step: func(p *process, i int) { p.infraRetries.Add(2) }},

		{name: "partitions stalled", alert: "KafkapgPartitionStalled", holds: true, summary: "2 partitions have made no progress for STALL_TIMEOUT (cause: breaker)",
			step: func(p *process, i int) {
				p.stalled.WithLabelValues("breaker").Set(2)
				p.stalled.WithLabelValues("handler").Set(0)
			}},
		{name: "no partition stalled", alert: "KafkapgPartitionStalled",
			step: func(p *process, i int) { p.stalled.WithLabelValues("breaker").Set(0) }},

		{name: "keys stuck", alert: "KafkapgKeysStuck", for_: 5 * time.Minute, holds: true, summary: "3 held keys are stuck (orphaned)",
			step: func(p *process, i int) { p.stuck.WithLabelValues("orphaned").Set(3) }},
		{name: "no key stuck", alert: "KafkapgKeysStuck",
			step: func(p *process, i int) { p.stuck.WithLabelValues("orphaned").Set(0) }},

		{name: "internal errors", alert: "KafkapgInternalErrors", holds: true,
			step: func(p *process, i int) { p.internalErrors.Inc() }},
		{name: "no internal error", alert: "KafkapgInternalErrors",
			step: func(p *process, i int) {}},

		{name: "outbox records set aside", alert: "KafkapgOutboxSetAside", holds: true,
			step: func(p *process, i int) { p.outboxSetAside.Set(2) }},
		{name: "outbox records waiting", alert: "KafkapgOutboxStuck", for_: 2 * time.Minute, holds: true, summary: "waited 1m30s",
			step: func(p *process, i int) { p.outboxOldest.Set(90) }},
		{name: "outbox records published", alert: "KafkapgOutboxStuck",
			step: func(p *process, i int) { p.outboxOldest.Set(30) }},

		// 10 GB, growing 1 GB a sample (every 15 s): 3 days of that is far over 100 GB.
		{name: "idempotency keys growing", alert: "KafkapgIdempotencyKeysGrowing", for_: 30 * time.Minute, holds: true, summary: "will take over 100GB within 3 days",
			step: func(p *process, i int) { p.idempotencyBytes.Set(10e9 + float64(i)*1e9) }},
		// 90 GB and level (pruning keeps pace): below the limit for good.
		{name: "idempotency keys level", alert: "KafkapgIdempotencyKeysGrowing",
			step: func(p *process, i int) { p.idempotencyBytes.Set(90e9) }},
		// 1 GB growing 10 kB a sample: 3 days of that is a few GB.
		{name: "idempotency keys growing slowly", alert: "KafkapgIdempotencyKeysGrowing",
			step: func(p *process, i int) { p.idempotencyBytes.Set(1e9 + float64(i)*1e4) }},
		// Above the limit and level: already too large.
		{name: "idempotency keys over the limit", alert: "KafkapgIdempotencyKeysGrowing", for_: 30 * time.Minute, holds: true, summary: "take 120GB",
			step: func(p *process, i int) { p.idempotencyBytes.Set(120e9) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p := newProcess()
			s := NewSampler(p.reg, every, time.Hour)
			run := min(tt.for_+3*time.Minute, time.Hour) // no sample dropped
			var since time.Time
			var pending, firing bool
			for i := range int(run / every) {
				now := t0.Add(time.Duration(i) * every)
				tt.step(p, i)
				s.Sample(now)
				alerts := Alerts(s.Samples(), now)
				if again := Alerts(uncached(s.Samples()), now); !reflect.DeepEqual(again, alerts) {
					t.Fatalf("at t0+%v: the sampler's evaluations give %+v, evaluating again gives %+v", now.Sub(t0), alerts, again)
				}
				var got []Alert
				for _, a := range alerts {
					if a.Name == tt.alert {
						got = append(got, a)
					}
				}
				if !tt.holds {
					if len(got) > 0 {
						t.Fatalf("at t0+%v: %+v, want no alert", now.Sub(t0), got)
					}
					continue
				}
				if len(got) == 0 {
					if !since.IsZero() {
						t.Fatalf("at t0+%v: the alert has gone", now.Sub(t0))
					}
					continue
				}
				a := got[0]
				if len(got) > 1 || a.For != tt.for_ || !strings.Contains(a.Summary, tt.summary) {
					t.Fatalf("at t0+%v: %+v, want one alert for %v saying %q", now.Sub(t0), got, tt.for_, tt.summary)
				}
				if since.IsZero() {
					since = a.Since
				}
				wantFiring := now.Sub(since) >= tt.for_
				if !a.Since.Equal(since) || a.Firing != wantFiring {
					t.Fatalf("at t0+%v: since t0+%v, firing %v; want since t0+%v, firing %v", now.Sub(t0), a.Since.Sub(t0), a.Firing, since.Sub(t0), wantFiring)
				}
				pending, firing = pending || !a.Firing, firing || a.Firing
			}
			switch {
			case !tt.holds:
			case since.IsZero() || since.Sub(t0) > time.Minute:
				t.Errorf("the alert held from t0+%v, want from the first samples", since.Sub(t0))
			case tt.for_ > 0 && !pending:
				t.Error("the alert was never pending")
			case tt.for_ < time.Hour && !firing: // no longer than the samples kept
				t.Error("the alert never fired")
			case tt.for_ >= time.Hour && firing:
				t.Error("the alert fired")
			}
		})
	}
}

// uncached returns samples without the rules' evaluations the sampler made.
func uncached(samples []Sample) []Sample {
	for i := range samples {
		samples[i].held = nil
	}
	return samples
}

// TestAlertsSinceTheConditionLastStarted checks that a condition that stops holding starts over.
func TestAlertsSinceTheConditionLastStarted(t *testing.T) {
	t.Parallel()
	p := newProcess()
	s := NewSampler(p.reg, 0, 0)
	for i, open := range []bool{true, true, true, false, true, true} {
		p.breaker.Set(map[bool]float64{true: 1}[open])
		s.Sample(t0.Add(time.Duration(i) * time.Minute))
	}
	now := t0.Add(10 * time.Minute)
	a := Alerts(s.Samples(), now)
	if len(a) != 1 || a[0].Name != "KafkapgCircuitBreakerOpen" || !a[0].Since.Equal(t0.Add(4*time.Minute)) || !a[0].Firing || a[0].State() != "firing" {
		t.Fatalf("Alerts = %+v, want the breaker open since t0+4m, firing", a)
	}
}

// TestRulesFollowTheAlertRules: the console evaluates every alert of
// deploy/kubernetes/prometheusrule.yaml (but KafkapgAbsent: the process serving the console is
// present), with its severity and for-duration, and no alert of its own.
func TestRulesFollowTheAlertRules(t *testing.T) {
	yaml, err := os.ReadFile("../../deploy/kubernetes/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	type want struct {
		severity string
		for_     time.Duration
	}
	inFile := map[string]want{}
	var name string
	for _, line := range strings.Split(string(yaml), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "- alert: "):
			name = strings.TrimPrefix(line, "- alert: ")
			inFile[name] = want{}
		case strings.HasPrefix(line, "for: ") && name != "":
			w := inFile[name]
			if w.for_, err = time.ParseDuration(strings.TrimPrefix(line, "for: ")); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			inFile[name] = w
		case strings.HasPrefix(line, "severity: ") && name != "" && inFile[name].severity == "":
			w := inFile[name]
			w.severity = strings.TrimPrefix(line, "severity: ")
			inFile[name] = w
		}
	}
	delete(inFile, "KafkapgAbsent")
	if len(inFile) < 10 {
		t.Fatalf("read %d alerts from the rules file: the parse is wrong", len(inFile))
	}
	seen := map[string]bool{}
	for _, r := range rules {
		seen[r.name] = true
		w, ok := inFile[r.name]
		if !ok {
			t.Errorf("the console evaluates %s, which the rules file does not have", r.name)
			continue
		}
		if w.severity != r.severity || w.for_ != r.for_ {
			t.Errorf("%s: severity %s, for %s in the console; %s, %s in the rules file", r.name, r.severity, r.for_, w.severity, w.for_)
		}
	}
	for n := range inFile {
		if !seen[n] {
			t.Errorf("the rules file has %s; the console does not evaluate it", n)
		}
	}
}
