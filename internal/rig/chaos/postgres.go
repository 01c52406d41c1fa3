package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/pgcluster"
	"github.com/kafkapg/kafkapg/internal/rig/faultproxy"
)

// The Postgres topologies the suite runs against (-postgres).
const (
	pgDirect    = "direct"                // DATABASE_URL, through a fault proxy
	pgBouncer   = "pgbouncer"             // DATABASE_URL behind PgBouncer in transaction mode, through a fault proxy
	pgSyncHA    = "sync-standby"          // a primary and a synchronous standby of the suite's own, failed over
	pgAsyncHA   = "async-standby"         // the same with an asynchronous standby: commits can vanish
	pgRestore   = "same-identity-restore" // a server of the suite's own, restored from copies of its data dir: commits vanish, same identity
	pgDatabase  = "kafkapg"               // the database of the suite's own servers
	bouncerPool = 10                      // PgBouncer's server sessions: fewer than the processors' connections
)

// database is the suite's Postgres: where it is, how the processors reach it, and the proxies
// that every Postgres fault cuts, drops or stalls.
type database struct {
	mode    string
	proxies []*faultproxy.Proxy
	// urls are the processors' DATABASE_URLs: processor i gets urls[i%len(urls)].
	urls []string

	bouncer *pgcluster.Bouncer // pgbouncer

	// The failover topologies: two servers, one of them the primary, and the address that moves
	// to whichever is (vip). The proxies in front of each server (byServer) serve the multi-host
	// URL, which finds the primary itself (target_session_attrs=read-write).
	servers  [2]*pgcluster.Server
	byServer [2]*faultproxy.Proxy
	primary  int
	vip      *faultproxy.Proxy

	restores *restoreState // same-identity-restore: servers[0], restored from copies of its data dir
}

func (d *database) failover() bool { return d.mode == pgSyncHA || d.mode == pgAsyncHA }

// url returns processor (or command) i's DATABASE_URL.
func (d *database) url(i int) string { return d.urls[i%len(d.urls)] }

// describe says, for the summary, how the processors reach Postgres.
func (d *database) describe() string {
	switch d.mode {
	case pgBouncer:
		return fmt.Sprintf("postgres behind pgbouncer (transaction mode, %d server sessions)", bouncerPool)
	case pgSyncHA, pgAsyncHA:
		kind := "a synchronous"
		if d.mode == pgAsyncHA {
			kind = "an asynchronous"
		}
		return "postgres primary with " + kind + " standby, processors by a multi-host URL (target_session_attrs=read-write) and by an address that moves to the primary"
	case pgRestore:
		return "postgres restored from copies of its data directory taken while it ran (same system identifier and timeline), processors through a proxy"
	}
	return "postgres direct"
}

func (d *database) cut() {
	for _, p := range d.proxies {
		p.Cut()
	}
}

func (d *database) drop() {
	for _, p := range d.proxies {
		p.Drop()
	}
}

func (d *database) stall() {
	for _, p := range d.proxies {
		p.Stall()
	}
}

func (d *database) restore() {
	for _, p := range d.proxies {
		p.Restore()
	}
}

func (d *database) close() {
	for _, p := range d.proxies {
		p.Close()
	}
	if d.bouncer != nil {
		d.bouncer.Close()
	}
	for _, srv := range d.servers {
		if srv != nil {
			srv.Close()
		}
	}
}

// setupPostgres sets up the topology and the suite's own pool (direct to Postgres, or to the
// primary whichever it is), in a fresh schema.
func (s *suite) setupPostgres(ctx context.Context, dbURL string) error {
	d := &database{mode: s.cfg.postgres}
	s.db = d
	var direct string
	var err error
	switch d.mode {
	case pgDirect, pgBouncer:
		if dbURL == "" {
			return errors.New("DATABASE_URL is not set: run `make chaos`, which starts a throwaway Postgres")
		}
		u, err := url.Parse(dbURL)
		if err != nil {
			return fmt.Errorf("DATABASE_URL: %w", err)
		}
		pgAddr := u.Host
		if u.Port() == "" {
			pgAddr = net.JoinHostPort(u.Hostname(), "5432")
		}
		target := pgAddr
		if d.mode == pgBouncer {
			pw, _ := u.User.Password() // make chaos's throwaway Postgres asks for one
			if d.bouncer, err = pgcluster.StartBouncer(ctx, pgcluster.BouncerOptions{
				Dir: filepath.Join(s.work, "pgbouncer"), Backend: pgAddr, PoolMode: "transaction",
				DefaultPoolSize: bouncerPool, MaxClientConn: 500, Password: pw,
			}); err != nil {
				return err
			}
			target = d.bouncer.Addr()
		}
		p, err := faultproxy.Listen("127.0.0.1:0", target)
		if err != nil {
			return err
		}
		d.proxies = []*faultproxy.Proxy{p}
		if direct, err = localrun.PostgresURL(dbURL, "", schema); err != nil {
			return err
		}
		procURL, err := localrun.PostgresURL(dbURL, p.Addr(), schema)
		if err != nil {
			return err
		}
		if d.mode == pgBouncer {
			// PgBouncer refuses startup parameters it does not know (search_path among them):
			// the schema is the database's default instead, as teams behind PgBouncer set it.
			procURL = withoutParam(procURL, "search_path")
		}
		d.urls = []string{procURL}
	case pgSyncHA, pgAsyncHA:
		if err := s.startServers(ctx); err != nil {
			return err
		}
		hosts := func(a, b string) string {
			return fmt.Sprintf("postgres://postgres@%s,%s/%s?sslmode=disable&target_session_attrs=read-write&search_path=%s", a, b, pgDatabase, schema)
		}
		direct = hosts(d.servers[0].Addr(), d.servers[1].Addr())
		d.urls = []string{
			hosts(d.byServer[0].Addr(), d.byServer[1].Addr()),
			fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&search_path=%s", d.vip.Addr(), pgDatabase, schema),
		}
	case pgRestore:
		if err := s.startRestorable(ctx); err != nil {
			return err
		}
		srv := d.servers[0]
		direct = fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&search_path=%s", srv.Addr(), pgDatabase, schema)
		d.urls = []string{fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&search_path=%s", d.proxies[0].Addr(), pgDatabase, schema)}
	default:
		return fmt.Errorf("-postgres must be %s, %s, %s, %s or %s, got %q", pgDirect, pgBouncer, pgSyncHA, pgAsyncHA, pgRestore, d.mode)
	}
	if s.pool, err = pgxpool.New(ctx, direct); err != nil {
		return err
	}
	if _, err := s.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+schema+` CASCADE; CREATE SCHEMA `+schema); err != nil {
		return fmt.Errorf("create schema %s: %w", schema, err)
	}
	if d.mode == pgBouncer {
		if _, err := s.pool.Exec(ctx, `DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET search_path TO `+schema+`', current_database()); END $$`); err != nil {
			return fmt.Errorf("set the database's search_path: %w", err)
		}
	}
	return nil
}

