package processor

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// What happens to a key's later records after one of its records is dead-lettered
// (Config.OnDeadLetter).
const (
	// OnDeadLetterSkip: the key's next record is applied; the dead letter is skipped.
	OnDeadLetterSkip = "skip"
	// OnDeadLetterBlock: the key stays held, its later records parked, until an operator releases
	// it (see ReleaseKeys).
	OnDeadLetterBlock = "block"
)

// DefaultRetryTiers are the retry tiers used when Config.RetryTiers is nil.
var DefaultRetryTiers = []time.Duration{time.Second, 10 * time.Second, time.Minute}

// Consumer group protocols (Config.GroupProtocol).
const (
	// GroupProtocolAuto uses Kafka 4's consumer group protocol (KIP-848: the broker assigns
	// partitions, with no group-wide join barrier) where the broker offers it, and the classic
	// protocol otherwise.
	GroupProtocolAuto = "auto"
	// GroupProtocolClassic always uses the classic protocol (JoinGroup/SyncGroup).
	GroupProtocolClassic = "classic"
)

// Start offsets for partitions with no stored position.
const (
	StartEarliest = "earliest"
	StartLatest   = "latest"
)

// Config configures a Processor. The environment variable that sets each field in cmd/processor
// is named in brackets.
type Config struct {
	// Brokers are the Kafka seed brokers, host:port. Required. [KAFKA_BROKERS]
	Brokers []string
	// Group is the Kafka consumer group id. It also scopes the offsets stored in Postgres.
	// Required. [KAFKA_GROUP_ID]
	Group string
	// Topics to consume. Required. [KAFKA_TOPICS]
	Topics []string
	// Handler applies records. If it also implements BatchHandler, HandleBatch is used. Required.
	Handler Handler

	// Schema is the Postgres schema of kafkapg's tables. Defaults to "kafkapg". [DB_SCHEMA]
	Schema string
	// StartOffset is where a partition starts when neither Postgres nor Kafka has a position for
	// it: StartEarliest or StartLatest. Defaults to StartEarliest. [KAFKA_START_OFFSET]
	StartOffset string

	// BatchMaxRecords is the most records applied in one transaction. Defaults to 500.
	// [BATCH_MAX_RECORDS]
	BatchMaxRecords int
	// BatchMaxWait is how long a partition waits for a batch to fill before applying what it
	// has; 0 applies whatever has arrived at once. Under load batches fill while the previous one
	// is being applied, so this only matters for trickles. Defaults to 20ms. [BATCH_MAX_WAIT]
	BatchMaxWait time.Duration
	// MaxBufferedBytes bounds the memory that fetched records take while they wait to be applied
	// or are being applied, across all partitions (source and retry tiers): fetching stops while
	// they cost this much, and each partition pauses at its equal share of it (resuming at half),
	// so one partition that cannot move on does not starve the others. A record costs its key,
	// value and headers plus about 400 bytes of bookkeeping. franz-go's fetch buffers come on
	// top: at most one fetch per broker of up to a quarter of this (see the README for the whole
	// bound). Defaults to 64 MiB. [MAX_BUFFERED_BYTES]
	MaxBufferedBytes int

	// RetryTiers are the delays of the retry tiers. A record that still fails with a retryable
	// error after its local attempts goes to tier 1 (topic {topic}.{group}.retry.1), is tried again
	// (delivery Attempt 2) once the tier's delay (plus up to 10% jitter) has passed, then goes to
	// tier 2, and so on; after the last tier it is dead-lettered. nil means DefaultRetryTiers
	// (1s, 10s, 1m); an empty, non-nil slice means no tiers: records are dead-lettered after
	// their local attempts. [RETRY_TIERS]
	RetryTiers []time.Duration
	// OnDeadLetter says what happens to a key's later records once one of its records has been
	// dead-lettered: OnDeadLetterSkip (they are applied) or OnDeadLetterBlock (they are held until
	// an operator releases the key). Defaults to OnDeadLetterSkip. [ON_DEAD_LETTER]
	OnDeadLetter string
	// DisableTopicCreation stops the processor from creating missing retry-tier and dead-letter
	// topics; a missing one is then an error at startup. [KAFKA_CREATE_TOPICS=false]
	DisableTopicCreation bool

	// MaxRecordBytes bounds the key and value of a record, together. A larger record is
	// dead-lettered at once (ErrRecordTooLarge, class permanent) without reaching the handler;
	// its copy in the DLQ topic carries no value (header kafkapg-value-omitted gives its size),
	// and its dead_letters row keeps it whole. Defaults to 1 MiB. [MAX_RECORD_BYTES]
	MaxRecordBytes int

	// LocalAttempts is how many times a failing record is tried within one delivery, counting
	// the first try, before it moves on to a retry tier or is dead-lettered. 1 disables local
	// retries. Defaults to 3. [RETRY_LOCAL_ATTEMPTS]
	LocalAttempts int
	// BackoffBase is the delay before the first retry; it doubles per retry up to BackoffMax,
	// with jitter. It applies to local retries of a record and to retries in place after an
	// infrastructure failure. Defaults to 200ms. [RETRY_BACKOFF_BASE]
	BackoffBase time.Duration
	// BackoffMax caps the retry delay. Defaults to 5s, or BackoffBase if that is larger.
	// [RETRY_BACKOFF_MAX]
	BackoffMax time.Duration

	// GroupProtocol is the consumer group protocol: GroupProtocolAuto (Kafka 4's consumer
	// protocol where the broker offers it, classic otherwise) or GroupProtocolClassic. Defaults
	// to GroupProtocolAuto. [KAFKA_GROUP_PROTOCOL]
	GroupProtocol string
	// SessionTimeout is the Kafka group session timeout: how long a silent member keeps its
	// partitions. Under the consumer protocol it is the group's, kept by the broker: the
	// processor asks the broker to set it (and a heartbeat interval of a third of it, at most
	// 500ms) for the group, and logs a warning if the broker refuses (its limits, missing
	// permission), in which case the broker's own apply. Defaults to 45s. [KAFKA_SESSION_TIMEOUT]
	SessionTimeout time.Duration
	// RebalanceTimeout is how long the group waits for members to rejoin during a rebalance.
	// A member that died mid-rebalance holds up the whole group until it passes, so it is kept
	// short; it must exceed DrainTimeout, the longest a revoke takes. Defaults to 30s.
	// [KAFKA_REBALANCE_TIMEOUT]
	RebalanceTimeout time.Duration
	// DrainTimeout is how long a partition that is revoked, or a processor that stops, waits for
	// the transaction in flight to finish before abandoning it (it is rolled back and the
	// partition's next owner applies the batch). Defaults to 5s.
	DrainTimeout time.Duration
	// TxIdleTimeout ends (in Postgres) a batch transaction whose client has been silent that
	// long, releasing its locks: a stalled owner (paused process, stuck handler) then delays the
	// partition's next owner by at most this much. A handler that spends longer than this
	// between two statements of its transaction has the transaction ended and retried. Defaults
	// to 30s. [DB_TX_IDLE_TIMEOUT]
	TxIdleTimeout time.Duration
	// StallTimeout is how long a partition may have records to apply and commit nothing before it
	// counts as stalled (kafkapg_stalled_partitions, with the cause, and an error log), and how long
	// a held key may go without progress before it counts as stuck (kafkapg_stuck_keys). Defaults
	// to 2m. [STALL_TIMEOUT]
	StallTimeout time.Duration
	// ShutdownTimeout bounds Run's shutdown after ctx is done: drain, final commits, leaving the
	// group. Defaults to 10s. [SHUTDOWN_TIMEOUT]
	ShutdownTimeout time.Duration

	// BreakerThreshold opens the circuit breaker when at least this share of the records seen in
	// the last BreakerWindow failed with retryable errors after their local tries (and at least
	// BreakerMinRecords records were seen): that looks like a downstream outage, not bad records.
	// While it is open, such records are held in place instead of going to the retry tiers; one
	// at a time is retried as a probe, every BreakerProbeInterval at first, doubling up to
	// BreakerProbeMax; the first probe that succeeds closes it. Defaults to 0.5; negative
	// disables the breaker. [BREAKER_THRESHOLD, where 0 disables it]
	BreakerThreshold float64
	// BreakerWindow is how far back the breaker looks. Defaults to 30s. [BREAKER_WINDOW]
	BreakerWindow time.Duration
	// BreakerMinRecords is how many records the window must hold before the breaker may open.
	// Defaults to 20. [BREAKER_MIN_RECORDS]
	BreakerMinRecords int
	// BreakerProbeInterval and BreakerProbeMax space the probes of an open breaker. Default to 1s
	// and 30s. [BREAKER_PROBE_INTERVAL, BREAKER_PROBE_MAX]
	BreakerProbeInterval time.Duration
	BreakerProbeMax      time.Duration

	// InstanceName labels this process in the offsets table's owner column and in logs. Defaults
	// to hostname:pid.
	InstanceName string
	// Logger receives structured logs. Defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the processor's Prometheus metrics, including franz-go's client
	// metrics. Defaults to a private registry (metrics are then not exported).
	Registerer prometheus.Registerer
	// KafkaOptions are extra franz-go options (TLS, SASL, ...), applied after kafkapg's own.
	// Options that change group callbacks, offsets or commits break the guarantees.
	KafkaOptions []kgo.Opt
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
	if out.DrainTimeout == 0 {
		out.DrainTimeout = 5 * time.Second
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

// Validate reports everything wrong with c, its defaults applied, as New would: for a caller
// that wants to reject a configuration before connecting anywhere.
func (c *Config) Validate() error {
	if err := c.withDefaults().validate(); err != nil {
		return fmt.Errorf("processor: invalid config: %w", err)
	}
	return nil
}

func (c *Config) validate() error {
	var errs []error
	if len(c.Brokers) == 0 {
		errs = append(errs, errors.New("Brokers (KAFKA_BROKERS) is required"))
	}
	for _, b := range c.Brokers {
		if b == "" {
			errs = append(errs, errors.New("Brokers (KAFKA_BROKERS) contains an empty address"))
			break
		}
	}
	if c.Group == "" {
		errs = append(errs, errors.New("Group (KAFKA_GROUP_ID) is required"))
	}
	if len(c.Topics) == 0 {
		errs = append(errs, errors.New("Topics (KAFKA_TOPICS) is required"))
	}
	seen := map[string]bool{}
	for _, t := range c.Topics {
		if t == "" {
			errs = append(errs, errors.New("Topics (KAFKA_TOPICS) contains an empty topic name"))
		} else if seen[t] {
			errs = append(errs, fmt.Errorf("Topics (KAFKA_TOPICS) lists %q twice", t))
		}
		seen[t] = true
	}
	if c.Handler == nil {
		errs = append(errs, errors.New("Handler is required"))
	}
	if c.StartOffset != StartEarliest && c.StartOffset != StartLatest {
		errs = append(errs, fmt.Errorf("StartOffset (KAFKA_START_OFFSET) must be %q or %q, got %q", StartEarliest, StartLatest, c.StartOffset))
	}
	if c.GroupProtocol != GroupProtocolAuto && c.GroupProtocol != GroupProtocolClassic {
		errs = append(errs, fmt.Errorf("GroupProtocol (KAFKA_GROUP_PROTOCOL) must be %q or %q, got %q", GroupProtocolAuto, GroupProtocolClassic, c.GroupProtocol))
	}
	if len(c.RetryTiers) > retrytopics.MaxTiers {
		errs = append(errs, fmt.Errorf("RetryTiers (RETRY_TIERS) has %d tiers; at most %d are allowed", len(c.RetryTiers), retrytopics.MaxTiers))
	}
	for i, d := range c.RetryTiers {
		if d <= 0 {
			errs = append(errs, fmt.Errorf("RetryTiers (RETRY_TIERS) tier %d: delay %v must be positive", i+1, d))
		}
	}
	if c.OnDeadLetter != OnDeadLetterSkip && c.OnDeadLetter != OnDeadLetterBlock {
		errs = append(errs, fmt.Errorf("OnDeadLetter (ON_DEAD_LETTER) must be %q or %q, got %q", OnDeadLetterSkip, OnDeadLetterBlock, c.OnDeadLetter))
	}
	for _, t := range c.Topics {
		if c.Group != "" && (strings.Contains(t, "."+c.Group+".retry.") || strings.HasSuffix(t, "."+c.Group+".dlq")) {
			errs = append(errs, fmt.Errorf("Topics (KAFKA_TOPICS) lists %q, which looks like a retry or dead-letter topic: list source topics only; their retry tiers are consumed with them", t))
		}
	}
	if c.BatchMaxRecords < 1 {
		errs = append(errs, fmt.Errorf("BatchMaxRecords (BATCH_MAX_RECORDS) must be at least 1, got %d", c.BatchMaxRecords))
	}
	if c.MaxBufferedBytes < 1<<20 {
		errs = append(errs, fmt.Errorf("MaxBufferedBytes (MAX_BUFFERED_BYTES) must be at least 1 MiB (1048576), got %d", c.MaxBufferedBytes))
	}
	if c.MaxRecordBytes < 1 {
		errs = append(errs, fmt.Errorf("MaxRecordBytes (MAX_RECORD_BYTES) must be at least 1, got %d", c.MaxRecordBytes))
	}
	if c.LocalAttempts < 1 {
		errs = append(errs, fmt.Errorf("LocalAttempts (RETRY_LOCAL_ATTEMPTS) must be at least 1, got %d", c.LocalAttempts))
	}
	if c.BackoffBase < 0 {
		errs = append(errs, fmt.Errorf("BackoffBase (RETRY_BACKOFF_BASE) must not be negative, got %v", c.BackoffBase))
	}
	if c.BackoffMax < c.BackoffBase {
		errs = append(errs, fmt.Errorf("BackoffMax (RETRY_BACKOFF_MAX) %v is less than BackoffBase (RETRY_BACKOFF_BASE) %v", c.BackoffMax, c.BackoffBase))
	}
	if c.RebalanceTimeout <= c.DrainTimeout {
		errs = append(errs, fmt.Errorf("RebalanceTimeout (KAFKA_REBALANCE_TIMEOUT) %v must be longer than DrainTimeout %v: revoking a partition may take that long", c.RebalanceTimeout, c.DrainTimeout))
	}
	if c.BreakerThreshold > 1 {
		errs = append(errs, fmt.Errorf("BreakerThreshold (BREAKER_THRESHOLD) is a share of records, at most 1, got %v", c.BreakerThreshold))
	}
	if c.BreakerMinRecords < 1 {
		errs = append(errs, fmt.Errorf("BreakerMinRecords (BREAKER_MIN_RECORDS) must be at least 1, got %d", c.BreakerMinRecords))
	}
	if c.BreakerProbeMax < c.BreakerProbeInterval {
		errs = append(errs, fmt.Errorf("BreakerProbeMax (BREAKER_PROBE_MAX) %v is less than BreakerProbeInterval (BREAKER_PROBE_INTERVAL) %v", c.BreakerProbeMax, c.BreakerProbeInterval))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"BreakerWindow (BREAKER_WINDOW)", c.BreakerWindow},
		{"BreakerProbeInterval (BREAKER_PROBE_INTERVAL)", c.BreakerProbeInterval},
		{"SessionTimeout (KAFKA_SESSION_TIMEOUT)", c.SessionTimeout},
		{"DrainTimeout", c.DrainTimeout},
		{"TxIdleTimeout (DB_TX_IDLE_TIMEOUT)", c.TxIdleTimeout},
		{"ShutdownTimeout (SHUTDOWN_TIMEOUT)", c.ShutdownTimeout},
		{"StallTimeout (STALL_TIMEOUT)", c.StallTimeout},
	} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("%s must not be negative, got %v", d.name, d.v))
		}
	}
	return errors.Join(errs...)
}
