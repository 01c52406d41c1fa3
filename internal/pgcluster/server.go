package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Options configure a server.
type Options struct {
	// Dir is where the server lives: its data dir (Dir/data), its log (Dir/postgres.log) and
	// the logs of initdb and pg_basebackup. Defaults to a new temp dir under /tmp, which Close
	// removes; a given Dir is left in place. If Dir/data already holds a cluster, Start starts
	// it instead of running initdb. Its last element names the server (see Server.Name).
	Dir string
	// Port is the TCP port on 127.0.0.1. Defaults to a free one.
	Port int
	// Settings are postgresql.conf settings, e.g. {"synchronous_commit": "on"}. They override
	// the rig's; "port" is Port's business.
	Settings map[string]string
	// Durable keeps fsync and full_page_writes on, as for benchmarks whose figures are
	// reported. By default both are off, as in scripts/with-postgres.sh: a crash of the
	// server process loses nothing (the OS still has the writes); a crash of the machine does.
	// synchronous_commit stays on either way, so that a synchronous standby means what it says.
	Durable bool
	// TLS, if set, turns ssl on with these files, and the server then accepts only TLS
	// connections (hostssl from 127.0.0.1 and ::1). Defaults to no TLS.
	TLS *TLS
	// Password, if set, is user postgres's password, and every connection must give it
	// (scram-sha-256 in pg_hba.conf, for local and host connections alike, replication
	// included); URL carries it. Defaults to none: trust, any local user is superuser. Start
	// sets it on a cluster that Dir already holds too (in single-user mode, before the server
	// listens), so a cluster made with trust, or with another password, is brought to this one.
	// A Standby of a server with a Password defaults to the same.
	Password string
}

// Server is a PostgreSQL server on 127.0.0.1, run as a child process of this one (as the
// postgres user when this process is root). Its methods may be called from any goroutine.
type Server struct {
	bin     string
	acct    *account
	opts    Options
	dir     string // Options.Dir or the temp dir
	data    string // the data dir
	logPath string
	temp    bool // dir is ours to remove
	name    string

	port int // set before Start or Standby returns, constant after

	mu      sync.Mutex // serializes starts, stops and Follow
	proc    *process   // nil while stopped
	primary *Server    // what it streams from; nil for a primary
	closed  bool

	snapshots int // taken so far (Snapshot): names the next one's dir
}

