package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"go.uber.org/goleak"
)

// TestMain also checks that no goroutine outlives the tests: each child process is awaited by
// one, so a leak here means a server or bouncer was left running. The spawner, whose thread
// must outlive the children, stays.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/kafkapg/kafkapg/internal/pgcluster.spawnLoop"))
}

// testCtx bounds a test; the servers' cleanups do not depend on it.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func start(t *testing.T, o Options) *Server {
	t.Helper()
	began := time.Now()
	s, err := Start(testCtx(t), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	t.Logf("started %s at %s in %v", s.Name(), s.Addr(), time.Since(began).Round(time.Millisecond))
	return s
}

func standby(t *testing.T, primary *Server, o Options) *Server {
	t.Helper()
	began := time.Now()
	s, err := primary.Standby(testCtx(t), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	t.Logf("standby %s of %s at %s in %v", s.Name(), primary.Name(), s.Addr(), time.Since(began).Round(time.Millisecond))
	return s
}

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(testCtx(t), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// mustExec runs sql on a fresh connection to db on s.
func mustExec(t *testing.T, s *Server, db, sql string, args ...any) {
	t.Helper()
	conn, err := pgx.Connect(testCtx(t), s.URL(db))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(testCtx(t), sql, args...); err != nil {
		t.Fatalf("%s on %s: %v", sql, s.Name(), err)
	}
}

// values returns the v column of table t in db on s, in order.
func values(t *testing.T, s *Server, db string) []string {
	t.Helper()
	conn, err := pgx.Connect(testCtx(t), s.URL(db))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	rows, _ := conn.Query(testCtx(t), "SELECT v FROM t ORDER BY id")
	vs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("read t on %s: %v", s.Name(), err)
	}
	return vs
}

func wantValues(t *testing.T, s *Server, db string, want ...string) {
	t.Helper()
	if got := values(t, s, db); !slices.Equal(got, want) {
		t.Fatalf("t on %s = %q, want %q", s.Name(), got, want)
	}
}

func wantRecovery(t *testing.T, s *Server, want bool) {
	t.Helper()
	in, err := s.InRecovery(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if in != want {
		t.Fatalf("%s: pg_is_in_recovery() = %v, want %v", s.Name(), in, want)
	}
}

func timed(t *testing.T, what string, f func() error) {
	t.Helper()
	began := time.Now()
	if err := f(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %v", what, time.Since(began).Round(time.Millisecond))
}

// sqlState is the SQLSTATE of err, "" if it has none.
func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

func TestBinDir(t *testing.T) {
	dir, err := BinDir()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"initdb", "postgres", "pg_basebackup"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Error(err)
		}
	}
	if got := compareVersions("9.6", "15"); got >= 0 {
		t.Errorf("compareVersions(9.6, 15) = %d, want < 0", got)
	}
}

func TestNameFor(t *testing.T) {
	for dir, want := range map[string]string{
		"/tmp/pgcluster-123":   "pgcluster_123",
		"/tmp/chaos/Primary.A": "primary_a",
		"/tmp/--":              "pgcluster",
	} {
		if got := nameFor(dir); got != want {
			t.Errorf("nameFor(%q) = %q, want %q", dir, got, want)
		}
	}
}

// A primary and an async standby: writes replicate; after a crash of the primary the standby
// is promoted and takes writes; the old primary follows the new one and receives them.
func TestFailoverAndFollow(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	p := start(t, Options{})
	if err := p.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	mustExec(t, p, "app", "CREATE TABLE t (id serial PRIMARY KEY, v text NOT NULL)")
	mustExec(t, p, "app", "INSERT INTO t (v) VALUES ('on primary')")
	sb := standby(t, p, Options{})
	wantRecovery(t, p, false)
	wantRecovery(t, sb, true)

	mustExec(t, p, "app", "INSERT INTO t (v) VALUES ('streamed')")
	timed(t, "WaitReplayed", func() error { return sb.WaitReplayed(ctx, p) })
	wantValues(t, sb, "app", "on primary", "streamed")

	// A standby is read-only.
	conn := connect(t, sb.URL("app"))
	if _, err := conn.Exec(ctx, "INSERT INTO t (v) VALUES ('no')"); sqlState(err) != "25006" {
		t.Fatalf("insert on standby: %v, want SQLSTATE 25006 (read_only_sql_transaction)", err)
	}

	began := time.Now()
	timed(t, "Kill primary", func() error { return p.Kill(ctx) })
	timed(t, "Promote", func() error { return sb.Promote(ctx) })
	t.Logf("failover (kill + promote): %v", time.Since(began).Round(time.Millisecond))
	wantRecovery(t, sb, false)
	mustExec(t, sb, "app", "INSERT INTO t (v) VALUES ('on new primary')")

	timed(t, "Follow", func() error { return p.Follow(ctx, sb) })
	wantRecovery(t, p, true)
	mustExec(t, sb, "app", "INSERT INTO t (v) VALUES ('streamed to old primary')")
	if err := p.WaitReplayed(ctx, sb); err != nil {
		t.Fatal(err)
	}
	wantValues(t, p, "app", "on primary", "streamed", "on new primary", "streamed to old primary")

	// Stop and Start keep a standby streaming.
	timed(t, "Stop standby", func() error { return p.Stop(ctx) })
	mustExec(t, sb, "app", "INSERT INTO t (v) VALUES ('while stopped')")
	timed(t, "Start standby", func() error { return p.Start(ctx) })
	if err := p.WaitReplayed(ctx, sb); err != nil {
		t.Fatal(err)
	}
	wantValues(t, p, "app", "on primary", "streamed", "on new primary", "streamed to old primary", "while stopped")

	// WaitReplayed on a primary is an error, not a hang.
	if err := sb.WaitReplayed(ctx, p); err == nil || !strings.Contains(err.Error(), "not a standby") {
		t.Fatalf("WaitReplayed on a primary: %v, want an error saying it is not a standby", err)
	}
}

// A synchronous standby: while it is down, commits on the primary wait for it; once it is
// back, or the primary is made asynchronous, they pass.
func TestSynchronousStandby(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	p := start(t, Options{})
	mustExec(t, p, "postgres", "CREATE TABLE t (id serial PRIMARY KEY, v text NOT NULL)")
	sb := standby(t, p, Options{})
	timed(t, "SetSynchronous", func() error { return p.SetSynchronous(ctx, "nobody", sb.Name()) })
	mustExec(t, p, "postgres", "INSERT INTO t (v) VALUES ('standby up')")
	timed(t, "Stop standby", func() error { return sb.Stop(ctx) })

	// The commit blocks past the client's deadline; statement_timeout does not end the wait
	// (for a simple-protocol statement the server disables it before committing). pgx then
	// closes the connection, sending a cancel request, which ends the server's wait: the
	// commit, already in the WAL, becomes visible on the primary though the client saw an
	// error, and reaches the standby when it is back.
	const wait = 1500 * time.Millisecond
	gaveUp := connect(t, p.URL("postgres")+"&statement_timeout=200")
	short, cancel := context.WithTimeout(ctx, wait)
	began := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := gaveUp.Exec(short, "INSERT INTO t (v) VALUES ('client gave up')")
		done <- err
	}()
	time.Sleep(wait / 3)
	select {
	case err := <-done:
		t.Fatalf("commit with the sync standby down returned after %v: %v", time.Since(began), err)
	default:
	}
	wantValues(t, p, "postgres", "standby up") // waiting for the standby, the commit is not visible
	err := <-done
	cancel()
	t.Logf("commit with the sync standby down, pgx defaults: %v after %v", err, time.Since(began).Round(time.Millisecond))
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(began) < wait {
		t.Fatalf("commit with the sync standby down: %v after %v, want context.DeadlineExceeded after %v", err, time.Since(began), wait)
	}
	err = poll(ctx, 10*time.Millisecond, "the abandoned commit to show", func() (bool, string, error) {
		got := values(t, p, "postgres")
		return slices.Equal(got, []string{"standby up", "client gave up"}), fmt.Sprint(got), nil
	})
	if err != nil {
		t.Fatal(err)
	}

	// With pgx's CancelRequestContextWatcherHandler the connection survives the cancel, and
	// the client sees the server's warning; the commit is visible on the primary alone.
	var (
		mu      sync.Mutex
		notices []string
	)
	cfg, err := pgx.ParseConfig(p.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		notices = append(notices, n.Severity+": "+n.Message)
	}
	cfg.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: 5 * time.Second}
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	short, cancel = context.WithTimeout(ctx, wait)
	began = time.Now()
	_, err = conn.Exec(short, "INSERT INTO t (v) VALUES ('canceled')")
	cancel()
	blocked := time.Since(began)
	mu.Lock()
	got := slices.Clone(notices)
	mu.Unlock()
	t.Logf("commit with the sync standby down, canceled: %v after %v, notices %q", err, blocked.Round(time.Millisecond), got)
	if blocked < wait || !slices.ContainsFunc(got, func(n string) bool {
		return strings.Contains(n, "canceling wait for synchronous replication")
	}) {
		t.Fatalf("canceled commit with the sync standby down took %v with notices %q; want >= %v and a warning that the wait for synchronous replication was canceled", blocked, got, wait)
	}
	wantValues(t, p, "postgres", "standby up", "client gave up", "canceled")

	timed(t, "Start standby", func() error { return sb.Start(ctx) })
	timed(t, "commit with the sync standby back", func() error {
		_, err := connect(t, p.URL("postgres")).Exec(ctx, "INSERT INTO t (v) VALUES ('standby back')")
		return err
	})
	if err := sb.WaitReplayed(ctx, p); err != nil {
		t.Fatal(err)
	}
	wantValues(t, sb, "postgres", "standby up", "client gave up", "canceled", "standby back")

	// Asynchronous again: commits pass while the standby is down.
	if err := p.SetSynchronous(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	short, cancel = context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := connect(t, p.URL("postgres")).Exec(short, "INSERT INTO t (v) VALUES ('async')"); err != nil {
		t.Fatalf("async commit with the standby down: %v", err)
	}
}

