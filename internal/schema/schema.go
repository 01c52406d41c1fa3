// Package schema creates and upgrades kafkapg's own tables (offsets, outbox, ...) in their Postgres
// schema with embedded, numbered SQL migrations.
//
// Migrate is safe to run from many replicas at once: it works in one transaction that first takes
// an advisory lock keyed on the schema name, so concurrent callers run one after another and the
// later ones find nothing left to do.
//
// # The upgrade window
//
// A rolling update runs two releases side by side on one schema, and a rollback runs the release
// before on the schema this one migrated. The release before reads the newest version in
// schema_migrations and refuses a schema newer than it knows. So the migrations a release applies
// beyond what the release before knows (PreviousSchema) are recorded in schema_migrations_pending
// instead: the window is open while any is, and the release before still runs. Such migrations
// are expand migrations only — new tables, new nullable columns, indexes — that the release before
// runs beside. Finalize closes the window (an operator's step, once no process of the release
// before runs: see docs/upgrading.md): it records them in schema_migrations, after which the
// release before refuses the schema, naming it. A schema created afresh by this release has no
// release before to run beside: its migrations are final at once.
//
// A release that finds pending migrations newer than it knows runs beside them (it is the
// release before, in a newer one's window); one that finds finalized migrations newer than it
// knows refuses.
package schema

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migration is one numbered SQL file.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Migrations returns the embedded migrations in version order.
func Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	var ms []Migration
	for _, e := range entries {
		num, rest, ok := strings.Cut(e.Name(), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migration file %q: name must start with a positive version number and '_'", e.Name())
		}
		body, err := migrationFiles.ReadFile("migrations/" + e.Name())
		if err != nil {
			return nil, err
		}
		ms = append(ms, Migration{Version: v, Name: strings.TrimSuffix(rest, ".sql"), SQL: string(body)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].Version < ms[j].Version })
	for i, m := range ms {
		if m.Version != i+1 {
			return nil, fmt.Errorf("migrations must be numbered 1, 2, 3, ... without gaps; found %d at position %d", m.Version, i+1)
		}
	}
	return ms, nil
}

// Beginner starts transactions; *pgxpool.Pool and *pgx.Conn satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// PreviousSchema is the newest schema version the release before this one knows (f433fb8, whose
// processors run beside this release's on one schema while the window is open).
const PreviousSchema = 5

// Version is the newest schema version this binary knows.
func Version() int {
	ms, err := Migrations()
	if err != nil {
		return 0
	}
	return len(ms)
}

// Report is what Migrate did and found.
type Report struct {
	Applied   []Migration // applied now, in order
	Finalized int         // the newest version in schema_migrations
	Pending   []int       // the versions recorded in schema_migrations_pending: the window is open while there are any
	Converted []int       // versions a build before the window recorded as final, recorded as pending now
}

// Open reports whether the upgrade window is open: migrations the release before does not know
// were applied and not finalized.
func (r Report) Open() bool { return len(r.Pending) > 0 }

// Migrate applies every migration that schemaName does not have yet and returns the versions it
// applied. It creates the schema if needed.
func Migrate(ctx context.Context, db Beginner, schemaName string) ([]int, error) {
	r, err := migrate(ctx, db, schemaName, -1)
	return versions(r.Applied), err
}

// MigrateReport is Migrate, telling what it did and found.
func MigrateReport(ctx context.Context, db Beginner, schemaName string) (Report, error) {
	return migrate(ctx, db, schemaName, -1)
}

// MigrateTo is Migrate up to version upTo (all if negative), for tests of upgrades.
func MigrateTo(ctx context.Context, db Beginner, schemaName string, upTo int) ([]int, error) {
	r, err := migrate(ctx, db, schemaName, upTo)
	return versions(r.Applied), err
}

func versions(ms []Migration) []int {
	var out []int
	for _, m := range ms {
		out = append(out, m.Version)
	}
	return out
}

