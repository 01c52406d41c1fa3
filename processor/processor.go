package processor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/plugin/kprom"

	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/internal/pooler"
	"github.com/kafkapg/kafkapg/internal/schema"
	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// Processor consumes topics in a consumer group and applies each record through a Handler,
// exactly once in effect. See the package documentation.
type Processor struct {
	cfg         *Config
	pool        *pgxpool.Pool
	log         *slog.Logger
	metrics     *metrics
	kprom       *kprom.Metrics
	store       *offsets.Store
	sink        *sink.Sink
	outbox      *sink.Outbox       // where Record.Emit writes
	captured    *[]sink.Event      // processortest: what Record.Emit was given, instead of the outbox
	tracer      *tracing.Tracer    // nil: tracing off
	keys        *keyring.Ring      // where idempotency keys are recorded
	partCounts  partitionCounts    // of the topics Record.Emit emits to, for numbering events
	streamSQL   streamSQL          // the consuming side of streams
	policies    map[string]*policy // by source topic
	backoff     backoff.Policy
	retry       *retrytopics.Store
	tierOf      map[string]tierRef // retry-tier topic -> its source topic and tier
	heldApplier *heldApplier
	breaker     *breaker
	prepLocks   prepLocks    // keeps a key's Prepare calls from overlapping (see Preparer)
	buf         *buffer      // fetched records in memory, across partitions
	nWorkers    atomic.Int32 // len(workers), read without the lock
	busy        atomic.Int32 // workers holding records: they share the buffer budget
	// heldSinceAnalyze counts the records this process held since the heldApplier last had
	// held_records analyzed.
	heldSinceAnalyze atomic.Int64

	client atomic.Pointer[kgo.Client]
	// clientCtx is the Kafka client's context; cutClient ends everything the client waits for
	// (a join held by the broker), at the end of a shutdown that left the group by hand.
	clientCtx context.Context
	cutClient context.CancelFunc
	relay     atomic.Pointer[sink.Relay]
	// keysAllUntil: until then (Unix milliseconds), numbered records are decided by key as well
	// (streamsGroupWindow).
	keysAllUntil atomic.Int64
	// window: the schema's upgrade window is open (window.go); windowRead: it was read once.
	window, windowRead atomic.Bool
	registeredAs       atomic.Value // string: the member id group_members has for this process
	// pooled says that the pool reaches Postgres through a pooler in transaction mode (see
	// checkPooler): the relay polls instead of LISTENing.
	pooled  atomic.Bool
	joined  atomic.Bool
	running atomic.Bool
	// waiting says what startup is waiting for (Kafka, a source topic), for Ready.
	waiting atomic.Pointer[string]
	// lameDuck is set when shutdown begins: Ready fails from then on.
	lameDuck atomic.Bool

	// starts holds where each partition claimed here was first started (offsets.Partition ->
	// int64), for the metadata of the offsets committed to Kafka (see kafkacommit.go).
	starts sync.Map

	lastStuck map[string]int // stuck keys by reason at the last refreshStats
	signalled atomic.Int64   // when Run's context ended, in Unix nanoseconds (the shutdown bound counts from it)

	// fail stops Run with an error: something that must not happen did (see worker.run).
	failOnce sync.Once
	failErr  error
	stopPoll context.CancelFunc

	// pauses: the group's pauses as the control loop last read them (control.go).
	pauses     atomic.Pointer[pauseView]
	pausesRead int // how many pauses the control loop read last (its goroutine only)

	mu      sync.Mutex
	workers map[offsets.Partition]*worker
	// rewinds are the partitions whose fetch the poll loop must move back (worker.dropWaiting);
	// wakePoll wakes the poll it waits in.
	rewinds  map[offsets.Partition]rewindReq
	wakePoll context.CancelFunc
}

