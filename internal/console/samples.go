package console

import (
	"context"
	"fmt"
	"html/template"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The overview shows lag, throughput, rates and the alerts that would fire without a Prometheus
// server: a Sampler reads the process's own registry every few seconds and keeps the last hour.
// What it sees is this process: the group-wide gauges (lag, retry path, dead letters) are the
// group's, but the per-process ones (breaker, stalled partitions, failure counters) are only this
// replica's.

// Sample is the state of the process's metrics at one time. Metric families that are absent
// (the processor has not started yet) read as zero. Its maps are never changed once the sample is
// taken.
type Sample struct {
	At time.Time

	// HasLag is false while kafkapg_consumer_lag_records has no series; Lag is then 0.
	HasLag       bool
	Lag          int64                    // records not applied yet, all source partitions
	TopicLag     map[string]int64         // the same by topic
	PartitionLag map[TopicPartition]int64 // and by partition

	// Paused is how long each pause of the group has lasted (kafkapg_partition_paused_seconds),
	// by source topic and partition, "all" for a whole topic; PausedTooLong is PAUSED_TOO_LONG
	// (kafkapg_paused_too_long_seconds). The lag rules leave paused partitions out.
	Paused        map[TopicPartition]time.Duration
	PausedTooLong time.Duration

	// Counters, summed over their labels.
	Applied      float64 // kafkapg_records_applied_total
	Consumed     float64 // kafkapg_records_consumed_total
	Failed       float64 // kafkapg_record_failures_total, infrastructure failures not counted
	DeadLettered float64 // kafkapg_records_dead_lettered_total
	ByTopic      map[string]Counts

	Fenced         float64 // kafkapg_fenced_transactions_total
	Forgotten      float64 // kafkapg_forgotten_partitions_total
	InfraRetries   float64 // kafkapg_infrastructure_retries_total
	InternalErrors float64 // kafkapg_internal_errors_total

	// Gauges.
	NotReady         bool                     // kafkapg_ready is 0 (false while absent)
	BreakerOpen      bool                     // kafkapg_circuit_breaker_open is 1
	Stalled          map[string]int64         // kafkapg_stalled_partitions by cause
	Stuck            map[string]int64         // kafkapg_stuck_keys by reason
	NewDeadLetters   int64                    // kafkapg_dead_letters_new
	OldestNew        time.Duration            // kafkapg_dead_letter_oldest_new_seconds
	OldestHeld       time.Duration            // kafkapg_oldest_held_record_age_seconds
	TierOverdue      map[string]time.Duration // kafkapg_retry_tier_lag_seconds by tier
	TasksInterrupted int64                    // kafkapg_tasks_interrupted
	OutboxSetAside   int64                    // kafkapg_outbox_set_aside_records
	OutboxOldest     time.Duration            // kafkapg_outbox_oldest_record_age_seconds
	Preparing        int64                    // kafkapg_prepares_in_flight, all topics
	IdempotencyBytes float64                  // kafkapg_idempotency_keys_bytes

	// held is what each alerting rule found at this sample, by rule name: the Sampler evaluates
	// the rules as it takes the sample, as Prometheus does at each interval, so that Alerts need
	// not evaluate them again over the whole history. Nil in a Sample made otherwise.
	held map[string]map[string]string
}

// TopicPartition names a source partition (the labels of kafkapg_consumer_lag_records).
type TopicPartition struct{ Topic, Partition string }

// IsPaused reports whether an operator paused tp, or its whole topic.
func (s Sample) IsPaused(tp TopicPartition) bool {
	_, one := s.Paused[tp]
	_, all := s.Paused[TopicPartition{tp.Topic, "all"}]
	return one || all
}

// activeLag is the lag of topic's partitions that are not paused (KafkapgLagGrowing's).
func (s Sample) activeLag(topic string) (int64, bool) {
	var n int64
	found := false
	for tp, lag := range s.PartitionLag {
		if tp.Topic == topic && !s.IsPaused(tp) {
			n, found = n+lag, true
		}
	}
	return n, found
}

// Counts are a topic's record counters (Sample's counters by their topic label).
type Counts struct{ Applied, Consumed, Failed, DeadLettered float64 }

// StalledTotal is the number of stalled partitions, all causes.
func (s Sample) StalledTotal() int64 { return sumOf(s.Stalled) }

// StuckTotal is the number of stuck keys, all reasons.
func (s Sample) StuckTotal() int64 { return sumOf(s.Stuck) }

// MaxTierOverdue is how far the most overdue retry tier is behind its due times.
func (s Sample) MaxTierOverdue() time.Duration {
	var m time.Duration
	for _, d := range s.TierOverdue {
		m = max(m, d)
	}
	return m
}

func sumOf(m map[string]int64) int64 {
	var n int64
	for _, v := range m {
		n += v
	}
	return n
}

// add folds one series of metric name into s.
func (s *Sample) add(name string, v float64, label func(string) string) {
	seconds := func(v float64) time.Duration { return time.Duration(v * float64(time.Second)) }
	count := func(f func(*Counts)) {
		c := s.ByTopic[label("topic")]
		f(&c)
		s.ByTopic[label("topic")] = c
	}
	switch name {
	case "kafkapg_consumer_lag_records":
		n := int64(v)
		s.HasLag = true
		s.Lag += n
		s.TopicLag[label("topic")] += n
		s.PartitionLag[TopicPartition{label("topic"), label("partition")}] += n
	case "kafkapg_partition_paused_seconds":
		s.Paused[TopicPartition{label("topic"), label("partition")}] = seconds(v)
	case "kafkapg_paused_too_long_seconds":
		s.PausedTooLong = seconds(v)
	case "kafkapg_records_applied_total":
		s.Applied += v
		count(func(c *Counts) { c.Applied += v })
	case "kafkapg_records_consumed_total":
		s.Consumed += v
		count(func(c *Counts) { c.Consumed += v })
	case "kafkapg_record_failures_total":
		if label("class") == "infrastructure" { // retried in place, never the record's fault
			return
		}
		s.Failed += v
		count(func(c *Counts) { c.Failed += v })
	case "kafkapg_records_dead_lettered_total":
		s.DeadLettered += v
		count(func(c *Counts) { c.DeadLettered += v })
	case "kafkapg_fenced_transactions_total":
		s.Fenced += v
	case "kafkapg_forgotten_partitions_total":
		s.Forgotten += v
	case "kafkapg_infrastructure_retries_total":
		s.InfraRetries += v
	case "kafkapg_internal_errors_total":
		s.InternalErrors += v
	case "kafkapg_ready":
		s.NotReady = v == 0
	case "kafkapg_circuit_breaker_open":
		s.BreakerOpen = s.BreakerOpen || v == 1
	case "kafkapg_stalled_partitions":
		s.Stalled[label("cause")] += int64(v)
	case "kafkapg_stuck_keys":
		s.Stuck[label("reason")] += int64(v)
	case "kafkapg_dead_letters_new":
		s.NewDeadLetters = int64(v)
	case "kafkapg_dead_letter_oldest_new_seconds":
		s.OldestNew = max(s.OldestNew, seconds(v))
	case "kafkapg_oldest_held_record_age_seconds":
		s.OldestHeld = seconds(v)
	case "kafkapg_retry_tier_lag_seconds":
		s.TierOverdue[label("tier")] = seconds(v)
	case "kafkapg_tasks_interrupted":
		s.TasksInterrupted = int64(v)
	case "kafkapg_outbox_set_aside_records":
		s.OutboxSetAside = int64(v)
	case "kafkapg_outbox_oldest_record_age_seconds":
		s.OutboxOldest = seconds(v)
	case "kafkapg_prepares_in_flight":
		s.Preparing += int64(v)
	case "kafkapg_idempotency_keys_bytes":
		s.IdempotencyBytes = max(s.IdempotencyBytes, v)
	}
}

// Sampler keeps samples of a process's metrics, oldest first, for the last keep. It is safe for
// concurrent use.
type Sampler struct {
	g     prometheus.Gatherer
	every time.Duration
	keep  time.Duration

	mu      sync.Mutex
	samples []Sample
}

// NewSampler returns a Sampler of g. every defaults to 15 s and keep to an hour.
func NewSampler(g prometheus.Gatherer, every, keep time.Duration) *Sampler {
	if every <= 0 {
		every = 15 * time.Second
	}
	if keep <= 0 {
		keep = time.Hour
	}
	return &Sampler{g: g, every: every, keep: keep}
}

// Run takes a sample at once, then one every interval, until ctx ends.
func (s *Sampler) Run(ctx context.Context) {
	s.Sample(time.Now())
	t := time.NewTicker(s.every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			s.Sample(now)
		}
	}
}

