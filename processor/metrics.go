package processor

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// metrics are the processor's Prometheus metrics. Labels are bounded: topic names and error
// classes, never keys or offsets.
type metrics struct {
	consumed        *prometheus.CounterVec
	handlerDuration prometheus.Histogram
	applied         *prometheus.CounterVec
	failures        *prometheus.CounterVec
	deadLettered    *prometheus.CounterVec
	published       *prometheus.CounterVec
	infraRetries    prometheus.Counter
	fenced          prometheus.Counter
	forgotten       prometheus.Counter
	windowOpen      prometheus.Gauge
	txDuration      prometheus.Histogram
	batchRecords    prometheus.Histogram
	assigned        prometheus.Gauge
	rebalances      *prometheus.CounterVec
	handlerPanics   prometheus.Counter

	routed      *prometheus.CounterVec
	recordsHeld *prometheus.CounterVec
	duplicates  *prometheus.CounterVec
	replayed    *prometheus.CounterVec

	// Group-wide state of the retry path, read from Postgres every few seconds.
	heldKeys     prometheus.Gauge
	blockedKeys  prometheus.Gauge
	heldRecords  prometheus.Gauge
	oldestHeld   prometheus.Gauge
	tierRecords  *prometheus.GaugeVec
	tierOverdue  *prometheus.GaugeVec
	deadLetterDB prometheus.Gauge
	oldestNew    prometheus.Gauge // the oldest new dead letter's age
	deadLetters  *prometheus.GaugeVec
	tasks        prometheus.Gauge
	interrupted  prometheus.Gauge

	// The circuit breaker (per process).
	breakerOpen    prometheus.Gauge
	breakerOpened  prometheus.Counter
	breakerWaiting prometheus.Gauge

	// Group-wide consumer lag: broker end offsets against the offsets stored in Postgres.
	lag *prometheus.GaugeVec

	// Progress: partitions of this process that make none, and failures nobody should wait out.
	stalled        *prometheus.GaugeVec
	internalErrors prometheus.Counter
	// Pauses: partitions paused here by an operator, and how long each pause of the group lasts.
	pausedParts   *prometheus.GaugeVec
	pausedSeconds *prometheus.GaugeVec
	pausedTooLong prometheus.Gauge
	stuckKeys     *prometheus.GaugeVec

	// The outbox (group-wide, from Postgres).
	outboxWaiting prometheus.Gauge
	outboxAside   prometheus.Gauge
	outboxOldest  prometheus.Gauge
	// Idempotency keys and emitted records.
	publishWait prometheus.Histogram
	dupKeys     *prometheus.CounterVec
	keysPruned  prometheus.Counter
	keyRows     prometheus.Gauge // the idempotency_keys table's (every group of the schema)
	keyBytes    prometheus.Gauge
	// Prepares (Preparer, Config.Concurrency).
	preparing       *prometheus.GaugeVec
	prepareWait     prometheus.Histogram
	prepareDuration prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	const ns = "kafkapg"
	m := &metrics{
		applied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "records_applied_total",
			Help: "Records whose effects were committed to Postgres.",
		}, []string{"topic"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "record_failures_total",
			Help: "Handler failures of single records, every try counted, by error class.",
		}, []string{"topic", "class"}),
		deadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "records_dead_lettered_total",
			Help: "Records routed to the dead-letter topic (committed to the outbox), by error class.",
		}, []string{"topic", "class"}),
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "outbox_published_total",
			Help: "Outbox records published to Kafka and acknowledged, by destination topic.",
		}, []string{"topic"}),
		publishWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: ns, Name: "outbox_publish_seconds",
			Help:    "Time from an outbox record's write (its transaction's commit, near enough) to Kafka's acknowledgement of it.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		dupKeys: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "duplicate_keys_skipped_total",
			Help: "Records not given to the handler because a record with the same idempotency key was applied before (within the key retention), by source topic.",
		}, []string{"topic"}),
		keysPruned: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "idempotency_keys_pruned_total",
			Help: "Idempotency keys deleted because they were older than the retention.",
		}),
		keyRows: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "idempotency_keys_rows",
			Help: "Idempotency keys kept in Postgres (the idempotency_keys table, every group of the schema; Postgres's count of live rows). Read every minute by processors with idempotency keys on, after their pruning.",
		}),
		keyBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "idempotency_keys_bytes",
			Help: "Disk space of the idempotency keys kept in Postgres (the idempotency_keys table with its indexes, every group of the schema). It levels off at keyed records/s x IDEMPOTENCY_RETENTION x bytes per key.",
		}),
		preparing: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "prepares_in_flight",
			Help: "Records of a partition's window being prepared (Preparer) at this moment, by source topic: as many keys at work at once.",
		}, []string{"topic"}),
		prepareWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: ns, Name: "prepare_wait_seconds",
			Help:    "Time a record waited in its partition's window, behind an earlier record of its key or for a free slot of Concurrency, before its Prepare started.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}),
		prepareDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: ns, Name: "prepare_duration_seconds",
			Help:    "Time spent in the handler's Prepare per record, failed calls included.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}),
		infraRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "infrastructure_retries_total",
			Help: "Transactions retried in place because Postgres (or another dependency) failed.",
		}),
		fenced: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "fenced_transactions_total",
			Help: "Transactions rolled back because another owner had claimed the partition.",
		}),
		windowOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "upgrade_window_open",
			Help: "1 while the schema's upgrade window is open (migrations the release before does not know are not finalized: it may run beside this release, which writes keys for it too), 0 once finalized.",
		}),
		forgotten: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "forgotten_partitions_total",
			Help: "Partitions Postgres had no position for although Kafka held an offset kafkapg committed for them (a failover to a standby that lacked it, a restore from a backup): started again where they were first started; and partitions whose owner found the stored position moved under it (the database lost its last commits or its claim): started again from the stored position.",
		}),
		consumed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "records_consumed_total",
			Help: "Records fetched from Kafka and handed to a partition worker, by topic (source and retry tier topics).",
		}, []string{"topic"}),
		handlerDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: ns, Name: "handler_duration_seconds",
			Help:    "Time spent in the handler per call of the batch (all of a transaction's records), failed calls included.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 18),
		}),
		txDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: ns, Name: "transaction_duration_seconds",
			Help:    "Duration of successful batch transactions, handler included.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		batchRecords: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: ns, Name: "batch_records",
			Help:    "Records per committed transaction.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 14),
		}),
		assigned: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "assigned_partitions",
			Help: "Partitions this process owns and processes.",
		}),
		rebalances: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "rebalance_events_total",
			Help: "Partition assignment changes seen by this process (assigned, revoked, lost).",
		}, []string{"event"}),
		handlerPanics: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "handler_panics_total",
			Help: "Handler panics recovered.",
		}),
		routed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "records_retried_total",
			Help: "Records sent to a retry tier (committed to the outbox), by source topic and tier.",
		}, []string{"topic", "tier"}),
		recordsHeld: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "records_held_total",
			Help: "Records held in Postgres behind an earlier record of their key that is in the retry path.",
		}, []string{"topic"}),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "retry_duplicates_skipped_total",
			Help: "Copies of retry records skipped because the record had already moved on (at-least-once publication).",
		}, []string{"topic"}),
		replayed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "replayed_records_total",
			Help: "Dead letters brought back by a replay that settled here, by outcome: applied, skipped_duplicate (by its idempotency key: a copy was applied before), or dead_lettered again.",
		}, []string{"topic", "outcome"}),
		pausedParts: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "paused_partitions",
			Help: "Partitions of this process paused by an operator (the pauses table), by source topic; a retry tier's partition counts under its source.",
		}, []string{"topic"}),
		pausedSeconds: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "partition_paused_seconds",
			Help: "How long each pause of the group has lasted, by source topic and partition (\"all\": the whole topic); group-wide, from Postgres.",
		}, []string{"topic", "partition"}),
		pausedTooLong: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "paused_too_long_seconds",
			Help: "PAUSED_TOO_LONG (Config.PausedTooLong): the alert KafkapgPausedTooLong fires for a pause older than this.",
		}),
		deadLetters: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "dead_letters",
			Help: "Rows in the dead_letters table by status: new, replaying, replayed, discarded (group-wide, from Postgres).",
		}, []string{"status"}),
		tasks: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "tasks_running",
			Help: "Replay and discard tasks running, or interrupted and waiting to be resumed (group-wide, from Postgres).",
		}),
		interrupted: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "tasks_interrupted",
			Help: "Running replay and discard tasks whose runner stopped heart-beating (killed halfway): resume or cancel them (group-wide, from Postgres).",
		}),
		heldKeys: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "held_keys",
			Help: "Keys of the group whose later records wait behind a record in the retry path or a blocked dead letter (group-wide, from Postgres).",
		}),
		blockedKeys: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "blocked_keys",
			Help: "Held keys waiting for an operator after a dead letter (OnDeadLetterBlock; group-wide, from Postgres).",
		}),
		heldRecords: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "held_records",
			Help: "Records held behind their key (group-wide, from Postgres).",
		}),
		oldestHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "oldest_held_record_age_seconds",
			Help: "Age of the oldest held record; 0 if none (group-wide, from Postgres).",
		}),
		tierRecords: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "retry_tier_records",
			Help: "Records waiting in each retry tier (group-wide, from Postgres).",
		}, []string{"tier"}),
		tierOverdue: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "retry_tier_lag_seconds",
			Help: "How far past its due time the most overdue record of each retry tier is: the tier consumer's lag (group-wide, from Postgres).",
		}, []string{"tier"}),
		deadLetterDB: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "dead_letters_new",
			Help: "Rows in the dead_letters table with status new (group-wide, from Postgres).",
		}),
		oldestNew: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "dead_letter_oldest_new_seconds",
			Help: "How long the oldest dead letter with status new has waited for an operator to replay or discard it, since it was dead-lettered (group-wide, from Postgres); 0 if none.",
		}),
		breakerOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "circuit_breaker_open",
			Help: "1 while this process's circuit breaker is open (failing records wait in place, probing), else 0.",
		}),
		breakerOpened: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "circuit_breaker_opened_total",
			Help: "Times the circuit breaker opened because most records failed with retryable errors.",
		}),
		breakerWaiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "circuit_breaker_waiting_records",
			Help: "Records kept waiting in place by the open circuit breaker (one per partition at most).",
		}),
		stalled: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "stalled_partitions",
			Help: "Partitions of this process that have had records to apply and committed nothing for StallTimeout, by cause: infrastructure, error (kafkapg's own statements fail: a bug or a changed schema), breaker, handler.",
		}, []string{"cause"}),
		stuckKeys: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "stuck_keys",
			Help: "Held keys that have made no progress for StallTimeout, by reason: orphaned (the record they wait for can no longer come back), overdue (it is long past due in its tier), unapplied (ready, nothing applies their held records); group-wide, from Postgres.",
		}, []string{"reason"}),
		outboxWaiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "outbox_records",
			Help: "Outbox records (retry and dead-letter records, and records handlers emitted) committed and not yet published to Kafka (group-wide, from Postgres).",
		}),
		outboxAside: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "outbox_set_aside_records",
			Help: "Outbox records set aside because Kafka refuses them for good, waiting for an operator (group-wide, from Postgres).",
		}),
		outboxOldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "outbox_oldest_record_age_seconds",
			Help: "How long the oldest outbox record not yet published has waited; 0 if none (group-wide, from Postgres).",
		}),
		internalErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "internal_errors_total",
			Help: "Transactions of kafkapg's own that failed in a way waiting will not fix (a bug, or the database changed underneath), each logged as an error and retried.",
		}),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "consumer_lag_records",
			Help: "Records of each source partition not yet applied: the broker's end offset minus the next offset stored in Postgres (group-wide).",
		}, []string{"topic", "partition"}),
	}
	for _, c := range []prometheus.Collector{m.breakerOpen, m.breakerOpened, m.breakerWaiting, m.consumed, m.handlerDuration, m.lag, m.applied, m.failures, m.deadLettered, m.published, m.infraRetries,
		m.pausedParts, m.pausedSeconds, m.pausedTooLong, m.fenced, m.forgotten, m.windowOpen, m.txDuration, m.batchRecords, m.assigned, m.rebalances, m.handlerPanics,
		m.routed, m.recordsHeld, m.duplicates, m.replayed, m.deadLetters, m.tasks, m.interrupted, m.heldKeys, m.blockedKeys, m.heldRecords, m.oldestHeld,
		m.tierRecords, m.tierOverdue, m.deadLetterDB, m.oldestNew, m.stalled, m.internalErrors, m.stuckKeys,
		m.outboxWaiting, m.outboxAside, m.outboxOldest, m.publishWait, m.dupKeys, m.keysPruned, m.keyRows, m.keyBytes,
		m.preparing, m.prepareWait, m.prepareDuration} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func tierLabel(n int) string { return strconv.Itoa(n) }

