package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/rig/faultproxy"
	"github.com/kafkapg/kafkapg/internal/rig/kafkacluster"
	"github.com/kafkapg/kafkapg/internal/topicread"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// suite is one chaos run.
type suite struct {
	cfg  config
	rng  *rand.Rand
	bin  string
	work string

	topic, group string   // stage 1's
	stages       []*stage // stage 1, and in a chain stage 2
	copies       int      // events the producer sends twice (a chain)

	pool *pgxpool.Pool // direct to Postgres (its primary), for the suite's own queries
	db   *database     // how the processors reach Postgres, and the proxies Postgres faults hit

	cluster     *kafkacluster.Cluster // the three-broker cluster (-kafka-cluster), or nil
	producedAt  []time.Time           // when each item was produced (its chunk sent)
	brokerName  string
	clientSeeds []string          // brokers for the suite's producer and reader
	procSeeds   []string          // brokers for the processors
	brokerProxy *faultproxy.Proxy // nil: broker faults are not possible
	devbroker   *exec.Cmd         // nil with an external broker
	devListen   string

	procs []*proc
	// groupType is the protocol the group runs, as the broker lists it: classic or consumer.
	groupType string

	mu    sync.Mutex
	stats stats

	traces *traces     // -trace: the receiver of the processors' spans, or nil
	traced traceReport // what the trace check found

	// -positions: the ops code the positions faults run (positions.go), and where each item was
	// produced (offset -1 until it is) and its event id, under mu.
	positions *positionsRig
	registry  *schemaRegistry // -schema-registry, or nil
	placed    []placement
	eventIDs  []string
	// unordered are the events a skip jumped over and a later rewind applied, after their
	// accounts' later events (skippedItems): left out of the order checks.
	unordered map[string]bool

	replayed *replayReport  // the replay phase's, once it ran
	up       *upgrade       // -upgrade-from: the rollout (upgrade.go), or nil
	bg       sync.WaitGroup // recovery measurements in flight
}

// stats counts faults and measures recoveries.
type stats struct {
	kills, terms, stops                int
	pgDrops, pgCuts, pgStalls          int
	brokerCuts, brokerRestarts         int
	acksLost, republished              int // relay-ack-lost faults, and the postings they republish (a chain)
	failovers                          int
	lostRows                           int64           // applied events the new primaries lacked (an asynchronous standby) or a restore lost, applied again
	restores                           []restoreRecord // same-identity-restore's
	promote, failoverRecovery          []time.Duration // primary killed -> standby promoted; -> processors commit again
	termExit, killRecovery, pgRecovery []time.Duration
	unmeasured                         int // recoveries that could not be measured (no traffic left)
	// alone holds the recoveries measured one fault at a time, with nothing else broken (the
	// docs/testing.md's targets are for these); the slices above are measured under overlapping faults.
	alone struct{ term, kill, pg, failover, leaderKill time.Duration }
	// The three-broker cluster: broker faults by kind (kill, term, freeze), the rolling restarts,
	// and the waits (produce -> applied) of the events produced during them.
	brokerFaults               map[string]int
	rolling                    []window
	rollingLongest, rollingP99 time.Duration
	rollingEvents              int
	settle                     time.Duration
	violations                 []string // problems seen during the run (bad exit codes)
	// -positions: the faults, what the rewinds read again and the skips left out (offsets), and
	// the events the skips left never applied (and of those skipped, how many a rewind applied
	// later).
	pauses, pausesWaiting, rewinds, skips              int
	rewound, skippedOffsets, skippedEvents, lateEvents int64
	// skipped is, by stage (1, 2), what the chain's processes that have ended counted in
	// kafkapg_duplicate_keys_skipped_total (see tally).
	skipped [3]float64
}

// stage is a group of processor processes, all with one handler, consuming one topic.
type stage struct {
	n                     int // 1 or 2
	handler, group, topic string
	procs                 int
}

// proc is one processor process.
type proc struct {
	idx      int
	stage    *stage
	cmd      *exec.Cmd
	http     string
	done     chan struct{}
	expected atomic.Bool // the suite asked it to end: an exit without this is a violation
	// tolerated: it exited on the release before's known startup defect (upgrade.go), not a violation
	tolerated atomic.Bool
}

// end sends p a signal that ends it (SIGKILL, SIGTERM), so that its exit is expected.
func (p *proc) end(sig syscall.Signal) {
	p.expected.Store(true)
	p.cmd.Process.Signal(sig)
}

// end ends p (proc.end); in a chain, it first reads what p counted in its metrics (tally), which
// end with it.
func (s *suite) end(p *proc, sig syscall.Signal) {
	if s.cfg.chain() {
		s.tally(p)
	}
	p.end(sig)
}