// Sample takes a sample dated now and drops the samples older than keep.
func (s *Sampler) Sample(now time.Time) {
	smp := Sample{
		At:           now,
		TopicLag:     map[string]int64{},
		PartitionLag: map[TopicPartition]int64{},
		Paused:       map[TopicPartition]time.Duration{},
		ByTopic:      map[string]Counts{},
		Stalled:      map[string]int64{},
		Stuck:        map[string]int64{},
		TierOverdue:  map[string]time.Duration{},
	}
	// Gather returns what it could collect along with an error about the rest; a sample of
	// what it could is worth more than a hole in the chart.
	mfs, _ := s.g.Gather()
	for _, mf := range mfs {
		name := mf.GetName()
		if !strings.HasPrefix(name, "kafkapg_") {
			continue
		}
		for _, m := range mf.GetMetric() {
			var v float64
			switch {
			case m.GetCounter() != nil:
				v = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				v = m.GetGauge().GetValue()
			case m.GetUntyped() != nil:
				v = m.GetUntyped().GetValue()
			default:
				continue // histograms and summaries: not sampled
			}
			smp.add(name, v, func(label string) string {
				for _, l := range m.GetLabel() {
					if l.GetName() == label {
						return l.GetValue()
					}
				}
				return ""
			})
		}
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	s.samples = append(s.samples, smp)
	held := make(map[string]map[string]string, len(rules))
	for _, r := range rules {
		held[r.name] = r.holds(s.samples)
	}
	s.samples[len(s.samples)-1].held = held
	cut := now.Add(-s.keep)
	i := 0
	for i < len(s.samples) && s.samples[i].At.Before(cut) {
		i++
	}
	s.samples = slices.Delete(s.samples, 0, i)
}

// Samples returns the samples kept, oldest first.
func (s *Sampler) Samples() []Sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.samples)
}

