package processor

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// OnDeadLetter says what happens to a key's later records after one of its records is
// dead-lettered (Config.OnDeadLetter, TopicPolicy.OnDeadLetter).
type OnDeadLetter string

const (
	// OnDeadLetterSkip: the key's next record is applied; the dead letter is skipped.
	OnDeadLetterSkip OnDeadLetter = "skip"
	// OnDeadLetterBlock: the key stays held, its later records held, until an operator releases
	// it (see ReleaseBlockedKeys).
	OnDeadLetterBlock OnDeadLetter = "block"
)

// NoBatchWait, as Config.BatchMaxWait, applies the records a partition has as soon as they
// arrive, without waiting for a batch to fill.
const NoBatchWait time.Duration = -1

// DefaultRetryTiers are the retry tiers used when Config.RetryTiers is nil.
var DefaultRetryTiers = []time.Duration{time.Second, 10 * time.Second, time.Minute}

// GroupProtocol is a consumer group protocol (Config.GroupProtocol).
type GroupProtocol string

const (
	// GroupProtocolAuto uses Kafka 4's consumer group protocol (KIP-848: the broker assigns
	// partitions, with no group-wide join barrier) where the broker offers it, and the classic
	// protocol otherwise.
	GroupProtocolAuto GroupProtocol = "auto"
	// GroupProtocolClassic always uses the classic protocol (JoinGroup/SyncGroup).
	GroupProtocolClassic GroupProtocol = "classic"
)

// StartOffset is where a partition with no stored position starts (Config.StartOffset).
type StartOffset string

const (
	StartEarliest StartOffset = "earliest"
	StartLatest   StartOffset = "latest"
)

// TopicPolicy is how the records of one source topic are handled where that differs from the
// Config's settings (Config.TopicPolicies). A zero field takes the Config's value.
type TopicPolicy struct {
	// Handler applies the topic's records instead of Config.Handler.
	Handler Handler
	// RetryTiers are the topic's retry tiers instead of Config.RetryTiers; an empty, non-nil
	// slice means none: its records are dead-lettered after their local attempts.
	RetryTiers []time.Duration
	// LocalAttempts replaces Config.LocalAttempts.
	LocalAttempts int
	// OnDeadLetter replaces Config.OnDeadLetter.
	OnDeadLetter OnDeadLetter
	// MaxRecordBytes replaces Config.MaxRecordBytes.
	MaxRecordBytes int
	// IdempotencyKey, if not nil, deduplicates the topic's records by business event: a record
	// whose key was applied before (within Config.IdempotencyRetention) is not given to the
	// handler; its offset advances and it is counted as a duplicate. The key is recorded in the
	// transaction that applies the record, so it is recorded if and only if the record's effects
	// are. See KeyFromHeader, KeyFromJSON. The startup log names it (IdempotencyKey.String).
	IdempotencyKey IdempotencyKey
	// Concurrency replaces Config.Concurrency.
	Concurrency int
	// Values, if not nil, decodes the topic's record values before its handler sees them
	// (Record.Decoded), and Keys its keys (Record.DecodedKey): see Decoder, and package schemaregistry
	// for the Schema Registry's formats.
	Values, Keys Decoder
}

