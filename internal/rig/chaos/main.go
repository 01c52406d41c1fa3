// Command chaos is kafkapg's fault-injection suite (`make chaos`). It runs several processor
// processes in one group with the ledger handler and short retry tiers, produces a continuous
// stream of ledger events (flaky, exhausted, poison and malformed ones included), and meanwhile
// breaks things at random: SIGKILL, SIGTERM and SIGSTOP of processors, dropped, cut and stalled
// Postgres connections (through a fault proxy), cut broker connections and, on the dev broker, a
// broker restart. Then it restores everything, waits for the pipeline to settle and checks, from
// the database and the dead-letter topic, that no record was lost or applied twice, that every
// account's events were applied in produce order, that the dead letters are exactly the expected
// ones, and that balances add up. It prints one summary line, with the recovery times it measured.
//
// With -handler ledger-forward it runs a chain of two services instead: stage 1 applies the
// ledger events (a tenth of them sent twice by the producer) and emits a posting per applied event
// through the outbox; stage 2 (HANDLER=ledger-post, a group of its own) inserts the postings into
// a table without a unique constraint. The faults hit both stages, one more (relay-ack-lost) makes
// stage 1's relays publish postings again, and every applied event must then have been posted
// exactly once, each account's postings in order.
//
// With -upgrade-from <binary> (make chaos-upgrade) the processes start on the release before (a
// binary scripts/build-release.sh builds from this repository's history) and go through a
// rolling upgrade to bin/processor, a rollback in the middle of it, the upgrade again and the
// upgrade window's finalize, all under the faults (upgrade.go); neither release may refuse the
// schema before the finalize, and the release before must refuse it after.
//
// It needs DATABASE_URL (make chaos starts a throwaway Postgres) and the processor and devbroker
// binaries next to it (make build). With KAFKA_BROKERS set it uses that broker instead of starting
// the dev broker; broker cuts then need the broker's second listener for the suite
// (KAFKA_CHAOS_LISTENER, advertised as KAFKA_CHAOS_ADVERTISED; scripts/kafka.sh sets one up).
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/localrun"
)