func generate(c config) []ledger.Item {
	return ledger.Generate(ledger.GenConfig{
		Events: c.events, Accounts: 200, Seed: c.seed, Prefix: "chaos",
		PoisonPerMille: 5, MalformedPerMille: 5, FlakyPerMille: 40, MaxFailAttempts: maxAttempt + 1,
		Mistakes: true, OversizedPerMille: 25,
	})
}

func (s *suite) setupKafka(ctx context.Context) error {
	s.topic = fmt.Sprintf("chaos-%d", s.cfg.seed%1_000_000)
	s.group = s.topic
	s.stages = []*stage{{n: 1, handler: s.cfg.stageHandler(), group: s.group, topic: s.topic, procs: s.cfg.procs}}
	if s.cfg.chain() {
		s.stages = append(s.stages, &stage{n: 2, handler: postHandler, group: s.group + "-post", topic: ledger.PostingsTopic(s.topic), procs: s.cfg.postProcs})
	}
	if s.cfg.kafkaCluster != "" {
		return s.setupCluster()
	}
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		s.brokerName = "kafka"
		s.clientSeeds = strings.Split(env, ",")
		s.procSeeds = s.clientSeeds
		listener, advertised := os.Getenv("KAFKA_CHAOS_LISTENER"), os.Getenv("KAFKA_CHAOS_ADVERTISED")
		if listener != "" && advertised != "" {
			p, err := faultproxy.Listen(advertised, listener)
			if err != nil {
				return fmt.Errorf("proxy for the broker's chaos listener: %w", err)
			}
			s.brokerProxy = p
			s.procSeeds = []string{advertised}
		} else {
			fmt.Println("chaos: KAFKA_CHAOS_LISTENER/KAFKA_CHAOS_ADVERTISED not set: no broker cuts against this broker")
		}
		return nil
	}
	s.brokerName = "kfake"
	var err error
	if s.devListen, err = localrun.FreeAddr(); err != nil {
		return err
	}
	if s.brokerProxy, err = faultproxy.Listen("127.0.0.1:0", s.devListen); err != nil {
		return err
	}
	s.clientSeeds = []string{s.brokerProxy.Addr()}
	s.procSeeds = s.clientSeeds
	return s.startDevbroker(ctx)
}

// startDevbroker starts the dev broker behind the broker proxy, keeping its data in the work
// directory so that a restart keeps the topics.
func (s *suite) startDevbroker(ctx context.Context) error {
	cmd, err := s.command("devbroker", "devbroker.log", nil,
		"-listen", s.devListen, "-advertise", s.brokerProxy.Addr(), "-data-dir", filepath.Join(s.work, "broker"))
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start devbroker: %w", err)
	}
	s.devbroker = cmd
	return localrun.WaitFor(ctx, 30*time.Second, func() error {
		cl, err := kgo.NewClient(kgo.SeedBrokers(s.devListen))
		if err != nil {
			return err
		}
		defer cl.Close()
		_, err = kadm.NewClient(cl).ListBrokers(ctx)
		return err
	})
}

func (s *suite) createTopic(ctx context.Context, topic string) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(s.clientSeeds...))
	if err != nil {
		return err
	}
	defer cl.Close()
	rf, configs := int16(-1), map[string]*string(nil)
	if s.cluster != nil {
		rf, configs = clusterReplicas, map[string]*string{"min.insync.replicas": kadm.StringPtr(clusterMinInsync)}
	}
	resp, err := kadm.NewClient(cl).CreateTopic(ctx, int32(s.cfg.partitions), rf, configs, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	return nil
}

func (s *suite) startProc(st *stage, idx int) (*proc, error) {
	addr, err := localrun.FreeAddr()
	if err != nil {
		return nil, err
	}
	cmd, err := s.command(s.processorBinary(idx), fmt.Sprintf("processor-%d.log", idx), s.procEnv(st, addr, idx))
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start processor %d: %w", idx, err)
	}
	p := &proc{idx: idx, stage: st, cmd: cmd, http: addr, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		if !p.expected.Load() && !s.toleratedExit(p) { // it crashed or gave up on its own: a bug, whatever the checks say
			s.count(func(st *stats) {
				st.violations = append(st.violations, fmt.Sprintf("processor %d exited on its own (%v); see processor-%d.log", idx, err, idx))
			})
		}
		close(p.done)
	}()
	return p, nil
}