// lastWindow returns the samples of samples (oldest first) dated within window of the newest.
func lastWindow(samples []Sample, window time.Duration) []Sample {
	if len(samples) == 0 {
		return nil
	}
	cut := samples[len(samples)-1].At.Add(-window)
	i, _ := slices.BinarySearchFunc(samples, cut, func(s Sample, t time.Time) int { return s.At.Compare(t) })
	return samples[i:]
}

// counterIncrease is how much the counter get grew over samples, a drop counting as a reset to
// zero as in Prometheus.
func counterIncrease(samples []Sample, get func(Sample) float64) float64 {
	var inc float64
	for i := 1; i < len(samples); i++ {
		d := get(samples[i]) - get(samples[i-1])
		if d < 0 {
			d = get(samples[i])
		}
		inc += d
	}
	return inc
}

// Rates returns the records applied, failed (infrastructure failures not counted) and
// dead-lettered per second over the window ending at the newest sample; ok is false with fewer
// than two samples in it.
func Rates(samples []Sample, window time.Duration) (applied, failed, deadLettered float64, ok bool) {
	w := lastWindow(samples, window)
	if len(w) < 2 {
		return 0, 0, 0, false
	}
	secs := w[len(w)-1].At.Sub(w[0].At).Seconds()
	if secs <= 0 {
		return 0, 0, 0, false
	}
	return counterIncrease(w, func(s Sample) float64 { return s.Applied }) / secs,
		counterIncrease(w, func(s Sample) float64 { return s.Failed }) / secs,
		counterIncrease(w, func(s Sample) float64 { return s.DeadLettered }) / secs,
		true
}

// humanNum formats v with a unit prefix and one decimal at most: 950, 1.2k, 3.4M.
func humanNum(v float64) string {
	units := []string{"", "k", "M", "G", "T"}
	for i, u := range units {
		r := math.Round(v*10) / 10
		if math.Abs(r) < 1000 || i == len(units)-1 {
			return strings.TrimSuffix(strconv.FormatFloat(r, 'f', 1, 64), ".0") + u
		}
		v /= 1000
	}
	panic("unreachable")
}

// humanDuration formats d to the second: 45s, 7m30s, 1h05m.
func humanDuration(d time.Duration) string {
	d = d.Round(time.Second)
	switch {
	case d >= time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	case d >= time.Minute:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	default:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	}
}

// The chart's geometry, in viewBox units.
const (
	chartW, chartH = 720.0, 220.0
	plotL, plotR   = 52.0, 668.0 // the plot's left and right edges
	plotT, plotB   = 28.0, 196.0 // its top and bottom
)

