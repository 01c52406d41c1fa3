package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	kschema "github.com/kafkapg/kafkapg/internal/schema"
)

// The upgrade mode (-upgrade-from <binary>) runs the suite through a rolling upgrade from the
// release before (schema.PreviousSchema) to this build, a rollback in the middle of it, and the
// upgrade again to its end, while events flow and the usual faults hit every process:
//
//  1. every processor runs the release before (the old binary) and creates the schema it knows;
//     the suite's recovery measurements run against them;
//  2. forward: half the processes, one at a time, are replaced by this build (SIGTERM, start,
//     wait until ready, as a rolling update does); the first one migrates the schema, which
//     opens the upgrade window (the migrations the release before does not know are pending);
//  3. rollback mid-rollout: those processes are replaced by the release before again, which must
//     start and run on the migrated schema;
//  4. forward again: every process is replaced by this build;
//  5. the window is finalized (schema.Finalize, the operator's step once no process of the
//     release before runs), after which the release before must refuse the schema, naming it.
//
// The steps are spread over the fault period, with the suite's random faults (kills, freezes,
// Postgres cuts and, with -postgres async-standby, failovers that lose commits) between them;
// a fault restarts a process with the release it runs at that moment. Beside the usual checks
// (every event exactly once, in per-account order; dead letters; a chain's postings exactly
// once), no process may exit on its own or with a non-zero status after SIGTERM, and no log may
// show a release refusing the other's schema.

// Which binary a process runs.
const (
	releaseOld = "old" // the release before (-upgrade-from)
	releaseNew = "new" // this build (bin/processor)
)

// upgrade is the upgrade mode's plan and what it saw.
type upgrade struct {
	oldBin string
	// release is what each process index runs now (releaseOld, releaseNew).
	release map[int]string
	plan    []upgradeStep
	due     []time.Time // when each step of plan is due
	done    int         // steps done

	// What it saw, for the summary.
	starts          map[string]int // processes started, by release
	replaced        []string       // "i:old->new" per replacement, in order
	window          []int          // the pending migrations the first process of this build opened the window with
	finalized       []int          // what Finalize moved
	refusedAfter    string         // the release before's refusal of the finalized schema (its first line)
	refusedWhileOld bool           // upgrade finalize refused while processes of the release before ran
	readyOld        []time.Duration
	readyNew        []time.Duration
	phases          []string
	windowOpenFor   time.Duration
	opened          time.Time
	// Postgres failovers: planned steps, and all of them by the releases that ran: only the release
	// before, before the window or (rolled back) in it; both; only this build, in the window; after it.
	planned, failovers int
	// setupExits are the release before's exits on its known startup defect (setupDefect).
	setupExits                                                                      []string
	failoversBefore, failoversOldOpen, failoversMixed, failoversNew, failoversAfter int
}

// upgradeStep is one step of the rollout: replace process idx by release, or (idx < 0) finalize
// or fail Postgres over.
type upgradeStep struct {
	phase   string
	idx     int
	release string
}

// The steps that replace no process.
const (
	stepFinalize        = -1
	stepFailover        = -2
	stepFinalizeRefused = -3 // upgrade finalize while processes of the release before run: refused
)

