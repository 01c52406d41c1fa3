package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/pgcluster"
	"github.com/kafkapg/kafkapg/internal/rig/faultproxy"
)

// With -postgres same-identity-restore the suite runs a Postgres server of its own and restores
// it, three times a run, from a copy of its data directory taken while it ran
// (pgcluster.Server.Snapshot: every server process frozen while the files are copied): the
// copy is started in the server's place, on its address, so the database has lost every commit
// made after the copy without changing its system identifier or WAL timeline, while Kafka keeps
// what the relays published meanwhile (events whose emitting commit the database no longer has)
// and the processors' commits to Kafka are ahead of the database's positions. The processors
// reach the server through a fault proxy: the restore cuts it (their connections drop), and they
// reconnect to the restored server. Once a run every processor is killed as the copy is started
// and started again after, so that none remembers a position in memory.

const (
	restoreCount = 3 // restores a run
	// restoresLog is the work directory's log of the restores, to read beside the processors'.
	restoresLog = "restores.log"
	logTime     = "2006-01-02T15:04:05.000Z07:00"
)

// restoreStep is one planned restore.
type restoreStep struct {
	copyAt     time.Time     // when to copy the data dir
	lose       time.Duration // how long after the copy to restore it: the commits of this span are lost
	restartAll bool          // every processor killed as the copy is started, started after
}

// restoreRecord is what one restore did.
type restoreRecord struct {
	lost       time.Duration // from the copy to the restore: the commits made meanwhile are gone
	frozen     time.Duration // how long the server was frozen for the copy
	bytes      int64         // the copy's size
	down       time.Duration // the proxy cut -> the restored server accepting
	recovery   time.Duration // the proxy forwarding again -> the processors commit again; 0: not measured
	restartAll bool
	entries    int64 // stage 1's applied events lost
	postings   int64 // stage 2's applied postings lost (a chain)
	// orphans are postings published to Kafka whose emitting commit the database lost; unmarked,
	// postings published whose "published" mark it lost (a chain).
	orphans, unmarked int64
	// Kafka's commits ahead of the restored database: partitions, and records in all.
	aheadParts   int
	aheadRecords int64
	forcedLost   int // relay-ack-lost marks undone (their republications may not happen)
}

// restoreState is the restore mode's plan and its copy in waiting.
type restoreState struct {
	plan        []restoreStep
	snap        *pgcluster.Snapshot
	republished int // stats.republished when the copy was taken
}

// restoreSettings are the server's settings in the restore mode: a small WAL (no standby to keep
// it for), so that the copies stay small and the server is frozen briefly.
var restoreSettings = map[string]string{
	"max_connections": "300", "shared_buffers": "128MB",
	"wal_keep_size": "0", "max_wal_size": "128MB", "min_wal_size": "32MB", "checkpoint_timeout": "30s",
}

// startRestorable starts the restore mode's server and the proxy the processors reach it by.
func (s *suite) startRestorable(ctx context.Context) error {
	d := s.db
	srv, err := pgcluster.Start(ctx, pgcluster.Options{Dir: filepath.Join(s.work, "pg"), Settings: restoreSettings})
	if err != nil {
		return err
	}
	d.servers[0] = srv
	if err := srv.CreateDatabase(ctx, pgDatabase); err != nil {
		return err
	}
	p, err := faultproxy.Listen("127.0.0.1:0", srv.Addr())
	if err != nil {
		return err
	}
	d.proxies = []*faultproxy.Proxy{p}
	d.restores = &restoreState{}
	return nil
}

// planRestores plans the run's restores over the fault period, one in each third of it: the
// first loses 2-5 s of commits, the second 5-10 s with every processor restarted, the third 10 s
// up to the third's end less 3 s (at most 30 s).
func (s *suite) planRestores(start time.Time) {
	slot := s.cfg.duration / restoreCount
	between := func(lo, hi time.Duration) time.Duration {
		if hi <= lo {
			return lo
		}
		return lo + time.Duration(s.rng.Int64N(int64(hi-lo)))
	}
	longest := max(min(slot-3*time.Second, 30*time.Second), 10*time.Second)
	loses := []time.Duration{between(2*time.Second, 5*time.Second), between(5*time.Second, 10*time.Second), between(10*time.Second, longest)}
	for i, lose := range loses {
		s.db.restores.plan = append(s.db.restores.plan, restoreStep{
			copyAt: start.Add(time.Duration(i)*slot + time.Second), lose: lose, restartAll: i == 1,
		})
	}
}