// procEnv is the environment of a stage's processor idx (and of the dlq commands), serving HTTP
// on addr.
func (s *suite) procEnv(st *stage, addr string, idx int) []string {
	env := []string{
		"KAFKA_BROKERS=" + strings.Join(s.procSeeds, ","),
		"KAFKA_GROUP_ID=" + st.group,
		"KAFKA_TOPICS=" + st.topic,
		"DATABASE_URL=" + s.db.url(idx),
		"DB_SCHEMA=" + schema,
		"DB_MAX_CONNS=6",
		"DB_TX_IDLE_TIMEOUT=3s",
		"HANDLER=" + st.handler,
		"KAFKA_GROUP_PROTOCOL=" + s.cfg.protocol,
		"HTTP_ADDR=" + addr,
		"RETRY_TIERS=" + tiers,
		"RETRY_BACKOFF_BASE=20ms",
		"RETRY_BACKOFF_MAX=500ms",
		"KAFKA_SESSION_TIMEOUT=" + sessionTimeout.String(),
		"KAFKA_REBALANCE_TIMEOUT=10s",
		"SHUTDOWN_TIMEOUT=5s",
		"LOG_FORMAT=text",
	}
	if s.cfg.concurrency > 0 && st.n == 1 {
		env = append(env, fmt.Sprintf("CONCURRENCY=%d", s.cfg.concurrency))
	}
	if s.cfg.chain() && st.n == 1 {
		env = append(env, "OUTBOX_RETENTION=1h") // published postings are kept for relayAckLost
	}
	if s.traces != nil {
		env = append(env, s.traces.env()...)
	}
	if s.registry != nil {
		env = append(env, "SCHEMA_REGISTRY_URL="+s.registry.procURL, "SCHEMA_REGISTRY_TIMEOUT=1s")
	}
	return env
}

// waitReady waits until the process answers /readyz with 200 (it is in the group and reaches
// Postgres).
func (p *proc) waitReady(ctx context.Context, timeout time.Duration) error {
	return localrun.WaitFor(ctx, timeout, func() error {
		select {
		case <-p.done:
			return fmt.Errorf("processor %d exited: %v", p.idx, p.cmd.ProcessState)
		default:
		}
		return localrun.Ready(p.http)
	})
}