func main() {
	var c config
	flag.DurationVar(&c.duration, "duration", time.Minute, "how long to inject faults while events flow")
	flag.Uint64Var(&c.seed, "seed", 0, "random seed (0: pick one and print it)")
	flag.IntVar(&c.procs, "procs", 3, "processor processes (stage 1's, in a chain)")
	flag.IntVar(&c.partitions, "partitions", 6, "partitions of the ledger topic")
	flag.IntVar(&c.events, "events", 20000, "ledger events to produce")
	flag.DurationVar(&c.settle, "settle", 4*time.Minute, "how long to wait, after the faults stop, for every event to be applied or dead-lettered")
	flag.BoolVar(&c.keep, "keep", false, "keep the work directory (logs) even if the run passes")
	flag.StringVar(&c.handler, "handler", "ledger", "the processors' HANDLER: ledger, ledger-careless (no unique constraint, binary errors, own timeouts, swallowed errors),"+
		" or ledger-forward (a chain: stage 1 forwards a posting per event to stage 2, HANDLER=ledger-post; a tenth of the events sent twice)")
	flag.IntVar(&c.postProcs, "post-procs", 2, "stage 2 processes (HANDLER=ledger-post), with -handler ledger-forward")
	flag.StringVar(&c.postgres, "postgres", pgDirect, "how the processors reach Postgres: "+pgDirect+" (DATABASE_URL), "+pgBouncer+" (DATABASE_URL behind PgBouncer in transaction mode), "+
		pgSyncHA+" or "+pgAsyncHA+" (a primary and a standby of the suite's own, failed over again and again; DATABASE_URL is not used),"+
		" or "+pgRestore+" (a server of the suite's own, restored three times from a copy of its data directory: the commits since the copy lost, its identity unchanged; DATABASE_URL is not used)")
	flag.StringVar(&c.kafkaCluster, "kafka-cluster", "", "the state directory of a three-broker cluster that `scripts/kafka.sh cluster start` runs (/tmp/kafkapg-kafka-cluster):"+
		" run against it, with broker faults (kill, controlled shutdown, freeze, a rolling restart) instead of broker cuts; KAFKA_BROKERS is not used")
	flag.StringVar(&c.protocol, "group-protocol", "auto", "the processors' KAFKA_GROUP_PROTOCOL: auto (the consumer protocol where the broker offers it) or classic")
	flag.IntVar(&c.concurrency, "concurrency", 0, "with -handler ledger-careless: the processors run HANDLER=ledger-careless-slow (a Prepare that waits 0-5 ms) with CONCURRENCY at this,"+
		" and no two prepares of a key may overlap")
	flag.StringVar(&c.upgradeFrom, "upgrade-from", "", "the release before's processor binary (scripts/build-release.sh): a rolling upgrade from it to bin/processor, a rollback mid-rollout,"+
		" forward again and the window finalized, under the faults (upgrade.go; `make chaos-upgrade`)")
	flag.BoolVar(&c.positions, "positions", false, "with -handler "+chainHandler+": an operator pauses, rewinds and skips stage 1's partitions among the faults (the producer sends no copies),"+
		" and the check expects the skipped records never applied, the rewound ones exactly once still, nothing applied while paused")
	flag.BoolVar(&c.schemaRegistry, "schema-registry", false, "with -handler ledger: the events are Avro in the Schema Registry's wire format (HANDLER=ledger-avro), against the registry at SCHEMA_REGISTRY_URL"+
		" (make chaos-registry starts one), new versions of their schema registered during the run and the registry cut among the faults")
	flag.BoolVar(&c.trace, "trace", false, "the processors export OpenTelemetry traces to a receiver of the suite's, and every record's trace must go on through every hop")
	flag.Parse()
	if c.handler != "ledger" && c.handler != "ledger-careless" && c.handler != chainHandler {
		fmt.Fprintf(os.Stderr, "chaos: -handler must be ledger, ledger-careless or %s, got %q\n", chainHandler, c.handler)
		os.Exit(2)
	}
	if c.concurrency != 0 && (c.handler != "ledger-careless" || c.concurrency < 2) {
		fmt.Fprintf(os.Stderr, "chaos: -concurrency needs -handler ledger-careless and a value of 2 or more, got %d with %q\n", c.concurrency, c.handler)
		os.Exit(2)
	}
	if c.positions && (c.handler != chainHandler || c.trace || c.upgradeFrom != "" || c.kafkaCluster != "" || c.postgres == pgAsyncHA || c.postgres == pgRestore) {
		fmt.Fprintf(os.Stderr, "chaos: -positions needs -handler %s, and neither -trace, -upgrade-from, -kafka-cluster nor a Postgres that loses commits (its check replays position_changes)\n", chainHandler)
		os.Exit(2)
	}
	if c.schemaRegistry && (c.handler != "ledger" || c.upgradeFrom != "") {
		fmt.Fprintf(os.Stderr, "chaos: -schema-registry runs -handler ledger's events in Avro (HANDLER=ledger-avro), and not with -upgrade-from\n")
		os.Exit(2)
	}
	if c.protocol != "auto" && c.protocol != "classic" {
		fmt.Fprintf(os.Stderr, "chaos: -group-protocol must be auto or classic, got %q\n", c.protocol)
		os.Exit(2)
	}
	if c.upgradeFrom != "" {
		abs, err := filepath.Abs(c.upgradeFrom)
		if err == nil {
			err = checkOldBinary(abs)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "chaos: %v\n", err)
			os.Exit(2)
		}
		c.upgradeFrom = abs
	}
	if c.seed == 0 {
		c.seed = rand.Uint64()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, c); err != nil {
		fmt.Fprintf(os.Stderr, "\nchaos: FAILED (seed %d): %v\n", c.seed, err)
		os.Exit(1)
	}
}

type config struct {
	duration   time.Duration
	seed       uint64
	procs      int
	partitions int
	events     int
	settle     time.Duration
	keep       bool
	handler    string
	protocol   string
	postgres   string // the Postgres topology (pgDirect, ...)
	// kafkaCluster is the state directory of the three-broker cluster to run against, if any.
	kafkaCluster string
	postProcs    int // stage 2's, in a chain
	trace        bool
	concurrency  int    // CONCURRENCY, with HANDLER=ledger-careless-slow; 0: off
	upgradeFrom  string // the release before's binary: the upgrade mode (upgrade.go); "": off
	positions    bool   // the positions faults (positions.go)
	// schemaRegistry: Avro events, the registry's outages among the faults (registry.go)
	schemaRegistry bool
}