// Chart draws the lag (records, left axis, an area) and the throughput (records applied per
// second, right axis, a line) of the samples over span ending at now, as an inline SVG. With
// fewer than two samples in the span it draws the empty frame and says why.
func Chart(samples []Sample, now time.Time, span time.Duration) template.HTML {
	if span <= 0 {
		span = time.Hour
	}
	start := now.Add(-span)
	i, _ := slices.BinarySearchFunc(samples, start, func(s Sample, t time.Time) int { return s.At.Compare(t) })
	prev, shown := samples[max(i-1, 0):], samples[i:]
	x := func(t time.Time) float64 {
		return plotL + (plotR-plotL)*float64(t.Sub(start))/float64(span)
	}

	// The series: lag at each sample, throughput between each sample and the one before.
	var lag, tput [][2]float64 // (x, value); NaN values break the line
	var lagMax, tputMax float64
	for _, s := range shown {
		v := math.NaN()
		if s.HasLag {
			v = float64(s.Lag)
			lagMax = max(lagMax, v)
		}
		lag = append(lag, [2]float64{x(s.At), v})
	}
	for j := 1; j < len(prev); j++ {
		a, b := prev[j-1], prev[j]
		if b.At.Before(start) || !b.At.After(a.At) {
			continue
		}
		v := counterIncrease([]Sample{a, b}, func(s Sample) float64 { return s.Applied }) / b.At.Sub(a.At).Seconds()
		tputMax = max(tputMax, v)
		tput = append(tput, [2]float64{x(b.At), v})
	}

	var b strings.Builder
	title := "Lag and throughput, last " + spanText(span)
	fmt.Fprintf(&b, `<svg id="chart" class="chart" viewBox="0 0 %g %g" width="100%%" role="img" aria-labelledby="chart-title chart-desc" xmlns="http://www.w3.org/2000/svg">`, chartW, chartH)
	fmt.Fprintf(&b, `<title id="chart-title">%s</title>`, title)
	if len(shown) < 2 {
		b.WriteString(`<desc id="chart-desc">No data yet.</desc>`)
	} else {
		fmt.Fprintf(&b, `<desc id="chart-desc">Lag in records (left axis, max %s) and records applied per second (right axis, max %s).</desc>`, humanNum(lagMax), humanNum(tputMax))
	}
	fmt.Fprintf(&b, `<rect class="frame" x="%g" y="%g" width="%g" height="%g"/>`, plotL, plotT, plotR-plotL, plotB-plotT)

	// Time ticks: a vertical grid line and a label every quarter of the span.
	for q := range 5 {
		tx := plotL + (plotR-plotL)*float64(q)/4
		anchor, label := "middle", "-"+spanTick(span*time.Duration(4-q)/4)
		switch q {
		case 0:
			anchor = "start"
		case 4:
			anchor, label = "end", "now"
		}
		if q > 0 && q < 4 {
			fmt.Fprintf(&b, `<line class="grid" x1="%.1f" y1="%g" x2="%.1f" y2="%g"/>`, tx, plotT, tx, plotB)
		}
		fmt.Fprintf(&b, `<text class="tick" x="%.1f" y="%g" text-anchor="%s">%s</text>`, tx, plotB+16, anchor, label)
	}
	fmt.Fprintf(&b, `<line class="grid" x1="%g" y1="%g" x2="%g" y2="%g"/>`, plotL, (plotT+plotB)/2, plotR, (plotT+plotB)/2)

	if len(shown) < 2 {
		fmt.Fprintf(&b, `<text class="empty" x="%g" y="%g" text-anchor="middle">Collecting samples: the chart fills in over the next minutes.</text>`, (plotL+plotR)/2, (plotT+plotB)/2-6)
		b.WriteString(`</svg>`)
		return template.HTML(b.String())
	}

	// The axes' scales: zero to the series' maximum.
	y := func(v, top float64) float64 {
		if top <= 0 {
			return plotB
		}
		return plotB - (plotB-plotT)*v/top
	}
	fmt.Fprintf(&b, `<path class="lag area" d="%s"/>`, svgPath(lag, func(v float64) float64 { return y(v, lagMax) }, true))
	fmt.Fprintf(&b, `<path class="lag line" d="%s"/>`, svgPath(lag, func(v float64) float64 { return y(v, lagMax) }, false))
	fmt.Fprintf(&b, `<path class="throughput" d="%s"/>`, svgPath(tput, func(v float64) float64 { return y(v, tputMax) }, false))

	fmt.Fprintf(&b, `<text class="axis lag" x="%g" y="%g" text-anchor="end">%s</text>`, plotL-6, plotT+4, humanNum(lagMax))
	fmt.Fprintf(&b, `<text class="axis" x="%g" y="%g" text-anchor="end">0</text>`, plotL-6, plotB)
	fmt.Fprintf(&b, `<text class="axis throughput" x="%g" y="%g">%s/s</text>`, plotR+6, plotT+4, humanNum(tputMax))
	fmt.Fprintf(&b, `<text class="axis" x="%g" y="%g">0/s</text>`, plotR+6, plotB)

	// The legend, above the plot.
	fmt.Fprintf(&b, `<rect class="lag area" x="%g" y="8" width="14" height="10"/>`, plotL)
	fmt.Fprintf(&b, `<text class="legend" x="%g" y="17">lag (records, left)</text>`, plotL+20)
	fmt.Fprintf(&b, `<line class="throughput" x1="%g" y1="13" x2="%g" y2="13"/>`, plotL+170, plotL+184)
	fmt.Fprintf(&b, `<text class="legend" x="%g" y="17">applied per second (right)</text>`, plotL+190)
	b.WriteString(`</svg>`)
	return template.HTML(b.String())
}

