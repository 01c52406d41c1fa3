package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// Snapshot is a copy of a server's data dir taken while it ran (Server.Snapshot): what a storage
// snapshot or a file-level copy of a running server holds. Started in the server's place
// (Server.Restore), it recovers from its own WAL to the moment of the copy and goes on with the
// server's system identifier and WAL timeline: a client that reconnects finds the same database,
// without the commits made after the copy, and nothing in the database tells it so. That is
// unlike a failover to a standby or a point-in-time restore, which start a new timeline.
type Snapshot struct {
	srv *Server
	dir string // the copy of the data dir, until Restore moves it into place
	// At is when the server was frozen for the copy: it has every commit acknowledged before.
	At time.Time
	// Frozen is how long the server was frozen (the copy's duration).
	Frozen time.Duration
	// Bytes is the size of the copy.
	Bytes int64
	used  bool
}

// Snapshot copies s's data dir while s runs, into a dir of its own under Dir. For the copy to be
// crash-consistent, every process of the server (the postmaster first, so that it starts no
// other, then its children) is frozen with SIGSTOP while the files are copied, and thawed with
// SIGCONT after: clients see a pause, not an error, and WAL written before the freeze (with fsync
// off, in the OS's cache: written, not flushed) is in the copy. Linux only (the children are
// found in /proc). The copy stays until Restore takes it, or until Close removes s's temp dir.
func (s *Server) Snapshot(ctx context.Context) (*Snapshot, error) {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return nil, s.errorf("snapshot", errors.New("closed"))
	case s.proc == nil:
		return nil, s.errorf("snapshot", errors.New("not running"))
	}
	s.snapshots++
	dir := filepath.Join(s.dir, "snapshot-"+strconv.Itoa(s.snapshots))
	if err := os.RemoveAll(dir); err != nil {
		return nil, s.errorf("snapshot", err)
	}
	pid := s.proc.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return nil, s.errorf("snapshot: freeze the postmaster", err)
	}
	frozen := []int{pid}
	thaw := func() {
		for _, p := range frozen {
			_ = syscall.Kill(p, syscall.SIGCONT)
		}
	}
	at := time.Now()
	children, err := childPIDs(pid)
	if err != nil {
		thaw()
		return nil, s.errorf("snapshot: find the server's processes", err)
	}
	for _, c := range children {
		if syscall.Kill(c, syscall.SIGSTOP) == nil { // one that just exited is not in the copy's way
			frozen = append(frozen, c)
		}
	}
	err = s.acct.run(ctx, s.dir, filepath.Join(s.dir, "snapshot.log"), "cp", "-a", s.data, dir)
	thaw()
	took := time.Since(at)
	if err != nil {
		os.RemoveAll(dir)
		return nil, s.errorf("snapshot: copy the data dir", err)
	}
	// The copy has the running server's lock file; the server that starts from the copy must not
	// take it for a live one's.
	if err := os.Remove(filepath.Join(dir, "postmaster.pid")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, s.errorf("snapshot", err)
	}
	return &Snapshot{srv: s, dir: dir, At: at, Frozen: took, Bytes: dirSize(dir)}, nil
}

// Restore stops s (immediately, a crash, if it runs), replaces its data dir with snap, which must
// be a snapshot of s not restored before, and starts it on its port; it returns once the server
// accepts connections, having recovered to the moment of the copy. Everything committed after
// snap.At is gone; the system identifier and the timeline are the ones s had.
func (s *Server) Restore(ctx context.Context, snap *Snapshot) error {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return s.errorf("restore", errors.New("closed"))
	case snap == nil || snap.srv != s:
		return s.errorf("restore", errors.New("not a snapshot of this server"))
	case snap.used:
		return s.errorf("restore", errors.New("snapshot "+snap.dir+" was restored already"))
	}
	if s.proc != nil {
		err := s.proc.stop(ctx, syscall.SIGQUIT, 10*time.Second)
		s.proc = nil
		if err != nil {
			return s.errorf("restore: stop", err)
		}
	}
	if err := os.RemoveAll(s.data); err != nil {
		return s.errorf("restore: remove the data dir", err)
	}
	if err := os.Rename(snap.dir, s.data); err != nil {
		return s.errorf("restore: move the copy into place", err)
	}
	snap.used = true
	return s.launch(ctx)
}

// childPIDs returns the pids of the processes whose parent is pid, from /proc.
func childPIDs(pid int) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []int
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // exited meanwhile
		}
		if ppid, ok := parentFromStat(b); ok && ppid == pid {
			out = append(out, p)
		}
	}
	return out, nil
}

// parentFromStat reads the parent pid from /proc/<pid>/stat: "pid (comm) state ppid ...", where
// comm may hold spaces and parentheses, so the fields are counted from the last ')'.
func parentFromStat(b []byte) (int, bool) {
	i := len(b) - 1
	for i >= 0 && b[i] != ')' {
		i--
	}
	if i < 0 {
		return 0, false
	}
	var state byte
	var ppid int
	if _, err := fmt.Sscanf(string(b[i+1:]), " %c %d", &state, &ppid); err != nil {
		return 0, false
	}
	return ppid, true
}

// dirSize is the size of the regular files under dir.
func dirSize(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}