// initLabels creates every series the processor can export for its topics and tiers at zero,
// so that dashboards and alerts (rate, increase, absent) see them before the first event.
// initLabels creates the series of source topic t, which has tiers retry tiers.
func (m *metrics) initLabels(t string, group string, tiers int) {
	classes := []string{ClassRetryable.String(), ClassPermanent.String(), ClassInfrastructure.String()}
	m.applied.WithLabelValues(t)
	m.consumed.WithLabelValues(t)
	m.recordsHeld.WithLabelValues(t)
	m.duplicates.WithLabelValues(t)
	m.dupKeys.WithLabelValues(t)
	m.preparing.WithLabelValues(t)
	m.replayed.WithLabelValues(t, "applied")
	m.replayed.WithLabelValues(t, "skipped_duplicate")
	m.replayed.WithLabelValues(t, "dead_lettered")
	for _, c := range classes {
		m.failures.WithLabelValues(t, c)
		m.deadLettered.WithLabelValues(t, c)
	}
	m.published.WithLabelValues(retrytopics.DLQTopic(t, group))
	for n := 1; n <= tiers; n++ {
		m.routed.WithLabelValues(t, tierLabel(n))
		m.published.WithLabelValues(retrytopics.TierTopic(t, group, n))
		m.consumed.WithLabelValues(retrytopics.TierTopic(t, group, n))
	}
}