// produce produces items in chunks spread over the fault period.
func (s *suite) produce(ctx context.Context, items []ledger.Item) error {
	// Oversized events are just under a mebibyte: over the producer's default batch limit.
	cl, err := kgo.NewClient(kgo.SeedBrokers(s.clientSeeds...), kgo.ProducerLinger(5*time.Millisecond), kgo.ProducerBatchMaxBytes(2<<20))
	if err != nil {
		return err
	}
	defer cl.Close()
	const chunk = 500
	chunks := (len(items) + chunk - 1) / chunk
	pause := (measureSpan + s.cfg.duration) * 8 / 10 / time.Duration(max(chunks, 1))
	for i := 0; i < len(items); i += chunk {
		recs := make([]*kgo.Record, 0, chunk)
		if s.registry != nil && i > 0 && (i/chunk)%max(chunks/5, 1) == 0 {
			// A new version of the events' schema every fifth of them: ids the processors
			// have not fetched, all through the run.
			if err := s.registry.newVersion(ctx); err != nil {
				return err
			}
		}
		for j, it := range items[i:min(i+chunk, len(items))] {
			r := it.Record(s.topic)
			if s.registry != nil {
				v, err := s.registry.encode(it)
				if err != nil {
					return err
				}
				// The checks of the dead letters match them by value: the bytes produced.
				r.Value, items[i+j].Value = v, v
			}
			if s.traces != nil {
				r.Headers = append(r.Headers, s.traces.header(i+j))
			}
			recs = append(recs, r)
		}
		sent := time.Now()
		for j := i; j < min(i+chunk, len(items)); j++ {
			s.producedAt[j] = sent
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		err := cl.ProduceSync(pctx, recs...).FirstErr()
		cancel()
		if err != nil {
			return err
		}
		if s.placed != nil {
			s.mu.Lock()
			for j, r := range recs {
				s.placed[i+j] = placement{r.Partition, r.Offset}
			}
			s.mu.Unlock()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(pause):
		}
	}
	return nil
}

// fault is one kind of fault the suite injects.
type fault struct {
	name   string
	weight int
	run    func(ctx context.Context) error
}

// inject injects random faults, one at a time, for the configured duration.
func (s *suite) inject(ctx context.Context) error {
	faults := []fault{
		{"kill", 3, s.kill},
		{"term", 2, s.term},
		{"stop", 1, s.stop},
		{"pg-drop", 2, s.pgDrop},
		{"pg-cut", 2, s.pgCut},
		{"pg-stall", 1, s.pgStall},
	}
	if s.brokerProxy != nil {
		faults = append(faults, fault{"broker-cut", 2, s.brokerCut})
	}
	if s.devbroker != nil {
		faults = append(faults, fault{"broker-restart", 1, s.brokerRestart})
	}
	if s.cluster != nil {
		for _, what := range []string{"kill", "term", "freeze"} {
			faults = append(faults, fault{"broker-" + what, 1, func(ctx context.Context) error { return s.brokerFault(ctx, what) }})
		}
	}
	if s.cfg.chain() {
		faults = append(faults, fault{"relay-ack-lost", 2, s.relayAckLost})
	}
	if s.db.failover() {
		faults = append(faults, fault{"pg-failover", 2, func(ctx context.Context) error { return s.pgFailover(ctx, false) }})
	}
	if s.positions != nil {
		faults = append(faults, s.positionsFaults()...)
	}
	if s.registry != nil {
		faults = append(faults, fault{"registry-cut", 2, s.registryCut})
	}
	total := 0
	for _, f := range faults {
		total += f.weight
	}
	if err := s.measure(ctx); err != nil {
		return err
	}
	if s.cfg.chain() { // at least once a run: stage 2's deduplication is what it tests
		if err := s.relayAckLost(ctx); err != nil {
			return fmt.Errorf("fault relay-ack-lost: %w", err)
		}
	}
	if s.positions != nil { // each at least once a run
		for _, f := range []fault{{"position-pause", 0, s.positionPause}, {"position-skip", 0, s.positionSkipPaused}, {"position-rewind", 0, s.positionRewind}} {
			if err := f.run(ctx); err != nil {
				return fmt.Errorf("fault %s: %w", f.name, err)
			}
		}
	}
	if s.cluster != nil { // once a run, as at every upgrade
		if err := s.rollingRestart(ctx); err != nil {
			return fmt.Errorf("rolling restart: %w", err)
		}
	}
	began := time.Now()
	end := began.Add(s.cfg.duration)
	if s.db.restores != nil {
		s.planRestores(began)
	}
	if s.up != nil {
		s.planUpgrade(began)
	}
	for time.Now().Before(end) {
		if err := sleep(ctx, time.Duration(300+s.rng.IntN(1200))*time.Millisecond); err != nil {
			return err
		}
		if err := s.restoreDue(ctx); err != nil {
			return fmt.Errorf("same-identity restore: %w", err)
		}
		if err := s.upgradeDue(ctx); err != nil {
			return fmt.Errorf("upgrade: %w", err)
		}
		n := s.rng.IntN(total)
		for _, f := range faults {
			if n -= f.weight; n < 0 {
				if err := f.run(ctx); err != nil {
					return fmt.Errorf("fault %s: %w", f.name, err)
				}
				break
			}
		}
	}
	if err := s.finishRestores(ctx); err != nil {
		return fmt.Errorf("same-identity restore: %w", err)
	}
	if err := s.finishUpgrade(ctx); err != nil {
		return fmt.Errorf("upgrade: %w", err)
	}
	return nil
}

// measureSpan is roughly how long measure takes; events are produced over it and the fault period.
const measureSpan = 30 * time.Second

// measure measures the recoveries docs/testing.md sets targets for, one fault at a time with nothing
// else broken and events flowing: SIGTERM to exit, a SIGKILL to the dead process's partitions
// flowing again on the other processes (it is restarted only afterwards), and Postgres coming
// back to commits resuming after a 3 s cut.
func (s *suite) measure(ctx context.Context) error {
	settled := func() error {
		for _, p := range s.procs {
			if err := p.waitReady(ctx, 60*time.Second); err != nil {
				return err
			}
		}
		return sleep(ctx, 2*time.Second) // a rebalance that follows a restart has settled
	}
	if err := settled(); err != nil {
		return err
	}
	s.groupType = s.readGroupType(ctx)
	// When each event was applied, for the waits during a rolling restart (the events applied
	// before this get its time).
	if _, err := s.pool.Exec(ctx, `ALTER TABLE ledger_entries ADD COLUMN IF NOT EXISTS applied_at timestamptz NOT NULL DEFAULT now()`); err != nil {
		return fmt.Errorf("add ledger_entries.applied_at: %w", err)
	}

	restart := func(p *proc) error {
		if err := s.restart(ctx, p); err != nil {
			return err
		}
		return settled()
	}

	p := s.pick()
	d := s.terminate(p)
	s.count(func(st *stats) { st.alone.term = d })
	if err := restart(p); err != nil {
		return err
	}

	// Kill a process of stage 1 that owns source partitions (one may own only retry tiers'
	// partitions: its kill would measure nothing).
	var owned map[int32]int64
	for _, q := range s.procs {
		if q.stage.n != 1 {
			continue
		}
		o, err := s.ownedPartitions(ctx, q)
		if err != nil {
			return err
		}
		if len(o) > len(owned) {
			p, owned = q, o
		}
	}
	s.end(p, syscall.SIGKILL)
	killed := time.Now()
	<-p.done
	if s.waitAdvanced(ctx, p.stage, owned, 60*time.Second) {
		d := time.Since(killed)
		s.count(func(st *stats) { st.alone.kill = d })
	}
	if err := restart(p); err != nil {
		return err
	}

	s.db.cut()
	err := sleep(ctx, 3*time.Second)
	s.db.restore()
	if err != nil {
		return err
	}
	if d, ok := s.waitCommits(ctx, time.Now()); ok {
		s.count(func(st *stats) { st.alone.pg = d })
	}
	if s.db.failover() {
		if err := sleep(ctx, 2*time.Second); err != nil {
			return err
		}
		if err := s.pgFailover(ctx, true); err != nil {
			return err
		}
	}
	if s.cluster != nil {
		if err := sleep(ctx, 2*time.Second); err != nil {
			return err
		}
		return s.killLeader(ctx)
	}
	return nil
}

func (s *suite) pick() *proc { return s.procs[s.rng.IntN(len(s.procs))] }

// readGroupType asks the broker which protocol the group runs ("classic" or "consumer").
func (s *suite) readGroupType(ctx context.Context) string {
	cl, err := kgo.NewClient(kgo.SeedBrokers(s.clientSeeds...))
	if err != nil {
		return "unknown"
	}
	defer cl.Close()
	resp, err := kmsg.NewPtrListGroupsRequest().RequestWith(ctx, cl)
	if err != nil {
		return "unknown"
	}
	for _, g := range resp.Groups {
		if g.Group == s.group {
			return g.GroupType
		}
	}
	return "unknown"
}

// restart replaces p with a new process. On kfake it waits until the new process is in the group:
// kfake (2026-09) can lose track of a member that dies while the group is joining, which stalls
// the group; real Kafka is killed mid-join too.
func (s *suite) restart(ctx context.Context, p *proc) error {
	np, err := s.startProc(p.stage, p.idx)
	if err != nil {
		return err
	}
	s.procs[p.idx] = np
	if s.devbroker != nil {
		return np.waitReady(ctx, 60*time.Second)
	}
	return nil
}

// kill SIGKILLs a processor, restarts it, and measures (in the background) how long its source
// partitions take to flow again.
func (s *suite) kill(ctx context.Context) error {
	p := s.pick()
	owned, err := s.ownedPartitions(ctx, p)
	if err != nil {
		return err
	}
	s.end(p, syscall.SIGKILL)
	killed := time.Now()
	<-p.done
	s.count(func(st *stats) { st.kills++ })
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		if s.waitAdvanced(ctx, p.stage, owned, 30*time.Second) {
			d := time.Since(killed)
			s.count(func(st *stats) { st.killRecovery = append(st.killRecovery, d) })
		} else {
			s.count(func(st *stats) { st.unmeasured++ })
		}
	}()
	return s.restart(ctx, p)
}