// stageHandler is stage 1's HANDLER.
func (c config) stageHandler() string {
	if c.concurrency > 0 {
		return slowHandler
	}
	if c.schemaRegistry {
		return "ledger-avro"
	}
	return c.handler
}

// slowHandler is ledger-careless behind a Prepare that waits (-concurrency).
const slowHandler = "ledger-careless-slow"

// chain reports whether the run is a chain of two stages.
func (c config) chain() bool { return c.handler == chainHandler }

const (
	group  = "chaos"
	topic  = "ledger"
	schema = "kafkapg_chaos"
	// tiers are the processors' retry tiers; records get len(tiers)+1 delivery attempts.
	tiers      = "200ms,500ms,1s"
	tierCount  = 3
	maxAttempt = 4
	// sessionTimeout is short so that a stopped process loses its partitions quickly.
	sessionTimeout = 6 * time.Second
)

func run(ctx context.Context, c config) (err error) {
	dbURL := os.Getenv("DATABASE_URL")
	bin, err := localrun.BinDir("chaos")
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "kafkapg-chaos-")
	if err != nil {
		return err
	}
	// The Postgres servers and PgBouncer of the suite's own run as the postgres user (when this is
	// root) and keep their data and logs here.
	if err := os.Chmod(work, 0o755); err != nil {
		return err
	}
	s := &suite{cfg: c, rng: rand.New(rand.NewPCG(c.seed, c.seed^0x5851f42d4c957f2d)), bin: bin, work: work, stats: stats{brokerFaults: map[string]int{}}}
	if c.upgradeFrom != "" {
		post := 0
		if c.chain() {
			post = c.postProcs
		}
		s.up = newUpgrade(c.upgradeFrom, c.procs, post, c.postgres == pgSyncHA || c.postgres == pgAsyncHA)
	}
	defer func() {
		if err != nil {
			s.cfg.keep = true // the logs of a failed run, whatever failed
		}
		s.close()
	}()
	procs := fmt.Sprintf("%d processes (HANDLER=%s", c.procs, c.stageHandler())
	if c.concurrency > 0 {
		procs += fmt.Sprintf(", CONCURRENCY=%d", c.concurrency)
	}
	if c.chain() {
		procs = fmt.Sprintf("%d processes (0-%d HANDLER=%s, %d-%d HANDLER=%s", c.procs+c.postProcs, c.procs-1, c.handler, c.procs, c.procs+c.postProcs-1, postHandler)
	}
	fmt.Printf("chaos: seed %d, %s, KAFKA_GROUP_PROTOCOL=%s), %d events, faults for %v; logs in %s\n",
		c.seed, procs, c.protocol, c.events, c.duration, work)

	if err := s.setupPostgres(ctx, dbURL); err != nil {
		return err
	}
	if err := s.setupKafka(ctx); err != nil {
		return err
	}
	if c.schemaRegistry {
		if err := s.setupRegistry(); err != nil {
			return err
		}
	}
	if c.trace {
		if s.traces, err = newTraces(c.seed, s.topic); err != nil {
			return err
		}
		defer s.traces.close()
	}
	for _, st := range s.stages {
		// The relay does not create topics: stage 1's postings topic is created with the others.
		if err := s.createTopic(ctx, st.topic); err != nil {
			return err
		}
	}
	for _, st := range s.stages {
		for range st.procs {
			p, err := s.startProc(st, len(s.procs))
			if err != nil {
				return err
			}
			s.procs = append(s.procs, p)
		}
	}

	if c.positions {
		if err := s.setupPositions(); err != nil {
			return err
		}
	}

	items := generate(c)
	if c.chain() && !c.positions {
		n := len(items)
		items = ledger.Duplicate(items, copyPerMille, c.seed)
		s.copies = len(items) - n
	}
	s.producedAt = make([]time.Time, len(items))
	if c.positions {
		s.placed, s.eventIDs = make([]placement, len(items)), make([]string, len(items))
		for i, it := range items {
			s.placed[i], s.eventIDs[i] = placement{offset: -1}, it.Event.EventID
		}
	}
	produced := make(chan error, 1)
	go func() { produced <- s.produce(ctx, items) }()

	if err := s.inject(ctx); err != nil {
		return err
	}
	if err := <-produced; err != nil {
		return fmt.Errorf("produce: %w", err)
	}
	if err := s.restoreAll(ctx); err != nil {
		return err
	}
	if c.positions {
		var n int
		if items, n, s.unordered, err = s.skippedItems(ctx, items); err != nil {
			return err
		}
		s.count(func(st *stats) { st.skippedEvents, st.lateEvents = int64(n), int64(len(s.unordered)) })
		defer func() {
			// What the rewinds read again that stage 1 had applied: skipped by key (there are no
			// copies to skip otherwise), in skipped_duplicates for trace.
			var dups int64
			if qerr := s.pool.QueryRow(ctx, `SELECT count(*) FROM skipped_duplicates WHERE consumer_group = $1 AND topic = $2`, s.group, s.topic).Scan(&dups); qerr == nil {
				fmt.Printf("chaos: positions: %d records read again by the rewinds were skipped as duplicates by stage 1 (skipped_duplicates)\n", dups)
			}
		}()
	}
	settled := time.Now()
	if err := s.waitSettled(ctx, items); err != nil {
		return err
	}
	s.stats.settle = time.Since(settled)
	s.bg.Wait() // recovery measurements
	rep, err := s.verify(ctx, items)
	if s.cluster != nil {
		var werr error
		if s.stats.rollingLongest, s.stats.rollingP99, s.stats.rollingEvents, werr = s.rollingWaits(ctx, items); werr != nil && err == nil {
			err = fmt.Errorf("read the waits during the rolling restart: %w", werr)
		}
		for _, v := range s.checkReplication(ctx) {
			s.count(func(st *stats) { st.violations = append(st.violations, v) })
		}
	}
	if err == nil && c.chain() {
		rep.chain, err = s.verifyChain(ctx, items, nil)
	}
	if err == nil {
		var r replayReport
		r, err = s.replay(ctx, items)
		s.replayed = &r
		s.bg.Wait()
		if err == nil && c.chain() {
			r.chain, err = s.verifyChain(ctx, items, r.recoveredIDs)
		}
	}
	s.stopAll()
	if s.traces != nil {
		var terr error
		if s.traced, terr = s.traces.check(ctx, s, items); err == nil {
			err = terr
		}
	}
	s.checkUpgradeLogs()
	if verr := s.violations(); err == nil {
		err = verr
	}
	fmt.Println(s.summary(rep, err))
	if s.up != nil {
		fmt.Println(s.describeUpgrade())
	}
	if err != nil {
		s.cfg.keep = true
		return err
	}
	return nil
}

// command returns a command running one of the sibling binaries with its output in a log file.
func (s *suite) command(name, logName string, env []string, args ...string) (*exec.Cmd, error) {
	if !filepath.IsAbs(name) {
		name = filepath.Join(s.bin, name)
	}
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), env...)
	f, err := os.OpenFile(filepath.Join(s.work, logName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = f, f
	return cmd, nil
}

// sortedDurations returns a sorted copy.
func sortedDurations(ds []time.Duration) []time.Duration {
	out := slices.Clone(ds)
	slices.Sort(out)
	return out
}

func maxDuration(ds []time.Duration) string {
	if len(ds) == 0 {
		return "n/a"
	}
	return sortedDurations(ds)[len(ds)-1].Round(time.Millisecond).String()
}

// measured formats a measurement ("n/a" if it could not be taken).
func measured(d time.Duration) string {
	if d == 0 {
		return "n/a"
	}
	return d.Round(time.Millisecond).String()
}

func medianDuration(ds []time.Duration) string {
	if len(ds) == 0 {
		return "n/a"
	}
	return sortedDurations(ds)[len(ds)/2].Round(time.Millisecond).String()
}