// svgPath returns the d attribute of a line through points (a new segment after each NaN
// value), or, if area, of the area between it and the bottom of the plot.
func svgPath(points [][2]float64, y func(float64) float64, area bool) string {
	var d strings.Builder
	var seg [][2]float64
	flush := func() {
		if len(seg) > 0 {
			if area {
				fmt.Fprintf(&d, "M%.1f,%g ", seg[0][0], plotB)
			}
			for k, p := range seg {
				op := "L"
				if k == 0 && !area {
					op = "M"
				}
				fmt.Fprintf(&d, "%s%.1f,%.1f ", op, p[0], y(p[1]))
			}
			if area {
				fmt.Fprintf(&d, "L%.1f,%g Z ", seg[len(seg)-1][0], plotB)
			}
		}
		seg = seg[:0]
	}
	for _, p := range points {
		if math.IsNaN(p[1]) {
			flush()
			continue
		}
		seg = append(seg, p)
	}
	flush()
	return strings.TrimSpace(d.String())
}

// spanText names a chart's span: "hour", "30m".
func spanText(span time.Duration) string {
	if span == time.Hour {
		return "hour"
	}
	return spanTick(span)
}

// spanTick formats an offset on the time axis in minutes, or seconds below two minutes.
func spanTick(d time.Duration) string {
	if d < 2*time.Minute {
		return fmt.Sprintf("%ds", int(d.Round(time.Second).Seconds()))
	}
	return fmt.Sprintf("%dm", int(d.Round(time.Minute).Minutes()))
}

// Alert is an alert of deploy/kubernetes/prometheusrule.yaml whose condition holds at the newest
// sample.
type Alert struct {
	Name     string
	Severity string // critical, warning or info
	Summary  string
	// Since is when the condition started to hold: the oldest of the newest samples in a row in
	// which it holds (so at most as old as the oldest sample kept).
	Since time.Time
	For   time.Duration // how long it must hold to fire
	// Firing is false while the alert is pending: the condition holds, but not yet for For.
	Firing bool
}

// State is "firing" or "pending".
func (a Alert) State() string {
	if a.Firing {
		return "firing"
	}
	return "pending"
}

// rule is an alerting rule of deploy/kubernetes/prometheusrule.yaml over samples.
type rule struct {
	name     string
	severity string
	for_     time.Duration
	// holds returns the instances (a topic, a partition, a cause, or "" for the process) for which
	// the condition holds at the newest of samples, the history up to it, with their summaries.
	holds func(samples []Sample) map[string]string
}

// The thresholds of the alerting rules, as deploy/kubernetes/prometheusrule.yaml and
// deploy/README.md's table state them too (TestAlertThresholdsAgree).
const (
	lagGrowingRecords     = 1000             // KafkapgLagGrowing: records of a topic not applied
	failureRateLimit      = 0.05             // KafkapgFailureRateHigh: failures / records consumed
	unhandledAfter        = 24 * time.Hour   // KafkapgDeadLettersUnhandled: the oldest new dead letter's wait
	heldTooLong           = time.Hour        // KafkapgKeyHeldTooLong: the oldest held record's age
	tierBehindBy          = 5 * time.Minute  // KafkapgRetryTierBehind: how far past due
	fencedLimit           = 10               // KafkapgFencedTransactions: fenced in fencedWindow
	fencedWindow          = 15 * time.Minute //
	infraRetriesPerSecond = 0.2              // KafkapgInfrastructureRetries: over 5 minutes
	outboxStuckAfter      = time.Minute      // KafkapgOutboxStuck: the oldest unpublished record's wait
)