// newUpgrade returns the plan for procs processes of stage 1 and post of stage 2: the processes
// are replaced in an order that alternates the stages, the first half forward, back, then all
// forward, then the window is finalized. With failover (a topology with a standby), Postgres is
// failed over twice in the window with both releases running: once the first half runs this
// build, and once one of them is back on the release before.
func newUpgrade(oldBin string, procs, post int, failover bool) *upgrade {
	var order []int
	for i := 0; i < max(procs, post); i++ {
		if i < procs {
			order = append(order, i)
		}
		if i < post {
			order = append(order, procs+i)
		}
	}
	u := &upgrade{oldBin: oldBin, release: map[int]string{}, starts: map[string]int{}}
	for i := range procs + post {
		u.release[i] = releaseOld
	}
	half := order[:(len(order)+1)/2]
	for _, i := range half {
		u.plan = append(u.plan, upgradeStep{"forward", i, releaseNew})
	}
	if failover {
		u.plan = append(u.plan, upgradeStep{"forward", stepFailover, ""})
	}
	for n, i := range slices.Backward(half) {
		u.plan = append(u.plan, upgradeStep{"rollback", i, releaseOld})
		if failover && n == len(half)-1 && len(half) > 1 {
			u.plan = append(u.plan, upgradeStep{"rollback", stepFailover, ""})
		}
	}
	for n, i := range order {
		u.plan = append(u.plan, upgradeStep{"forward again", i, releaseNew})
		if n == 0 {
			u.plan = append(u.plan, upgradeStep{"forward again", stepFinalizeRefused, ""})
		}
	}
	u.plan = append(u.plan, upgradeStep{"finalize", stepFinalize, ""})
	return u
}

// processorBinary is the binary process idx runs (its release in the upgrade mode), and in the
// upgrade mode notes in the process's log which release starts.
func (s *suite) processorBinary(idx int) string {
	if s.up == nil {
		return "processor"
	}
	rel := s.up.release[idx]
	bin := filepath.Join(s.bin, "processor")
	if rel == releaseOld {
		bin = s.up.oldBin
	}
	s.count(func(*stats) { s.up.starts[rel]++ })
	s.appendLog(fmt.Sprintf("processor-%d.log", idx), fmt.Appendf(nil, "==== chaos -upgrade-from: %s starts the %s release (%s)\n",
		time.Now().UTC().Format(logTime), rel, bin))
	return bin
}

// planUpgrade spreads the rollout's steps over the fault period that starts at start, leaving a
// slot after the finalize.
func (s *suite) planUpgrade(start time.Time) {
	u := s.up
	slot := s.cfg.duration / time.Duration(len(u.plan)+1)
	u.due = nil
	for i := range u.plan {
		u.due = append(u.due, start.Add(time.Duration(i+1)*slot))
	}
}

// upgradeDue runs the rollout's next step if it is due, after restarting the processes that
// exited on the release before's known startup defect (as an orchestrator restarts them).
func (s *suite) upgradeDue(ctx context.Context) error {
	u := s.up
	if u == nil {
		return nil
	}
	for _, p := range s.procs {
		select {
		case <-p.done:
			if p.tolerated.Load() {
				if err := s.restart(ctx, p); err != nil {
					return err
				}
			}
		default:
		}
	}
	if u.done >= len(u.plan) || time.Now().Before(u.due[u.done]) {
		return nil
	}
	step := u.plan[u.done]
	u.done++
	if len(u.phases) == 0 || u.phases[len(u.phases)-1] != step.phase {
		u.phases = append(u.phases, step.phase)
		fmt.Printf("chaos: upgrade: %s (%s)\n", step.phase, time.Now().Format(time.TimeOnly))
	}
	s.countFailovers()
	switch step.idx {
	case stepFinalizeRefused:
		return s.finalizeRefused(ctx)
	case stepFinalize:
		err := s.finalize(ctx)
		s.countFailovers()
		return err
	case stepFailover:
		err := s.pgFailover(ctx, false)
		s.count(func(*stats) { u.planned++ })
		s.countFailovers()
		return err
	}
	err := s.replace(ctx, step.idx, step.release)
	s.countFailovers()
	return err
}

// countFailovers attributes the failovers since it last ran to the releases that ran meanwhile
// (as they run now: a step runs between two calls).
func (s *suite) countFailovers() {
	u := s.up
	s.mu.Lock()
	defer s.mu.Unlock()
	n := s.stats.failovers - u.failovers
	u.failovers = s.stats.failovers
	if n == 0 {
		return
	}
	var old, cur bool
	for _, rel := range u.release {
		old, cur = old || rel == releaseOld, cur || rel == releaseNew
	}
	switch {
	case u.finalized != nil:
		u.failoversAfter += n
	case old && cur:
		u.failoversMixed += n
	case cur:
		u.failoversNew += n
	case u.window != nil:
		u.failoversOldOpen += n
	default:
		u.failoversBefore += n
	}
}