// restoreDue takes the next copy, or restores it, when its time has come.
func (s *suite) restoreDue(ctx context.Context) error {
	r := s.db.restores
	if r == nil || len(r.plan) == 0 {
		return nil
	}
	step := r.plan[0]
	if r.snap == nil {
		if time.Now().Before(step.copyAt) {
			return nil
		}
		snap, err := s.db.servers[0].Snapshot(ctx)
		if err != nil {
			return err
		}
		r.snap = snap
		s.mu.Lock()
		r.republished = s.stats.republished
		n := len(s.stats.restores) + 1
		s.mu.Unlock()
		s.appendLog(restoresLog, fmt.Appendf(nil, "%s copy %d of the data dir taken (%d bytes, the server frozen %v); to be restored in %v\n",
			snap.At.UTC().Format(logTime), n, snap.Bytes, snap.Frozen.Round(time.Millisecond), step.lose.Round(time.Millisecond)))
		return nil
	}
	if time.Since(r.snap.At) < step.lose {
		return nil
	}
	r.plan = r.plan[1:]
	return s.pgRestore(ctx, step)
}

// finishRestores does the restores the fault period left undone, each when its time comes.
func (s *suite) finishRestores(ctx context.Context) error {
	r := s.db.restores
	for r != nil && len(r.plan) > 0 {
		if err := s.restoreDue(ctx); err != nil {
			return err
		}
		if err := sleep(ctx, 100*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// restoredCounts are what the database has of the run's effects, before and after a restore.
type restoredCounts struct {
	entries, postings int64
	published         []int64 // the ids of stage 1's published postings (a chain)
}

func (s *suite) restoredCounts(ctx context.Context) (restoredCounts, error) {
	var c restoredCounts
	err := localrun.WaitFor(ctx, 30*time.Second, func() error { // the pool's connections died with the server
		if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(&c.entries); err != nil {
			return err
		}
		if !s.cfg.chain() {
			return nil
		}
		return s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM ledger_postings),
				(SELECT coalesce(array_agg(id), '{}') FROM outbox WHERE consumer_group = $1 AND topic = $2 AND published_at IS NOT NULL)`,
			s.stages[0].group, s.stages[1].topic).Scan(&c.postings, &c.published)
	})
	return c, err
}

// pgRestore restores the copy: the proxy is cut (the processors' connections drop), in the
// restart-all step every processor is killed, the server is stopped (immediately) and the copy
// started in its place; the suite counts what the database lost and how far Kafka's commits
// are ahead of it, then the proxy forwards again (and the processors are started again). In the
// background it measures how long after that the processors commit again.
func (s *suite) pgRestore(ctx context.Context, step restoreStep) error {
	d := s.db
	r := d.restores
	snap := r.snap
	r.snap = nil
	rec := restoreRecord{restartAll: step.restartAll, frozen: snap.Frozen, bytes: snap.Bytes}
	d.cut()
	cut := time.Now()
	rec.lost = cut.Sub(snap.At)
	if step.restartAll {
		for _, p := range s.procs {
			s.end(p, syscall.SIGKILL)
		}
		for _, p := range s.procs {
			<-p.done
		}
	}
	before, err := s.restoredCounts(ctx)
	if err != nil {
		return fmt.Errorf("count what the database has before the restore: %w", err)
	}
	if err := d.servers[0].Restore(ctx, snap); err != nil {
		return err
	}
	rec.down = time.Since(cut)
	after, err := s.restoredCounts(ctx)
	if err != nil {
		return fmt.Errorf("count what the restored database has: %w", err)
	}
	rec.entries, rec.postings = max(before.entries-after.entries, 0), max(before.postings-after.postings, 0)
	if s.cfg.chain() {
		if err := s.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE o.id IS NULL), count(*) FILTER (WHERE o.id IS NOT NULL AND o.published_at IS NULL)
				FROM unnest($1::int8[]) AS u(id) LEFT JOIN outbox o ON o.id = u.id`, before.published).Scan(&rec.orphans, &rec.unmarked); err != nil {
			return fmt.Errorf("count the postings published that the restored database lost: %w", err)
		}
	}
	if rec.aheadParts, rec.aheadRecords, err = s.kafkaAhead(ctx); err != nil {
		return fmt.Errorf("compare Kafka's commits with the restored database: %w", err)
	}
	var idx int
	s.count(func(st *stats) {
		// relay-ack-lost marks made after the copy are gone with it: the postings they marked
		// may never be published again.
		rec.forcedLost = st.republished - r.republished
		st.republished = r.republished
		st.lostRows += rec.entries
		idx = len(st.restores)
		st.restores = append(st.restores, rec)
	})
	d.restore()
	back := time.Now()
	s.appendLog(restoresLog, fmt.Appendf(nil, "%s copy %d restored (proxy cut at %s; every processor restarted: %v): %v of commits lost, %d applied events, %d postings stage 2 had applied;"+
		" %d postings in Kafka whose emitting commit is lost, %d whose published mark is; Kafka's commits ahead on %d partitions by %d records; the proxy forwards again\n",
		back.UTC().Format(logTime), idx+1, cut.UTC().Format(logTime), step.restartAll, rec.lost.Round(time.Millisecond), rec.entries, rec.postings, rec.orphans, rec.unmarked, rec.aheadParts, rec.aheadRecords))
	if step.restartAll {
		for _, p := range s.procs {
			np, err := s.startProc(p.stage, p.idx)
			if err != nil {
				return err
			}
			s.procs[p.idx] = np
		}
		if s.devbroker != nil { // see restart
			for _, p := range s.procs {
				if err := p.waitReady(ctx, 60*time.Second); err != nil {
					return err
				}
			}
		}
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		dur, ok := s.waitCommits(ctx, back)
		s.count(func(st *stats) {
			if ok {
				st.restores[idx].recovery = dur
			} else {
				st.unmeasured++
			}
		})
	}()
	return nil
}

// kafkaAhead compares the commits in Kafka of every stage's group with the positions the
// database has: the partitions where Kafka's is ahead, and by how many records in all.
func (s *suite) kafkaAhead(ctx context.Context) (parts int, records int64, err error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(s.clientSeeds...))
	if err != nil {
		return 0, 0, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	for _, st := range s.stages {
		committed, err := adm.FetchOffsets(ctx, st.group)
		if err == nil {
			err = committed.Error()
		}
		if err != nil {
			return 0, 0, err
		}
		stored := map[string]map[int32]int64{}
		rows, err := s.pool.Query(ctx, `SELECT topic, partition, coalesce(next_offset, 0) FROM offsets WHERE consumer_group = $1`, st.group)
		if err != nil {
			return 0, 0, err
		}
		for rows.Next() {
			var topic string
			var part int32
			var next int64
			if err := rows.Scan(&topic, &part, &next); err != nil {
				rows.Close()
				return 0, 0, err
			}
			if stored[topic] == nil {
				stored[topic] = map[int32]int64{}
			}
			stored[topic][part] = next
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return 0, 0, err
		}
		committed.Each(func(o kadm.OffsetResponse) {
			if at := o.At; at > stored[o.Topic][o.Partition] {
				parts++
				records += at - stored[o.Topic][o.Partition]
			}
		})
	}
	return parts, records, nil
}

// describeRestores is the restore mode's part of the summary.
func describeRestores(st stats, chain bool) string {
	var lost, frozen, recovery []string
	var downs []time.Duration
	var size, entries, postings, orphans, unmarked, aheadRecords int64
	aheadParts, forcedLost := 0, 0
	for _, r := range st.restores {
		l := r.lost.Round(100 * time.Millisecond).String()
		if r.restartAll {
			l += " (every processor killed and started again)"
		}
		lost = append(lost, l)
		frozen = append(frozen, r.frozen.Round(time.Millisecond).String())
		recovery = append(recovery, measured(r.recovery))
		downs = append(downs, r.down)
		size = max(size, r.bytes)
		entries += r.entries
		postings += r.postings
		orphans += r.orphans
		unmarked += r.unmarked
		aheadParts += r.aheadParts
		aheadRecords += r.aheadRecords
		forcedLost += r.forcedLost
	}
	out := fmt.Sprintf(": %d restores, the commits of the last %s lost; copies of up to %.0f MB, the server frozen %s for them; proxy cut->copy accepting max %s;"+
		" restored->commits again %s; %d applied events lost and applied again; Kafka's commits ahead of the restored database on %d partitions by %d records",
		len(st.restores), strings.Join(lost, ", "), float64(size)/(1<<20), strings.Join(frozen, ", "), maxDuration(downs),
		strings.Join(recovery, ", "), entries, aheadParts, aheadRecords)
	if chain {
		out += fmt.Sprintf("; %d postings stage 2 had applied lost; %d postings in Kafka whose emitting commit the database lost, %d whose published mark it lost; %d relay-ack-lost marks undone",
			postings, orphans, unmarked, forcedLost)
	}
	return out
}