// term sends SIGTERM, measures the time to exit (the process must exit 0), and restarts it.
func (s *suite) term(ctx context.Context) error {
	p := s.pick()
	s.terminate(p)
	s.count(func(st *stats) { st.terms++ })
	return s.restart(ctx, p)
}

// terminate sends p SIGTERM and returns (and records) how long it took to exit; exiting with a
// non-zero status, or not within 20 s (it is then killed), is a violation.
func (s *suite) terminate(p *proc) time.Duration {
	s.end(p, syscall.SIGTERM)
	start := time.Now()
	select {
	case <-p.done:
		d := time.Since(start)
		s.count(func(st *stats) {
			st.termExit = append(st.termExit, d)
			if code := p.cmd.ProcessState.ExitCode(); code != 0 && !p.tolerated.Load() {
				st.violations = append(st.violations, fmt.Sprintf("processor %d exited with status %d after SIGTERM", p.idx, code))
			}
		})
		return d
	case <-time.After(20 * time.Second):
		p.end(syscall.SIGKILL)
		<-p.done
		s.count(func(st *stats) {
			st.violations = append(st.violations, fmt.Sprintf("processor %d did not exit within 20s of SIGTERM", p.idx))
		})
		return time.Since(start)
	}
}

// stop freezes a processor (SIGSTOP) for longer than the session timeout, so that the group gives
// its partitions away, then thaws it: it comes back as a zombie.
func (s *suite) stop(ctx context.Context) error {
	p := s.pick()
	p.cmd.Process.Signal(syscall.SIGSTOP)
	s.count(func(st *stats) { st.stops++ })
	err := sleep(ctx, sessionTimeout+time.Duration(1000+s.rng.IntN(2000))*time.Millisecond)
	p.cmd.Process.Signal(syscall.SIGCONT)
	return err
}

func (s *suite) pgDrop(context.Context) error {
	s.db.drop()
	s.count(func(st *stats) { st.pgDrops++ })
	return nil
}

