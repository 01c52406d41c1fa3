package service

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/KimMachineGun/automemlimit/memlimit"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/processor"
)

// builtin is a handler cmd/processor can run by name.
type builtin struct {
	handler processor.Handler
	// setup creates the handler's tables; it runs at startup.
	setup func(ctx context.Context, pool *pgxpool.Pool) error
}

var handlers = map[string]builtin{
	"ledger":          {handler: ledger.Handler{}, setup: setupUnderLock("ledger", ledger.Schema)},
	"ledger-careless": {handler: ledger.Careless{}, setup: setupUnderLock("ledger-careless", ledger.CarelessSchema)},
}

// setupUnderLock runs a handler's schema SQL under an advisory lock: replicas start together, and
// concurrent CREATE TABLE IF NOT EXISTS can fail on Postgres's catalog (23505 on pg_type).
func setupUnderLock(name, sql string) func(ctx context.Context, pool *pgxpool.Pool) error {
	return func(ctx context.Context, pool *pgxpool.Pool) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('kafkapg.handler-setup:' || $1, 0))`, name); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sql)
			return err
		})
	}
}

// HandlerNames lists the built-in handlers.
func HandlerNames() []string {
	var out []string
	for n := range handlers {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

const usage = `usage: processor [run|migrate|help]

  run      consume KAFKA_TOPICS and apply them to DATABASE_URL (the default)
  migrate  create or upgrade kafkapg's tables in DB_SCHEMA, then exit