// Start creates a cluster (initdb -A trust -U postgres -E UTF8 --locale=C; with a Password,
// -A scram-sha-256 and that password) in o.Dir, configures it and starts it. The cluster accepts replication connections from 127.0.0.1 (trust) and
// has wal_level=replica, max_wal_senders=10 and hot_standby=on, so Standby can copy it.
// Start returns once the server accepts connections.
func Start(ctx context.Context, o Options) (*Server, error) {
	s, err := newServer(o)
	if err != nil {
		return nil, err
	}
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	if _, err := os.Stat(filepath.Join(s.data, "PG_VERSION")); err != nil {
		if err := s.initdb(ctx); err != nil {
			s.Close()
			return nil, err
		}
		if err := s.includeRigConfig(); err != nil {
			s.Close()
			return nil, s.errorf("configure", err)
		}
	} else if o.Password != "" {
		if err := s.setPassword(ctx); err != nil {
			s.Close()
			return nil, err
		}
	}
	if err := s.boot(ctx); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// initdb creates the cluster in s.data.
func (s *Server) initdb(ctx context.Context) error {
	auth := []string{"-A", "trust"}
	if s.opts.Password != "" {
		// initdb reads the password from a file, which the account must read; it lives in the
		// server's own dir (mode 0700) only as long as initdb runs.
		const pwfile = "initdb.pw"
		if err := s.acct.writeFileIn(s.dir, pwfile, []byte(s.opts.Password+"\n"), 0o600); err != nil {
			return s.errorf("initdb", err)
		}
		defer os.Remove(filepath.Join(s.dir, pwfile))
		auth = []string{"-A", "scram-sha-256", "--pwfile", filepath.Join(s.dir, pwfile)}
	}
	args := append([]string{"-D", s.data}, auth...)
	args = append(args, "-U", "postgres", "-E", "UTF8", "--locale=C")
	if !s.opts.Durable {
		args = append(args, "--no-sync")
	}
	if err := s.acct.run(ctx, s.dir, filepath.Join(s.dir, "initdb.log"), filepath.Join(s.bin, "initdb"), args...); err != nil {
		return s.errorf("initdb", err)
	}
	return nil
}

// setPassword sets user postgres's password to Options.Password on the cluster in s.data, in
// single-user mode: no connection is accepted meanwhile, and the password goes through the
// backend's standard input, not its arguments or a file.
func (s *Server) setPassword(ctx context.Context) error {
	sql := "ALTER ROLE postgres PASSWORD '" + strings.ReplaceAll(s.opts.Password, "'", "''") + "'\n"
	err := s.acct.runInput(ctx, s.dir, filepath.Join(s.dir, "single-user.log"), sql, filepath.Join(s.bin, "postgres"),
		"--single", "-D", s.data, "-c", "exit_on_error=on", "-c", "password_encryption=scram-sha-256", "-c", "log_statement=none", "postgres")
	if err != nil {
		return s.errorf("set the password (postgres --single)", err)
	}
	return nil
}

// newServer checks o, finds the binaries and prepares the dir.
func newServer(o Options) (*Server, error) {
	if o.Port < 0 || o.Port > 65535 {
		return nil, fmt.Errorf("pgcluster: Options.Port %d is out of range", o.Port)
	}
	for k := range o.Settings {
		if !settingName.MatchString(k) {
			return nil, fmt.Errorf("pgcluster: Options.Settings: %q is not a setting name", k)
		}
		if k == "port" {
			return nil, errors.New("pgcluster: Options.Settings: set the port with Options.Port")
		}
	}
	if strings.ContainsAny(o.Password, "\n\r\x00") {
		return nil, errors.New("pgcluster: Options.Password must not hold a line break or NUL")
	}
	if t := o.TLS; t != nil && (t.CertFile == "" || t.KeyFile == "") {
		return nil, errors.New("pgcluster: Options.TLS needs CertFile and KeyFile")
	}
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	acct, err := serverAccount()
	if err != nil {
		return nil, err
	}
	if o.TLS != nil {
		for _, f := range []string{o.TLS.CertFile, o.TLS.KeyFile} {
			if err := acct.checkReachable(f); err != nil {
				return nil, fmt.Errorf("pgcluster: Options.TLS: %w", err)
			}
		}
	}
	dir, temp, err := acct.makeDir(o.Dir, "pgcluster-")
	if err != nil {
		return nil, fmt.Errorf("pgcluster: Options.Dir: %w", err)
	}
	o.Settings = maps.Clone(o.Settings)
	return &Server{
		bin:     bin,
		acct:    acct,
		opts:    o,
		dir:     dir,
		data:    filepath.Join(dir, "data"),
		logPath: filepath.Join(dir, "postgres.log"),
		temp:    temp,
		name:    nameFor(dir),
		port:    o.Port,
	}, nil
}

var (
	settingName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_.]*$`)
	notName     = regexp.MustCompile(`[^a-z0-9_]+`)
)

// nameFor derives an application_name from a dir: its last element, lower case, [a-z0-9_].
func nameFor(dir string) string {
	n := strings.Trim(notName.ReplaceAllString(strings.ToLower(filepath.Base(dir)), "_"), "_")
	if n == "" {
		n = "pgcluster"
	}
	if len(n) > 63 {
		n = n[:63]
	}
	return n
}

// Addr is the server's address, 127.0.0.1:PORT.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port())) }

// Port is the server's TCP port.
func (s *Server) Port() int { return s.port }

// Dir is the dir the server lives in (Options.Dir or its temp dir).
func (s *Server) Dir() string { return s.dir }

// LogPath is the server's log file.
func (s *Server) LogPath() string { return s.logPath }

// Name is the server's application_name when it streams from a primary, derived from its dir:
// the name to list in synchronous_standby_names (see SetSynchronous). It is also its
// cluster_name, which ps shows in its processes' titles.
func (s *Server) Name() string { return s.name }

// URL is a connection URL for database db as user postgres:
// postgres://postgres@127.0.0.1:PORT/db?sslmode=disable, with the password if Options has one.
// With TLS the URL has no sslmode: the caller adds the mode and root certificate it wants to
// test.
func (s *Server) URL(db string) string {
	u := url.URL{Scheme: "postgres", User: s.user(), Host: s.Addr(), Path: "/" + db}
	if s.opts.TLS == nil {
		u.RawQuery = "sslmode=disable"
	}
	return u.String()
}

// adminURL is how this package connects: TLS without verification when the server wants TLS.
func (s *Server) adminURL(db string) string {
	mode := "disable"
	if s.opts.TLS != nil {
		mode = "require"
	}
	u := url.URL{Scheme: "postgres", User: s.user(), Host: s.Addr(), Path: "/" + db,
		RawQuery: "sslmode=" + mode + "&connect_timeout=5&application_name=pgcluster"}
	return u.String()
}

// user is the URL's user: postgres, with Options.Password if set.
func (s *Server) user() *url.Userinfo {
	if s.opts.Password != "" {
		return url.UserPassword("postgres", s.opts.Password)
	}
	return url.User("postgres")
}

// connect opens an administrative connection to database db.
func (s *Server) connect(ctx context.Context, db string) (*pgx.Conn, error) {
	return pgx.Connect(ctx, s.adminURL(db))
}

// exec runs statements on database postgres, in order, each in its own transaction.
func (s *Server) exec(ctx context.Context, sqls ...string) error {
	conn, err := s.connect(ctx, "postgres")
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, sql := range sqls {
		if _, err := conn.Exec(ctx, sql); err != nil {
			return fmt.Errorf("%s: %w", sql, err)
		}
	}
	return nil
}

// CreateDatabase creates database name.
func (s *Server) CreateDatabase(ctx context.Context, name string) error {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	if err := s.exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return s.errorf("create database "+name, err)
	}
	return nil
}

// InRecovery reports pg_is_in_recovery(): true on a standby.
func (s *Server) InRecovery(ctx context.Context) (bool, error) {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	conn, err := s.connect(ctx, "postgres")
	if err != nil {
		return false, s.errorf("pg_is_in_recovery", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var in bool
	if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&in); err != nil {
		return false, s.errorf("pg_is_in_recovery", err)
	}
	return in, nil
}

// Kill stops the server as a crash would (SIGQUIT: immediate shutdown, no checkpoint, no
// goodbye to standbys): commits it acknowledged but had not streamed are missing on its
// standbys. Its own WAL survives (the OS has it), so Start recovers them on this server.
func (s *Server) Kill(ctx context.Context) error {
	return s.stop(ctx, syscall.SIGQUIT, "kill", 10*time.Second)
}

// Stop shuts the server down cleanly (SIGINT: fast shutdown; sessions are cut, standbys get
// all WAL up to the shutdown checkpoint).
func (s *Server) Stop(ctx context.Context) error {
	return s.stop(ctx, syscall.SIGINT, "stop", 30*time.Second)
}

func (s *Server) stop(ctx context.Context, sig syscall.Signal, op string, grace time.Duration) error {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return s.errorf(op, errors.New("not running"))
	}
	err := s.proc.stop(ctx, sig, grace)
	s.proc = nil
	if err != nil {
		return s.errorf(op, err)
	}
	return nil
}

// Start starts the stopped server again on its data dir and port (a standby goes on
// streaming from its primary), and returns once it accepts connections.
func (s *Server) Start(ctx context.Context) error {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return s.errorf("start", errors.New("closed"))
	case s.proc != nil:
		return s.errorf("start", errors.New("already running"))
	}
	return s.launch(ctx)
}

// Close stops the server (immediate shutdown) if it runs and removes its dir if it is a temp
// dir. It may be called more than once.
func (s *Server) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	if s.proc != nil {
		_ = s.proc.stop(context.Background(), syscall.SIGQUIT, 10*time.Second)
		s.proc = nil
	}
	if s.temp {
		os.RemoveAll(s.dir)
	}
}

// boot writes the configuration and starts the server for the first time; without
// Options.Port it tries other ports when it lost the race for one.
func (s *Server) boot(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for attempt := 1; ; attempt++ {
		if s.opts.Port == 0 {
			p, err := freePort()
			if err != nil {
				return s.errorf("start", err)
			}
			s.port = p
		}
		if err := s.writeConfig(); err != nil {
			return s.errorf("configure", err)
		}
		off := fileSize(s.logPath)
		err := s.launch(ctx)
		if err == nil {
			return nil
		}
		if s.opts.Port == 0 && attempt < 5 && ctx.Err() == nil {
			if l := logSince(s.logPath, off); strings.Contains(l, "could not bind") || strings.Contains(l, "already in use") {
				continue
			}
		}
		return err
	}
}

// launch starts postgres on the data dir and waits until it accepts connections. s.mu is held.
func (s *Server) launch(ctx context.Context) error {
	// SIGQUIT if this process dies: an immediate shutdown, so that no server outlives a
	// crashed test or chaos run.
	p, err := s.acct.start(s.dir, s.logPath, syscall.SIGQUIT, filepath.Join(s.bin, "postgres"), "-D", s.data)
	if err != nil {
		return s.errorf("start", err)
	}
	err = s.waitAccepting(ctx, p)
	if err != nil {
		_ = p.stop(context.WithoutCancel(ctx), syscall.SIGQUIT, 10*time.Second)
		return s.errorf("start", err)
	}
	s.proc = p
	return nil
}

// waitAccepting waits until the server accepts a connection (a standby does once it has
// reached a consistent state), or exits.
func (s *Server) waitAccepting(ctx context.Context, p *process) error {
	var last error
	for {
		conn, err := s.connect(ctx, "postgres")
		if err == nil {
			return conn.Close(ctx)
		}
		if last == nil || ctx.Err() == nil { // keep the last failure that was not our deadline
			last = err
		}
		select {
		case <-p.done:
			return fmt.Errorf("postgres exited before accepting connections: %v", p.err)
		case <-ctx.Done():
			return fmt.Errorf("not accepting connections: %w (last attempt: %v)", ctx.Err(), last)
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// includeRigConfig makes postgresql.conf include pgcluster.conf, the file this package owns
// and rewrites before each first start; ALTER SYSTEM (postgresql.auto.conf) still wins over it.
func (s *Server) includeRigConfig() error {
	root, err := os.OpenRoot(s.dir) // the account's dir: no symlink out of it is followed
	if err != nil {
		return err
	}
	defer root.Close()
	f, err := root.OpenFile(filepath.Join("data", "postgresql.conf"), os.O_WRONLY|os.O_APPEND|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString("\n# Settings of the pgcluster test rig (internal/pgcluster).\ninclude 'pgcluster.conf'\n")
	return errors.Join(err, f.Close())
}

// writeConfig writes pgcluster.conf and pg_hba.conf for s's options (and, on a standby, its
// primary).
func (s *Server) writeConfig() error {
	conf := map[string]string{
		"listen_addresses":        "127.0.0.1",
		"port":                    strconv.Itoa(s.port),
		"unix_socket_directories": "",
		"cluster_name":            s.name,
		"wal_level":               "replica",
		"max_wal_senders":         "10",
		"max_replication_slots":   "10",
		"hot_standby":             "on",
		// Keep WAL for a standby that was stopped for a while, so it can catch up.
		"wal_keep_size":      "512MB",
		"logging_collector":  "off",
		"log_line_prefix":    "%m [%p] %q%a ",
		"log_connections":    "off",
		"log_disconnections": "off",
	}
	if !s.opts.Durable {
		conf["fsync"] = "off"
		conf["full_page_writes"] = "off"
	}
	if t := s.opts.TLS; t != nil {
		conf["ssl"] = "on"
		conf["ssl_cert_file"] = t.CertFile
		conf["ssl_key_file"] = t.KeyFile
		if t.CAFile != "" {
			conf["ssl_ca_file"] = t.CAFile
		}
	}
	if s.primary != nil {
		conf["primary_conninfo"] = s.primary.conninfo(s.name)
	}
	maps.Copy(conf, s.opts.Settings)

	var b strings.Builder
	b.WriteString("# Written by internal/pgcluster before each first start; edits are lost.\n")
	for _, k := range slices.Sorted(maps.Keys(conf)) {
		fmt.Fprintf(&b, "%s = '%s'\n", k, strings.ReplaceAll(conf[k], "'", "''"))
	}
	if err := s.acct.writeFileIn(s.dir, filepath.Join("data", "pgcluster.conf"), []byte(b.String()), 0o600); err != nil {
		return err
	}

	kind := "host"
	if s.opts.TLS != nil {
		kind = "hostssl"
	}
	auth, hba := "trust", "# Written by internal/pgcluster: trust on loopback only.\n"
	if s.opts.Password != "" {
		auth, hba = "scram-sha-256", "# Written by internal/pgcluster: a password (scram-sha-256), loopback only.\n"
		// No unix socket is opened (unix_socket_directories is empty); should one be, it
		// asks for the password too.
		hba += fmt.Sprintf("%-8s %-12s all %-13s %s\n", "local", "all", "", auth)
		hba += fmt.Sprintf("%-8s %-12s all %-13s %s\n", "local", "replication", "", auth)
	}
	for _, db := range []string{"all", "replication"} {
		for _, addr := range []string{"127.0.0.1/32", "::1/128"} {
			hba += fmt.Sprintf("%-8s %-12s all %-13s %s\n", kind, db, addr, auth)
		}
	}
	return s.acct.writeFileIn(s.dir, filepath.Join("data", "pg_hba.conf"), []byte(hba), 0o600)
}

// conninfo is how a standby named app connects to s for replication.
func (s *Server) conninfo(app string) string {
	mode := "disable"
	if s.opts.TLS != nil {
		mode = "require"
	}
	ci := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s sslmode=%s", s.port, app, mode)
	if s.opts.Password != "" {
		ci += " password='" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s.opts.Password) + "'"
	}
	return ci
}

// errorf wraps err with the server's identity, the operation and the tail of its log.
func (s *Server) errorf(op string, err error) error {
	return fmt.Errorf("pgcluster: %s %s (%s, %s): %w%s", op, s.name, s.Addr(), s.dir, err, logTail(s.logPath))
}

// CloseWhenProcessExits has the server stopped (immediate shutdown) and its temp dir removed
// when this process exits, however it exits, for a server shared by the tests of a test binary,
// which has no hook at its end: a small shell, started now, waits for its standard input, a pipe
// whose write end only this process holds, to close. It stops a server started after it too
// (Start after Stop) only if it has the same pid, so call it on a running server you do not
// restart.
func (s *Server) CloseWhenProcessExits() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return s.errorf("close when this process exits", errors.New("the server is not running"))
	}
	pid := s.proc.cmd.Process.Pid
	dir := ""
	if s.temp {
		dir = s.dir
	}
	r, w, err := os.Pipe()
	if err != nil {
		return s.errorf("close when this process exits", err)
	}
	// $1 the server's pid, $2 the dir to remove ("" for none).
	cmd := exec.Command("/bin/sh", "-c", `read _; kill -QUIT "$1" 2>/dev/null; n=0; while kill -0 "$1" 2>/dev/null && [ $n -lt 100 ]; do sleep 0.1; n=$((n+1)); done; [ -n "$2" ] && rm -rf "$2"`, "pgcluster-reaper", strconv.Itoa(pid), dir)
	cmd.Stdin = r
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // not stopped by a Ctrl-C to the test's process group
	if err := cmd.Start(); err != nil {
		r.Close()
		w.Close()
		return s.errorf("close when this process exits", err)
	}
	r.Close()
	reapers = append(reapers, w) // never closed: the OS closes it when this process exits
	go cmd.Wait()
	return nil
}

// reapers keeps the write ends of CloseWhenProcessExits's pipes open as long as this process.
var reapers []*os.File