// rules are the rules of deploy/kubernetes/prometheusrule.yaml, in its order, that the samples
// can tell. KafkapgAbsent is left out: the process that serves the console reports metrics.
var rules = []rule{
	{"KafkapgLagGrowing", "warning", 15 * time.Minute, lagGrowing},
	{"KafkapgPartitionStuck", "critical", 30 * time.Minute, partitionStuck},
	{"KafkapgFailureRateHigh", "warning", 10 * time.Minute, failureRateHigh},
	{"KafkapgDeadLettersGrowing", "warning", 0, deadLettersGrowing},
	// The age of the oldest, not "some have been new for a day": a steady trickle that operators
	// handle within the hour never leaves none new, and must not fire.
	{"KafkapgDeadLettersUnhandled", "info", 10 * time.Minute, gaugeRule(func(s Sample) (bool, string) {
		return s.OldestNew > unhandledAfter, fmt.Sprintf("A dead letter has waited %s for an operator to replay or discard it (%s new)", humanDuration(s.OldestNew), humanNum(float64(s.NewDeadLetters)))
	})},
	{"KafkapgReplayTaskInterrupted", "info", 10 * time.Minute, gaugeRule(func(s Sample) (bool, string) {
		return s.TasksInterrupted > 0, fmt.Sprintf("%d replay or discard tasks have lost their runner: resume or cancel them", s.TasksInterrupted)
	})},
	{"KafkapgKeyHeldTooLong", "warning", 5 * time.Minute, gaugeRule(func(s Sample) (bool, string) {
		return s.OldestHeld > heldTooLong, fmt.Sprintf("A key's records have waited behind a failing record for %s", humanDuration(s.OldestHeld))
	})},
	{"KafkapgRetryTierBehind", "warning", 10 * time.Minute, retryTierBehind},
	{"KafkapgNotReady", "warning", 10 * time.Minute, gaugeRule(func(s Sample) (bool, string) {
		return s.NotReady, "This process is not ready: it is not in the consumer group or cannot reach Postgres (/readyz says which)"
	})},
	{"KafkapgCircuitBreakerOpen", "warning", 5 * time.Minute, gaugeRule(func(s Sample) (bool, string) {
		return s.BreakerOpen, "The circuit breaker is open: most records fail with retryable errors, and failing records wait in place"
	})},
	{"KafkapgFencedTransactions", "warning", 0, counterRule(fencedWindow, func(s Sample) float64 { return s.Fenced }, func(inc, _ float64) (bool, string) {
		return inc > fencedLimit, fmt.Sprintf("%s transactions were fenced in %d minutes: replicas keep losing partitions", humanNum(inc), int(fencedWindow.Minutes()))
	})},
	{"KafkapgDatabaseForgotPartitions", "warning", 0, counterRule(time.Hour, func(s Sample) float64 { return s.Forgotten }, func(inc, _ float64) (bool, string) {
		return inc > 0, fmt.Sprintf("Postgres had forgotten %s partitions that Kafka remembered (a failover or a restore): they were started again from where they first started", humanNum(inc))
	})},
	{"KafkapgInfrastructureRetries", "warning", 10 * time.Minute, counterRule(5*time.Minute, func(s Sample) float64 { return s.InfraRetries }, func(_, rate float64) (bool, string) {
		return rate > infraRetriesPerSecond, fmt.Sprintf("kafkapg retries %s transactions per second in place: Postgres or a dependency fails", humanNum(rate))
	})},
	{"KafkapgPartitionStalled", "critical", 0, labelRule(func(s Sample) map[string]int64 { return s.Stalled }, func(n int64, cause string) string {
		return fmt.Sprintf("%d partitions have made no progress for STALL_TIMEOUT (cause: %s)", n, cause)
	})},
	{"KafkapgKeysStuck", "warning", 5 * time.Minute, labelRule(func(s Sample) map[string]int64 { return s.Stuck }, func(n int64, reason string) string {
		return fmt.Sprintf("%d held keys are stuck (%s)", n, reason)
	})},
	{"KafkapgInternalErrors", "critical", 0, counterRule(15*time.Minute, func(s Sample) float64 { return s.InternalErrors }, func(inc, _ float64) (bool, string) {
		return inc > 0, fmt.Sprintf("kafkapg's own transactions failed %s times in 15 minutes in a way waiting will not fix: see the error logs", humanNum(inc))
	})},
	{"KafkapgOutboxSetAside", "warning", 0, gaugeRule(func(s Sample) (bool, string) {
		return s.OutboxSetAside > 0, fmt.Sprintf("%d outbox records are set aside: Kafka refuses them", s.OutboxSetAside)
	})},
	{"KafkapgOutboxStuck", "warning", 2 * time.Minute, gaugeRule(func(s Sample) (bool, string) {
		return s.OutboxOldest > outboxStuckAfter, fmt.Sprintf("The oldest unpublished outbox record has waited %s", humanDuration(s.OutboxOldest))
	})},
	{"KafkapgIdempotencyKeysGrowing", "warning", 30 * time.Minute, idempotencyKeysGrowing},
	{"KafkapgPausedTooLong", "warning", 0, pausedTooLong},
}

// pausedTooLong: a pause of the group has lasted longer than PAUSED_TOO_LONG.
func pausedTooLong(samples []Sample) map[string]string {
	held := map[string]string{}
	s := samples[len(samples)-1]
	if s.PausedTooLong <= 0 {
		return held
	}
	for tp, d := range s.Paused {
		if d > s.PausedTooLong {
			held[tp.Topic+"["+tp.Partition+"]"] = fmt.Sprintf("%s partition %s has been paused for %s, longer than PAUSED_TOO_LONG (%s): resume it (positions resume), or raise PAUSED_TOO_LONG",
				tp.Topic, tp.Partition, humanDuration(d), humanDuration(s.PausedTooLong))
		}
	}
	return held
}

