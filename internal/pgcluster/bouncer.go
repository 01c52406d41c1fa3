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
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// BouncerOptions configure a PgBouncer.
type BouncerOptions struct {
	// Dir holds pgbouncer.ini, the userlist and pgbouncer.log. Defaults to a new temp dir
	// under /tmp, which Close removes.
	Dir string
	// Port is the TCP port on 127.0.0.1. Defaults to a free one.
	Port int
	// Backend is the host:port of the Postgres server every database is routed to. Required.
	// PgBouncer connects to it without TLS.
	Backend string
	// PoolMode is "transaction", "session" or "statement". Defaults to "transaction".
	PoolMode string
	// DefaultPoolSize is the number of server connections per database and user. Defaults to
	// 20, PgBouncer's default.
	DefaultPoolSize int
	// MaxClientConn is the number of client connections PgBouncer accepts. Defaults to 100,
	// PgBouncer's default.
	MaxClientConn int
	// IgnoreStartupParameters are startup parameters PgBouncer accepts from clients and then
	// ignores, e.g. "extra_float_digits". By default it refuses any it does not track itself.
	IgnoreStartupParameters []string
	// Settings are further [pgbouncer] settings; they override the rig's, which include
	// server_login_retry = 1 (PgBouncer's default, 15 s, would stall a failover test).
	Settings map[string]string
	// Password, if set, is user postgres's password on the backend: PgBouncer logs in to it
	// with it, and asks every client for it too (scram-sha-256; else, with a backend that asks
	// for none, trust). URL carries it.
	Password string
}

// Bouncer is a PgBouncer in front of one Postgres server, run in the foreground as a child
// process of this one (as the postgres user when this process is root), with trust
// authentication for user postgres (or its Password) and an admin console (database
// "pgbouncer") for it.
// Its methods may be called from any goroutine.
type Bouncer struct {
	acct    *account
	opts    BouncerOptions
	dir     string
	ini     string
	logPath string
	temp    bool
	port    int // set before StartBouncer returns, constant after

	mu      sync.Mutex
	backend string
	proc    *process
	closed  bool
}

// PgBouncerPath finds the pgbouncer binary: on PATH, else /usr/sbin/pgbouncer (Debian's
// package puts it there, off a normal user's PATH).
func PgBouncerPath() (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	const debian = "/usr/sbin/pgbouncer"
	if fi, err := os.Stat(debian); err == nil && fi.Mode()&0o111 != 0 {
		return debian, nil
	}
	return "", errors.New("pgcluster: pgbouncer not found on PATH nor at /usr/sbin/pgbouncer. Install it: " +
		"Debian/Ubuntu: apt-get install -y pgbouncer; macOS: brew install pgbouncer")
}

