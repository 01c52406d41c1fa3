package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
)

func startBouncer(t *testing.T, o BouncerOptions) *Bouncer {
	t.Helper()
	began := time.Now()
	b, err := StartBouncer(testCtx(t), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	t.Logf("pgbouncer at %s -> %s in %v", b.Addr(), o.Backend, time.Since(began).Round(time.Millisecond))
	return b
}

// What pgx sends in its startup message by default: only user and database, nothing that
// PgBouncer would refuse. Parameters in the URL that pgx does not know become startup
// parameters.
func TestPgxStartupParameters(t *testing.T) {
	for _, k := range []string{"PGAPPNAME", "PGOPTIONS", "PGTZ", "PGCLIENTENCODING", "PGDATESTYLE"} {
		t.Setenv(k, "")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan map[string]string, 1)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			msg, err := pgproto3.NewBackend(c, c).ReceiveStartupMessage()
			if sm, ok := msg.(*pgproto3.StartupMessage); ok && err == nil {
				got <- sm.Parameters
			}
			c.Close()
		}
	}()
	base := "postgres://postgres@" + ln.Addr().String() + "/app?sslmode=disable&connect_timeout=2"
	for _, c := range []struct {
		query string
		want  []string
	}{
		{"", []string{"database", "user"}},
		{"&search_path=s&default_query_exec_mode=exec&statement_cache_capacity=0", []string{"database", "search_path", "user"}},
	} {
		conn, err := pgx.Connect(testCtx(t), base+c.query)
		if err == nil {
			conn.Close(context.Background())
		}
		var params map[string]string
		select {
		case params = <-got:
		case <-time.After(10 * time.Second):
			t.Fatal("no startup message")
		}
		keys := make([]string, 0, len(params))
		for k := range params {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		if !slices.Equal(keys, c.want) {
			t.Errorf("pgx with %q sends startup parameters %q, want %q", c.query, params, c.want)
		}
	}
}

// PgBouncer 1.18 refuses a startup parameter it does not track, unless it is listed in
// ignore_startup_parameters: then it is dropped, not passed on.
func TestBouncerStartupParameters(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pg := start(t, Options{})
	strict := startBouncer(t, BouncerOptions{Backend: pg.Addr()})
	lax := startBouncer(t, BouncerOptions{Backend: pg.Addr(), IgnoreStartupParameters: []string{"search_path", "extra_float_digits"}})

	// The parameters PgBouncer tracks are accepted and passed on.
	for _, c := range []struct{ param, show, want string }{
		{"application_name=kafkapg", "application_name", "kafkapg"},
		{"timezone=Asia/Tokyo", "TimeZone", "Asia/Tokyo"},
		{"client_encoding=LATIN1", "client_encoding", "LATIN1"},
		{"datestyle=German", "DateStyle", "German, DMY"},
	} {
		var got string
		if err := connect(t, strict.URL("postgres")+"&"+c.param).QueryRow(ctx, "SHOW "+c.show).Scan(&got); err != nil || got != c.want {
			t.Errorf("%s through pgbouncer: SHOW %s = %q, %v; want %q", c.param, c.show, got, err, c.want)
		}
	}

	for _, param := range []string{"search_path=s", "extra_float_digits=3", "options=-csearch_path%3Ds", "statement_timeout=1000"} {
		conn, err := pgx.Connect(ctx, strict.URL("postgres")+"&"+param)
		if err == nil {
			conn.Close(ctx)
			t.Fatalf("%s: accepted by pgbouncer without ignore_startup_parameters", param)
		}
		t.Logf("%s: %v", param, err)
		name, _, _ := strings.Cut(param, "=")
		if want := "unsupported startup parameter: " + name; !strings.Contains(err.Error(), want) || sqlState(err) != "08P01" {
			t.Errorf("%s: %v (SQLSTATE %q), want %q with SQLSTATE 08P01", param, err, sqlState(err), want)
		}
	}

	var path string
	if err := connect(t, lax.URL("postgres")+"&search_path=s").QueryRow(ctx, "SHOW search_path").Scan(&path); err != nil {
		t.Fatal(err)
	}
	if path != `"$user", public` {
		t.Errorf("search_path through pgbouncer ignoring it = %q, want the server's default", path)
	}
	if err := connect(t, pg.URL("postgres")+"&search_path=s").QueryRow(ctx, "SHOW search_path").Scan(&path); err != nil || path != "s" {
		t.Errorf("search_path straight to Postgres = %q, %v; want s", path, err)
	}
}