// initTierLabels creates the series of the group-wide tier gauges, for tiers 1 to tiers, and the
// other fixed label values.
func (m *metrics) initTierLabels(tiers int) {
	for n := 1; n <= tiers; n++ {
		m.tierRecords.WithLabelValues(tierLabel(n))
		m.tierOverdue.WithLabelValues(tierLabel(n))
	}
	for _, e := range []string{"assigned", "revoked", "lost"} {
		m.rebalances.WithLabelValues(e)
	}
	for _, c := range stallCauses {
		m.stalled.WithLabelValues(c)
	}
	for _, r := range retrytopics.StuckReasons {
		m.stuckKeys.WithLabelValues(r)
	}
}

// setRetryStats publishes the retry path's state; tiers is the number of configured tiers, so
// that empty tiers read 0.
func (m *metrics) setRetryStats(st retrytopics.Stats, tiers int) {
	m.heldKeys.Set(float64(st.HeldKeys))
	m.blockedKeys.Set(float64(st.BlockedKeys))
	m.heldRecords.Set(float64(st.HeldRecords))
	m.oldestHeld.Set(st.OldestHeld.Seconds())
	m.deadLetterDB.Set(float64(st.DeadLetters["new"]))
	m.oldestNew.Set(st.OldestNew.Seconds())
	for _, s := range retrytopics.DeadLetterStatuses {
		m.deadLetters.WithLabelValues(s).Set(float64(st.DeadLetters[s]))
	}
	m.tasks.Set(float64(st.TasksRunning))
	m.interrupted.Set(float64(st.TasksInterrupted))
	for n := 1; n <= tiers; n++ {
		t := st.Tiers[n]
		m.tierRecords.WithLabelValues(tierLabel(n)).Set(float64(t.Records))
		m.tierOverdue.WithLabelValues(tierLabel(n)).Set(t.Overdue.Seconds())
	}
}

// observe records v in h, with an exemplar pointing at the span of sc when it is sampled (tracing
// on): a slow bucket of a latency histogram then leads to a trace of what was slow.
func observe(h prometheus.Histogram, v float64, sc trace.SpanContext) {
	if sc.IsSampled() {
		if eo, ok := h.(prometheus.ExemplarObserver); ok {
			eo.ObserveWithExemplar(v, prometheus.Labels{"trace_id": sc.TraceID().String(), "span_id": sc.SpanID().String()})
			return
		}
	}
	h.Observe(v)
}

// setPauses publishes the partitions paused here (by source topic) and the age of each pause of
// the group; series of pauses gone are removed.
func (m *metrics) setPauses(here map[string]int, pauses []offsets.Pause, now time.Time) {
	m.pausedParts.Reset()
	for topic, n := range here {
		m.pausedParts.WithLabelValues(topic).Set(float64(n))
	}
	m.pausedSeconds.Reset()
	for _, z := range pauses {
		m.pausedSeconds.WithLabelValues(z.Topic, pauseKey(z.Partition)).Set(now.Sub(z.At).Seconds())
	}
}