// New returns a Processor that applies records to pool. Call Migrate (or run `processor migrate`)
// before Run.
func New(pool *pgxpool.Pool, cfg *Config) (*Processor, error) {
	if pool == nil {
		return nil, errors.New("processor: pool is required")
	}
	if cfg == nil {
		return nil, errors.New("processor: config is required")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("processor: invalid config: %w", err)
	}
	c := cfg.withDefaults()
	m, err := newMetrics(c.Registerer)
	if err != nil {
		return nil, fmt.Errorf("processor: register metrics: %w", err)
	}
	m.pausedTooLong.Set(c.PausedTooLong.Seconds())
	p := &Processor{
		cfg:      c,
		pool:     pool,
		log:      c.Logger.With("group", c.Group),
		metrics:  m,
		kprom:    kprom.NewMetrics("kafkapg_kafka", kprom.Registerer(c.Registerer)),
		store:    offsets.NewStore(c.Schema, c.Group),
		backoff:  backoff.Policy{Base: c.BackoffBase, Max: c.BackoffMax},
		workers:  map[offsets.Partition]*worker{},
		retry:    retrytopics.NewStore(c.Schema, c.Group),
		tierOf:   map[string]tierRef{},
		policies: map[string]*policy{},
		buf:      newBuffer(c.MaxBufferedBytes),
		tracer:   tracing.New(c.TracerProvider, c.Propagator, c.Group),
	}
	for _, t := range c.Topics {
		pol := c.policy(t)
		p.policies[t] = pol
		for n := 1; n <= len(pol.tiers); n++ {
			p.tierOf[retrytopics.TierTopic(t, c.Group, n)] = tierRef{source: t, n: n}
		}
		m.initLabels(t, c.Group, len(pol.tiers))
	}
	m.initTierLabels(p.maxTiers())
	if err := c.Registerer.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "kafkapg", Name: "buffered_bytes",
		Help: "What the fetched records this process holds in memory (waiting or being applied) cost, counted against MaxBufferedBytes.",
	}, func() float64 { return float64(p.buf.used.Load()) })); err != nil {
		return nil, fmt.Errorf("processor: register metrics: %w", err)
	}
	p.clientCtx, p.cutClient = context.WithCancel(context.Background())
	p.heldApplier = newHeldApplier(p)
	p.breaker = newBreaker(breakerConfig{
		threshold:  c.breakerThreshold(),
		window:     c.BreakerWindow,
		minRecords: c.BreakerMinRecords,
		probeMin:   c.BreakerProbeInterval,
		probeMax:   c.BreakerProbeMax,
	}, p.log.With("component", "breaker"), m)
	// No NOTIFY: after a commit that emitted, the processor wakes its own relay (committed), and
	// NOTIFY would serialize the commits of every partition's batches.
	p.outbox, err = sink.NewOutbox(sink.OutboxConfig{Schema: c.Schema, Group: c.Group, NoNotify: true, Partitions: p.partitions})
	if err != nil {
		return nil, fmt.Errorf("processor: %w", err)
	}
	p.keys = keyring.New(c.Schema)
	p.streamSQL = newStreamSQL(c.Schema)
	p.sink = sink.New(pool, p.store, sink.Config{
		Schema:        c.Schema,
		TxIdleTimeout: c.TxIdleTimeout,
		Written: func() {
			if r := p.relay.Load(); r != nil {
				r.Notify()
			}
		},
	})
	return p, nil
}

// Migrate creates or upgrades kafkapg's tables in schema (see Config.Schema). It is safe to call
// from many processes at once.
func Migrate(ctx context.Context, pool *pgxpool.Pool, schemaName string) error {
	if schemaName == "" {
		schemaName = "kafkapg"
	}
	_, err := schema.Migrate(ctx, pool, schemaName)
	return err
}