// pgx's default query mode prepares named statements ("stmtcache_<hash of the SQL>") per
// connection. Through transaction pooling two clients share one server connection, and the
// second one's Parse of the same SQL meets the first one's statement. cache_describe and exec
// use the unnamed statement and pass, even under concurrency.
func TestBouncerPreparedStatements(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pg := start(t, Options{})
	b := startBouncer(t, BouncerOptions{Backend: pg.Addr(), DefaultPoolSize: 1})

	const sql = "SELECT $1::int + 1"
	a, c := connect(t, b.URL("postgres")), connect(t, b.URL("postgres"))
	var n int
	if err := a.QueryRow(ctx, sql, 1).Scan(&n); err != nil {
		t.Fatalf("first client: %v", err)
	}
	err := c.QueryRow(ctx, sql, 1).Scan(&n)
	t.Logf("second client, pgx defaults: %v", err)
	if sqlState(err) != "42P05" || !strings.Contains(err.Error(), `prepared statement "stmtcache_`) {
		t.Fatalf("second client with pgx defaults: %v, want 42P05 prepared statement \"stmtcache_...\" already exists", err)
	}

	for _, mode := range []string{"cache_describe", "exec"} {
		t.Run(mode, func(t *testing.T) {
			pool := startBouncer(t, BouncerOptions{Backend: pg.Addr(), DefaultPoolSize: 2})
			errs := make(chan error, 4)
			for w := range 4 {
				go func() {
					errs <- func() error {
						conn, err := pgx.Connect(ctx, pool.URL("postgres")+"&default_query_exec_mode="+mode)
						if err != nil {
							return err
						}
						defer conn.Close(context.Background())
						for i := range 100 {
							var got int
							// Two texts, so that statements and descriptions are reused.
							if err := conn.QueryRow(ctx, fmt.Sprintf("SELECT $1::int + %d", i%2), i).Scan(&got); err != nil {
								return fmt.Errorf("client %d, query %d: %w", w, i, err)
							}
							if got != i+i%2 {
								return fmt.Errorf("client %d, query %d: got %d", w, i, got)
							}
						}
						return nil
					}()
				}()
			}
			for range 4 {
				if err := <-errs; err != nil {
					t.Error(err)
				}
			}
		})
	}
}

// LISTEN is session state: through transaction pooling the listening client's server
// connection goes back to the pool, and its notifications go to whichever client holds that
// connection when they arrive; here (one server connection) the notifier itself. Session
// pooling delivers them to the listener.
func TestBouncerListenNotify(t *testing.T) {
	t.Parallel()
	pg := start(t, Options{})
	for _, c := range []struct {
		mode      string
		poolSize  int
		delivered bool
	}{{"session", 2, true}, {"transaction", 1, false}} {
		t.Run(c.mode, func(t *testing.T) {
			ctx := testCtx(t)
			b := startBouncer(t, BouncerOptions{Backend: pg.Addr(), PoolMode: c.mode, DefaultPoolSize: c.poolSize})
			listener, notifier := connect(t, b.URL("postgres")), connect(t, b.URL("postgres"))
			if _, err := listener.Exec(ctx, "LISTEN ch"); err != nil {
				t.Fatal(err)
			}
			if _, err := notifier.Exec(ctx, "NOTIFY ch, 'hello'"); err != nil {
				t.Fatal(err)
			}
			wait, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			n, err := listener.WaitForNotification(wait)
			t.Logf("%s mode: notification %+v, %v", c.mode, n, err)
			switch {
			case c.delivered && (err != nil || n.Payload != "hello"):
				t.Fatalf("%s mode: %+v, %v; want the notification", c.mode, n, err)
			case !c.delivered && !errors.Is(err, context.DeadlineExceeded):
				t.Fatalf("%s mode: %+v, %v; want no notification", c.mode, n, err)
			}
			if !c.delivered {
				wait, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				n, err := notifier.WaitForNotification(wait)
				t.Logf("%s mode: the notifier got %+v, %v", c.mode, n, err)
				if err != nil || n.Payload != "hello" {
					t.Fatalf("%s mode: the notifier got %+v, %v; want the notification it sent", c.mode, n, err)
				}
			}
		})
	}
}