// Config configures a Processor. Zero fields take the defaults their comments give. The service
// package sets each field from an environment variable (see docs/configuration.md).
type Config struct {
	// Brokers are the Kafka seed brokers, host:port. Required.
	Brokers []string
	// Group is the Kafka consumer group id. It also scopes the offsets stored in Postgres.
	// Required.
	Group string
	// Topics to consume. Required, unless RelayOnly.
	Topics []string
	// RelayOnly runs the processor as the outbox relay of Group alone: it consumes nothing (Topics
	// must be empty) and publishes what transactions emitted into Group's outbox
	// (sink.Outbox), for an application that writes events from its own transactions.
	RelayOnly bool
	// Handler applies records. If it also implements BatchHandler, HandleBatch is used; if it
	// implements ErrorClassifier, it classifies its errors. Required, unless every topic has
	// its own in TopicPolicies.
	Handler Handler
	// TopicPolicies override, per source topic, the handler and the retry and dead-letter
	// settings below. Every key must be one of Topics.
	TopicPolicies map[string]TopicPolicy

	// Schema is the Postgres schema of kafkapg's tables. Defaults to "kafkapg".
	Schema string
	// StartOffset is where a partition starts when neither Postgres nor Kafka has a position for
	// it: StartEarliest or StartLatest. Defaults to StartEarliest.
	StartOffset StartOffset

	// BatchMaxRecords is the most records applied in one transaction. Defaults to 500.
	BatchMaxRecords int
	// BatchMaxWait is how long, at most, a partition waits for its batch to fill, and it waits
	// only while Postgres is busy (every connection of the pool in use): then its transaction
	// would wait for a connection anyway, and the records that arrive meanwhile join the batch.
	// Otherwise a batch is what arrived while the partition's previous transaction committed,
	// applied at once. NoBatchWait never waits. Defaults to 20ms.
	BatchMaxWait time.Duration
	// Concurrency is how many records of one partition are prepared at once, for a Handler that
	// implements Preparer (its step that waits on other systems, outside the transaction): records
	// of different keys are prepared side by side, ahead of the partition's transactions, which
	// still apply them in offset order; the records of one key are prepared one at a time, in
	// offset order. 1 prepares each record just before its Handle, in its batch's transaction.
	// More than 1 needs a Preparer, or a Decoder (TopicPolicy.Values, Keys): decoding runs
	// concurrently too. At most 10000. Defaults to 1.
	Concurrency int
	// MaxBufferedBytes bounds the memory that fetched records take while they wait to be applied
	// or are being applied, across all partitions (source and retry tiers): fetching stops while
	// they cost this much, and each partition pauses at its share of it (resuming at half), which
	// is at most a quarter once 4 partitions or more are assigned, so that one partition that
	// cannot move on does not starve the others. A record costs its key, value and headers plus
	// 448 bytes of bookkeeping, and 56 more for each header. franz-go's fetches come on top: at
	// most one per broker, of max(MaxBufferedBytes/32, 1 MiB) and at most 50 MiB
	// (docs/guarantees.md, "Memory", has the shares and the whole bound). At least 1 MiB.
	// Defaults to 64 MiB.
	MaxBufferedBytes int

	// RetryTiers are the delays of the retry tiers. A record that still fails with a retryable
	// error after its local attempts goes to tier 1 (topic {topic}.{group}.retry.1), is tried again
	// (delivery Attempt 2) once the tier's delay (plus up to 10% jitter) has passed, then goes to
	// tier 2, and so on; after the last tier it is dead-lettered. An empty, non-nil slice means no
	// tiers: records are dead-lettered after their local attempts. nil defaults to 1s, 10s, 1m
	// (DefaultRetryTiers).
	RetryTiers []time.Duration
	// OnDeadLetter says what happens to a key's later records once one of its records has been
	// dead-lettered: OnDeadLetterSkip (they are applied) or OnDeadLetterBlock (they are held until
	// an operator releases the key). Defaults to OnDeadLetterSkip.
	OnDeadLetter OnDeadLetter
	// DisableTopicCreation stops the processor from creating missing retry-tier and dead-letter
	// topics; a missing one is then an error at startup.
	DisableTopicCreation bool
	// TopicReplicationFactor is the replication factor of the retry-tier and dead-letter topics
	// the processor creates. Defaults to (0) the source topic's: their records are worth as much.
	// -1 leaves it to the broker's default.replication.factor, which is 1 unless the cluster
	// sets it: such a topic loses its records with one broker's disk.
	TopicReplicationFactor int16
	// TopicMinInsyncReplicas is the min.insync.replicas of the topics the processor creates.
	// Defaults to (0) the source topic's own setting, if it has one, and otherwise the broker's.
	TopicMinInsyncReplicas int

	// MaxRecordBytes bounds the key, value and headers of a record, together. A larger record is
	// dead-lettered at once (ErrRecordTooLarge, class permanent) without reaching the handler;
	// its copy in the DLQ topic carries no value (header kafkapg-value-omitted gives its size),
	// and its dead_letters row keeps it whole. Defaults to 1 MiB.
	MaxRecordBytes int

	// LocalAttempts is how many times a failing record is tried within one delivery, counting
	// the first try, before it moves on to a retry tier or is dead-lettered. 1 disables local
	// retries. Defaults to 3.
	LocalAttempts int
	// BackoffBase is the delay before the first retry; it doubles per retry up to BackoffMax,
	// with jitter. It applies to local retries of a record and to retries in place after an
	// infrastructure failure. Defaults to 200ms.
	BackoffBase time.Duration
	// BackoffMax caps the retry delay. Defaults to 5s, or BackoffBase if that is larger.
	BackoffMax time.Duration

	// GroupProtocol is the consumer group protocol: GroupProtocolAuto (Kafka 4's consumer
	// protocol where the broker offers it, classic otherwise) or GroupProtocolClassic. Defaults
	// to GroupProtocolAuto.
	GroupProtocol GroupProtocol
	// SessionTimeout is the Kafka group session timeout: how long a silent member keeps its
	// partitions. The heartbeat interval is min(500ms, SessionTimeout/3): 500ms at the default.
	// Under the classic protocol members heartbeat that often. Under the consumer protocol both
	// are the group's, kept by the broker within its group.consumer.min/max.session.timeout.ms
	// and group.consumer.min/max.heartbeat.interval.ms (45s to 60s and 5s to 15s by default):
	// the processor reads those limits from the brokers' configs and asks the broker to set
	// both for the group, moved into them, with a warning when the session timeout that applies
	// is not SessionTimeout. On a broker with default settings a SessionTimeout below 45s gets
	// 45s, and the heartbeat interval is 5s. Without permission to read the limits it asks for
	// SessionTimeout and its heartbeat interval as they are, with a warning; a broker that
	// refuses keeps its own, with a warning. Defaults to 45s.
	SessionTimeout time.Duration
	// RebalanceTimeout is how long the group waits for members to rejoin during a rebalance.
	// A member that died mid-rebalance holds up the whole group until it passes, so it is kept
	// short; it must exceed HandoffTimeout, the longest a revoke takes. Defaults to 30s.
	RebalanceTimeout time.Duration
	// HandoffTimeout is how long a partition handed off (revoked, or its processor stopping)
	// waits for its transaction in flight to finish before abandoning it (it is rolled back and
	// the partition's next owner applies the batch). Defaults to 5s.
	HandoffTimeout time.Duration
	// TxIdleTimeout ends (in Postgres) a batch transaction whose client has been silent that
	// long, releasing its locks: a stalled owner (paused process, stuck handler) then delays the
	// partition's next owner by at most this much. A handler that spends longer than this
	// between two statements of its transaction has the transaction ended and retried. Defaults
	// to 30s.
	TxIdleTimeout time.Duration
	// StallTimeout is how long a partition may have records to apply and commit nothing before it
	// counts as stalled (kafkapg_stalled_partitions, with the cause, and an error log), and how long
	// a held key may go without progress before it counts as stuck (kafkapg_stuck_keys). Defaults
	// to 2m.
	StallTimeout time.Duration
	// PausedTooLong is how long an operator's pause may last before the alert
	// KafkapgPausedTooLong fires: published as kafkapg_paused_too_long_seconds, which the alert
	// compares kafkapg_partition_paused_seconds with. A paused partition is never stalled.
	// Defaults to 4h.
	PausedTooLong time.Duration
	// ShutdownTimeout bounds Run's shutdown after ctx is done: handing off the partitions, final
	// commits, leaving the group. Defaults to 10s.
	ShutdownTimeout time.Duration

	// BreakerDisabled turns the circuit breaker off: retryable failures always go on to the
	// retry tiers, even during a downstream outage.
	BreakerDisabled bool
	// BreakerThreshold opens the circuit breaker when at least this share of the records seen in
	// the last BreakerWindow failed with retryable errors after their local tries (and at least
	// BreakerMinRecords records were seen): that looks like a downstream outage, not bad records.
	// While it is open, such records wait in place instead of going to the retry tiers; one
	// at a time is retried as a probe, every BreakerProbeInterval at first, doubling up to
	// BreakerProbeMax; the first probe that succeeds closes it. A share above 0, at most 1;
	// defaults to 0.5.
	BreakerThreshold float64
	// BreakerWindow is how far back the breaker looks. Defaults to 30s.
	BreakerWindow time.Duration
	// BreakerMinRecords is how many records the window must hold before the breaker may open.
	// Defaults to 20.
	BreakerMinRecords int
	// BreakerProbeInterval is the first interval between the probes of an open breaker; it
	// doubles after each failed probe, up to BreakerProbeMax. Defaults to 1s.
	BreakerProbeInterval time.Duration
	// BreakerProbeMax caps the interval between probes. Defaults to 30s, or BreakerProbeInterval
	// if that is larger.
	BreakerProbeMax time.Duration

	// IdempotencyRetention is how long the idempotency keys of applied records are kept
	// (TopicPolicy.IdempotencyKey): a copy of a record arriving later than that after it is
	// applied again. Keys are kept in generations, and the oldest is emptied whole (TRUNCATE)
	// every third of the longest retention among the groups that share the schema: a key lives
	// at most 4/3 of that. Defaults to 7 days.
	IdempotencyRetention time.Duration

	// OutboxPollInterval is how often the outbox relay looks for records it was not woken for
	// (written by another process without LISTEN/NOTIFY reaching it, or left by a crashed one).
	// Defaults to 1s.
	OutboxPollInterval time.Duration
	// OutboxListenDisabled stops the relay from LISTENing for the commits of sink.Outbox.Emit:
	// it then finds records emitted by other processes on its polls. A processor's own emits
	// wake its relay in any case. Through a connection pooler in transaction mode (PgBouncer),
	// which passes no notifications on, the processor finds that out at startup and polls.
	OutboxListenDisabled bool
	// OutboxRetention keeps published outbox rows that long (for inspection) instead of deleting
	// them when Kafka acknowledges them. Zero deletes them at once.
	OutboxRetention time.Duration

	// InstanceName labels this process in the offsets table's owner column and in logs. Defaults
	// to hostname:pid.
	InstanceName string
	// Logger receives structured logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the processor's Prometheus metrics, including franz-go's client
	// metrics. Defaults to a private registry (metrics are then not exported).
	Registerer prometheus.Registerer
	// TracerProvider, if not nil, receives OpenTelemetry spans: a "process {topic}" span for each
	// delivery of a record to the handler (a child of the trace context the record carries), a
	// "commit {topic}" span for each batch transaction, a "send {topic}" span for each record the
	// outbox relay publishes (emitted events, retry and dead-letter copies), whose trace context
	// replaces the one the record carried. Nil: no tracing, at no cost. The service sets it from
	// the standard OTEL_* environment (see docs/operations.md, "Tracing").
	TracerProvider trace.TracerProvider
	// Propagator reads and writes trace context in record headers. Defaults to W3C Trace Context
	// alone (traceparent, tracestate): a record's baggage header is its producer's text, and taken
	// in it would travel on into the handler's outgoing calls and the records kafkapg publishes;
	// add propagation.Baggage{} to take it in.
	Propagator propagation.TextMapPropagator
	// KafkaOptions are extra franz-go options (TLS, SASL, ...), applied after kafkapg's own.
	// Options that change group callbacks, offsets or commits break the guarantees.
	KafkaOptions []kgo.Opt

	// Test holds hooks for tests of a service (package servicetest); leave it zero in production.
	Test TestConfig
}

