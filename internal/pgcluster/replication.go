package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Standby copies s (pg_basebackup -X stream, a fast checkpoint) into o.Dir, which must not
// hold a cluster yet, and starts the copy as a hot standby that streams from s, on its own
// port, with application_name Name(). It returns once the standby accepts connections; it may
// not have replayed everything yet (see WaitReplayed).
//
// The standby's settings are s's Options.Settings overridden by o.Settings (a hot standby
// needs max_connections and the like at least as high as its primary's); Durable and TLS are
// o's. The copy does not inherit s's synchronous_standby_names: promoted, it does not wait for
// standbys until SetSynchronous says so.
func (s *Server) Standby(ctx context.Context, o Options) (*Server, error) {
	settings := maps.Clone(s.opts.Settings)
	if settings == nil {
		settings = map[string]string{}
	}
	maps.Copy(settings, o.Settings)
	o.Settings = settings
	if o.Password == "" {
		o.Password = s.opts.Password
	}
	sb, err := newServer(o)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(sb.data, "PG_VERSION")); err == nil {
		sb.Close()
		return nil, fmt.Errorf("pgcluster: Standby: Options.Dir %s already holds a cluster; use Follow to replace it", sb.dir)
	}
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	if err := sb.copyFrom(ctx, s); err != nil {
		sb.Close()
		return nil, err
	}
	if err := sb.boot(ctx); err != nil {
		sb.Close()
		return nil, err
	}
	return sb, nil
}

// copyFrom replaces s's data dir by a base backup of primary, configured as its standby.
func (s *Server) copyFrom(ctx context.Context, primary *Server) error {
	if err := os.RemoveAll(s.data); err != nil {
		return s.errorf("remove old data dir", err)
	}
	args := []string{"-d", primary.conninfo("pgcluster_basebackup"), "-D", s.data, "-X", "stream", "-c", "fast"}
	if !s.opts.Durable {
		args = append(args, "--no-sync")
	}
	logPath := filepath.Join(s.dir, "pg_basebackup.log")
	if err := s.acct.run(ctx, s.dir, logPath, filepath.Join(s.bin, "pg_basebackup"), args...); err != nil {
		return s.errorf("pg_basebackup from "+primary.Name()+" ("+primary.Addr()+")", err)
	}
	s.primary = primary
	if err := errors.Join(
		s.acct.writeFileIn(s.dir, filepath.Join("data", "standby.signal"), nil, 0o600),
		s.dropAutoSettings("synchronous_standby_names", "primary_conninfo"),
		s.writeConfig(),
	); err != nil {
		return s.errorf("configure standby", err)
	}
	return nil
}

// dropAutoSettings removes settings from the copied postgresql.auto.conf (what ALTER SYSTEM
// set on the primary), so that the rig's config for this server decides them.
func (s *Server) dropAutoSettings(names ...string) error {
	path := filepath.Join("data", "postgresql.auto.conf")
	root, err := os.OpenRoot(s.dir) // the account's dir: no symlink out of it is followed
	if err != nil {
		return err
	}
	defer root.Close()
	b, err := root.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var kept []string
	for line := range strings.Lines(string(b)) {
		name, _, _ := strings.Cut(strings.TrimSpace(line), "=")
		if !slices.Contains(names, strings.TrimSpace(name)) {
			kept = append(kept, line)
		}
	}
	return s.acct.writeFileIn(s.dir, path, []byte(strings.Join(kept, "")), 0o600)
}

// Follow makes s a standby of primary: s is stopped (immediately, if it still runs), its data
// dir is replaced by a base backup of primary, and it is started on its own port. This is how
// a former primary rejoins after a failover; whatever it had that primary lacks is gone, as
// after pg_rewind.
func (s *Server) Follow(ctx context.Context, primary *Server) error {
	if primary == s {
		return s.errorf("follow", errors.New("a server cannot follow itself"))
	}
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return s.errorf("follow", errors.New("closed"))
	}
	if s.proc != nil {
		err := s.proc.stop(ctx, syscall.SIGQUIT, 10*time.Second)
		s.proc = nil
		if err != nil {
			return s.errorf("follow: stop", err)
		}
	}
	if err := s.copyFrom(ctx, primary); err != nil {
		return err
	}
	return s.launch(ctx)
}