// Retarget moves a bouncer from server A to server B: the same client connection and new ones
// reach B, and A has no connection from the bouncer left.
func TestBouncerRetarget(t *testing.T) {
	t.Parallel()
	a, b := start(t, Options{}), start(t, Options{})
	serverPort := func(t *testing.T, conn *pgx.Conn) int {
		t.Helper()
		var port int
		if err := conn.QueryRow(testCtx(t), "SELECT inet_server_port()").Scan(&port); err != nil {
			t.Fatal(err)
		}
		return port
	}
	clientsOn := func(t *testing.T, s *Server) int {
		t.Helper()
		conn := connect(t, s.URL("postgres"))
		var n int
		if err := conn.QueryRow(testCtx(t), "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, mode := range []string{"transaction", "session"} {
		t.Run(mode, func(t *testing.T) {
			ctx := testCtx(t)
			bouncer := startBouncer(t, BouncerOptions{Backend: a.Addr(), PoolMode: mode})
			// exec mode: pgx's default statement cache would break on the switch (26000).
			url := bouncer.URL("postgres") + "&default_query_exec_mode=exec"
			held := connect(t, url)
			if got := serverPort(t, held); got != a.Port() {
				t.Fatalf("before Retarget: inet_server_port() = %d, want A's %d", got, a.Port())
			}
			cached := connect(t, bouncer.URL("postgres")) // pgx defaults
			const sql = "SELECT inet_server_port() + $1"
			var port int
			if err := cached.QueryRow(ctx, sql, 0).Scan(&port); err != nil {
				t.Fatal(err)
			}
			timed(t, "Retarget in "+mode+" mode", func() error { return bouncer.Retarget(ctx, b.Addr()) })
			if got := serverPort(t, connect(t, url)); got != b.Port() {
				t.Fatalf("new client after Retarget: inet_server_port() = %d, want B's %d", got, b.Port())
			}
			if n := clientsOn(t, a); n != 0 {
				t.Fatalf("after Retarget A still has %d client connections", n)
			}
			err := held.QueryRow(ctx, "SELECT inet_server_port()").Scan(&port)
			switch mode {
			case "transaction": // the client keeps its connection; its next transaction goes to B
				if err != nil || port != b.Port() {
					t.Fatalf("held client after Retarget: %d, %v; want B's %d", port, err, b.Port())
				}
				// A client with pgx's statement cache finds its statement missing on B, once;
				// pgx then forgets it and prepares it again.
				err := cached.QueryRow(ctx, sql, 0).Scan(&port)
				t.Logf("client with pgx's statement cache after Retarget: %v", err)
				if sqlState(err) != "26000" {
					t.Fatalf("client with pgx's statement cache after Retarget: %v, want SQLSTATE 26000", err)
				}
				if err := cached.QueryRow(ctx, sql, 0).Scan(&port); err != nil || port != b.Port() {
					t.Fatalf("client with pgx's statement cache, second try: %d, %v; want B's %d", port, err, b.Port())
				}
			case "session": // the session on A was cut
				if err == nil {
					t.Fatalf("held session after Retarget: reached port %d, want its connection cut", port)
				}
				t.Logf("held session after Retarget: %v", err)
			}
			if err := bouncer.Retarget(ctx, a.Addr()); err != nil {
				t.Fatal(err)
			}
			if got := serverPort(t, connect(t, url)); got != a.Port() {
				t.Fatalf("after Retarget back: inet_server_port() = %d, want A's %d", got, a.Port())
			}
		})
	}
}

func TestBouncerOptionErrors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		o    BouncerOptions
		want string
	}{
		{BouncerOptions{}, "Backend is required"},
		{BouncerOptions{Backend: "127.0.0.1"}, "Backend"},
		{BouncerOptions{Backend: "127.0.0.1:1", PoolMode: "pipelined"}, "PoolMode"},
	} {
		b, err := StartBouncer(testCtx(t), c.o)
		if err == nil {
			b.Close()
			t.Errorf("%+v: started", c.o)
		} else if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want it to mention %q", c.o, err, c.want)
		}
	}
	// A backend that is down: StartBouncer gives up at the deadline and says why.
	ctx, cancel := context.WithTimeout(testCtx(t), 2*time.Second)
	defer cancel()
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	b, err := StartBouncer(ctx, BouncerOptions{Backend: fmt.Sprintf("127.0.0.1:%d", port)})
	if err == nil {
		b.Close()
		t.Fatal("started in front of nothing")
	}
	t.Logf("backend down: %v", err)
	if !strings.Contains(err.Error(), "no query through it reached Postgres") {
		t.Errorf("backend down: %v", err)
	}
}