// finishUpgrade runs the steps not done yet (the fault period ended first).
func (s *suite) finishUpgrade(ctx context.Context) error {
	for s.up != nil && s.up.done < len(s.up.plan) {
		s.up.due[s.up.done] = time.Now()
		if err := s.upgradeDue(ctx); err != nil {
			return err
		}
	}
	return nil
}

// replace replaces process idx by one of release, as a rolling update does: SIGTERM (it must
// exit 0 within 20 s), start, and wait until it is ready (in the group, Postgres reached). The
// first process of this build migrates the schema: the window must then be open, with the
// release before's version final.
func (s *suite) replace(ctx context.Context, idx int, release string) error {
	u := s.up
	p := s.procs[idx]
	from := u.release[idx]
	p.cmd.Process.Signal(syscall.SIGCONT) // a frozen process would not see SIGTERM before the freeze ends
	s.terminate(p)
	u.release[idx] = release
	np, err := s.startProc(p.stage, idx)
	if err != nil {
		return err
	}
	s.procs[idx] = np
	started := time.Now()
	if err := np.waitReady(ctx, 90*time.Second); err != nil {
		return fmt.Errorf("process %d of the %s release did not become ready (see processor-%d.log): %w", idx, release, idx, err)
	}
	ready := time.Since(started)
	s.count(func(*stats) {
		u.replaced = append(u.replaced, fmt.Sprintf("%d:%s->%s", idx, from, release))
		if release == releaseOld {
			u.readyOld = append(u.readyOld, ready)
		} else {
			u.readyNew = append(u.readyNew, ready)
		}
	})
	if release == releaseNew && u.window == nil {
		finalized, pending, err := kschema.Window(ctx, s.pool, schema)
		if err != nil {
			return fmt.Errorf("read the upgrade window: %w", err)
		}
		if finalized != kschema.PreviousSchema || len(pending) == 0 {
			s.violate(fmt.Sprintf("after the first process of this build migrated the schema, schema_migrations says %d and schema_migrations_pending %v: want %d and the versions after it pending (the window open)",
				finalized, pending, kschema.PreviousSchema))
		}
		u.window = pending
		if u.window == nil {
			u.window = []int{}
		}
		u.opened = time.Now()
	}
	return nil
}

// finalize closes the window (the operator's step: every process runs this build) and checks
// that the release before now refuses the schema, naming it: its `migrate` command must exit
// non-zero and say so (it is not started as a processor: one that ran would apply events
// beside this build, which records keys for it no more).
func (s *suite) finalize(ctx context.Context) error {
	u := s.up
	for i, rel := range u.release {
		if rel != releaseNew {
			return fmt.Errorf("finalize with process %d still on the %s release", i, rel)
		}
	}
	// The operator's command, as docs/upgrading.md has it. It is refused until every member of the
	// groups said its release (a process this build started a moment ago says it within seconds).
	var moved []int
	var out []byte
	for deadline := time.Now().Add(90 * time.Second); ; {
		var err error
		if out, err = s.upgradeCommand(ctx); err == nil {
			break
		} else if time.Now().After(deadline) {
			s.violate(fmt.Sprintf("upgrade finalize refused for 90 s with every process on this build: %v: %s", err, firstLine(out)))
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(3 * time.Second):
		}
	}
	moved = slices.Clone(u.window)
	if !bytes.Contains(out, []byte(fmt.Sprintf("finalized versions %v", u.window))) {
		moved = nil
		s.violate(fmt.Sprintf("upgrade finalize did not say it finalized %v: %s", u.window, firstLine(out)))
	}
	u.finalized = moved
	u.windowOpenFor = time.Since(u.opened)
	if !slices.Equal(moved, u.window) {
		s.violate(fmt.Sprintf("schema.Finalize moved %v to schema_migrations, but the window opened with %v pending", moved, u.window))
	}
	if finalized, pending, err := kschema.Window(ctx, s.pool, schema); err != nil {
		return err
	} else if len(pending) > 0 || len(moved) > 0 && finalized != moved[len(moved)-1] {
		s.violate(fmt.Sprintf("after Finalize, schema_migrations says %d and schema_migrations_pending %v", finalized, pending))
	}

	pctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(pctx, u.oldBin, "migrate")
	cmd.Env = append(os.Environ(), s.procEnv(s.stages[0], "127.0.0.1:0", 0)...)
	out, err := cmd.CombinedOutput()
	s.appendLog("finalized-probe.log", out)
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit) && bytes.Contains(out, []byte("newer than this binary knows")):
		u.refusedAfter = firstLine(out)
	case err == nil:
		s.violate("the release before's migrate ran on the finalized schema (exit 0): it must refuse it (finalized-probe.log)")
	default:
		s.violate(fmt.Sprintf("the release before's migrate on the finalized schema: %v, without naming the schema as newer (finalized-probe.log)", err))
	}
	return nil
}

