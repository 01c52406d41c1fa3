package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/ops"
)

// replayReport is what the replay phase did.
type replayReport struct {
	rows, recovered, deadAgain, kills int
	copiesSkipped                     int // dead letters of copies of recovered events: skipped as duplicates (a chain)
	resumed                           bool
	took                              time.Duration
	recoveredIDs                      map[string]bool // the recovered events
	chain                             chainReport     // a chain's stage 2 after the replay
}

// replay is the suite's second act: an operator replays every dead letter with the processors'
// `dlq replay --execute` while processors are killed and the replay command itself is killed
// and resumed. The flaky events a replay can recover (every flaky event whose failures end
// within the attempts the replay gives it) must then be applied exactly once, the others must
// be back in their own dead_letters rows, and each row must have been queued exactly once.
func (s *suite) replay(ctx context.Context, items []ledger.Item) (replayReport, error) {
	var rep replayReport
	tbl := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	// What a replay can recover: a flaky event that dies at attempt n is replayed as attempt
	// n+1 and then, as ever, goes round the tiers (oversized ones cannot: their retry copies
	// are over Kafka's limit, so they get just the one attempt).
	attempts := map[string]int{} // by value: an event's copy has its value, and its attempts
	// By the bytes produced (JSON, or Avro in the wire format with -schema-registry).
	rows, err := s.pool.Query(ctx, `SELECT value, attempts FROM `+tbl("dead_letters")+` WHERE consumer_group = $1 AND value IS NOT NULL`, s.group)
	if err != nil {
		return rep, err
	}
	var value []byte
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&value, &n}, func() error {
		attempts[string(value)] = n
		rep.rows++
		return nil
	}); err != nil {
		return rep, fmt.Errorf("read dead letters: %w", err)
	}
	var rowsBefore int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl("dead_letters")+` WHERE consumer_group = $1`, s.group).Scan(&rowsBefore); err != nil {
		return rep, err
	}
	recovered := map[string]bool{}
	recoveredRows := 0 // an event's and its copies'
	for _, it := range items {
		n, ok := attempts[string(it.Value)]
		if !ok || it.Kind != ledger.KindFlaky {
			continue
		}
		last := n + 1 + tierCount
		if it.Oversized() {
			last = n + 1
		}
		if it.Event.FailAttempts < last {
			recovered[it.Event.EventID] = true
			recoveredRows++
		}
	}
	rep.recovered, rep.recoveredIDs = len(recovered), recovered
	rep.deadAgain = rep.rows - recoveredRows
	rep.copiesSkipped = recoveredRows - rep.recovered

	start := time.Now()
	env := s.procEnv(s.stages[0], "", 1) // in the failover topologies, the address that moves
	cli, err := s.command("processor", "replay.log", env, "dlq", "replay", "--execute", "--reason", "chaos: replay every dead letter", "--actor", "chaos",
		"--rate", fmt.Sprint(max(20, rep.rows/4)), "--wait", "0") // about four seconds: long enough to kill things meanwhile
	if err != nil {
		return rep, err
	}
	if err := cli.Start(); err != nil {
		return rep, fmt.Errorf("start dlq replay: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cli.Wait() }()

	// Kill processors while the replay runs and settles, and the replay command once, mid-way.
	kills := make(chan int, 1)
	stopKilling := make(chan struct{})
	go func() {
		n := 0
		defer func() { kills <- n }()
		for n < 4 {
			select {
			case <-stopKilling:
				return
			case <-time.After(1500 * time.Millisecond):
			}
			if err := s.kill(ctx); err != nil {
				s.count(func(st *stats) { st.violations = append(st.violations, fmt.Sprintf("replay phase: kill: %v", err)) })
				return
			}
			n++
		}
	}()
	stopKills := sync.OnceFunc(func() {
		close(stopKilling)
		rep.kills = <-kills
	})
	defer stopKills()
	killedCLI := false
	select {
	case err := <-exited:
		if err != nil {
			return rep, fmt.Errorf("dlq replay failed (%v); see replay.log", err)
		}
	case <-time.After(time.Second):
		killedCLI = true
		cli.Process.Signal(syscall.SIGKILL)
		<-exited
	case <-ctx.Done():
		return rep, ctx.Err()
	}
	if killedCLI {
		// The task's runner is gone: once its lease is over, resume it (as an operator would).
		var id int64
		var status string
		if err := s.pool.QueryRow(ctx, `SELECT id, status FROM `+tbl("tasks")+` WHERE consumer_group = $1 ORDER BY id DESC LIMIT 1`, s.group).Scan(&id, &status); err != nil {
			return rep, fmt.Errorf("find the replay task: %w", err)
		}
		if status == "running" {
			rep.resumed = true
			// Until the lease is over, resume says the task is busy; any other failure is one.
			var failed error
			err := localrun.WaitFor(ctx, time.Minute, func() error {
				cmd := exec.CommandContext(ctx, filepath.Join(s.bin, "processor"), "dlq", "resume", fmt.Sprint(id), "--wait", "0")
				cmd.Env = append(os.Environ(), env...)
				out, err := cmd.CombinedOutput()
				s.appendLog("replay.log", out)
				if err != nil && strings.Contains(string(out), ops.ErrTaskBusy.Error()) {
					return fmt.Errorf("task %d still leased to its killed runner", id)
				}
				if err != nil {
					failed = fmt.Errorf("dlq resume %d failed (%v); see replay.log", id, err)
				}
				return nil
			})
			if failed != nil {
				err = failed
			}
			if err != nil {
				return rep, err
			}
		}
	}

	// Settled: nothing replaying, nothing in the retry path, every recovered event applied.
	applied, _ := ledger.Expect(items, maxAttempt)
	want := applied + rep.recovered
	var last string
	err = localrun.WaitFor(ctx, s.cfg.settle, func() error {
		p, err := ledger.ReadProgress(ctx, s.pool, schema, s.group)
		if err != nil {
			return err
		}
		var replaying, running int
		if err := s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+tbl("dead_letters")+` WHERE consumer_group = $1 AND status = 'replaying'),
				(SELECT count(*) FROM `+tbl("tasks")+` WHERE consumer_group = $1 AND status = 'running')`, s.group).Scan(&replaying, &running); err != nil {
			return err
		}
		if p.Applied < want || replaying > 0 || running > 0 || p.InFlight() > 0 {
			last = fmt.Sprintf("%d of %d events applied, %d dead letters replaying, %d tasks running, %d outbox, %d in tiers, %d held keys, %d held records",
				p.Applied, want, replaying, running, p.Outbox, p.Tiers, p.HeldKeys, p.HeldRecords)
			return errors.New(last)
		}
		return nil
	})
	if err != nil {
		return rep, fmt.Errorf("replay did not settle within %v: %s", s.cfg.settle, last)
	}
	rep.took = time.Since(start)
	stopKills()
	s.bg.Wait() // their recovery measurements

	var errs []error
	if _, err := ledger.VerifyWith(ctx, s.pool, items, maxAttempt, ledger.VerifyOptions{Recovered: recovered, Unordered: s.unordered}); err != nil {
		errs = append(errs, fmt.Errorf("ledger after the replay:\n%w", err))
	}
	// One row per dead letter still, each queued exactly once, replayed or back to new as
	// expected.
	var total int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl("dead_letters")+` WHERE consumer_group = $1`, s.group).Scan(&total); err != nil {
		return rep, err
	}
	if total != rowsBefore {
		errs = append(errs, fmt.Errorf("%d dead_letters rows after the replay, %d before: a replay must never add a row", total, rowsBefore))
	}
	rows, err = s.pool.Query(ctx, `SELECT coalesce(value, ''::bytea), status, replays,
			(SELECT count(*) FROM `+tbl("dead_letter_events")+` e WHERE e.dead_letter_id = d.id AND e.event = 'replay_queued')
		FROM `+tbl("dead_letters")+` d WHERE consumer_group = $1`, s.group)
	if err != nil {
		return rep, err
	}
	byValue := map[string]ledger.Item{}
	for _, it := range items {
		byValue[string(it.Value)] = it
	}
	var status string
	var replays, queued int
	bad := 0
	if _, err := pgx.ForEachRow(rows, []any{&value, &status, &replays, &queued}, func() error {
		it, ok := byValue[string(value)]
		want := "new"
		if ok && recovered[it.Event.EventID] {
			want = "replayed"
		}
		_, hadValue := attempts[string(value)]
		if !hadValue {
			return nil // lost in the retry path: a replay leaves it alone
		}
		if status != want || replays != 1 || queued != 1 {
			if bad++; bad <= 10 {
				errs = append(errs, fmt.Errorf("dead letter of event %q: status %s, replays %d, queued %d times; want %s, replayed once",
					it.Event.EventID, status, replays, queued, want))
			}
		}
		return nil
	}); err != nil {
		return rep, err
	}
	return rep, errors.Join(errs...)
}

// appendLog appends out to the work directory's log file name.
func (s *suite) appendLog(name string, out []byte) {
	f, err := os.OpenFile(filepath.Join(s.work, name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	f.Write(out)
}