// An async standby that was stopped lacks what the primary acknowledged meanwhile; promoted
// after the primary crashed, it has lost those commits, though the old primary still has them.
func TestAsyncStandbyLosesAcknowledgedCommits(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	p := start(t, Options{})
	mustExec(t, p, "postgres", "CREATE TABLE t (id serial PRIMARY KEY, v text NOT NULL)")
	mustExec(t, p, "postgres", "INSERT INTO t (v) VALUES ('replicated')")
	sb := standby(t, p, Options{})
	if err := sb.WaitReplayed(ctx, p); err != nil {
		t.Fatal(err)
	}
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	mustExec(t, p, "postgres", "INSERT INTO t (v) VALUES ('acknowledged')") // returned: acknowledged
	if err := p.Kill(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	wantValues(t, sb, "postgres", "replicated")

	// The crashed primary recovers the commit from its own WAL: the two have diverged.
	if err := p.Start(ctx); err != nil {
		t.Fatal(err)
	}
	wantValues(t, p, "postgres", "replicated", "acknowledged")
	mustExec(t, sb, "postgres", "INSERT INTO t (v) VALUES ('after failover')")

	// Following the new primary discards it.
	if err := p.Follow(ctx, sb); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitReplayed(ctx, sb); err != nil {
		t.Fatal(err)
	}
	wantValues(t, p, "postgres", "replicated", "after failover")
}

// tempDir is a temp dir the postgres user can enter (t.TempDir() is 0700 and owned by root).
func tempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp(tmpBase(), "pgcluster-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestTLS(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dir := tempDir(t)
	good, err := NewTLS(filepath.Join(dir, "good"), "localhost")
	if err != nil {
		t.Fatal(err)
	}
	other, err := NewTLS(filepath.Join(dir, "other"), "localhost")
	if err != nil {
		t.Fatal(err)
	}
	s := start(t, Options{TLS: good})
	url := strings.Replace(s.URL("postgres"), "127.0.0.1", "localhost", 1)

	conn := connect(t, url+"?sslmode=verify-full&sslrootcert="+good.CAFile)
	var ssl bool
	if err := conn.QueryRow(ctx, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl); err != nil || !ssl {
		t.Fatalf("pg_stat_ssl.ssl = %v, %v; want true", ssl, err)
	}

	for _, c := range []struct{ name, url, want string }{
		{"wrong CA", url + "?sslmode=verify-full&sslrootcert=" + other.CAFile, "certificate signed by unknown authority"},
		{"wrong host", s.URL("postgres") + "?sslmode=verify-full&sslrootcert=" + good.CAFile, "x509: cannot validate certificate for 127.0.0.1"},
		{"no TLS", url + "?sslmode=disable", "no pg_hba.conf entry"},
	} {
		conn, err := pgx.Connect(ctx, c.url)
		if err == nil {
			conn.Close(ctx)
			t.Errorf("%s: connected, want an error", c.name)
			continue
		}
		t.Logf("%s: %v", c.name, err)
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error containing %q", c.name, err, c.want)
		}
	}

	// A standby of a TLS primary replicates over TLS, and has TLS itself.
	mustExec(t, s, "postgres", "CREATE TABLE t (id int PRIMARY KEY, v text)")
	mustExec(t, s, "postgres", "INSERT INTO t VALUES (1, 'over TLS')")
	sb := standby(t, s, Options{TLS: good})
	if err := sb.WaitReplayed(ctx, s); err != nil {
		t.Fatal(err)
	}
	sbConn := connect(t, strings.Replace(sb.URL("postgres"), "127.0.0.1", "localhost", 1)+"?sslmode=verify-full&sslrootcert="+good.CAFile)
	var v string
	if err := sbConn.QueryRow(ctx, "SELECT v FROM t").Scan(&v); err != nil || v != "over TLS" {
		t.Fatalf("standby: %q, %v", v, err)
	}
	var walSSL bool
	if err := conn.QueryRow(ctx, "SELECT s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)").Scan(&walSSL); err != nil || !walSSL {
		t.Fatalf("replication connection ssl = %v, %v; want true", walSSL, err)
	}
}