// Run consumes and applies records until ctx is done, then shuts down: it stops fetching,
// finishes (or, after Config.HandoffTimeout, abandons) the transactions in flight, publishes what
// is left in the outbox, commits offsets to Kafka and leaves the group, within
// Config.ShutdownTimeout. It returns nil after a shutdown asked for through ctx, and an error if
// it could not start or stopped on an unexpected internal error (a restart resumes from
// Postgres). Run may be called once.
func (p *Processor) Run(ctx context.Context) error {
	if !p.running.CompareAndSwap(false, true) {
		return errors.New("processor: Run called twice")
	}
	if err := p.checkPooler(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	cl, err := p.newClient()
	if err != nil {
		return err
	}
	p.client.Store(cl)
	p.checkNumbering(ctx)
	if p.streamsOn() {
		if err := p.streamsGroupWindow(ctx); err != nil {
			cl.Close()
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
	if err := p.inPlace(ctx, nil, p.log, "", nil, func() error { return p.readWindow(ctx) }); err != nil {
		cl.Close()
		if ctx.Err() != nil {
			return nil
		}
		return err
	}

	if err := p.ensureTopics(ctx, kadm.NewClient(cl)); err != nil {
		cl.Close() // not in a group yet: nothing to wait for
		if ctx.Err() != nil {
			return nil
		}
		return err
	}

	relay := sink.NewRelay(p.pool, cl, sink.RelayConfig{
		Schema:        p.cfg.Schema,
		Group:         p.cfg.Group,
		Logger:        p.log.With("component", "outbox"),
		BackoffBase:   p.cfg.BackoffBase,
		BackoffMax:    p.cfg.BackoffMax,
		TxIdleTimeout: p.cfg.TxIdleTimeout,
		Interval:      p.cfg.OutboxPollInterval,
		Retention:     p.cfg.OutboxRetention,
		Listen:        p.listenConfig(),
		Published: func(m sink.Message, waited time.Duration) {
			p.metrics.published.WithLabelValues(m.Topic).Inc()
			p.metrics.publishWait.Observe(waited.Seconds())
		},
		Refused:        p.refused,
		TracerProvider: p.cfg.TracerProvider,
		Propagator:     p.cfg.Propagator,
	})
	p.relay.Store(relay)
	relayCtx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	relayDone := make(chan struct{})
	go func() {
		defer close(relayDone)
		relay.Run(relayCtx)
	}()
	defer stopRelay()
	statsCtx, stopStats := context.WithCancel(ctx)
	defer stopStats()
	go p.refreshStats(statsCtx)
	go p.watchWindow(statsCtx, windowEvery)
	if p.cfg.RelayOnly {
		p.joined.Store(true) // there is no group to join: ready once the relay runs
		p.log.Info("outbox relay started (relay only: nothing is consumed)", "instance", p.cfg.InstanceName)
		<-ctx.Done()
		p.shutdownRelay(ctx, cl, stopRelay, relayDone)
		return nil
	}
	go p.control(statsCtx)
	go p.heldApplier.run()
	if p.keysOn() {
		go p.keepKeys(statsCtx)
	} else {
		// A group without keys says so (a retention of 0): the table of keys of the layout before
		// migration 8 is emptied only once every group of the schema has said how long it keeps
		// its keys (keyring.Ring.Keep). Tried once; a group that could not say holds it back, and
		// the keep loop of a group with keys logs which.
		go func() {
			if err := p.keys.Register(statsCtx, p.pool, p.cfg.Group); err != nil && statsCtx.Err() == nil {
				p.log.Warn("cannot register the group with the idempotency key ring (it holds the table of keys before migration 8 back until it does)", "err", err)
			}
		}()
	}

	if p.cfg.GroupProtocol != GroupProtocolClassic {
		p.setGroupTimeouts(ctx, cl)
	}

	// Joining starts only now, so the rebalance callbacks always find p.client set.
	topics := slices.Concat(p.cfg.Topics, slices.Sorted(maps.Keys(p.tierOf)))
	cl.AddConsumeTopics(topics...)
	p.log.Info("processor started", "topics", p.cfg.Topics, "instance", p.cfg.InstanceName)
	for _, t := range p.cfg.Topics {
		p.logPolicy(t)
	}
	if p.keysOn() {
		p.log.Info("idempotency keys are on: "+keySizing(p.cfg.IdempotencyRetention), "idempotency_retention", p.cfg.IdempotencyRetention.String(),
			"bytes_per_key", keyBytesPeak, "metric", "kafkapg_idempotency_keys_bytes")
	}
	context.AfterFunc(ctx, func() { p.signalled.Store(time.Now().UnixNano()) })
	pollCtx, stopPoll := context.WithCancel(ctx)
	p.mu.Lock()
	p.stopPoll = stopPoll
	p.mu.Unlock()
	p.poll(pollCtx, cl)
	stopPoll()
	p.shutdown(ctx, cl, relay, stopRelay, relayDone)
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.failErr
}

// fail makes Run shut down and return err.
func (p *Processor) fail(err error) {
	p.failOnce.Do(func() {
		p.log.Error("processor stopping on an unexpected error", "err", err)
		p.mu.Lock()
		p.failErr = err
		stop := p.stopPoll
		p.mu.Unlock()
		if stop != nil {
			stop()
		}
	})
}

func (p *Processor) shutdown(ctx context.Context, cl *kgo.Client, relay *sink.Relay, stopRelay func(), relayDone <-chan struct{}) {
	begun := time.Now()
	p.lameDuck.Store(true) // not ready first, then hand off
	// The bound counts from the signal: the poll loop may have taken a moment to notice it (a
	// rebalance callback in progress holds the poll). A stop by fail has no signal.
	signalled := begun
	if ns := p.signalled.Load(); ns != 0 && ns < begun.UnixNano() {
		signalled = time.Unix(0, ns)
	}
	sctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), signalled.Add(p.cfg.ShutdownTimeout))
	defer cancel()
	p.log.Info("shutting down", "timeout", p.cfg.ShutdownTimeout)

	// Stop the workers first: nothing new is applied from here on.
	handoff := min(p.cfg.HandoffTimeout, max(time.Until(deadlineOf(sctx))/2, 0))
	p.stopWorkers(append(stoppers(p.removeWorkers(nil)), p.heldApplier), handoff)

	// Publish what the last transactions put in the outbox, if time allows; anything left is
	// published by the next processor to run.
	stopRelay()
	select {
	case <-relayDone:
	case <-sctx.Done():
	}
	fctx, fcancel := context.WithTimeout(sctx, max(time.Until(deadlineOf(sctx))/2, 0))
	if n, err := relay.Flush(fctx); err != nil {
		p.log.Warn("outbox not fully published at shutdown; the next processor will publish the rest", "published", n, "err", err)
	}
	fcancel()

	// Kafka's committed offsets are advisory: do not let a commit that waits for a rebalance in
	// progress (the group is rejoining) eat the time left for leaving the group.
	cctx, ccancel := context.WithTimeout(kgo.PreCommitFnContext(sctx, p.stampCommit), min(time.Second, max(time.Until(deadlineOf(sctx))/4, 0)))
	if err := cl.CommitMarkedOffsets(cctx); err != nil {
		p.log.Warn("final kafka offset commit failed (advisory only; postgres holds the positions)", "err", err)
	}
	ccancel()

	// Leaving the group and closing the client wait for the group's state machine. Under the
	// classic protocol that can be stuck in a join that waits for a dead member (the broker
	// answers no member's join until every member has joined, or the session or rebalance timeout
	// passes). A clean leave takes milliseconds: if it has not happened by then, leave by hand and
	// cut the client loose, so that the group reassigns our partitions as soon as the join
	// completes, without waiting for our session to expire too.
	closed := make(chan struct{})
	// Nothing polls any more: open BlockRebalanceOnPoll's gate for good. franz-go's leave waits
	// for it, in a goroutine of its own that would wait for ever if LeaveGroupContext returned at
	// the deadline first.
	cl.AllowRebalance()
	go func() {
		defer close(closed)
		if err := cl.LeaveGroupContext(sctx); err != nil {
			p.log.Warn("leave group", "err", err)
		}
		cl.CloseAllowingRebalance()
	}()
	grace := time.NewTimer(min(leaveGrace, max(time.Until(deadlineOf(sctx))/2, 0)))
	defer grace.Stop()
	select {
	case <-closed:
	case <-grace.C:
		p.log.Info("leaving the group is held up (a rebalance waiting for a member?); leaving by hand")
		p.leaveByHand(sctx, cl)
		p.cutClient()
		select {
		case <-closed:
		case <-sctx.Done():
			p.log.Warn("kafka client did not close within the shutdown timeout; stopping anyway")
		}
	case <-sctx.Done():
		p.log.Warn("kafka client did not close within the shutdown timeout; stopping anyway (the group expels this member at its session timeout)")
	}
	p.cutClient()
	p.log.Info("processor stopped", "took", time.Since(begun).Round(time.Millisecond))
}

// shutdownRelay is the shutdown of a relay alone (Config.RelayOnly): it stops the relay,
// publishes what is left within ShutdownTimeout and closes the client.
func (p *Processor) shutdownRelay(ctx context.Context, cl *kgo.Client, stopRelay func(), relayDone <-chan struct{}) {
	begun := time.Now()
	p.lameDuck.Store(true)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.ShutdownTimeout)
	defer cancel()
	stopRelay()
	select {
	case <-relayDone:
	case <-sctx.Done():
	}
	if n, err := p.relay.Load().Flush(sctx); err != nil {
		p.log.Warn("outbox not fully published at shutdown; the next relay will publish the rest", "published", n, "err", err)
	}
	cl.Close()
	p.cutClient()
	p.log.Info("outbox relay stopped", "took", time.Since(begun).Round(time.Millisecond))
}