// StartBouncer writes pgbouncer.ini ([databases] * = the backend, listening on 127.0.0.1)
// and starts PgBouncer. It returns once a connection through it reaches Postgres, so the
// backend must be up.
func StartBouncer(ctx context.Context, o BouncerOptions) (*Bouncer, error) {
	if o.PoolMode == "" {
		o.PoolMode = "transaction"
	}
	if o.DefaultPoolSize == 0 {
		o.DefaultPoolSize = 20
	}
	if o.MaxClientConn == 0 {
		o.MaxClientConn = 100
	}
	switch {
	case o.Backend == "":
		return nil, errors.New("pgcluster: BouncerOptions.Backend is required")
	case !slices.Contains([]string{"transaction", "session", "statement"}, o.PoolMode):
		return nil, fmt.Errorf("pgcluster: BouncerOptions.PoolMode %q is not transaction, session or statement", o.PoolMode)
	case o.DefaultPoolSize < 0 || o.MaxClientConn < 0:
		return nil, errors.New("pgcluster: BouncerOptions.DefaultPoolSize and MaxClientConn must not be negative")
	case o.Port < 0 || o.Port > 65535:
		return nil, fmt.Errorf("pgcluster: BouncerOptions.Port %d is out of range", o.Port)
	}
	if _, _, err := net.SplitHostPort(o.Backend); err != nil {
		return nil, fmt.Errorf("pgcluster: BouncerOptions.Backend: %w", err)
	}
	for k := range o.Settings {
		if !settingName.MatchString(k) {
			return nil, fmt.Errorf("pgcluster: BouncerOptions.Settings: %q is not a setting name", k)
		}
	}
	for _, p := range o.IgnoreStartupParameters {
		if !settingName.MatchString(p) {
			return nil, fmt.Errorf("pgcluster: BouncerOptions.IgnoreStartupParameters: %q is not a parameter name", p)
		}
	}
	bin, err := PgBouncerPath()
	if err != nil {
		return nil, err
	}
	acct, err := serverAccount()
	if err != nil {
		return nil, err
	}
	dir, temp, err := acct.makeDir(o.Dir, "pgbouncer-")
	if err != nil {
		return nil, fmt.Errorf("pgcluster: BouncerOptions.Dir: %w", err)
	}
	o.Settings = maps.Clone(o.Settings)
	b := &Bouncer{
		acct:    acct,
		opts:    o,
		dir:     dir,
		ini:     filepath.Join(dir, "pgbouncer.ini"),
		logPath: filepath.Join(dir, "pgbouncer.log"),
		temp:    temp,
		port:    o.Port,
		backend: o.Backend,
	}
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	// PgBouncer's trust still wants the user in auth_file; the password is not checked of
	// clients then, only given to the backend.
	if strings.ContainsAny(o.Password, `"\`+"\n") {
		b.Close()
		return nil, b.errorf("configure", errors.New("the password has a quote, a backslash or a newline, which auth_file cannot hold as written"))
	}
	if err := acct.writeFile(filepath.Join(dir, "userlist.txt"), []byte(`"postgres" "`+o.Password+`"`+"\n"), 0o600); err != nil {
		b.Close()
		return nil, b.errorf("configure", err)
	}
	for attempt := 1; ; attempt++ {
		if o.Port == 0 {
			if b.port, err = freePort(); err != nil {
				b.Close()
				return nil, b.errorf("start", err)
			}
		}
		if err := b.writeIni(); err != nil {
			b.Close()
			return nil, b.errorf("configure", err)
		}
		off := fileSize(b.logPath)
		err = b.launch(ctx, bin)
		if err == nil {
			return b, nil
		}
		if o.Port == 0 && attempt < 5 && ctx.Err() == nil && strings.Contains(logSince(b.logPath, off), "in use") {
			continue
		}
		b.Close()
		return nil, err
	}
}

// pastDeadline reports whether ctx has ended or reached its deadline: a dial cut by the
// deadline can return before ctx's own timer has ended it.
func pastDeadline(ctx context.Context) bool {
	dl, ok := ctx.Deadline()
	return ctx.Err() != nil || (ok && !time.Now().Before(dl))
}

// launch starts pgbouncer and waits until a query through it reaches Postgres.
func (b *Bouncer) launch(ctx context.Context, bin string) error {
	p, err := b.acct.start(b.dir, b.logPath, syscall.SIGKILL, bin, b.ini)
	if err != nil {
		return b.errorf("start", err)
	}
	var last error
	for {
		err := b.ping(ctx)
		if err == nil {
			b.proc = p
			return nil
		}
		if last == nil || !pastDeadline(ctx) { // keep the last failure that was not our deadline
			last = err
		}
		select {
		case <-p.done:
			return b.errorf("start", fmt.Errorf("pgbouncer exited: %v", p.err))
		case <-ctx.Done():
			_ = p.stop(context.Background(), syscall.SIGTERM, 5*time.Second)
			return b.errorf("start", fmt.Errorf("no query through it reached Postgres at %s: %w (last attempt: %v)", b.opts.Backend, ctx.Err(), last))
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// ping runs a query through the bouncer.
func (b *Bouncer) ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, b.URL("postgres")+"&default_query_exec_mode=simple_protocol&application_name=pgcluster")
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, "SELECT 1")
	return err
}

// writeIni writes pgbouncer.ini for b.backend and b.port.
func (b *Bouncer) writeIni() error {
	host, port, _ := net.SplitHostPort(b.backend)
	set := map[string]string{
		"listen_addr":        "127.0.0.1",
		"listen_port":        strconv.Itoa(b.port),
		"unix_socket_dir":    "",
		"auth_type":          "trust",
		"auth_file":          filepath.Join(b.dir, "userlist.txt"),
		"admin_users":        "postgres",
		"stats_users":        "postgres",
		"pool_mode":          b.opts.PoolMode,
		"default_pool_size":  strconv.Itoa(b.opts.DefaultPoolSize),
		"max_client_conn":    strconv.Itoa(b.opts.MaxClientConn),
		"server_login_retry": "1",
	}
	if b.opts.Password != "" {
		set["auth_type"] = "scram-sha-256"
	}
	if len(b.opts.IgnoreStartupParameters) > 0 {
		set["ignore_startup_parameters"] = strings.Join(b.opts.IgnoreStartupParameters, ",")
	}
	maps.Copy(set, b.opts.Settings)
	var s strings.Builder
	s.WriteString("; Written by internal/pgcluster; Retarget rewrites it.\n[databases]\n")
	fmt.Fprintf(&s, "* = host=%s port=%s\n\n[pgbouncer]\n", host, port)
	for _, k := range slices.Sorted(maps.Keys(set)) {
		fmt.Fprintf(&s, "%s = %s\n", k, set[k])
	}
	return b.acct.writeFile(b.ini, []byte(s.String()), 0o600)
}

// Addr is the bouncer's address, 127.0.0.1:PORT.
func (b *Bouncer) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port)) }

// Port is the bouncer's TCP port.
func (b *Bouncer) Port() int { return b.port }

// LogPath is the bouncer's log file.
func (b *Bouncer) LogPath() string { return b.logPath }

// URL is a connection URL for database db through the bouncer, as user postgres:
// postgres://postgres@127.0.0.1:PORT/db?sslmode=disable.
func (b *Bouncer) URL(db string) string {
	user := url.User("postgres")
	if b.opts.Password != "" {
		user = url.UserPassword("postgres", b.opts.Password)
	}
	u := url.URL{Scheme: "postgres", User: user, Host: b.Addr(), Path: "/" + db, RawQuery: "sslmode=disable"}
	return u.String()
}

// Backend is the host:port the bouncer routes to now.
func (b *Bouncer) Backend() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.backend
}

// Retarget routes the bouncer to another backend, as a virtual IP moving to a new primary
// would: it rewrites [databases] and RELOADs, so new server connections go to backend, and
// RECONNECTs, so each server connection to the old backend is closed as soon as its client
// releases it (at once if idle; at the end of the transaction in transaction mode). Server
// connections still held after a second (a session in session mode, a long transaction) are
// cut with KILL and RESUME, which also disconnects their databases' clients. When Retarget
// returns, no server connection to the old backend is left.
func (b *Bouncer) Retarget(ctx context.Context, backend string) error {
	if _, _, err := net.SplitHostPort(backend); err != nil {
		return b.errorf("retarget", err)
	}
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	b.mu.Lock()
	defer b.mu.Unlock()
	op := "retarget from " + b.backend + " to " + backend
	if b.proc == nil {
		return b.errorf(op, errors.New("not running"))
	}
	old := b.backend
	if sameAddr(old, backend) {
		return nil
	}
	b.backend = backend
	if err := b.writeIni(); err != nil {
		return b.errorf(op, err)
	}
	conn, err := b.admin(ctx)
	if err != nil {
		return b.errorf(op, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, cmd := range []string{"RELOAD", "RECONNECT"} {
		if _, err := conn.Exec(ctx, cmd); err != nil {
			return b.errorf(op, fmt.Errorf("%s: %w", cmd, err))
		}
	}
	stale, err := b.waitNoServers(ctx, conn, old, time.Now().Add(time.Second))
	if err != nil {
		return b.errorf(op, err)
	}
	for _, db := range stale {
		for _, cmd := range []string{"KILL ", "RESUME "} {
			if _, err := conn.Exec(ctx, cmd+db); err != nil { // the console takes a bare name
				return b.errorf(op, fmt.Errorf("%s%s: %w", cmd, db, err))
			}
		}
	}
	if len(stale) > 0 {
		if _, err := b.waitNoServers(ctx, conn, old, time.Time{}); err != nil {
			return b.errorf(op, err)
		}
	}
	return nil
}

// waitNoServers waits until SHOW SERVERS lists no connection to backend, or until the time
// until (if not zero), and returns the databases that still have one then. The time limit is
// not a ctx deadline because a deadline that expires mid-query closes the connection.
func (b *Bouncer) waitNoServers(ctx context.Context, conn *pgx.Conn, backend string, until time.Time) ([]string, error) {
	for {
		servers, err := showServers(ctx, conn)
		if err != nil {
			return nil, err
		}
		var stale []string
		for _, s := range servers {
			if sameAddr(net.JoinHostPort(s["addr"], s["port"]), backend) && !slices.Contains(stale, s["database"]) {
				stale = append(stale, s["database"])
			}
		}
		if len(stale) == 0 || !until.IsZero() && time.Now().After(until) {
			return stale, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for no server connection to %s: %w (databases with one: %v)", backend, ctx.Err(), stale)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// showServers returns SHOW SERVERS as one map of column to value per server connection.
func showServers(ctx context.Context, conn *pgx.Conn) ([]map[string]string, error) {
	rows, err := conn.Query(ctx, "SHOW SERVERS")
	if err != nil {
		return nil, fmt.Errorf("SHOW SERVERS: %w", err)
	}
	defer rows.Close()
	var out []map[string]string
	for rows.Next() {
		m := map[string]string{}
		for i, fd := range rows.FieldDescriptions() {
			m[fd.Name] = string(rows.RawValues()[i])
		}
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("SHOW SERVERS: %w", err)
	}
	return out, nil
}

// sameAddr compares host:port addresses, resolving a host name to its first address.
func sameAddr(a, b string) bool {
	norm := func(hp string) string {
		h, p, err := net.SplitHostPort(hp)
		if err != nil {
			return hp
		}
		if net.ParseIP(h) == nil {
			if addrs, err := net.LookupHost(h); err == nil && len(addrs) > 0 {
				h = addrs[0]
			}
		}
		return net.JoinHostPort(h, p)
	}
	return norm(a) == norm(b)
}

// admin connects to the admin console, which speaks only the simple query protocol.
func (b *Bouncer) admin(ctx context.Context) (*pgx.Conn, error) {
	conn, err := pgx.Connect(ctx, b.URL("pgbouncer")+"&default_query_exec_mode=simple_protocol&connect_timeout=5")
	if err != nil {
		return nil, fmt.Errorf("admin console: %w", err)
	}
	return conn, nil
}

// Close stops PgBouncer (SIGTERM: immediate shutdown in 1.18) and removes its dir if it is a
// temp dir. It may be called more than once.
func (b *Bouncer) Close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	b.closed = true
	if b.proc != nil {
		_ = b.proc.stop(context.Background(), syscall.SIGTERM, 5*time.Second)
		b.proc = nil
	}
	if b.temp {
		os.RemoveAll(b.dir)
	}
}

func (b *Bouncer) errorf(op string, err error) error {
	return fmt.Errorf("pgcluster: pgbouncer %s (%s): %s: %w%s", b.Addr(), b.dir, op, err, logTail(b.logPath))
}
