package processor

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the processor's Prometheus metrics. Labels are bounded: topic names and error
// classes, never keys or offsets.
type metrics struct {
	applied       *prometheus.CounterVec
	failures      *prometheus.CounterVec
	deadLettered  *prometheus.CounterVec
	published     *prometheus.CounterVec
	infraRetries  prometheus.Counter
	fenced        prometheus.Counter
	txDuration    prometheus.Histogram
	batchRecords  prometheus.Histogram
	assigned      prometheus.Gauge
	rebalances    *prometheus.CounterVec
	handlerPanics prometheus.Counter
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
		infraRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "infrastructure_retries_total",
			Help: "Transactions retried in place because Postgres (or another dependency) failed.",
		}),
		fenced: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "fenced_transactions_total",
			Help: "Transactions rolled back because another owner had claimed the partition.",
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
	}
	for _, c := range []prometheus.Collector{m.applied, m.failures, m.deadLettered, m.published, m.infraRetries,
		m.fenced, m.txDuration, m.batchRecords, m.assigned, m.rebalances, m.handlerPanics} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