// PgBouncer's trust still looks the user up in auth_file.
func TestBouncerTrustNeedsAuthFile(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(testCtx(t), 3*time.Second)
	defer cancel()
	b, err := StartBouncer(ctx, BouncerOptions{Backend: "127.0.0.1:1", Settings: map[string]string{"auth_file": "/nonexistent"}})
	if err == nil {
		b.Close()
		t.Fatal("started without the user in auth_file")
	}
	if want := `FATAL: "trust" authentication failed`; !strings.Contains(err.Error(), want) {
		t.Fatalf("%v, want %q", err, want)
	}
}

// The admin console speaks only the simple query protocol.
func TestBouncerAdminConsole(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pg := start(t, Options{})
	b := startBouncer(t, BouncerOptions{Backend: pg.Addr()})
	var version string
	err := connect(t, b.URL("pgbouncer")).QueryRow(ctx, "SHOW VERSION").Scan(&version)
	t.Logf("SHOW VERSION, pgx defaults: %v", err)
	if err == nil {
		t.Fatal("the admin console took the extended protocol")
	}
	if err := connect(t, b.URL("pgbouncer")+"&default_query_exec_mode=simple_protocol").QueryRow(ctx, "SHOW VERSION").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if version != "PgBouncer 1.18.0" {
		t.Logf("note: the facts in doc.go were checked with PgBouncer 1.18.0; this is %s", version)
	}
}

// TestBouncerWithAPassword: in front of a server that asks for a password, the bouncer logs in
// to it with Password and asks every client for it too: no local user gets through it without
// it (a trust bouncer would hand the backend's superuser to anyone). Its URL carries it, and its
// admin console takes it.
func TestBouncerWithAPassword(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pg := start(t, Options{Password: "s3cret-bouncer"})
	b := startBouncer(t, BouncerOptions{Backend: pg.Addr(), Password: "s3cret-bouncer"})
	var one int
	if err := connect(t, b.URL("postgres")).QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
		t.Fatalf("through the bouncer with its URL: %v", err)
	}
	without := fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable&connect_timeout=5", b.Addr())
	if conn, err := pgx.Connect(ctx, without); err == nil {
		conn.Close(ctx)
		t.Fatal("a client without the password got through the bouncer")
	} else if !strings.Contains(err.Error(), "SASL auth") && !strings.Contains(err.Error(), "password") {
		t.Errorf("a client without the password was refused, but not for the want of one: %v", err)
	}
	var version string
	if err := connect(t, b.URL("pgbouncer")+"&default_query_exec_mode=simple_protocol").QueryRow(ctx, "SHOW VERSION").Scan(&version); err != nil {
		t.Fatalf("the admin console with the password: %v", err)
	}
}