func TestOptionErrors(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	for _, c := range []struct {
		name string
		o    Options
		want string
	}{
		{"port setting", Options{Settings: map[string]string{"port": "1"}}, "Options.Port"},
		{"bad setting", Options{Settings: map[string]string{"a b": "1"}}, "not a setting name"},
		{"unreachable dir", Options{Dir: filepath.Join(t.TempDir(), "pg")}, "Options.Dir"},
	} {
		if c.name == "unreachable dir" && os.Geteuid() != 0 {
			continue
		}
		s, err := Start(ctx, c.o)
		if err == nil {
			s.Close()
			t.Errorf("%s: started, want an error", c.name)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want it to mention %q", c.name, err, c.want)
		}
	}
	// A server that cannot start says why, with its log.
	_, err := Start(ctx, Options{Settings: map[string]string{"shared_buffers": "nonsense"}})
	if err == nil || !strings.Contains(err.Error(), `invalid value for parameter "shared_buffers"`) {
		t.Fatalf("start with a bad setting: %v, want the log's complaint", err)
	}
	t.Logf("bad setting: %v", err)
}

// TestSnapshotRestoreLosesCommitsKeepsIdentity: a copy of the running server's data dir, started
// in its place, has what was committed before the copy and not after, with the same system
// identifier and timeline; a client connected during the copy sees a pause, not an error.
func TestSnapshotRestoreLosesCommitsKeepsIdentity(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	s := start(t, Options{})
	mustExec(t, s, "postgres", "CREATE TABLE t (id serial PRIMARY KEY, v text NOT NULL)")
	mustExec(t, s, "postgres", "INSERT INTO t (v) VALUES ('before')")
	identity := func() string {
		t.Helper()
		conn := connect(t, s.URL("postgres"))
		var id string
		if err := conn.QueryRow(ctx, `SELECT (SELECT system_identifier::text FROM pg_control_system()) || '/' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	was := identity()

	// A client writes all along the copy: its writes wait, none fails.
	conn := connect(t, s.URL("postgres"))
	stop := make(chan struct{})
	wrote := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stop:
				wrote <- nil
				return
			default:
			}
			if _, err := conn.Exec(ctx, "INSERT INTO t (v) VALUES ('during')"); err != nil {
				wrote <- err
				return
			}
		}
	}()
	time.Sleep(50 * time.Millisecond)
	snap, err := s.Snapshot(ctx)
	close(stop)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-wrote; err != nil {
		t.Fatalf("a write during the snapshot failed: %v", err)
	}
	t.Logf("snapshot of %d bytes, server frozen %v", snap.Bytes, snap.Frozen.Round(time.Millisecond))
	var atCopy int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&atCopy); err != nil {
		t.Fatal(err)
	}
	mustExec(t, s, "postgres", "INSERT INTO t (v) VALUES ('after')")

	if err := s.Restore(ctx, snap); err != nil {
		t.Fatal(err)
	}
	got := values(t, s, "postgres")
	if len(got) == 0 || got[0] != "before" || slices.Contains(got, "after") {
		t.Fatalf("t after the restore = %q, want 'before' and no 'after'", got)
	}
	if len(got) > atCopy {
		t.Fatalf("t after the restore has %d rows, more than the %d committed by the time the copy ended", len(got), atCopy)
	}
	if now := identity(); now != was {
		t.Fatalf("identity after the restore = %s, want %s (same system identifier and timeline)", now, was)
	}
	mustExec(t, s, "postgres", "INSERT INTO t (v) VALUES ('restored')")
	if err := s.Restore(ctx, snap); err == nil || !strings.Contains(err.Error(), "restored already") {
		t.Fatalf("a second restore of the snapshot: %v, want 'restored already'", err)
	}
}

func TestParentFromStat(t *testing.T) {
	for _, tt := range []struct {
		name, stat string
		want       int
		ok         bool
	}{
		{"plain", "123 (postgres) S 77 123 123 0", 77, true},
		{"title with spaces and parens", "124 (postgres: (x) y) S 78 124", 78, true},
		{"garbage", "nothing", 0, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := parentFromStat([]byte(tt.stat))
			if got != tt.want || ok != tt.ok {
				t.Fatalf("parentFromStat(%q) = %d, %v; want %d, %v", tt.stat, got, ok, tt.want, tt.ok)
			}
		})
	}
}

// TestRootFollowsNoLinkOfTheServersUser: as root, a server's dir belongs to the postgres user,
// who (or whoever runs code as it: COPY ... FROM PROGRAM) can put links there. Files this
// package writes as root must not go through them to a file root owns.
func TestRootFollowsNoLinkOfTheServersUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: only then do the server's dirs belong to another user")
	}
	victim := filepath.Join(tempDir(t), "victim")
	if err := os.WriteFile(victim, []byte("root's\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(tempDir(t), "server")
	s := start(t, Options{Dir: dir})
	if err := s.Stop(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	s.Close()
	plant := func(name string) {
		t.Helper()
		path := filepath.Join(dir, name)
		acct, err := serverAccount()
		if err != nil {
			t.Fatal(err)
		}
		if err := errors.Join(os.Remove(path), os.Symlink(victim, path), os.Lchown(path, int(acct.cred.Uid), int(acct.cred.Gid))); err != nil {
			t.Fatal(err)
		}
	}
	intact := func() {
		t.Helper()
		b, err := os.ReadFile(victim)
		fi, _ := os.Stat(victim)
		if err != nil || string(b) != "root's\n" || fi.Sys().(*syscall.Stat_t).Uid != 0 {
			t.Errorf("the victim file was written through a link: %q %v", b, err)
		}
	}

	plant("data/pg_hba.conf") // rewritten before each first start
	s = start(t, Options{Dir: dir})
	intact()
	if fi, err := os.Lstat(filepath.Join(dir, "data", "pg_hba.conf")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("pg_hba.conf: %v %v, want a regular file in the link's place", fi, err)
	}
	if err := s.Stop(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	s.Close()

	plant("postgres.log") // appended to by root
	if s, err := Start(testCtx(t), Options{Dir: dir}); err == nil {
		s.Close()
		t.Error("Start appended its log through a symlink")
	}
	intact()
}

// TestPassword: with Options.Password every connection must give it, and a cluster made with
// trust is brought to it.
func TestPassword(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(tempDir(t), "server")
	s := start(t, Options{Dir: dir})
	if err := s.Stop(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	s.Close()
	for _, pw := range []string{"first'pass\\word", "second"} {
		s := start(t, Options{Dir: dir, Password: pw})
		conn := connect(t, s.URL("postgres"))
		conn.Close(context.Background())
		u, err := url.Parse(s.URL("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		if p, _ := u.User.Password(); p != pw {
			t.Errorf("URL's password: %q, want %q", p, pw)
		}
		u.User = url.User("postgres")
		if c, err := pgx.Connect(testCtx(t), u.String()); err == nil {
			c.Close(context.Background())
			t.Errorf("%s connected without the password", u)
		}
		if err := s.Stop(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		s.Close()
	}
}