// upgradeCommand runs this build's `upgrade finalize --execute` with stage 1's environment.
func (s *suite) upgradeCommand(ctx context.Context) ([]byte, error) {
	pctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(pctx, filepath.Join(s.bin, "processor"), "upgrade", "finalize", "--execute", "--reason", "chaos -upgrade-from")
	cmd.Env = append(os.Environ(), s.procEnv(s.stages[0], "127.0.0.1:0", 0)...)
	out, err := cmd.CombinedOutput()
	s.appendLog("upgrade-finalize.log", out)
	return out, err
}

// finalizeRefused runs `upgrade finalize --execute` while processes of the release before run:
// it must refuse, naming the release before, and leave the window open.
func (s *suite) finalizeRefused(ctx context.Context) error {
	u := s.up
	// Another failure (the broker cut by a fault as it is asked) is tried again.
	for deadline := time.Now().Add(60 * time.Second); ; {
		out, err := s.upgradeCommand(ctx)
		if err == nil {
			s.violate(fmt.Sprintf("upgrade finalize finalized the window with processes of the release before running: %s", firstLine(out)))
			break
		}
		if bytes.Contains(out, []byte("a process of the release before still runs")) {
			u.refusedWhileOld = true
			break
		}
		if time.Now().After(deadline) {
			s.violate(fmt.Sprintf("upgrade finalize failed for 60 s (%v) without naming a process of the release before: %s (upgrade-finalize.log)", err, firstLine(out)))
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(3 * time.Second):
		}
	}
	if _, pending, err := kschema.Window(ctx, s.pool, schema); err != nil {
		return err
	} else if len(pending) == 0 {
		s.violate("the window closed while processes of the release before ran")
	}
	return nil
}

// setupDefect is how the release before (f433fb8) exits when Postgres fails while it sets up a
// handler's tables at startup: it does not wait for Postgres there, as it does while migrating
// (fixed after it by c33c79c, "Postgres cut while a handler's tables are set up is waited for").
// A fault can hit a process of the release before as it starts; an orchestrator restarts it.
const setupDefect = ": set up the tables of handler "

// connErrors are the errors of a Postgres connection lost or refused.
var connErrors = []string{"conn closed", "connection refused", "connection reset", "unexpected EOF", "broken pipe", "timeout", "failed to connect", "closed pool"}