// begin takes the migration lock of schemaName in tx and makes sure the bookkeeping tables
// exist; it reports whether schema_migrations_pending had to be created (the schema's first
// migration by a release with the window).
func begin(ctx context.Context, tx pgx.Tx, schemaName string) (created bool, err error) {
	ident := pgx.Identifier{schemaName}.Sanitize()
	// Serialize concurrent migrators of the same schema. The lock is released at commit.
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('kafkapg.migrate:' || $1, 0))`, schemaName); err != nil {
		return false, fmt.Errorf("take migration lock: %w", err)
	}
	if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+ident); err != nil {
		return false, fmt.Errorf("create schema %s: %w", ident, err)
	}
	// Unqualified names in the migration files resolve to (and are created in) the schema. A
	// migration that must wait for a table's lock (a transaction of a running processor holds
	// it) gives up after LockTimeout rather than queue everyone's statements behind it for as
	// long: migrate tries again.
	if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+ident+`; SET LOCAL lock_timeout = `+strconv.FormatInt(LockTimeout.Milliseconds(), 10)); err != nil {
		return false, err
	}
	if err := tx.QueryRow(ctx, `SELECT to_regclass('schema_migrations_pending') IS NULL`).Scan(&created); err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
			version    integer     PRIMARY KEY,
			name       text        NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now()
		);
		CREATE TABLE IF NOT EXISTS schema_migrations_pending (
			version    integer     PRIMARY KEY,
			name       text        NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now()
		)`); err != nil {
		return false, fmt.Errorf("create schema_migrations: %w", err)
	}
	return created, nil
}

// state reads the newest finalized version and the pending ones.
func state(ctx context.Context, tx pgx.Tx) (finalized int, pending []int, err error) {
	if err := tx.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM schema_migrations`).Scan(&finalized); err != nil {
		return 0, nil, err
	}
	rows, _ := tx.Query(ctx, `SELECT version FROM schema_migrations_pending ORDER BY version`)
	pending, err = pgx.CollectRows(rows, pgx.RowTo[int])
	return finalized, pending, err
}

// LockTimeout is how long a migration waits for a lock on one of kafkapg's tables before it
// gives up and tries again (lockTries times, a second apart): processors running beside it (the
// release before, during an upgrade) wait at most that long behind it.
var LockTimeout = 2 * time.Second

const lockTries = 30

// migrate is Migrate up to version upTo (all if negative), trying again while a lock it needs is
// held too long.
func migrate(ctx context.Context, db Beginner, schemaName string, upTo int) (Report, error) {
	for try := 1; ; try++ {
		r, err := migrateOnce(ctx, db, schemaName, upTo)
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55P03" || try == lockTries {
			return r, err
		}
		select { // lock_not_available: a running transaction holds a table's lock
		case <-ctx.Done():
			return r, err
		case <-time.After(time.Second):
		}
	}
}

// migrateOnce is one try of migrate.
func migrateOnce(ctx context.Context, db Beginner, schemaName string, upTo int) (Report, error) {
	if schemaName == "" {
		return Report{}, fmt.Errorf("schema name is empty")
	}
	ms, err := Migrations()
	if err != nil {
		return Report{}, err
	}
	all := len(ms)
	if upTo >= 0 {
		ms = ms[:min(upTo, len(ms))]
	}
	ident := pgx.Identifier{schemaName}.Sanitize()

	var r Report
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		r = Report{}
		created, err := begin(ctx, tx, schemaName)
		if err != nil {
			return err
		}
		finalized, pending, err := state(ctx, tx)
		if err != nil {
			return err
		}
		if created && finalized > PreviousSchema && finalized <= all {
			// Recorded as final by a build before the window: no release finalized them, and the
			// release before may still run. Pending, they let it.
			rows, _ := tx.Query(ctx, `WITH moved AS (DELETE FROM schema_migrations WHERE version > $1 RETURNING version, name, applied_at)
				INSERT INTO schema_migrations_pending SELECT * FROM moved RETURNING version`, PreviousSchema)
			if r.Converted, err = pgx.CollectRows(rows, pgx.RowTo[int]); err != nil {
				return fmt.Errorf("record the migrations past %d as pending: %w", PreviousSchema, err)
			}
			slices.Sort(r.Converted)
			if finalized, pending, err = state(ctx, tx); err != nil {
				return err
			}
		}
		if finalized > all {
			return fmt.Errorf("schema %s is at version %d, finalized for a newer release than this binary knows (%d): upgrade kafkapg; "+
				"this release can no longer run on it (rolling back past a finalized upgrade takes restoring the database from before it)", ident, finalized, all)
		}
		current := finalized
		if len(pending) > 0 {
			current = max(current, pending[len(pending)-1])
		}
		fresh := current == 0
		for _, m := range ms[min(current, len(ms)):] {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("migration %d (%s): %w", m.Version, m.Name, err)
			}
			table := "schema_migrations"
			if !fresh && m.Version > PreviousSchema {
				table, pending = "schema_migrations_pending", append(pending, m.Version)
			} else {
				finalized = m.Version
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+table+` (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
				return err
			}
			r.Applied = append(r.Applied, m)
		}
		r.Finalized, r.Pending = finalized, pending
		if len(pending) > 0 {
			// The release before looks keys up in idempotency_keys only: while the window is
			// open, the key ring looks there too and keeps it (a build before the window may have
			// emptied it and stopped looking).
			if _, err := tx.Exec(ctx, `DO $$ BEGIN
				IF to_regclass('idempotency_ring') IS NOT NULL THEN UPDATE idempotency_ring SET legacy = 0 WHERE legacy <> 0; END IF;
			END $$`); err != nil {
				return fmt.Errorf("look the release before's keys up while the window is open: %w", err)
			}
		}
		return nil
	})
	if err != nil {
		return Report{}, fmt.Errorf("migrate schema %s: %w", ident, err)
	}
	return r, nil
}