// pgCut makes Postgres unreachable for 1-3 s and measures (in the background) how long after it
// returns the processors commit again.
func (s *suite) pgCut(ctx context.Context) error {
	s.count(func(st *stats) { st.pgCuts++ })
	err := s.outage(ctx, s.db.cut, s.db.restore)
	back := time.Now()
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		d, ok := s.waitCommits(ctx, back)
		s.count(func(st *stats) {
			if ok {
				st.pgRecovery = append(st.pgRecovery, d)
			} else {
				st.unmeasured++
			}
		})
	}()
	return err
}

// outage runs start, waits 1-3 s, then runs restore.
func (s *suite) outage(ctx context.Context, start, restore func()) error {
	start()
	defer restore()
	return sleep(ctx, time.Duration(1000+s.rng.IntN(2000))*time.Millisecond)
}

// waitCommits waits until a processor commits an offset after back and returns how long after
// back that was; it reports false if none did within 30 s.
func (s *suite) waitCommits(ctx context.Context, back time.Time) (time.Duration, bool) {
	err := localrun.WaitFor(ctx, 30*time.Second, func() error {
		var n int
		if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM offsets WHERE updated_at > $1`, back).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return errors.New("no commit yet")
		}
		return nil
	})
	return time.Since(back), err == nil
}

func (s *suite) pgStall(ctx context.Context) error {
	s.count(func(st *stats) { st.pgStalls++ })
	return s.outage(ctx, s.db.stall, s.db.restore)
}

func (s *suite) brokerCut(ctx context.Context) error {
	s.count(func(st *stats) { st.brokerCuts++ })
	return s.outage(ctx, s.brokerProxy.Cut, s.brokerProxy.Restore)
}

// brokerRestart stops the dev broker and starts it again on its data directory.
func (s *suite) brokerRestart(ctx context.Context) error {
	s.devbroker.Process.Signal(syscall.SIGTERM)
	s.devbroker.Wait()
	s.count(func(st *stats) { st.brokerRestarts++ })
	return s.startDevbroker(ctx)
}

func (s *suite) count(fn func(*stats)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fn(&s.stats)
}

// ownedPartitions returns the next offsets of the source partitions a process owns in Postgres.
func (s *suite) ownedPartitions(ctx context.Context, p *proc) (map[int32]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT partition, coalesce(next_offset, -1) FROM offsets
		WHERE consumer_group = $1 AND topic = $2 AND owner LIKE $3`, p.stage.group, p.stage.topic, "%:"+strconv.Itoa(p.cmd.Process.Pid)+" member=%")
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[int32]int64{}
	for rows.Next() {
		var part int32
		var next int64
		if err := rows.Scan(&part, &next); err != nil {
			return nil, err
		}
		out[part] = next
	}
	return out, rows.Err()
}

// waitAdvanced waits until every partition of st's topic in from has moved past its offset
// there; it reports false if that did not happen within timeout (no more records to apply) or
// from is empty.
func (s *suite) waitAdvanced(ctx context.Context, st *stage, from map[int32]int64, timeout time.Duration) bool {
	if len(from) == 0 {
		return false
	}
	err := localrun.WaitFor(ctx, timeout, func() error {
		for part, was := range from {
			var next int64
			if err := s.pool.QueryRow(ctx, `SELECT coalesce(next_offset, -1) FROM offsets WHERE consumer_group = $1 AND topic = $2 AND partition = $3`,
				st.group, st.topic, part).Scan(&next); err != nil {
				return err
			}
			if next <= was {
				return fmt.Errorf("partition %d still at %d", part, next)
			}
		}
		return nil
	})
	return err == nil
}

// restoreAll ends every fault: proxies forward again and every processor runs.
func (s *suite) restoreAll(ctx context.Context) error {
	s.db.restore()
	if s.brokerProxy != nil {
		s.brokerProxy.Restore()
	}
	for _, p := range s.procs {
		p.cmd.Process.Signal(syscall.SIGCONT)
		select {
		case <-p.done:
			if err := s.restart(ctx, p); err != nil {
				return err
			}
		default:
		}
	}
	return nil
}

// waitSettled waits until the run is over for items (ledger.Settled).
func (s *suite) waitSettled(ctx context.Context, items []ledger.Item) error {
	var last string
	err := localrun.WaitFor(ctx, s.cfg.settle, func() error {
		p, err := ledger.ReadProgress(ctx, s.pool, schema, s.group)
		if err != nil {
			return err
		}
		dlq, err := topicread.All(ctx, s.clientSeeds, retrytopics.DLQTopic(s.topic, s.group))
		if err != nil {
			return err
		}
		if err := ledger.Settled(p, items, maxAttempt, len(dlq)); err != nil {
			last = strings.ReplaceAll(err.Error(), "\n", "; ")
			return err
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("did not settle within %v: %s", s.cfg.settle, last)
	}
	return nil
}

// stopAll stops every processor with SIGTERM, measuring the time to exit.
func (s *suite) stopAll() {
	for _, p := range s.procs {
		s.terminate(p)
	}
}

// report is what the verification found.
type report struct {
	applied, dead, dlq, dups, rows int
	chain                          chainReport // a chain's stage 2, and how both stages deduplicated
}

// verify checks the ledger, the dead-letter topic and the dead_letters table against items.
func (s *suite) verify(ctx context.Context, items []ledger.Item) (report, error) {
	var rep report
	var errs []error
	lrep, err := ledger.VerifyWith(ctx, s.pool, items, maxAttempt, ledger.VerifyOptions{Unordered: s.unordered})
	rep.applied = lrep.Applied
	if err != nil {
		errs = append(errs, fmt.Errorf("ledger:\n%w", err))
	}
	for _, it := range items {
		if it.Dead(maxAttempt) {
			rep.dead++
		}
	}
	dlq, err := topicread.All(ctx, s.clientSeeds, retrytopics.DLQTopic(s.topic, s.group))
	if err != nil {
		return rep, err
	}
	rep.dlq = len(dlq)
	rep.dups, err = ledger.CheckDeadLetters(items, dlq, maxAttempt, true)
	if err != nil {
		errs = append(errs, fmt.Errorf("dead-letter topic:\n%w", err))
	}
	rep.rows, err = ledger.CheckDeadLetterRows(ctx, s.pool, schema, s.group, items, maxAttempt)
	if err != nil {
		errs = append(errs, fmt.Errorf("dead_letters table:\n%w", err))
	}
	if s.cfg.concurrency > 0 {
		bad, err := ledger.PrepareViolations(ctx, s.pool)
		if err != nil {
			return rep, err
		}
		for _, v := range bad {
			errs = append(errs, fmt.Errorf("prepare: %s", v))
		}
	}
	s.mu.Lock()
	for _, v := range s.stats.violations {
		errs = append(errs, errors.New(v))
	}
	s.mu.Unlock()
	return rep, errors.Join(errs...)
}

// violations returns the problems seen during the run (bad exit codes), joined.
func (s *suite) violations() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for _, v := range s.stats.violations {
		errs = append(errs, errors.New(v))
	}
	return errors.Join(errs...)
}

// summary is the one line the suite prints.
func (s *suite) summary(rep report, err error) string {
	s.mu.Lock()
	st := s.stats
	s.mu.Unlock()
	result := "ok"
	if err != nil {
		result = "FAILED"
	}
	replay := "replay: not run"
	if r := s.replayed; r != nil {
		resumed := "not killed"
		if r.resumed {
			resumed = "killed and resumed"
		}
		replay = fmt.Sprintf("replay of %d dead letters (%d processor kills, the replay command %s): %d recovered and applied exactly once, %d dead again in their own rows, settled in %s",
			r.rows, r.kills, resumed, r.recovered, r.deadAgain, r.took.Round(100*time.Millisecond))
		if s.cfg.chain() {
			replay += fmt.Sprintf("; %d replayed copies of recovered events skipped by stage 1; then %d postings published, %d posted exactly once, %d published twice and skipped by stage 2",
				r.copiesSkipped, r.chain.published, r.chain.posted, r.chain.republished)
		}
	}
	traced := ""
	if s.traces != nil {
		traced = " | " + s.traced.describe(s.cfg.chain())
	}
	handler, events := "HANDLER="+s.cfg.stageHandler(), fmt.Sprintf("%d events", s.cfg.events)
	if s.cfg.concurrency > 0 {
		handler += fmt.Sprintf(" CONCURRENCY=%d (no prepares of a key overlapped)", s.cfg.concurrency)
	}
	chain, acksLost := "", ""
	if s.cfg.chain() {
		acksLost = fmt.Sprintf(", %d relay-ack-lost (%d postings)", st.acksLost, st.republished)
		if s.positions != nil {
			acksLost += fmt.Sprintf(", %d position-pause (%d with records waiting; nothing of the partition changed while paused), %d position-rewind (%d records read again), %d position-skip (%d offsets: %d events never applied nor dead-lettered, %d applied by a rewind after their accounts' later events; stage 1's /metrics count of duplicates skipped holds the rewinds')",
				st.pauses, st.pausesWaiting, st.rewinds, st.rewound, st.skips, st.skippedOffsets, st.skippedEvents, st.lateEvents)
		}
		c := rep.chain
		handler = fmt.Sprintf("chain HANDLER=%s -> HANDLER=%s", s.cfg.handler, postHandler)
		events = fmt.Sprintf("%d events + %d copies", s.cfg.events, s.copies)
		chain = fmt.Sprintf(" | chain: %d postings published, %d posted exactly once in per-account order (one per applied event); stage 1 skipped %d copies (its /metrics counted %.0f), stage 2 skipped %d postings published twice (its /metrics counted %.0f), its deduplication state %d streams (%d forked upstream, their possible repeats keyed), no key per posting otherwise",
			c.published, c.posted, c.copiesSkipped, c.copiesCounted, c.republished, c.republishedCounted, c.streams, c.forks)
	}
	return fmt.Sprintf("chaos %s %s-protocol %s seed=%d: %s: %d applied exactly once in per-account order, %d dead-lettered (%d in the DLQ topic, %d duplicates; %d dead_letters rows)%s"+
		" | faults: %d kill, %d term, %d stop, %d pg-drop, %d pg-cut, %d pg-stall, %d broker-cut, %d broker-restart%s"+
		" | recovery, one fault at a time: SIGTERM->exit %s (target 5s), kill->partitions flowing elsewhere %s (target %s: session timeout + 1s), postgres back->commits %s (target 10s)"+
		" | under random faults: SIGTERM->exit max %s; kill->flowing median %s max %s; postgres back->commits median %s max %s; %d not measured"+
		" | %s | settled in %s | %s%s | %s",
		s.brokerName, s.groupType, handler, s.cfg.seed, events, rep.applied, rep.dead, rep.dlq, rep.dups, rep.rows, chain,
		st.kills, st.terms, st.stops, st.pgDrops, st.pgCuts, st.pgStalls, st.brokerCuts, st.brokerRestarts, acksLost,
		measured(st.alone.term), measured(st.alone.kill), sessionTimeout+time.Second, measured(st.alone.pg),
		maxDuration(st.termExit), medianDuration(st.killRecovery), maxDuration(st.killRecovery),
		medianDuration(st.pgRecovery), maxDuration(st.pgRecovery), st.unmeasured,
		s.topology(st), st.settle.Round(100*time.Millisecond), replay, traced, result)
}

// topology describes, for the summary, what the processors ran against and what its own faults
// measured.
func (s *suite) topology(st stats) string {
	out := s.db.describe()
	if s.cluster != nil {
		out += fmt.Sprintf(" | kafka cluster: %d broker kills, %d controlled shutdowns, %d freezes (%v), %d rolling restarts; leader of a busy partition killed->its records applied again %s;"+
			" during the rolling restart(s), produce->applied longest %s, p99 %s over %d events applied at their first delivery; tiers and DLQ replicated %d ways, min.insync.replicas=%s as the source",
			st.brokerFaults["kill"], st.brokerFaults["term"], st.brokerFaults["freeze"], freezeFor, len(st.rolling), measured(st.alone.leaderKill),
			measured(st.rollingLongest), measured(st.rollingP99), st.rollingEvents, clusterReplicas, clusterMinInsync)
	}
	if s.db.failover() {
		out += fmt.Sprintf(": %d failovers, the standby promoted %s (median) after the primary was killed; primary killed->commits again %s alone, median %s max %s under random faults; "+
			"%d applied events lost with the old primaries and applied again",
			st.failovers, medianDuration(st.promote), measured(st.alone.failover), medianDuration(st.failoverRecovery), maxDuration(st.failoverRecovery), st.lostRows)
	}
	if s.db.restores != nil {
		out += describeRestores(st, s.cfg.chain())
	}
	if s.registry != nil {
		out += " | " + s.registry.describe()
	}
	return out
}

// close stops whatever still runs and removes the work directory unless it is kept.
func (s *suite) close() {
	for _, p := range s.procs {
		p.cmd.Process.Signal(syscall.SIGCONT)
		p.end(syscall.SIGKILL)
		<-p.done
	}
	if s.devbroker != nil && s.devbroker.ProcessState == nil {
		s.devbroker.Process.Signal(syscall.SIGTERM)
		s.devbroker.Wait()
	}
	if s.db != nil {
		defer s.db.close() // after the schema is dropped
	}
	if s.cluster != nil {
		s.cluster.Close()
	}
	if s.registry != nil {
		s.registry.proxy.Close()
	}
	if s.positions != nil {
		s.positions.kc.Close()
	}
	if s.brokerProxy != nil {
		s.brokerProxy.Close()
	}
	if s.pool != nil {
		if !s.cfg.keep {
			s.pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+schema+` CASCADE`)
		}
		s.pool.Close()
	}
	if s.cfg.keep {
		fmt.Printf("chaos: logs kept in %s\n", s.work)
	} else {
		os.RemoveAll(s.work)
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}