// withoutParam removes a query parameter from a URL.
func withoutParam(raw, name string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return raw
	}
	q := u.Query()
	q.Del(name)
	u.RawQuery = q.Encode()
	return u.String()
}

// startServers starts the failover topologies' primary and standby, and their proxies.
func (s *suite) startServers(ctx context.Context) error {
	d := s.db
	settings := map[string]string{"max_connections": "300", "shared_buffers": "128MB", "wal_keep_size": "256MB"}
	primary, err := pgcluster.Start(ctx, pgcluster.Options{Dir: filepath.Join(s.work, "pg-a"), Settings: settings})
	if err != nil {
		return err
	}
	d.servers[0] = primary
	if err := primary.CreateDatabase(ctx, pgDatabase); err != nil {
		return err
	}
	standby, err := primary.Standby(ctx, pgcluster.Options{Dir: filepath.Join(s.work, "pg-b"), Settings: settings})
	if err != nil {
		return err
	}
	d.servers[1] = standby
	if d.mode == pgSyncHA {
		if err := primary.SetSynchronous(ctx, standby.Name()); err != nil {
			return err
		}
	}
	for i, srv := range d.servers {
		if d.byServer[i], err = faultproxy.Listen("127.0.0.1:0", srv.Addr()); err != nil {
			return err
		}
	}
	if d.vip, err = faultproxy.Listen("127.0.0.1:0", primary.Addr()); err != nil {
		return err
	}
	d.proxies = []*faultproxy.Proxy{d.byServer[0], d.byServer[1], d.vip}
	return nil
}

// pgFailover kills the primary (an immediate stop: a crash) and promotes the standby; the
// address the odd processors use moves to it, the multi-host URL of the even ones finds it. With
// an asynchronous standby, the standby is stopped for a moment first, so that it lags behind the
// primary when the primary dies: the commits it has not received are lost with it. The old
// primary then rejoins as the new primary's standby (synchronous again, in that mode), so that
// the next failover can follow. It measures, in the background, how long after the kill the
// processors commit again (alone: before it returns, as the failover measured with nothing else
// broken), and checks what the new primary kept.
func (s *suite) pgFailover(ctx context.Context, alone bool) error {
	d := s.db
	old, next := d.servers[d.primary], d.servers[1-d.primary]
	if d.mode == pgAsyncHA {
		if err := next.Stop(ctx); err != nil {
			return err
		}
		if err := sleep(ctx, time.Duration(1000+s.rng.IntN(2000))*time.Millisecond); err != nil {
			return err
		}
	}
	var before int64
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(&before); err != nil {
		return fmt.Errorf("count the applied events before the failover: %w", err)
	}
	if err := old.Kill(ctx); err != nil {
		return err
	}
	killed := time.Now()
	if d.mode == pgAsyncHA {
		if err := next.Start(ctx); err != nil {
			return err
		}
	}
	if err := next.Promote(ctx); err != nil {
		return err
	}
	d.vip.Retarget(next.Addr())
	d.primary = 1 - d.primary
	promoted := time.Since(killed)

	var after int64
	if err := localrun.WaitFor(ctx, 30*time.Second, func() error {
		return s.pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(&after)
	}); err != nil {
		return fmt.Errorf("count the applied events after the failover: %w", err)
	}
	lost := max(before-after, 0)
	s.count(func(st *stats) {
		st.failovers++
		st.lostRows += lost
		st.promote = append(st.promote, promoted)
		if d.mode == pgSyncHA && lost > 0 {
			st.violations = append(st.violations, fmt.Sprintf("failover %d: the synchronous standby lacked %d applied events the primary had committed", st.failovers, lost))
		}
	})
	measure := func() {
		dur, ok := s.waitCommits(ctx, killed)
		s.count(func(st *stats) {
			switch {
			case ok && alone:
				st.alone.failover = dur
			case ok:
				st.failoverRecovery = append(st.failoverRecovery, dur)
			default:
				st.unmeasured++
			}
		})
	}
	if alone {
		measure()
	} else {
		s.bg.Add(1)
		go func() {
			defer s.bg.Done()
			measure()
		}()
	}

	// The old primary comes back as the new one's standby.
	if err := old.Follow(ctx, next); err != nil {
		return err
	}
	if d.mode == pgSyncHA {
		return next.SetSynchronous(ctx, old.Name())
	}
	return nil
}