// Finalize closes the upgrade window of schemaName: the pending migrations become final, and the
// release before refuses the schema from then on. It returns the versions finalized (none if the
// window was closed). It refuses pending migrations newer than this binary knows (a newer
// release's window: finalize with that release).
func Finalize(ctx context.Context, db Beginner, schemaName string) ([]int, error) {
	ms, err := Migrations()
	if err != nil {
		return nil, err
	}
	var moved []int
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := begin(ctx, tx, schemaName); err != nil {
			return err
		}
		_, pending, err := state(ctx, tx)
		if err != nil {
			return err
		}
		if len(pending) > 0 && pending[len(pending)-1] > len(ms) {
			return fmt.Errorf("migration %d is pending, newer than this binary knows (%d): finalize with the release that applied it", pending[len(pending)-1], len(ms))
		}
		rows, _ := tx.Query(ctx, `WITH moved AS (DELETE FROM schema_migrations_pending RETURNING version, name, applied_at)
			INSERT INTO schema_migrations SELECT * FROM moved RETURNING version`)
		if moved, err = pgx.CollectRows(rows, pgx.RowTo[int]); err != nil {
			return err
		}
		slices.Sort(moved)
		if len(moved) > 0 {
			// Events the release before applied were keyed, not numbered: every group decides
			// numbered events by key as well for a retention more; and every group that numbers
			// the events it emits numbers them Keyed for as long (sink.Stream.Keyed), as the
			// release before may have emitted them unnumbered in a commit its database loses.
			if _, err := tx.Exec(ctx, `DO $$ BEGIN
				IF to_regclass('idempotency_groups') IS NOT NULL THEN
					INSERT INTO idempotency_groups (consumer_group, keys_all_until)
						SELECT DISTINCT consumer_group, now() FROM outbox_streams
						ON CONFLICT (consumer_group) DO NOTHING;
					UPDATE idempotency_groups SET keys_all_until = greatest(keys_all_until,
						now() + coalesce((SELECT max(retention) FROM idempotency_retention), interval '7 days'));
				END IF;
			END $$`); err != nil {
				return fmt.Errorf("extend the groups' windows of keys: %w", err)
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("finalize schema %s: %w", pgx.Identifier{schemaName}.Sanitize(), err)
	}
	return moved, nil
}

// Window reads schemaName's upgrade window: the newest finalized version and the pending ones
// (none: closed). A schema never migrated reads as 0 and none.
func Window(ctx context.Context, q Querier, schemaName string) (finalized int, pending []int, err error) {
	ident := pgx.Identifier{schemaName}.Sanitize()
	var exists bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, ident+".schema_migrations_pending").Scan(&exists); err != nil {
		return 0, nil, err
	}
	if !exists {
		return 0, nil, nil
	}
	if err := q.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM `+ident+`.schema_migrations`).Scan(&finalized); err != nil {
		return 0, nil, err
	}
	rows, _ := q.Query(ctx, `SELECT version FROM `+ident+`.schema_migrations_pending ORDER BY version`)
	pending, err = pgx.CollectRows(rows, pgx.RowTo[int])
	return finalized, pending, err
}

// Querier runs queries; *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}
