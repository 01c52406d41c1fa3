// Package service runs a processor as a complete service: your handlers, configured by
// environment variables, with everything it takes to operate it. A main of a few lines,
//
//	func main() {
//		service.Main(service.Handler{
//			Name:    "orders",
//			Handler: processor.HandlerFunc(handleOrder),
//			Setup:   service.SetupSQL(`CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, amount bigint)`),
//		})
//	}
//
// builds a binary that reads its configuration from the environment (docs/configuration.md),
// waits for Postgres and Kafka, creates kafkapg's tables and the handler's, serves /metrics,
// /healthz and /readyz, logs in JSON, shuts down within SHUTDOWN_TIMEOUT on SIGTERM, and exits 0
// after a clean shutdown, 2 on bad configuration and 1 on other failures. Its commands:
//
//	run      consume KAFKA_TOPICS and apply them to DATABASE_URL (the default)
//	migrate  create or upgrade kafkapg's tables in DB_SCHEMA, then exit
//	upgrade  the upgrade window (docs/upgrading.md): status, finalize
//
// cmd/processor is this package with the built-in ledger handler.
package service

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"slices"
	"sort"
	"strconv"
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
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/pooler"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/internal/schema"
	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// Handler is a handler a service can run, chosen by name with HANDLER (or, per topic, with
// TOPIC_<topic>_HANDLER).
type Handler struct {
	// Name selects the handler. Required, and unique within a binary.
	Name string
	// Handler applies records. It may also be a processor.BatchHandler, a
	// processor.ErrorClassifier, or a processor.Preparer: its Prepare runs outside the
	// transaction, before Handle, for up to CONCURRENCY records of a partition at once (see
	// Concurrency). Required.
	Handler processor.Handler
	// Setup, if set, creates or upgrades the handler's own tables. It runs at startup, after
	// kafkapg's migrations, inside a transaction that holds an advisory lock for the handler's
	// name: replicas that start together run it one after the other, so it can be a plain
	// CREATE TABLE IF NOT EXISTS (which two sessions running at once can fail).
	Setup func(ctx context.Context, tx pgx.Tx) error
	// IdempotencyKey, if set, deduplicates the records of every topic this handler handles (see
	// processor.TopicPolicy.IdempotencyKey), unless TOPIC_<topic>_IDEMPOTENCY_KEY says otherwise.
	// `<binary> config` and the startup log name it as it was built (IdempotencyKey.String):
	// KeyFromJSON("order_id"), KeyFromHeader("x-id"), or "a function of yours".
	IdempotencyKey processor.IdempotencyKey
	// RetryTiers, LocalAttempts, OnDeadLetter and MaxRecordBytes, if set (not zero; RetryTiers
	// not nil), are the retry and dead-letter settings of every topic this handler handles, in
	// Go: each takes the place of the service-wide variable (RETRY_TIERS, RETRY_LOCAL_ATTEMPTS,
	// ON_DEAD_LETTER, MAX_RECORD_BYTES) for these topics, and TOPIC_<topic>_<setting> overrides
	// it in turn. An empty, non-nil RetryTiers means no tiers: records are dead-lettered after
	// their local attempts. `<binary> config` shows which one is in force, and where it came from.
	// Values and Keys, if set, decode the values (keys) of every topic this handler handles with
	// the Schema Registry at SCHEMA_REGISTRY_URL, into Record.Decoded (DecodedKey), before
	// Prepare and Handle: schemaregistry.AvroFormat[Order](schema), ProtobufFormat[*pb.Order](),
	// JSONSchemaFormat[Order](). TOPIC_<topic>_VALUE_FORMAT (_KEY_FORMAT) overrides it: avro,
	// protobuf or json-schema decode without a Go type, none not at all.
	Values, Keys schemaregistry.Format
	// Encoders are the handler's Encoders of the events it emits in the wire format
	// (schemaregistry.AvroEncoder(nil, subject, schema) and the like): the service binds them to
	// the registry SCHEMA_REGISTRY_URL names when it starts.
	Encoders       []*schemaregistry.Encoder
	RetryTiers     []time.Duration
	LocalAttempts  int
	OnDeadLetter   processor.OnDeadLetter
	MaxRecordBytes int
	// Concurrency, if set, is how many records of a partition a processor.Preparer prepares
	// at once for the topics this handler handles (processor.Config.Concurrency), in place of
	// CONCURRENCY; TOPIC_<topic>_CONCURRENCY overrides it.
	Concurrency int
}