// SetSynchronous makes s's commits wait for the first connected standby of standbyNames
// (synchronous_standby_names = 'FIRST 1 (...)'), or, with no names, for no standby. It sets
// this with ALTER SYSTEM, reloads, and returns once pg_stat_replication shows one of the named
// standbys as sync (so that standby must be streaming), or none as sync.
func (s *Server) SetSynchronous(ctx context.Context, standbyNames ...string) error {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	value := ""
	if len(standbyNames) > 0 {
		quoted := make([]string, len(standbyNames))
		for i, n := range standbyNames {
			quoted[i] = `"` + strings.ReplaceAll(n, `"`, `""`) + `"`
		}
		value = "FIRST 1 (" + strings.Join(quoted, ", ") + ")"
	}
	op := fmt.Sprintf("set synchronous_standby_names = '%s'", value)
	conn, err := s.connect(ctx, "postgres")
	if err != nil {
		return s.errorf(op, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "ALTER SYSTEM SET synchronous_standby_names = "+quoteLiteral(value)); err != nil {
		return s.errorf(op, err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return s.errorf(op, err)
	}
	err = poll(ctx, 20*time.Millisecond, "pg_stat_replication to agree", func() (bool, string, error) {
		var setting string
		if err := conn.QueryRow(ctx, "SELECT current_setting('synchronous_standby_names')").Scan(&setting); err != nil {
			return false, "", err
		}
		rows, _ := conn.Query(ctx, "SELECT application_name || '=' || sync_state, application_name, sync_state FROM pg_stat_replication")
		type standby struct{ Desc, App, State string }
		standbys, err := pgx.CollectRows(rows, pgx.RowToStructByPos[standby])
		if err != nil {
			return false, "", err
		}
		done := setting == value
		if len(standbyNames) > 0 {
			done = done && slices.ContainsFunc(standbys, func(sb standby) bool {
				return sb.State == "sync" && slices.Contains(standbyNames, sb.App)
			})
		} else {
			done = done && !slices.ContainsFunc(standbys, func(sb standby) bool { return sb.State != "async" })
		}
		var descs []string
		for _, sb := range standbys {
			descs = append(descs, sb.Desc)
		}
		return done, fmt.Sprintf("synchronous_standby_names = '%s', standbys %v", setting, descs), nil
	})
	if err != nil {
		return s.errorf(op, err)
	}
	return nil
}

// quoteLiteral quotes a string as an SQL literal (standard_conforming_strings is on).
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// Promote ends recovery on a standby (pg_promote, as pg_ctl promote does) and returns once
// pg_is_in_recovery() is false: s is then a primary on a new timeline.
func (s *Server) Promote(ctx context.Context) error {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	conn, err := s.connect(ctx, "postgres")
	if err != nil {
		return s.errorf("promote", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "SELECT pg_promote(wait => false)"); err != nil {
		return s.errorf("promote", err)
	}
	err = poll(ctx, 20*time.Millisecond, "pg_is_in_recovery() to be false", func() (bool, string, error) {
		var in bool
		err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&in)
		return !in, "in recovery", err
	})
	if err != nil {
		return s.errorf("promote", err)
	}
	return nil
}

// WaitReplayed waits until s, a standby, has replayed the WAL that from has now: from's
// pg_current_wal_lsn() (or, if from is a standby too, its replay position). Everything
// committed on from before the call is then visible on s.
func (s *Server) WaitReplayed(ctx context.Context, from *Server) error {
	ctx, cancel := withDefaultTimeout(ctx)
	defer cancel()
	op := "wait to replay " + from.Name() + "'s WAL"
	var target string
	err := func() error {
		conn, err := from.connect(ctx, "postgres")
		if err != nil {
			return err
		}
		defer conn.Close(context.WithoutCancel(ctx))
		return conn.QueryRow(ctx, "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)::text").Scan(&target)
	}()
	if err != nil {
		return s.errorf(op, fmt.Errorf("WAL position of %s: %w", from.Name(), err))
	}
	conn, err := s.connect(ctx, "postgres")
	if err != nil {
		return s.errorf(op, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	err = poll(ctx, 10*time.Millisecond, "replay up to "+target, func() (bool, string, error) {
		var in, done bool
		var replayed *string
		err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text, coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", target).Scan(&in, &replayed, &done)
		switch {
		case err != nil:
			return false, "", err
		case !in:
			return false, "", errors.New("not a standby (pg_is_in_recovery() is false)")
		}
		return done, "replayed up to " + deref(replayed), nil
	})
	if err != nil {
		return s.errorf(op, err)
	}
	return nil
}

func deref(p *string) string {
	if p == nil {
		return "NULL"
	}
	return *p
}