// listenConfig is the connection the relay LISTENs on: one like the pool's, unless
// OutboxListenDisabled, or the pool reaches Postgres through a pooler in transaction mode, which
// passes no notifications on.
func (p *Processor) listenConfig() *pgx.ConnConfig {
	if p.cfg.OutboxListenDisabled || p.pooled.Load() {
		return nil
	}
	return p.pool.Config().ConnConfig.Copy()
}

// checkPooler finds out, waiting for Postgres if it must, whether the pool reaches it through a
// pooler in transaction mode (PgBouncer), and refuses a pool that cannot work through it: one
// that prepares named statements (pgx's default query mode), or a pooler in statement mode.
func (p *Processor) checkPooler(ctx context.Context) error {
	cc := p.pool.Config().ConnConfig
	for failures := 1; ; failures++ {
		found, err := pooler.Detect(ctx, cc)
		mode := cc.DefaultQueryExecMode
		if err == nil && found.Kind != pooler.Direct {
			mode, err = p.queryExecMode(ctx)
		}
		switch {
		case errors.Is(err, pooler.ErrStatementMode):
			return fmt.Errorf("processor: %w", err)
		case err == nil && found.Unsupported(mode):
			return fmt.Errorf("processor: postgres is reached through a connection pooler in transaction mode (PgBouncer?) that does not keep prepared statements, " +
				"where pgx's default query mode, which prepares named statements, fails (prepared statement \"stmtcache_...\" already exists): give the pool a mode without them, " +
				"default_query_exec_mode=cache_describe in the connection string (or pgxpool.Config.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe), " +
				"or let the pooler keep them (PgBouncer 1.21 and later: max_prepared_statements)")
		case err == nil:
			p.waiting.Store(nil)
			if found.Kind != pooler.Direct {
				p.pooled.Store(true)
				if found.Pooled() && pooler.NamedStatements(mode) {
					p.log.Warn("postgres is reached through a connection pooler, and the pool prepares named statements: that works in its session mode, and fails in its transaction mode; "+
						"default_query_exec_mode=cache_describe works in both", "pooler", found.Kind.String())
				}
				p.log.Info("postgres is reached through a connection pooler: the outbox relay polls for records other processes emit, instead of LISTENing",
					"pooler", found.Kind.String(), "query_exec_mode", mode.String(), "pooler_keeps_prepared_statements", found.PreparedStatements, "poll_interval", p.cfg.OutboxPollInterval)
			}
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		why := fmt.Sprintf("waiting for postgres: %v", err)
		p.waiting.Store(&why)
		d := p.backoff.Delay(failures)
		p.log.Warn("cannot reach postgres yet; retrying", "err", err, "retry_in", d)
		if !backoff.Sleep(ctx, nil, d) {
			return ctx.Err()
		}
	}
}

// queryExecMode returns the query mode of the pool's connections: its configuration's, unless a
// BeforeConnect hook (the service's, see package pooler) changes it for each connection.
func (p *Processor) queryExecMode(ctx context.Context) (pgx.QueryExecMode, error) {
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Release()
	return conn.Conn().Config().DefaultQueryExecMode, nil
}

func deadlineOf(ctx context.Context) time.Time {
	d, ok := ctx.Deadline()
	if !ok {
		return time.Now()
	}
	return d
}

// policy returns the policy of source topic, which must be one of Config.Topics.
func (p *Processor) policy(topic string) *policy { return p.policies[topic] }

// logPolicy logs the settings in force for topic: its TopicPolicy with the Config's defaults
// applied, and the topics its failures go to.
func (p *Processor) logPolicy(topic string) {
	pol := p.policies[topic]
	tiers := make([]string, len(pol.tiers))
	for i, d := range pol.tiers {
		tiers[i] = fmt.Sprintf("%s after %s", retrytopics.TierTopic(topic, p.cfg.Group, i+1), d)
	}
	p.log.Info("topic settings", "topic", topic, "handler", fmt.Sprintf("%T", pol.handler),
		"retry_tiers", fmt.Sprint(pol.tiers), "tier_topics", tiers, "dlq_topic", retrytopics.DLQTopic(topic, p.cfg.Group),
		"local_attempts", pol.localAttempts, "on_dead_letter", pol.onDeadLetter, "max_record_bytes", pol.maxRecordBytes,
		"idempotency_key", pol.idempotencyKey.String())
}

// tierCounts returns the number of retry tiers of each source topic.
func (p *Processor) tierCounts() map[string]int {
	out := make(map[string]int, len(p.policies))
	for t, pol := range p.policies {
		out[t] = len(pol.tiers)
	}
	return out
}

// maxTiers returns the most retry tiers any source topic has.
func (p *Processor) maxTiers() int {
	n := 0
	for _, pol := range p.policies {
		n = max(n, len(pol.tiers))
	}
	return n
}

// Healthy reports whether the processor is alive: its state lock can be taken before ctx ends
// (a deadlock there would stall every partition). It does not depend on Kafka or Postgres, so a
// liveness probe on it does not restart processes during an outage.
func (p *Processor) Healthy(ctx context.Context) error {
	got := make(chan struct{})
	go func() {
		p.mu.Lock()
		p.mu.Unlock()
		close(got)
	}()
	select {
	case <-got:
		return nil
	case <-ctx.Done():
		return errors.New("processor state lock not acquired in time: deadlocked?")
	}
}

// Ready reports whether the processor has joined its group and Postgres answers. It fails from
// the moment shutdown begins (lame duck), before the processor hands its partitions off.
func (p *Processor) Ready(ctx context.Context) error {
	if p.lameDuck.Load() {
		return errors.New("shutting down")
	}
	if !p.joined.Load() {
		if why := p.waiting.Load(); why != nil {
			return fmt.Errorf("not a member of the consumer group yet: %s", *why)
		}
		return errors.New("not a member of the consumer group yet")
	}
	if err := p.pool.Ping(ctx); err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	return nil
}