Configuration is read from environment variables; see README.md.
`

// Main is cmd/processor. It returns the process exit status: 0 after a clean run or shutdown,
// 2 for bad usage or configuration, 1 for other failures.
func Main(args []string, stderr io.Writer) int {
	cmd := "run"
	if len(args) > 0 {
		cmd = args[0]
	}
	if len(args) > 1 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	var err error
	switch cmd {
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stderr, usage)
		return 0
	case "migrate":
		err = migrateOnly(ctx, stderr)
	case "run":
		var env *Env
		if env, err = LoadEnv(); err == nil {
			err = Run(ctx, env, NewLogger(env, stderr))
		}
	default:
		fmt.Fprintf(stderr, "processor: unknown command %q\n%s", cmd, usage)
		return 2
	}
	var cerr *ConfigError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &cerr):
		fmt.Fprintf(stderr, "processor: configuration error: %s\n", strings.ReplaceAll(err.Error(), "\n", "; "))
		return 2
	default:
		fmt.Fprintf(stderr, "processor: %v\n", err)
		return 1
	}
}

func migrateOnly(ctx context.Context, stderr io.Writer) error {
	env, err := LoadDBEnv()
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	pool, err := openPool(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := processor.Migrate(ctx, pool, env.DBSchema); err != nil {
		return err
	}
	log.Info("schema is up to date", "schema", env.DBSchema)
	return nil
}

// NewLogger returns the logger LOG_FORMAT and LOG_LEVEL ask for.
func NewLogger(env *Env, w io.Writer) *slog.Logger {
	level, _ := parseLevel(env.LogLevel)
	opts := &slog.HandlerOptions{Level: level}
	if env.LogFormat == "text" {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}

func openPool(ctx context.Context, env *DBEnv) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(env.DatabaseURL)
	if err != nil {
		return nil, &ConfigError{fmt.Errorf("DATABASE_URL is not a valid connection string: %v", err)}
	}
	if !strings.Contains(env.DatabaseURL, "pool_max_conns") {
		cfg.MaxConns = env.DBMaxConns
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

// Run runs the processor service until ctx is done: it waits for Postgres, migrates, creates the
// handler's tables, serves /metrics, /healthz and /readyz on HTTP_ADDR, and processes records.
func Run(ctx context.Context, env *Env, log *slog.Logger) error {
	b := handlers[env.Handler]
	// The Go runtime does not know its container's memory limit: without a soft limit, the
	// garbage collector lets the heap grow to twice what is live, which a memory-limited pod pays
	// for with an OOM kill. GOMEMLIMIT, if set, wins.
	if limit, err := memlimit.Set(memlimit.WithLogger(log)); err != nil {
		log.Warn("cannot read the container's memory limit; GOMEMLIMIT not set", "err", err)
	} else if limit < math.MaxInt64 {
		log.Info("soft memory limit", "gomemlimit_bytes", limit, "max_buffered_bytes", env.MaxBufferedBytes)
	}
	pool, err := openPool(ctx, &env.DBEnv)
	if err != nil {
		return err
	}
	defer pool.Close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	// Serve health and metrics from the start: /healthz answers while we wait for Postgres,
	// /readyz only once the processor is ready.
	var proc atomic.Pointer[processor.Processor]
	ready := func(ctx context.Context) error {
		p := proc.Load()
		if p == nil {
			return errors.New("starting: waiting for postgres")
		}
		return p.Ready(ctx)
	}
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kafkapg_ready",
		Help: "1 if this process is ready (in the consumer group, Postgres answers, not shutting down), as /readyz says; else 0.",
	}, func() float64 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if ready(ctx) != nil {
			return 0
		}
		return 1
	}))
	ln, err := net.Listen("tcp", env.HTTPAddr)
	if err != nil {
		return &ConfigError{fmt.Errorf("HTTP_ADDR=%q: %v", env.HTTPAddr, err)}
	}
	healthy := func(ctx context.Context) error {
		if p := proc.Load(); p != nil {
			return p.Healthy(ctx)
		}
		return nil
	}
	srv := &http.Server{Handler: httpHandler(reg, healthy, ready), ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	log.Info("http listening", "addr", ln.Addr().String(), "paths", "/metrics /healthz /readyz")

	// Postgres may not be up yet (pods start in any order): wait for it with backoff.
	policy := backoff.Policy{Base: env.RetryBackoffBase, Max: env.RetryBackoffMax}
	for failures := 1; ; failures++ {
		err := processor.Migrate(ctx, pool, env.DBSchema)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		if processor.Classify(err) != processor.ClassInfrastructure {
			return fmt.Errorf("migrate schema %s: %w", env.DBSchema, err)
		}
		d := policy.Delay(failures)
		log.Warn("waiting for postgres", "err", err, "retry_in", d)
		if !backoff.Sleep(ctx, nil, d) {
			return nil
		}
	}
	if err := b.setup(ctx, pool); err != nil {
		return fmt.Errorf("set up tables of handler %s: %w", env.Handler, err)
	}

	p, err := processor.New(pool, env.processorConfig(b.handler, log, reg))
	if err != nil {
		return err
	}
	proc.Store(p)
	return p.Run(ctx)
}

// processorConfig is the processor configuration the environment describes. Where the
// variables and processor.Config spell "off" differently, it translates: BATCH_MAX_WAIT=0 (apply
// at once) and BREAKER_THRESHOLD=0 (no breaker) are negative there, zero meaning "default".
func (env *Env) processorConfig(h processor.Handler, log *slog.Logger, reg prometheus.Registerer) *processor.Config {
	start := processor.StartEarliest
	if env.KafkaStartOffset == "latest" {
		start = processor.StartLatest
	}
	batchWait := env.BatchMaxWait
	if batchWait == 0 {
		batchWait = -1
	}
	breaker := env.BreakerThreshold
	if breaker == 0 {
		breaker = -1
	}
	return &processor.Config{
		Brokers:              env.KafkaBrokers,
		Group:                env.KafkaGroupID,
		Topics:               env.KafkaTopics,
		Handler:              h,
		Schema:               env.DBSchema,
		StartOffset:          start,
		GroupProtocol:        env.KafkaGroupProtocol,
		BatchMaxRecords:      env.BatchMaxRecords,
		BatchMaxWait:         batchWait,
		LocalAttempts:        env.RetryLocalAttempts,
		MaxRecordBytes:       env.MaxRecordBytes,
		MaxBufferedBytes:     env.MaxBufferedBytes,
		RetryTiers:           env.Tiers,
		OnDeadLetter:         env.OnDeadLetter,
		DisableTopicCreation: !env.KafkaCreateTopics,
		BackoffBase:          env.RetryBackoffBase,
		BackoffMax:           env.RetryBackoffMax,
		SessionTimeout:       env.KafkaSessionTimeout,
		RebalanceTimeout:     env.KafkaRebalanceTimeout,
		ShutdownTimeout:      env.ShutdownTimeout,
		BreakerThreshold:     breaker,
		BreakerWindow:        env.BreakerWindow,
		BreakerMinRecords:    env.BreakerMinRecords,
		BreakerProbeInterval: env.BreakerProbeInterval,
		BreakerProbeMax:      env.BreakerProbeMax,
		TxIdleTimeout:        env.DBTxIdleTimeout,
		StallTimeout:         env.StallTimeout,
		KafkaOptions:         env.KafkaOpts,
		Logger:               log,
		Registerer:           reg,
	}
}

func httpHandler(reg *prometheus.Registry, healthy, ready func(context.Context) error) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := healthy(ctx); err != nil {
			http.Error(w, "unhealthy: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := ready(ctx); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "ready\n")
	})
	return mux
}