// SetupSQL returns a Handler.Setup that runs sql, which may hold several statements.
func SetupSQL(sql string) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, sql)
		return err
	}
}

// registry is a binary's handlers, by name.
type registry struct {
	names  []string // sorted
	byName map[string]*Handler
}

func newRegistry(hs []Handler) (*registry, error) {
	r := &registry{byName: map[string]*Handler{}}
	var errs []error
	for i := range hs {
		h := &hs[i]
		switch {
		case h.Name == "":
			errs = append(errs, fmt.Errorf("handler %d has no Name", i+1))
		case h.Handler == nil:
			errs = append(errs, fmt.Errorf("handler %q has no Handler", h.Name))
		case r.byName[h.Name] != nil:
			errs = append(errs, fmt.Errorf("two handlers are named %q", h.Name))
		default:
			r.byName[h.Name] = h
			r.names = append(r.names, h.Name)
		}
	}
	if len(hs) == 0 {
		errs = append(errs, errors.New("no handlers: pass at least one to Main"))
	}
	sort.Strings(r.names)
	return r, errors.Join(errs...)
}

// get returns the handler called name, or nil.
func (r *registry) get(name string) *Handler { return r.byName[name] }

// setup runs the Setup of the handlers called names, each under its advisory lock.
func (r *registry) setup(ctx context.Context, pool *pgxpool.Pool, names []string) error {
	for _, n := range names {
		h := r.get(n)
		if h.Setup == nil {
			continue
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('kafkapg.handler-setup:' || $1, 0))`, n); err != nil {
				return err
			}
			return h.Setup(ctx, tx)
		})
		if err != nil {
			return fmt.Errorf("set up the tables of handler %s: %w", n, err)
		}
	}
	return nil
}

// progName is the binary's name, for messages: its file's, through any link to it.
func progName() string {
	if exe, err := os.Executable(); err == nil {
		if real, err := filepath.EvalSymlinks(exe); err == nil {
			return filepath.Base(real)
		}
	}
	return filepath.Base(os.Args[0])
}

const usage = `usage: %[1]s [run|config|migrate|upgrade|dlq|keys|positions|trace|help]

  run        consume KAFKA_TOPICS and apply them to DATABASE_URL (the default)
  config     print the configuration in force (secrets redacted), then exit
  migrate    create or upgrade kafkapg's tables in DB_SCHEMA, then exit
  upgrade    the upgrade window: status, and finalize it once the release before no longer runs
  dlq        list, show, replay, discard and purge dead letters; list and cancel tasks
  keys       list held and blocked keys; release one
  positions  the group's positions; pause and resume a topic or partition; set a position
  trace      where a record is now, and how it got there

Each operator command takes -h for its own help. Commands that change anything are
dry runs unless given --execute, and then need --reason.

Configuration is read from environment variables: see docs/configuration.md in
github.com/kafkapg/kafkapg.
Handlers in this binary (HANDLER): %[2]s
`

// Main runs the service with handlers, as the command line and the environment say, and exits
// with its status: 0 after a clean run or shutdown, 2 for bad usage or configuration, 1 for other
// failures.
func Main(handlers ...Handler) {
	os.Exit(Run(os.Args[1:], os.Stderr, handlers...))
}

// Run is Main without the exit: it runs the command args name (run if none) and returns the
// exit status. It stops on SIGINT or SIGTERM.
func Run(args []string, stderr io.Writer, handlers ...Handler) int {
	return run(args, os.Stdout, stderr, handlers...)
}

// run is Run writing the results of operator commands to stdout.
func run(args []string, stdout, stderr io.Writer, handlers ...Handler) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return runIn(ctx, args, stdout, stderr, nil, handlers...)
}

// runIn is run until ctx ends. A harness, if not nil, gives the configuration in place of the
// process's environment (package servicetest).
func runIn(ctx context.Context, args []string, stdout, stderr io.Writer, h *harness, handlers ...Handler) int {
	prog := progName()
	hs, err := newRegistry(handlers)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %s\n", prog, strings.ReplaceAll(err.Error(), "\n", "; "))
		return 2
	}
	help := func() { fmt.Fprintf(stderr, usage, prog, strings.Join(hs.names, ", ")) }
	cmd := "run"
	if len(args) > 0 {
		cmd = args[0]
	}
	withArgs := cmd == "dlq" || cmd == "keys" || cmd == "positions" || cmd == "trace" || cmd == "config" || cmd == "upgrade"
	if len(args) > 1 && !withArgs {
		help()
		return 2
	}
	if h != nil && !h.supports(cmd) {
		fmt.Fprintf(stderr, "%s: command %q is not run in a test harness (it runs run, config, dlq, keys, positions and trace)\n", prog, cmd)
		return 2
	}

	switch cmd {
	case "help", "-h", "-help", "--help":
		help()
		return 0
	case "migrate":
		err = migrateOnly(ctx, stderr)
	case "upgrade":
		stderr = safetext.TerminalWriter(stderr) // a refusal names members as the broker describes them (client ids, hosts: anyone's)
		err = upgradeCmd(ctx, args[1:], stdout, stderr)
	case "config":
		h.read(func() { err = configCmd(args[1:], hs, stdout, stderr) }) // it escapes for the terminal or for JSON
	case "dlq", "keys", "positions", "trace":
		stderr = safetext.TerminalWriter(stderr) // the errors below may quote what came from outside
		var e *env
		if h.read(func() { e, err = loadOpsEnv(hs) }); err == nil {
			err = operate(ctx, e, cmd, args[1:], hs, stdout, stderr)
		}
	case "run":
		var e *env
		if h.read(func() { e, err = loadEnv(hs) }); err == nil {
			log := newLogger(e, stderr)
			if h == nil {
				setMemoryLimit(log, e.MaxBufferedBytes)
			} else {
				e.test = h.test
			}
			err = serve(ctx, e, hs, log)
		}
	default:
		fmt.Fprintf(stderr, "%s: unknown command %q\n", prog, cmd)
		help()
		return 2
	}
	var cerr *configError
	var uerr *usageError
	switch {
	case err == nil, errors.Is(err, errHelpShown):
		return 0
	case errors.As(err, &uerr), errors.Is(err, ops.ErrUsage):
		fmt.Fprintf(stderr, "%s %s: %v\n", prog, cmd, err)
		return 2
	case errors.As(err, &cerr):
		fmt.Fprintf(stderr, "%s: configuration error: %s%s\n", prog, strings.ReplaceAll(err.Error(), "\n", "; "), devEnvHint(err))
		return 2
	default:
		fmt.Fprintf(stderr, "%s: %v\n", prog, err)
		return 1
	}
}

// devEnvFile is where the dev loop (`go tool kafkapg dev`) writes the environment of its
// broker and database, "export NAME=VALUE" lines, in the directory it runs in.
const devEnvFile = ".kafkapg/env"

// requiredVar finds the variables a configuration error says are required.
var requiredVar = regexp.MustCompile(`\b([A-Z][A-Z0-9_]*) is required`)

// devEnvHint is what a configuration error adds when a variable it says is required is one that
// .kafkapg/env, in the working directory, sets: the dev loop runs (or ran) here, and the shell
// that started the service has not sourced its file. It reads the variables' names only.
func devEnvHint(err error) string {
	b, rerr := os.ReadFile(devEnvFile)
	if rerr != nil {
		return ""
	}
	sets := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "export "); ok {
			name, _, _ := strings.Cut(rest, "=")
			sets[name] = true
		}
	}
	var names []string
	for _, m := range requiredVar.FindAllStringSubmatch(err.Error(), -1) {
		if sets[m[1]] && !slices.Contains(names, m[1]) {
			names = append(names, m[1])
		}
	}
	if len(names) == 0 {
		return ""
	}
	return fmt.Sprintf(" (%s, which the dev loop wrote here, sets %s: source it first, `. %s`)", devEnvFile, strings.Join(names, ", "), devEnvFile)
}

func migrateOnly(ctx context.Context, stderr io.Writer) error {
	env, err := loadDBEnv()
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	pool, adapt, err := openPool(ctx, env)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := adapt(ctx, log); err != nil {
		return fmt.Errorf("database: %w", err)
	}
	return migrateLogged(ctx, pool, env.DBSchema, log)
}

// migrateLogged migrates schemaName and logs what it did: each migration applied, and the
// upgrade window (schema.Migrate) if it is open.
func migrateLogged(ctx context.Context, pool *pgxpool.Pool, schemaName string, log *slog.Logger) error {
	r, err := schema.MigrateReport(ctx, pool, schemaName)
	if err != nil {
		return err
	}
	if len(r.Converted) > 0 {
		log.Info("migrations a build before recorded as final are pending now: the upgrade window is open (see docs/upgrading.md)",
			"schema", schemaName, "versions", r.Converted)
	}
	for _, m := range r.Applied {
		log.Info("migration applied", "schema", schemaName, "version", m.Version, "name", m.Name, "pending", m.Version > r.Finalized)
	}
	switch {
	case r.Open():
		log.Info("the upgrade window is open: processes of the release before may run beside this one, and a rollback to it works; "+
			"finalize once none runs (`upgrade finalize`, docs/upgrading.md)",
			"schema", schemaName, "finalized_version", r.Finalized, "pending_versions", r.Pending, "release_before_schema", schema.PreviousSchema)
	case len(r.Applied) == 0:
		log.Info("schema is up to date", "schema", schemaName, "version", r.Finalized)
	default:
		log.Info("schema migrated", "schema", schemaName, "version", r.Finalized)
	}
	return nil
}

// newLogger returns the logger LOG_FORMAT and LOG_LEVEL ask for.
func newLogger(env *env, w io.Writer) *slog.Logger {
	level, _ := parseLevel(env.LogLevel)
	opts := &slog.HandlerOptions{Level: level}
	if env.LogFormat == "text" {
		return slog.New(slog.NewTextHandler(w, opts)) // it quotes what a terminal would take for commands
	}
	return slog.New(slog.NewJSONHandler(safetext.JSONWriter(w), opts))
}

// openPool returns the pool on DATABASE_URL, and adapt, which must run (once Postgres answers)
// before the pool is used: it finds out whether DATABASE_URL leads to a connection pooler in
// transaction mode (PgBouncer) and then, unless DATABASE_URL chose a query mode, switches the
// pool to one that works through it (see package pooler). openPool itself connects nowhere.
func openPool(ctx context.Context, env *dbEnv, opts ...func(*pgxpool.Config)) (pool *pgxpool.Pool, adapt func(context.Context, *slog.Logger) error, err error) {
	cfg, err := pgxpool.ParseConfig(env.DatabaseURL)
	if err != nil {
		return nil, nil, &configError{fmt.Errorf("DATABASE_URL is not a valid connection string: %s", dsnError(env.DatabaseURL, err))}
	}
	for _, o := range opts {
		o(cfg)
	}
	if !strings.Contains(env.DatabaseURL, "pool_max_conns") {
		cfg.MaxConns = env.DBMaxConns
	}
	chosen := strings.Contains(env.DatabaseURL, "default_query_exec_mode")
	var pooled atomic.Bool
	cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
		if pooled.Load() { // a pooler that would lose the named statements of the default mode
			cc.DefaultQueryExecMode = pooler.QueryExecMode
		}
		return nil
	}
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, nil, err
	}
	adapt = func(ctx context.Context, log *slog.Logger) error {
		found, err := pooler.Detect(ctx, cfg.ConnConfig)
		if errors.Is(err, pooler.ErrStatementMode) {
			return &configError{fmt.Errorf("DATABASE_URL: %v", err)}
		}
		if err != nil || found.Kind == pooler.Direct {
			return err
		}
		mode := cfg.ConnConfig.DefaultQueryExecMode
		switch {
		case chosen && found.Unsupported(mode):
			return &configError{errors.New("DATABASE_URL leads to a connection pooler in transaction mode (PgBouncer?) that does not keep prepared statements, where its " +
				"default_query_exec_mode=cache_statement fails: use default_query_exec_mode=cache_describe, or leave it out and kafkapg chooses " +
				"(or let the pooler keep them: PgBouncer 1.21 and later, max_prepared_statements)")}
		case !chosen && found.Pooled():
			pooled.Store(true)
			pool.Reset() // connections made before this have the old mode
			mode = pooler.QueryExecMode
		case chosen && found.Pooled() && pooler.NamedStatements(mode) && log != nil:
			log.Warn("DATABASE_URL asks for default_query_exec_mode=cache_statement through a connection pooler: that works in its session mode, and fails in its transaction mode",
				"pooler", found.Kind.String())
		}
		if log != nil {
			log.Info("DATABASE_URL leads to a connection pooler (PgBouncer?); the outbox relay polls instead of LISTENing",
				"pooler", found.Kind.String(), "pooler_keeps_prepared_statements", found.PreparedStatements, "query_exec_mode", mode.String())
		}
		return nil
	}
	return pool, adapt, nil
}

// serve runs the processor service until ctx is done: it waits for Postgres, migrates, sets up
// the handlers' tables, serves /metrics, /healthz and /readyz on HTTP_ADDR, and processes records.
func serve(ctx context.Context, env *env, hs *registry, log *slog.Logger) error {
	// The shutdown bound is the binary's: SHUTDOWN_TIMEOUT from the signal to the exit, whatever
	// is stuck. What follows the processor's own shutdown (closing the pool waits for the
	// connections handed out, one of them perhaps to a handler that ignores its context) gets
	// what is left of it, and is abandoned, with a warning, when that runs out.
	bound := &exitBound{timeout: env.ShutdownTimeout, log: log}
	context.AfterFunc(ctx, bound.signalled)
	tp, err := newTracerProvider(ctx, env.tracing, env.KafkaGroupID, log)
	if err != nil {
		return err
	}
	var poolOpts []func(*pgxpool.Config)
	if tp != nil {
		// Spans are flushed last: after the processor, whose last spans they are.
		defer bound.within("flushing spans to the OpenTelemetry collector", func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if err := tp.Shutdown(sctx); err != nil {
				log.Warn("flushing spans to the OpenTelemetry collector", "err", err)
			}
		})
		log.Info("tracing on: OpenTelemetry spans exported over OTLP", "protocol", env.tracing.protocol, "sampler", cmp.Or(os.Getenv("OTEL_TRACES_SAMPLER"), "parentbased_always_on"))
		// Statements a handler (or kafkapg, in a record's transaction) runs in a traced
		// delivery are its child spans; others are not traced.
		poolOpts = append(poolOpts, func(c *pgxpool.Config) {
			c.ConnConfig.Tracer = tracing.PostgresTracer(tp)
		})
	}
	pool, adapt, err := openPool(ctx, &env.dbEnv, poolOpts...)
	if err != nil {
		return err
	}
	defer bound.within("closing the Postgres connection pool (a handler still holds a connection: one that ignores its context?)", pool.Close)

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	// Serve health and metrics from the start: /healthz answers while we wait for Postgres,
	// /readyz only once the processor is ready.
	var proc atomic.Pointer[processor.Processor]
	rd := &readiness{log: log, check: func(ctx context.Context) error {
		p := proc.Load()
		if p == nil {
			return errStarting
		}
		return p.Ready(ctx)
	}}
	ready := rd.ready
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kafkapg_ready",
		Help: "1 if this process is ready (in the consumer group, Postgres answers, not shutting down), as /readyz says; else 0.",
	}, func() float64 {
		ctx, cancel := context.WithTimeout(context.Background(), readyCheckTimeout)
		defer cancel()
		if ready(ctx) != nil {
			return 0
		}
		return 1
	}))
	ln, err := net.Listen("tcp", env.HTTPAddr)
	if err != nil {
		return &configError{fmt.Errorf("HTTP_ADDR=%q: %v", env.HTTPAddr, err)}
	}
	healthy := func(ctx context.Context) error {
		if p := proc.Load(); p != nil {
			return p.Healthy(ctx)
		}
		return nil
	}
	var operator http.Handler
	if env.OperatorToken != "" || env.OperatorTokens != "" {
		tokens, err := env.operatorTokens()
		if err != nil {
			return &configError{err} // validate refused it already
		}
		a := newAPI(ctx, ops.New(pool, env.DBSchema, env.KafkaGroupID).WithIdempotencyKeys(env.idempotencyKeys(hs)), env.OperatorToken, tokens, log)
		a.keys = keysRoutes(a, env, env.concurrency(hs))
		defer bound.within("stopping the operator API's tasks", a.wait) // before the pool closes: running tasks stop after their chunk in flight
		operator = a.handler()
	}
	srv := serveHTTP(ln, httpHandler(reg, healthy, ready, operator), 0)
	defer bound.within("closing the HTTP server", func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	})
	paths := "/metrics /healthz /readyz"
	if operator != nil {
		paths += " /api/v1/ (operator API)"
	}
	log.Info("http listening", "addr", ln.Addr().String(), "paths", paths)
	if env.ConsoleAddr != "" {
		stop, err := serveConsole(ctx, env, env.concurrency(hs), env.idempotencyKeys(hs), pool, reg, log)
		if err != nil {
			return err
		}
		defer bound.within("closing the console", stop)
	}
	if env.PprofAddr != "" {
		stop, err := servePprof(env.PprofAddr, log)
		if err != nil {
			return &configError{fmt.Errorf("PPROF_ADDR=%q: %v", env.PprofAddr, err)}
		}
		defer stop()
	}

	if err := prepareDatabase(ctx, pool, adapt, env.DBSchema, hs, env.handlersUsed(), backoff.Policy{Base: env.RetryBackoffBase, Max: env.RetryBackoffMax}, log); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return nil // SIGTERM while starting: nothing started to finish
	}

	cfg := env.processorConfig(hs, log, reg)
	if tp != nil {
		cfg.TracerProvider, cfg.Propagator = tp, env.tracing.prop
	}
	p, err := processor.New(pool, cfg)
	if err != nil {
		return err
	}
	proc.Store(p)
	err = p.Run(ctx)
	if errors.Is(err, retrytopics.ErrTopicMissing) {
		return fmt.Errorf("%w (KAFKA_CREATE_TOPICS=true lets the service create them)", err)
	}
	return err
}

// prepareDatabase adapts the pool to a pooler in front of Postgres (adapt), migrates kafkapg's
// schema and sets up the tables of the handlers called names. Postgres may not be up yet (pods
// start in any order), or be cut meanwhile: it waits for it with backoff. A failure of Postgres's
// own (a wrong statement in a handler's Setup) stops it with the error; ctx's end, with nil.
func prepareDatabase(ctx context.Context, pool *pgxpool.Pool, adapt func(context.Context, *slog.Logger) error, schema string, hs *registry, names []string,
	policy backoff.Policy, log *slog.Logger) error {
	adapted, migrated := false, false
	for failures := 1; ; failures++ {
		var err error
		if !adapted {
			err = adapt(ctx, log)
			adapted = err == nil
		}
		if err == nil && !migrated {
			if err = migrateLogged(ctx, pool, schema, log); err != nil {
				err = fmt.Errorf("migrate schema %s: %w", schema, err)
			}
			migrated = err == nil
		}
		if err == nil {
			err = hs.setup(ctx, pool, names)
		}
		if err == nil {
			return nil
		}
		var cerr *configError
		if errors.As(err, &cerr) {
			return err
		}
		if ctx.Err() != nil {
			return nil
		}
		// Postgres failing, also under a statement sent (a cut mid-migration: its transaction
		// rolled back), is waited out; an answer of Postgres's is not.
		if !processor.IsOutage(err) {
			return err
		}
		d := policy.Delay(failures)
		log.Warn("waiting for postgres", "err", err, "retry_in", d)
		if !backoff.Sleep(ctx, nil, d) {
			return nil
		}
	}
}

// exitBound is the binary's shutdown bound: SHUTDOWN_TIMEOUT after the signal.
type exitBound struct {
	timeout time.Duration
	log     *slog.Logger
	at      atomic.Int64 // when the signal came, in Unix nanoseconds; 0 until then
}

func (b *exitBound) signalled() { b.at.Store(time.Now().UnixNano()) }

// within runs fn, and waits for it until the bound (SHUTDOWN_TIMEOUT from now, if no signal came:
// a failure ends the service), then leaves it behind with a warning naming what.
func (b *exitBound) within(what string, fn func()) {
	deadline := time.Now().Add(b.timeout)
	if ns := b.at.Load(); ns != 0 {
		deadline = time.Unix(0, ns).Add(b.timeout)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	t := time.NewTimer(max(time.Until(deadline), 0))
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		b.log.Warn("shutdown: gave up "+what+" at SHUTDOWN_TIMEOUT; exiting anyway", "shutdown_timeout", b.timeout)
	}
}

// serveConsole serves the operator console on CONSOLE_ADDR (see package console). It returns a
// function that stops it.
func serveConsole(ctx context.Context, env *env, concurrency map[string]int, keys ops.IdempotencyKeys, pool *pgxpool.Pool, reg prometheus.Gatherer, log *slog.Logger) (stop func(), err error) {
	users, tokens, err := env.consoleLogins()
	if err != nil {
		return nil, &configError{err}
	}
	c := &opsCmd{env: env}
	cl, err := c.kafka()
	if err != nil {
		return nil, err
	}
	// The group's topics are all a trace may read; the keys let a rewind's dry run count the
	// records a key would skip.
	o := ops.New(pool, env.DBSchema, env.KafkaGroupID).WithTopics(env.KafkaTopics...).WithIdempotencyKeys(keys)
	log = log.With("component", "console")
	tasks := newTaskRunner(ctx, o, "console", log)
	// The overview's chart and alerts come from this process's own metrics.
	samples := console.NewSampler(reg, env.ConsoleSampleEvery, time.Hour)
	sctx, stopSampling := context.WithCancel(ctx)
	go samples.Run(sctx)
	con, err := console.New(console.Config{
		Ops: o, Admin: kadm.NewClient(cl), Kafka: cl, Stuck: env.stuckScope(), HideValues: env.ConsoleHideValues, Registry: env.sr, Samples: samples,
		TraceURL: env.TraceURL, Concurrency: concurrency,
		Users: users, Tokens: tokens, Log: log, Run: tasks.run,
	})
	if err != nil {
		stopSampling()
		cl.Close()
		return nil, err
	}
	ln, err := net.Listen("tcp", env.ConsoleAddr)
	if err != nil {
		stopSampling()
		cl.Close()
		return nil, &configError{fmt.Errorf("CONSOLE_ADDR=%q: %v", env.ConsoleAddr, err)}
	}
	srv := serveHTTP(ln, con.Handler(), 0)
	log.Info("console listening", "addr", ln.Addr().String(), "users", len(users), "tokens", len(tokens))
	return func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
		stopSampling()
		tasks.wait() // before the pool closes: running tasks stop after their chunk in flight
		cl.Close()
	}, nil
}

// setMemoryLimit sets the process's soft memory limit from its container's (setSoftMemoryLimit),
// and logs it.
func setMemoryLimit(log *slog.Logger, maxBuffered int) {
	if limit, gogc, err := setSoftMemoryLimit(memlimit.FromCgroup, log); err != nil {
		log.Warn("cannot read the container's memory limit; GOMEMLIMIT not set", "err", err)
	} else if limit < math.MaxInt64 {
		log.Info("soft memory limit", "gomemlimit_bytes", limit, "gogc", gogc, "max_buffered_bytes", maxBuffered)
	}
}

// The soft memory limit's share of the container's, and the garbage collector's GOGC under a soft
// limit when GOGC is not set.
const (
	memoryLimitShare    = 0.9
	gcPercentUnderLimit = 300
)

// setSoftMemoryLimit sets the Go runtime's soft memory limit to memoryLimitShare of what
// containerLimit reports (memlimit.FromCgroup: the memory limit of the process's cgroup, v1 or
// v2), unless GOMEMLIMIT is set, which wins; and, under a soft limit (the container's or
// GOMEMLIMIT's), GOGC to gcPercentUnderLimit unless GOGC is set. It returns the soft limit in
// force (math.MaxInt64: none; then GOGC is left alone) and the GOGC in force.
//
// The Go runtime does not know its container's memory limit: without a soft limit, the garbage
// collector lets the heap grow to twice what is live, which a memory-limited pod pays for with an
// OOM kill.
func setSoftMemoryLimit(containerLimit memlimit.Provider, log *slog.Logger) (limit int64, gogc string, err error) {
	limit, err = memlimit.Set(memlimit.WithProvider(containerLimit), memlimit.WithRatio(memoryLimitShare), memlimit.WithLogger(log))
	if err != nil || limit == math.MaxInt64 {
		return limit, "", err
	}
	gogc = os.Getenv("GOGC")
	if gogc == "" {
		// Under a soft limit the heap may grow further between collections: the limit, not
		// GOGC, bounds it. Draining a backlog, GOGC=100's collections cost a tenth of the
		// drain rate (BenchmarkBacklogMemory).
		debug.SetGCPercent(gcPercentUnderLimit)
		gogc = strconv.Itoa(gcPercentUnderLimit)
	}
	return limit, gogc, nil
}

// servePprof serves Go's profiles (net/http/pprof) on addr, a listener of their own so that they
// are never exposed where the metrics are scraped. It returns a function that closes it.
//
// The profiles have no authentication: anyone who reaches them reads the goroutines' stacks and
// the command line, and spends the process's CPU (a profile, a trace). An address that is not a
// loopback one (":6060" is every interface) is served all the same, with a warning: refusing it
// would take a variable to allow it again, and the profiles hold no record or secret of the
// service's own.
func servePprof(addr string, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	if a, ok := ln.Addr().(*net.TCPAddr); !ok || !a.IP.IsLoopback() {
		log.Warn("PPROF_ADDR is not a loopback address: anyone who reaches it reads the profiles and spends the CPU, without authentication; "+
			"bind it to 127.0.0.1:6060 and use kubectl port-forward", "addr", ln.Addr().String())
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := serveHTTP(ln, mux, 5*time.Minute) // a CPU profile streams for ?seconds= (30 by default)
	log.Info("pprof listening", "addr", ln.Addr().String(), "path", "/debug/pprof/")
	return func() { srv.Close() }, nil
}

// httpHandler serves the metrics, the health checks and, if not nil, the operator API under
// /api/.
func httpHandler(reg *prometheus.Registry, healthy, ready func(context.Context) error, operator http.Handler) http.Handler {
	mux := http.NewServeMux()
	if operator != nil {
		mux.Handle("/api/", operator)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg, EnableOpenMetrics: true}))
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
		ctx, cancel := context.WithTimeout(r.Context(), readyCheckTimeout)
		defer cancel()
		if err := ready(ctx); err != nil {
			// Anyone may ask: the detail (the database's user and hosts, the brokers) is logged.
			http.Error(w, "not ready: "+notReadyReason(err), http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "ready\n")
	})
	return mux
}