// toleratedExit reports whether p, exiting on its own, ran the release before and exited 1 on
// its known startup defect (setupDefect) with a connection error; it then marks p tolerated
// and counts it. Every other exit on its own is a violation.
func (s *suite) toleratedExit(p *proc) bool {
	if s.up == nil || p.cmd.ProcessState.ExitCode() != 1 {
		return false
	}
	b, err := os.ReadFile(filepath.Join(s.work, fmt.Sprintf("processor-%d.log", p.idx)))
	if err != nil {
		return false
	}
	i := bytes.LastIndex(b, []byte("==== chaos -upgrade-from: "))
	if i < 0 {
		return false
	}
	run := string(b[i:])
	if !strings.Contains(firstLine([]byte(run)), "starts the "+releaseOld+" release") {
		return false
	}
	lines := strings.Split(strings.TrimSpace(run), "\n")
	last := lines[len(lines)-1]
	if !strings.Contains(last, setupDefect) || !slices.ContainsFunc(connErrors, func(e string) bool { return strings.Contains(last, e) }) {
		return false
	}
	p.tolerated.Store(true)
	s.count(func(*stats) {
		s.up.setupExits = append(s.up.setupExits, fmt.Sprintf("processor %d: %s", p.idx, last))
	})
	return true
}

func firstLine(b []byte) string {
	line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return line
}

func (s *suite) violate(v string) {
	s.count(func(st *stats) { st.violations = append(st.violations, v) })
}

// refusals are what either release logs when it refuses the schema as too new for it.
var refusals = []string{"newer than this binary knows", "finalized for a newer release"}

// checkUpgradeLogs adds a violation per processor log line in which a release refused the
// schema: during the window neither may.
func (s *suite) checkUpgradeLogs() {
	if s.up == nil {
		return
	}
	logs, _ := filepath.Glob(filepath.Join(s.work, "processor-*.log"))
	for _, name := range logs {
		b, err := os.ReadFile(name)
		if err != nil {
			s.violate(fmt.Sprintf("read %s: %v", name, err))
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			for _, r := range refusals {
				if strings.Contains(line, r) {
					s.violate(fmt.Sprintf("%s: a release refused the schema during the window: %s", filepath.Base(name), line))
				}
			}
		}
	}
}

// describeUpgrade is the upgrade mode's part of the summary.
func (s *suite) describeUpgrade() string {
	u := s.up
	if u == nil {
		return ""
	}
	s.countFailovers()
	s.mu.Lock()
	defer s.mu.Unlock()
	refused := "the release before's refusal not seen"
	if u.refusedAfter != "" {
		refused = "then the release before's migrate refused it"
	}
	if u.refusedWhileOld {
		refused = "upgrade finalize refused while processes of the release before ran, then done with `upgrade finalize`; " + refused
	}
	failovers := ""
	if s.db.failover() {
		failovers = fmt.Sprintf("; postgres failovers (%d of them planned steps): %d with only the release before running (%d of them in the window, rolled back), %d with both releases running, %d with only this build before the finalize, %d after it",
			u.planned, u.failoversBefore+u.failoversOldOpen, u.failoversOldOpen, u.failoversMixed, u.failoversNew, u.failoversAfter)
	}
	if len(u.setupExits) > 0 {
		failovers += fmt.Sprintf("; the release before exited 1 at startup, Postgres failing while it set up the handler's tables (its known defect, fixed by c33c79c), and was restarted %d times: %s",
			len(u.setupExits), strings.Join(u.setupExits, "; "))
	}
	return fmt.Sprintf("upgrade from %s: %s; %d replacements (%s); the window opened with %v pending, finalized %v after %s, %s;"+
		" %d processes of the release before started and %d of this build (restarts by faults included); ready after a replacement: release before median %s max %s, this build median %s max %s%s",
		filepath.Base(u.oldBin), strings.Join(u.phases, " -> "), len(u.replaced), strings.Join(u.replaced, " "), u.window, u.finalized,
		u.windowOpenFor.Round(time.Second), refused, u.starts[releaseOld], u.starts[releaseNew],
		medianDuration(u.readyOld), maxDuration(u.readyOld), medianDuration(u.readyNew), maxDuration(u.readyNew), failovers)
}

// checkOldBinary checks -upgrade-from's binary before the run.
func checkOldBinary(path string) error {
	if _, err := os.Stat(path); err != nil {
		return fmt.Errorf("-upgrade-from: %w (build it with scripts/build-release.sh <commit> <out>, or run `make chaos-upgrade`)", err)
	}
	return nil
}