// Alerts returns the alerts whose condition holds at the newest sample, firing or pending, in the
// order of the rules.
func Alerts(samples []Sample, now time.Time) []Alert {
	var alerts []Alert
	if len(samples) == 0 {
		return nil
	}
	for _, r := range rules {
		newest := heldAt(r, samples, len(samples)-1)
		keys := make([]string, 0, len(newest))
		for k := range newest {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		// Walk back while the condition held for some instance, to find when each run began.
		since := map[string]time.Time{}
		for _, k := range keys {
			since[k] = samples[len(samples)-1].At
		}
		open := slices.Clone(keys)
		for i := len(samples) - 2; i >= 0 && len(open) > 0; i-- {
			held := heldAt(r, samples, i)
			open = slices.DeleteFunc(open, func(k string) bool {
				_, ok := held[k]
				if ok {
					since[k] = samples[i].At
				}
				return !ok
			})
		}
		for _, k := range keys {
			alerts = append(alerts, Alert{
				Name: r.name, Severity: r.severity, Summary: newest[k],
				Since: since[k], For: r.for_, Firing: now.Sub(since[k]) >= r.for_,
			})
		}
	}
	return alerts
}

// heldAt returns the instances of r that held at samples[i].
func heldAt(r rule, samples []Sample, i int) map[string]string {
	if samples[i].held != nil {
		return samples[i].held[r.name]
	}
	return r.holds(samples[:i+1])
}

// gaugeRule is a rule on the newest sample alone: max(gauge) > threshold.
func gaugeRule(cond func(Sample) (bool, string)) func([]Sample) map[string]string {
	return func(samples []Sample) map[string]string {
		if ok, summary := cond(samples[len(samples)-1]); ok {
			return map[string]string{"": summary}
		}
		return nil
	}
}

// counterRule is a rule on the increase and the per-second rate of a counter over window:
// increase(counter[window]) or rate(counter[window]) against a threshold.
func counterRule(window time.Duration, get func(Sample) float64, cond func(inc, rate float64) (bool, string)) func([]Sample) map[string]string {
	return func(samples []Sample) map[string]string {
		w := lastWindow(samples, window)
		if len(w) < 2 {
			return nil
		}
		inc := counterIncrease(w, get)
		if ok, summary := cond(inc, inc/w[len(w)-1].At.Sub(w[0].At).Seconds()); ok {
			return map[string]string{"": summary}
		}
		return nil
	}
}

// labelRule is a rule per label value of a gauge: max by (label) (gauge) > 0.
func labelRule(get func(Sample) map[string]int64, summary func(n int64, label string) string) func([]Sample) map[string]string {
	return func(samples []Sample) map[string]string {
		held := map[string]string{}
		for label, n := range get(samples[len(samples)-1]) {
			if n > 0 {
				held[label] = summary(n, label)
			}
		}
		return held
	}
}

// lagGrowing: a topic's lag > lagGrowingRecords and its deriv over 15 minutes > 0.
func lagGrowing(samples []Sample) map[string]string {
	held := map[string]string{}
	w := lastWindow(samples, 15*time.Minute)
	for topic := range w[len(w)-1].TopicLag {
		lag, _ := w[len(w)-1].activeLag(topic)
		if lag <= lagGrowingRecords {
			continue
		}
		var xs, ys []float64
		for _, s := range w {
			if v, ok := s.activeLag(topic); ok {
				xs = append(xs, s.At.Sub(w[0].At).Seconds())
				ys = append(ys, float64(v))
			}
		}
		if deriv(xs, ys) > 0 {
			held[topic] = fmt.Sprintf("Lag on %s keeps growing: %s records are not applied yet", topic, humanNum(float64(lag)))
		}
	}
	return held
}

// idempotencyKeysLimit and idempotencyKeysHorizon are KafkapgIdempotencyKeysGrowing's: the size
// the idempotency keys should not pass, and how far ahead their last hour's growth is projected.
const (
	idempotencyKeysLimit   = 100e9
	idempotencyKeysHorizon = 3 * 24 * time.Hour
)

// idempotencyKeysGrowing: the idempotency keys' size, projected idempotencyKeysHorizon ahead
// from the last hour's samples by least squares (as Prometheus's predict_linear), passes
// idempotencyKeysLimit.
func idempotencyKeysGrowing(samples []Sample) map[string]string {
	w := lastWindow(samples, time.Hour)
	newest := w[len(w)-1]
	xs, ys := make([]float64, len(w)), make([]float64, len(w))
	var mx, my float64
	for i, s := range w {
		xs[i], ys[i] = s.At.Sub(newest.At).Seconds(), s.IdempotencyBytes
		mx, my = mx+xs[i]/float64(len(w)), my+ys[i]/float64(len(w))
	}
	slope := deriv(xs, ys)
	projected := my - slope*mx + slope*idempotencyKeysHorizon.Seconds() // the fit's value at newest, plus the horizon's growth
	if projected <= idempotencyKeysLimit {
		return nil
	}
	return map[string]string{"": fmt.Sprintf("Idempotency keys take %sB of Postgres and, at the last hour's growth, will take over %sB within %d days",
		humanNum(newest.IdempotencyBytes), humanNum(idempotencyKeysLimit), int(idempotencyKeysHorizon.Hours()/24))}
}

// deriv is the least-squares slope of ys over xs, as Prometheus' deriv; 0 with fewer than two
// points.
func deriv(xs, ys []float64) float64 {
	n := float64(len(xs))
	if n < 2 {
		return 0
	}
	var sx, sy, sxy, sxx float64
	for i := range xs {
		sx += xs[i]
		sy += ys[i]
		sxy += xs[i] * ys[i]
		sxx += xs[i] * xs[i]
	}
	den := n*sxx - sx*sx
	if den == 0 {
		return 0
	}
	return (n*sxy - sx*sy) / den
}

// partitionStuck: a partition's lag > 0, its delta over 30 minutes >= 0, and nothing of its topic
// applied in 30 minutes.
func partitionStuck(samples []Sample) map[string]string {
	held := map[string]string{}
	w := lastWindow(samples, 30*time.Minute)
	if len(w) < 2 {
		return held
	}
	oldest, newest := w[0], w[len(w)-1]
	applied := map[string]float64{} // by topic
	for tp, lag := range newest.PartitionLag {
		before, ok := oldest.PartitionLag[tp]
		if lag <= 0 || !ok || lag < before || newest.IsPaused(tp) {
			continue
		}
		if _, ok := applied[tp.Topic]; !ok {
			applied[tp.Topic] = counterIncrease(w, func(s Sample) float64 { return s.ByTopic[tp.Topic].Applied })
		}
		if applied[tp.Topic] > 0 {
			continue
		}
		held[tp.Topic+"["+tp.Partition+"]"] = fmt.Sprintf("kafkapg applies nothing from %s partition %s: %s records wait", tp.Topic, tp.Partition, humanNum(float64(lag)))
	}
	return held
}

// failureRateHigh: a topic's failures (infrastructure failures aside) are more than failureRateLimit of its
// records consumed over 5 minutes.
func failureRateHigh(samples []Sample) map[string]string {
	held := map[string]string{}
	w := lastWindow(samples, 5*time.Minute)
	if len(w) < 2 {
		return held
	}
	for topic := range w[len(w)-1].ByTopic {
		failed := counterIncrease(w, func(s Sample) float64 { return s.ByTopic[topic].Failed })
		consumed := counterIncrease(w, func(s Sample) float64 { return s.ByTopic[topic].Consumed })
		switch {
		case failed/max(consumed, 1e-9) <= failureRateLimit:
		case consumed == 0:
			held[topic] = fmt.Sprintf("More than %g%% of %s's records fail: %s failures and no record consumed in 5 minutes", 100*failureRateLimit, topic, humanNum(failed))
		default:
			held[topic] = fmt.Sprintf("More than %g%% of %s's records fail: %.1f%% (%s failures for %s records consumed in 5 minutes)",
				100*failureRateLimit, topic, 100*failed/consumed, humanNum(failed), humanNum(consumed))
		}
	}
	return held
}

// deadLettersGrowing: records of a topic were dead-lettered in the last 30 minutes.
func deadLettersGrowing(samples []Sample) map[string]string {
	held := map[string]string{}
	w := lastWindow(samples, 30*time.Minute)
	if len(w) < 2 {
		return held
	}
	for topic := range w[len(w)-1].ByTopic {
		if n := counterIncrease(w, func(s Sample) float64 { return s.ByTopic[topic].DeadLettered }); n > 0 {
			held[topic] = fmt.Sprintf("%s records of %s were dead-lettered in the last 30 minutes", humanNum(n), topic)
		}
	}
	return held
}

// retryTierBehind: a retry tier is more than tierBehindBy behind its due times.
func retryTierBehind(samples []Sample) map[string]string {
	held := map[string]string{}
	for tier, d := range samples[len(samples)-1].TierOverdue {
		if d > tierBehindBy {
			held[tier] = fmt.Sprintf("Retry tier %s is %s behind its due times", tier, humanDuration(d))
		}
	}
	return held
}