// TestConfig is Config.Test: what a test may change of a processor that production never does.
type TestConfig struct {
	// Now, if set, is the retry path's clock in place of time.Now: when a record that fails is
	// due in its next retry tier (Now + the tier's delay, in its kafkapg-due-at header) and
	// whether a tier's record is due. A test moves it forward to have a record tried again
	// without waiting for its tier's delay; while it is set, a tier's partition that waits for
	// a record to be due looks at the clock again at least every 20ms. Everything else (batch
	// waits, backoff between local attempts, timeouts) keeps the real clock.
	Now func() time.Time
}

func (c *Config) withDefaults() *Config {
	out := *c
	if out.Schema == "" {
		out.Schema = "kafkapg"
	}
	if out.StartOffset == "" {
		out.StartOffset = StartEarliest
	}
	if out.GroupProtocol == "" {
		out.GroupProtocol = GroupProtocolAuto
	}
	if out.BatchMaxRecords == 0 {
		out.BatchMaxRecords = 500
	}
	if out.BatchMaxWait == 0 {
		out.BatchMaxWait = 20 * time.Millisecond
	} else if out.BatchMaxWait < 0 {
		out.BatchMaxWait = 0
	}
	if out.Concurrency == 0 {
		out.Concurrency = 1
	}
	if out.MaxBufferedBytes == 0 {
		out.MaxBufferedBytes = 64 << 20
	}
	if out.RetryTiers == nil {
		out.RetryTiers = DefaultRetryTiers
	}
	if out.OnDeadLetter == "" {
		out.OnDeadLetter = OnDeadLetterSkip
	}
	if out.MaxRecordBytes == 0 {
		out.MaxRecordBytes = 1 << 20
	}
	if out.LocalAttempts == 0 {
		out.LocalAttempts = 3
	}
	if out.BackoffBase == 0 {
		out.BackoffBase = 200 * time.Millisecond
	}
	if out.BackoffMax == 0 {
		out.BackoffMax = max(5*time.Second, out.BackoffBase)
	}
	if out.SessionTimeout == 0 {
		out.SessionTimeout = 45 * time.Second
	}
	if out.HandoffTimeout == 0 {
		out.HandoffTimeout = 5 * time.Second
	}
	if out.RebalanceTimeout == 0 {
		out.RebalanceTimeout = 30 * time.Second
	}
	if out.TxIdleTimeout == 0 {
		out.TxIdleTimeout = 30 * time.Second
	}
	if out.StallTimeout == 0 {
		out.StallTimeout = 2 * time.Minute
	}
	if out.PausedTooLong == 0 {
		out.PausedTooLong = 4 * time.Hour
	}
	if out.ShutdownTimeout == 0 {
		out.ShutdownTimeout = 10 * time.Second
	}
	if out.BreakerThreshold == 0 {
		out.BreakerThreshold = 0.5
	}
	if out.BreakerWindow == 0 {
		out.BreakerWindow = 30 * time.Second
	}
	if out.BreakerMinRecords == 0 {
		out.BreakerMinRecords = 20
	}
	if out.BreakerProbeInterval == 0 {
		out.BreakerProbeInterval = time.Second
	}
	if out.BreakerProbeMax == 0 {
		out.BreakerProbeMax = max(30*time.Second, out.BreakerProbeInterval)
	}
	if out.IdempotencyRetention == 0 {
		out.IdempotencyRetention = 7 * 24 * time.Hour
	}
	if out.OutboxPollInterval == 0 {
		out.OutboxPollInterval = time.Second
	}
	if out.InstanceName == "" {
		host, _ := os.Hostname()
		out.InstanceName = fmt.Sprintf("%s:%d", host, os.Getpid())
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	if out.Registerer == nil {
		out.Registerer = prometheus.NewRegistry()
	}
	return &out
}

// breakerThreshold is the breaker's threshold, 0 if it is disabled.
func (c *Config) breakerThreshold() float64 {
	if c.BreakerDisabled {
		return 0
	}
	return c.BreakerThreshold
}

// policy is how the records of one source topic, and of its retry tiers, are handled: the
// Config's settings with the topic's TopicPolicy applied.
type policy struct {
	handler        Handler
	batch          BatchHandler    // handler as a BatchHandler, if it is one
	classifier     ErrorClassifier // handler as an ErrorClassifier, if it is one
	tiers          []time.Duration
	localAttempts  int
	onDeadLetter   OnDeadLetter
	maxRecordBytes int
	idempotencyKey IdempotencyKey
	preparer       Preparer // handler as a Preparer, if it is one
	concurrency    int      // records of one partition prepared at once (Config.Concurrency)
}

// policy returns topic's policy, c's defaults applied.
func (c *Config) policy(topic string) *policy {
	tp := c.TopicPolicies[topic]
	p := &policy{
		handler:        cmp.Or(tp.Handler, c.Handler),
		tiers:          c.RetryTiers,
		localAttempts:  cmp.Or(tp.LocalAttempts, c.LocalAttempts),
		onDeadLetter:   cmp.Or(tp.OnDeadLetter, c.OnDeadLetter),
		maxRecordBytes: cmp.Or(tp.MaxRecordBytes, c.MaxRecordBytes),
		idempotencyKey: tp.IdempotencyKey,
		concurrency:    cmp.Or(tp.Concurrency, c.Concurrency),
	}
	if tp.RetryTiers != nil {
		p.tiers = tp.RetryTiers
	}
	p.batch, _ = p.handler.(BatchHandler)
	p.classifier, _ = p.handler.(ErrorClassifier)
	p.preparer, _ = p.handler.(Preparer)
	if tp.Values != nil || tp.Keys != nil {
		p.preparer = decodingPreparer{values: tp.Values, keys: tp.Keys, next: p.preparer}
	}
	return p
}

// ConfigError is a field of Config set wrong. Validate and New report every one they find,
// joined (errors.Join); errors.As finds the first.
type ConfigError struct {
	// Field is the Config field at fault ("BatchMaxRecords"), or the TopicPolicy field
	// ("RetryTiers") when Topic is set.
	Field string
	// Topic is the TopicPolicies key whose policy is at fault, if it is one.
	Topic string
	Err   error
}

func (e *ConfigError) Error() string {
	if e.Topic != "" {
		return fmt.Sprintf("TopicPolicies[%q].%s: %v", e.Topic, e.Field, e.Err)
	}
	return e.Field + ": " + e.Err.Error()
}

func (e *ConfigError) Unwrap() error { return e.Err }

// Validate reports everything wrong with c, its defaults applied, as New would: for a caller
// that wants to reject a configuration before connecting anywhere. Each problem is a
// *ConfigError.
func (c *Config) Validate() error {
	return c.withDefaults().validate()
}

func (c *Config) validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, &ConfigError{Field: field, Err: fmt.Errorf(format, args...)})
	}
	if len(c.Brokers) == 0 {
		bad("Brokers", "required")
	}
	if slices.Contains(c.Brokers, "") {
		bad("Brokers", "contains an empty address")
	}
	if c.Group == "" {
		bad("Group", "required")
	}
	switch {
	case len(c.Topics) == 0 && !c.RelayOnly:
		bad("Topics", "required (or set RelayOnly to run the outbox relay alone)")
	case len(c.Topics) > 0 && c.RelayOnly:
		bad("Topics", "must be empty with RelayOnly: a relay alone consumes nothing")
	}
	if c.IdempotencyRetention < 0 {
		bad("IdempotencyRetention", "must not be negative, got %v", c.IdempotencyRetention)
	}
	if c.OutboxPollInterval < 0 {
		bad("OutboxPollInterval", "must not be negative, got %v", c.OutboxPollInterval)
	}
	if c.OutboxRetention < 0 {
		bad("OutboxRetention", "must not be negative, got %v", c.OutboxRetention)
	}
	seen := map[string]bool{}
	for _, t := range c.Topics {
		switch {
		case t == "":
			bad("Topics", "contains an empty topic name")
		case seen[t]:
			bad("Topics", "lists %q twice", t)
		case c.Group != "" && (strings.Contains(t, "."+c.Group+".retry.") || strings.HasSuffix(t, "."+c.Group+".dlq")):
			bad("Topics", "lists %q, which looks like a retry or dead-letter topic: list source topics only; their retry tiers are consumed with them", t)
		}
		seen[t] = true
	}
	for _, t := range slices.Sorted(maps.Keys(c.TopicPolicies)) {
		if !seen[t] {
			bad("TopicPolicies", "has a policy for %q, which is not one of Topics %q", t, c.Topics)
		}
	}
	if len(c.Topics) == 0 && c.Handler == nil && !c.RelayOnly {
		bad("Handler", "required")
	}
	for _, t := range c.Topics {
		if t == "" || c.RelayOnly { // topics with RelayOnly are the error already reported
			continue
		}
		if c.policy(t).handler == nil {
			if c.TopicPolicies == nil {
				bad("Handler", "required")
				break
			}
			bad("Handler", "required: topic %q has no handler in TopicPolicies", t)
			continue
		}
		if pol := c.policy(t); pol.concurrency > 1 && pol.preparer == nil {
			e := &ConfigError{Field: "Concurrency", Err: fmt.Errorf("is %d for topic %q, whose handler (%T) does not implement Preparer and which has no Decoder: only a Preparer's step and decoding run concurrently (Handle runs in the partition's transaction, in offset order)",
				pol.concurrency, t, pol.handler)}
			if c.TopicPolicies[t].Concurrency > 1 {
				e.Topic = t
			}
			errs = append(errs, e)
		}
	}
	if c.TopicReplicationFactor < -1 {
		bad("TopicReplicationFactor", "must be at least 1, or 0 (the source topic's) or -1 (the broker's default), got %d", c.TopicReplicationFactor)
	}
	if c.TopicMinInsyncReplicas < 0 {
		bad("TopicMinInsyncReplicas", "must be at least 1, or 0 (the source topic's, or the broker's default), got %d", c.TopicMinInsyncReplicas)
	}
	if c.TopicReplicationFactor > 0 && c.TopicMinInsyncReplicas > int(c.TopicReplicationFactor) {
		bad("TopicMinInsyncReplicas", "is %d, more than TopicReplicationFactor %d: no write could succeed", c.TopicMinInsyncReplicas, c.TopicReplicationFactor)
	}
	if c.StartOffset != StartEarliest && c.StartOffset != StartLatest {
		bad("StartOffset", "must be %q or %q, got %q", StartEarliest, StartLatest, c.StartOffset)
	}
	if c.GroupProtocol != GroupProtocolAuto && c.GroupProtocol != GroupProtocolClassic {
		bad("GroupProtocol", "must be %q or %q, got %q", GroupProtocolAuto, GroupProtocolClassic, c.GroupProtocol)
	}
	c.validatePolicy(&errs, "", TopicPolicy{RetryTiers: c.RetryTiers, LocalAttempts: c.LocalAttempts, OnDeadLetter: c.OnDeadLetter, MaxRecordBytes: c.MaxRecordBytes,
		Concurrency: c.Concurrency})
	for _, t := range slices.Sorted(maps.Keys(c.TopicPolicies)) {
		c.validatePolicy(&errs, t, c.TopicPolicies[t])
	}
	if c.BatchMaxRecords < 1 {
		bad("BatchMaxRecords", "must be at least 1, got %d", c.BatchMaxRecords)
	}
	if c.MaxBufferedBytes < 1<<20 {
		bad("MaxBufferedBytes", "must be at least 1 MiB (1048576), got %d", c.MaxBufferedBytes)
	}
	if c.BackoffBase < 0 {
		bad("BackoffBase", "must not be negative, got %v", c.BackoffBase)
	}
	if c.BackoffMax < c.BackoffBase {
		bad("BackoffMax", "%v is less than BackoffBase (%v)", c.BackoffMax, c.BackoffBase)
	}
	if c.RebalanceTimeout <= c.HandoffTimeout {
		bad("RebalanceTimeout", "%v must be longer than HandoffTimeout (%v): handing off a partition may take that long", c.RebalanceTimeout, c.HandoffTimeout)
	}
	if c.BreakerThreshold <= 0 || c.BreakerThreshold > 1 {
		bad("BreakerThreshold", "is a share of records, above 0 and at most 1, got %v (BreakerDisabled turns the breaker off)", c.BreakerThreshold)
	}
	if c.BreakerMinRecords < 1 {
		bad("BreakerMinRecords", "must be at least 1, got %d", c.BreakerMinRecords)
	}
	if c.BreakerProbeMax < c.BreakerProbeInterval {
		bad("BreakerProbeMax", "%v is less than BreakerProbeInterval (%v)", c.BreakerProbeMax, c.BreakerProbeInterval)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"BreakerWindow", c.BreakerWindow},
		{"BreakerProbeInterval", c.BreakerProbeInterval},
		{"SessionTimeout", c.SessionTimeout},
		{"HandoffTimeout", c.HandoffTimeout},
		{"TxIdleTimeout", c.TxIdleTimeout},
		{"ShutdownTimeout", c.ShutdownTimeout},
		{"StallTimeout", c.StallTimeout},
		{"PausedTooLong", c.PausedTooLong},
	} {
		if d.v < 0 {
			bad(d.name, "must not be negative, got %v", d.v)
		}
	}
	return errors.Join(errs...)
}

