package pgcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// DefaultTimeout bounds every call that waits for a server (start, stop, replication, promotion)
// when its ctx has no deadline, so that a broken server fails a test instead of hanging it.
const DefaultTimeout = 60 * time.Second

// withDefaultTimeout gives ctx a deadline of DefaultTimeout unless it has one.
func withDefaultTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, DefaultTimeout)
}

// BinDir returns the directory of the PostgreSQL server binaries (initdb, postgres,
// pg_basebackup): pg_config --bindir, else the newest /usr/lib/postgresql/*/bin, else the
// directory of initdb on PATH. Its error says how to install them.
func BinDir() (string, error) { return binDir() }

var binDir = sync.OnceValues(findBinDir)

func findBinDir() (string, error) {
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		if d := strings.TrimSpace(string(out)); hasServer(d) {
			return d, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int {
		return compareVersions(filepath.Base(filepath.Dir(a)), filepath.Base(filepath.Dir(b)))
	})
	for _, d := range slices.Backward(dirs) {
		if hasServer(d) {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		if d := filepath.Dir(p); hasServer(d) {
			return d, nil
		}
	}
	return "", errors.New("pgcluster: PostgreSQL server binaries (initdb, postgres, pg_basebackup) not found; " +
		"looked at pg_config --bindir, /usr/lib/postgresql/*/bin and PATH. Install them: " +
		"Debian/Ubuntu: apt-get install -y postgresql; macOS: brew install postgresql@16 and put " +
		"$(brew --prefix postgresql@16)/bin on PATH")
}

func hasServer(dir string) bool {
	if dir == "" {
		return false
	}
	for _, name := range []string{"initdb", "postgres", "pg_basebackup"} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// compareVersions orders "9.6" < "15" < "16.2".
func compareVersions(a, b string) int {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) || i < len(bs); i++ {
		var x, y int
		if i < len(as) {
			x, _ = strconv.Atoi(as[i])
		}
		if i < len(bs) {
			y, _ = strconv.Atoi(bs[i])
		}
		if x != y {
			return x - y
		}
	}
	return strings.Compare(a, b)
}

// account is the system user that runs initdb, postgres and pgbouncer: ourselves, or, when we
// are root (which all three refuse), the `postgres` user.
type account struct {
	cred *syscall.Credential // nil: run as ourselves
}

var serverAccount = sync.OnceValues(func() (*account, error) {
	if os.Geteuid() != 0 {
		return &account{}, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("pgcluster: running as root, which initdb, postgres and pgbouncer refuse, and there is "+
			"no 'postgres' user to run them as (apt-get install -y postgresql creates it; or "+
			"useradd --system --home-dir /var/lib/postgresql postgres): %w", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("pgcluster: user postgres: %w", err)
	}
	return &account{cred: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{uint32(gid)}}}, nil
})

// chown gives path to the account (when we are root).
func (a *account) chown(path string) error {
	if a.cred == nil {
		return nil
	}
	return os.Chown(path, int(a.cred.Uid), int(a.cred.Gid))
}

// checkReachable returns an error if the account could not enter dir, because one of its
// parents is closed to it (t.TempDir() is mode 0700 and owned by root, for example).
func (a *account) checkReachable(dir string) error {
	if a.cred == nil {
		return nil
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	for d := filepath.Dir(dir); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if ok {
			var bit os.FileMode = 0o001
			switch {
			case st.Uid == a.cred.Uid:
				bit = 0o100
			case st.Gid == a.cred.Gid:
				bit = 0o010
			}
			if fi.Mode().Perm()&bit == 0 {
				return fmt.Errorf("the postgres user cannot enter %s (mode %v, owner uid %d): "+
					"use a directory it can reach, e.g. under /tmp", d, fi.Mode().Perm(), st.Uid)
			}
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}

// command prepares a program to run as the account. Environment variables that libpq or the
// server would pick up (PG*, locale) are dropped, so only the arguments decide what happens.
// The child is in its own process group, and is sent deathSig if this process dies, so a crashed
// test leaves no server behind.
func (a *account) command(home string, deathSig syscall.Signal, name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "PG") || strings.HasPrefix(k, "LC_") || k == "LANG" || k == "LANGUAGE" || k == "HOME" {
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, "LC_ALL=C", "HOME="+home)
	cmd.Dir = home
	cmd.SysProcAttr = sysProcAttr(a.cred, deathSig)
	return cmd
}

// run runs a short-lived tool (initdb, pg_basebackup) as the account, its output appended to
// logPath. If ctx ends first, its whole process group is killed.
func (a *account) run(ctx context.Context, home, logPath, name string, args ...string) error {
	return a.runInput(ctx, home, logPath, "", name, args...)
}

// runInput is run with stdin as the tool's standard input (a secret goes there, never in args).
func (a *account) runInput(ctx context.Context, home, logPath, stdin, name string, args ...string) error {
	logf, err := openLog(logPath)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := a.command(home, syscall.SIGKILL, name, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Stdin = strings.NewReader(stdin)
	if err := spawn(cmd); err != nil {
		return fmt.Errorf("%s: %w", filepath.Base(name), err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-ctx.Done():
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		err = ctx.Err()
	}
	if err != nil {
		return fmt.Errorf("%s %s: %w%s", filepath.Base(name), strings.Join(args, " "), err, logTail(logPath))
	}
	return nil
}

// spawn starts cmd from one OS thread that lives as long as this process. Linux sends a
// child its Pdeathsig when the thread that forked it exits, not the process, and Go ends a
// thread when a goroutine locked to it returns (golang/go#27505): started from an arbitrary
// goroutine, a server could be killed in the middle of a test.
func spawn(cmd *exec.Cmd) error {
	done := make(chan error, 1)
	spawner() <- func() { done <- cmd.Start() }
	return <-done
}

var spawner = sync.OnceValue(func() chan<- func() {
	c := make(chan func())
	go spawnLoop(c)
	return c
})

func spawnLoop(c <-chan func()) {
	runtime.LockOSThread() // never unlocked: the thread lives until the process exits
	for f := range c {
		f()
	}
}

// process is a long-running child (postgres or pgbouncer) and the wait for its exit.
type process struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once it has exited
	err  error         // its exit status; set before done is closed
}

// start starts a long-running program as the account, its output appended to logPath.
func (a *account) start(home, logPath string, deathSig syscall.Signal, name string, args ...string) (*process, error) {
	logf, err := openLog(logPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close() // the child has its own copy
	cmd := a.command(home, deathSig, name, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := spawn(cmd); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Base(name), err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// stop sends sig and waits for the exit. If that takes longer than grace, or ctx ends first, it
// kills the process group and reports that.
func (p *process) stop(ctx context.Context, sig syscall.Signal, grace time.Duration) error {
	select {
	case <-p.done:
		return nil
	default:
	}
	_ = p.cmd.Process.Signal(sig)
	timer := time.NewTimer(grace)
	defer timer.Stop()
	select {
	case <-p.done:
		return nil
	case <-timer.C:
	case <-ctx.Done():
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
	return fmt.Errorf("pid %d did not exit within %v of %v; killed it", p.cmd.Process.Pid, grace, sig)
}

// exited reports whether the process has exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// tmpBase is where temporary dirs go: /tmp when we are root, because the postgres user must
// reach them and $TMPDIR may be private.
func tmpBase() string {
	if os.Geteuid() == 0 {
		return "/tmp"
	}
	return os.TempDir()
}

// makeDir creates dir (or, if dir is "", a new temp dir named after prefix) for the account.
// It reports whether the dir is a temp dir, which the caller removes when done.
func (a *account) makeDir(dir, prefix string) (string, bool, error) {
	temp := dir == ""
	var err error
	if temp {
		dir, err = os.MkdirTemp(tmpBase(), prefix)
	} else {
		dir, err = filepath.Abs(dir)
		if err == nil {
			err = os.MkdirAll(dir, 0o700)
		}
	}
	if err == nil {
		err = a.checkReachable(dir)
	}
	if err == nil {
		err = a.checkOwnDir(dir)
	}
	if err == nil {
		err = errors.Join(a.chown(dir), os.Chmod(dir, 0o700))
	}
	if err != nil {
		if temp && dir != "" {
			os.RemoveAll(dir)
		}
		return "", false, err
	}
	return dir, temp, nil
}

// checkOwnDir refuses a dir that chown and chmod must not touch: a symlink (they would follow it
// to wherever it points) or a dir owned by neither this process's user nor the account (someone
// else's). The caller vouches for the dir's parent: that no one else can replace the dir after
// this check.
func (a *account) checkOwnDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		return fmt.Errorf("%s is a symlink: refusing to follow it", dir)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		if uid := int(st.Uid); uid != os.Geteuid() && (a.cred == nil || st.Uid != a.cred.Uid) {
			return fmt.Errorf("%s is owned by uid %d, neither this process's user (uid %d) nor the server's", dir, uid, os.Geteuid())
		}
	}
	return nil
}

// openLog opens a log file for appending. As root it is created in a dir of the postgres user,
// who could plant a link there to make root append to any file: it follows no symlink at path,
// and refuses a file with another hard link.
func openLog(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND|syscall.O_NOFOLLOW, 0o644)
	if err != nil {
		return nil, err
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() || hardLinked(fi) {
		f.Close()
		return nil, fmt.Errorf("%s: not a regular file of its own (a link?): refusing to write to it", path)
	}
	return f, nil
}

// hardLinked reports whether a file has more than one name.
func hardLinked(fi os.FileInfo) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && st.Nlink > 1
}

// writeFile writes path, a file the account owns (see writeFileIn).
func (a *account) writeFile(path string, data []byte, perm os.FileMode) error {
	return a.writeFileIn(filepath.Dir(path), filepath.Base(path), data, perm)
}

// writeFileIn writes base/name, a file the account owns. As root, the dirs it writes into
// belong to the postgres user, who must not be able to make root write anywhere else by
// planting a link: no symlink is followed out of base (os.Root) nor at name, and nothing is
// written through a hard link (a new file is renamed over name).
func (a *account) writeFileIn(base, name string, data []byte, perm os.FileMode) error {
	root, err := os.OpenRoot(base)
	if err != nil {
		return err
	}
	defer root.Close()
	tmp := name + ".pgcluster-tmp"
	if err := root.Remove(tmp); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, perm)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	err = errors.Join(err, f.Chmod(perm))
	if a.cred != nil {
		err = errors.Join(err, f.Chown(int(a.cred.Uid), int(a.cred.Gid)))
	}
	if err = errors.Join(err, f.Close()); err == nil {
		err = root.Rename(tmp, name)
	}
	if err != nil {
		_ = root.Remove(tmp)
		return fmt.Errorf("write %s: %w", filepath.Join(base, name), err)
	}
	return nil
}

// Ports handed out by freePort and not yet bound, so that parallel starts in one process do
// not pick the same one.
var (
	portsMu sync.Mutex
	ports   = map[int]bool{}
)

// freePort returns a port on 127.0.0.1 that nothing listens on now. It picks below Linux's
// ephemeral range (32768-60999) so that client sockets do not take it before the server binds.
// A lost race shows up as "Address already in use" and the caller tries again.
func freePort() (int, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 100 {
		p := 20000 + rand.IntN(12000)
		if ports[p] {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue
		}
		ln.Close()
		ports[p] = true
		if len(ports) > 1000 {
			clear(ports)
		}
		return p, nil
	}
	return 0, errors.New("no free port on 127.0.0.1 in 20000-31999")
}

// fileSize is the size of path, 0 if it does not exist.
func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// logSince returns what was appended to path after offset (up to 64 KiB).
func logSince(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	b, _ := io.ReadAll(io.LimitReader(io.NewSectionReader(f, offset, 1<<16), 1<<16))
	return string(b)
}

// logTail formats the last lines of a log file for an error message.
func logTail(path string) string {
	const maxLines, maxBytes = 25, 4096
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	size := fileSize(path)
	off := max(size-maxBytes, 0)
	b, _ := io.ReadAll(io.NewSectionReader(f, off, size-off))
	b = bytes.TrimRight(b, "\n")
	if len(b) == 0 {
		return "\n(" + path + " is empty)"
	}
	lines := strings.Split(string(b), "\n")
	if off > 0 && len(lines) > 1 {
		lines = lines[1:] // the first line is cut
	}
	if len(lines) > maxLines {
		lines = lines[len(lines)-maxLines:]
	}
	return "\n--- last lines of " + path + " ---\n" + strings.Join(lines, "\n")
}

// poll calls f every interval until it reports done, returns an error, or ctx ends. On ctx's
// end the error names what was awaited and the last state f described.
func poll(ctx context.Context, interval time.Duration, what string, f func() (done bool, state string, err error)) error {
	var last string
	for {
		done, state, err := f()
		if err != nil {
			return err
		}
		if done {
			return nil
		}
		last = state
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w (last seen: %s)", what, ctx.Err(), last)
		case <-time.After(interval):
		}
	}
}

// Reachable returns an error, naming the parent at fault, if the account the servers run as
// (the postgres user when this process is root) could not enter dir.
func Reachable(dir string) error {
	a, err := serverAccount()
	if err != nil {
		return err
	}
	return a.checkReachable(dir)
}
