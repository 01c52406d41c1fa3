// Package schema creates and upgrades kafkapg's own tables (offsets, outbox, ...) in their Postgres
// schema with embedded, numbered SQL migrations.
//
// Migrate is safe to run from many replicas at once: it works in one transaction that first takes
// an advisory lock keyed on the schema name, so concurrent callers run one after another and the
// later ones find nothing left to do.
package schema

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
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

// Migrate applies every migration that schemaName does not have yet and returns the versions it
// applied. It creates the schema if needed.
func Migrate(ctx context.Context, db Beginner, schemaName string) ([]int, error) {
	return migrate(ctx, db, schemaName, -1)
}

// MigrateTo is Migrate up to version upTo (all if negative), for tests of upgrades.
func MigrateTo(ctx context.Context, db Beginner, schemaName string, upTo int) ([]int, error) {
	return migrate(ctx, db, schemaName, upTo)
}

// migrate is Migrate up to version upTo (all if negative).
func migrate(ctx context.Context, db Beginner, schemaName string, upTo int) ([]int, error) {
	if schemaName == "" {
		return nil, fmt.Errorf("schema name is empty")
	}
	ms, err := Migrations()
	if err != nil {
		return nil, err
	}
	all := len(ms)
	if upTo >= 0 {
		ms = ms[:min(upTo, len(ms))]
	}
	ident := pgx.Identifier{schemaName}.Sanitize()

	var applied []int
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		// Serialize concurrent migrators of the same schema. The lock is released at commit.
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('kafkapg.migrate:' || $1, 0))`, schemaName); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+ident); err != nil {
			return fmt.Errorf("create schema %s: %w", ident, err)
		}
		// Unqualified names in the migration files resolve to (and are created in) the schema.
		if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+ident); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
			version    integer     PRIMARY KEY,
			name       text        NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now()
		)`); err != nil {
			return fmt.Errorf("create schema_migrations: %w", err)
		}
		var current int
		if err := tx.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM schema_migrations`).Scan(&current); err != nil {
			return err
		}
		if current > all {
			return fmt.Errorf("schema %s is at version %d, newer than this binary knows (%d): upgrade kafkapg", ident, current, all)
		}
		if current > len(ms) {
			return nil
		}
		for _, m := range ms[current:] {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("migration %d (%s): %w", m.Version, m.Name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
				return err
			}
			applied = append(applied, m.Version)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("migrate schema %s: %w", ident, err)
	}
	return applied, nil
}