// validatePolicy checks the retry and dead-letter settings of the Config (topic "") or of a
// topic's policy, whose zero fields are not set.
func (c *Config) validatePolicy(errs *[]error, topic string, p TopicPolicy) {
	bad := func(field, format string, args ...any) {
		*errs = append(*errs, &ConfigError{Field: field, Topic: topic, Err: fmt.Errorf(format, args...)})
	}
	if len(p.RetryTiers) > retrytopics.MaxTiers {
		bad("RetryTiers", "has %d tiers; at most %d are allowed", len(p.RetryTiers), retrytopics.MaxTiers)
	}
	for i, d := range p.RetryTiers {
		if d <= 0 {
			bad("RetryTiers", "tier %d: delay %v must be positive", i+1, d)
		}
	}
	if p.OnDeadLetter != "" && p.OnDeadLetter != OnDeadLetterSkip && p.OnDeadLetter != OnDeadLetterBlock {
		bad("OnDeadLetter", "must be %q or %q, got %q", OnDeadLetterSkip, OnDeadLetterBlock, p.OnDeadLetter)
	}
	if p.MaxRecordBytes < 0 || (topic == "" && p.MaxRecordBytes < 1) {
		bad("MaxRecordBytes", "must be at least 1, got %d", p.MaxRecordBytes)
	}
	if p.LocalAttempts < 0 || (topic == "" && p.LocalAttempts < 1) {
		bad("LocalAttempts", "must be at least 1, got %d", p.LocalAttempts)
	}
	if p.Concurrency < 0 || (topic == "" && p.Concurrency < 1) || p.Concurrency > maxConcurrency {
		bad("Concurrency", "must be between 1 and %d, got %d", maxConcurrency, p.Concurrency)
	}
}

// maxConcurrency bounds Config.Concurrency: the goroutines of one partition's prepares.
const maxConcurrency = 10000
