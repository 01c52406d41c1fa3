// Package pooler finds out whether connections reach Postgres through a connection pooler in
// transaction mode (PgBouncer, and poolers like it: pgcat, Odyssey, RDS Proxy, Supavisor), where
// each transaction of a client may run on another server session, and says what that means for
// pgx.
//
// Through such a pooler, anything scoped to a server session outlives the client's transaction
// on a session another client gets next: pgx's default query mode (named prepared statements,
// cached per client connection) fails with `prepared statement "stmtcache_…" already exists`
// (42P05) or `does not exist` (26000), LISTEN hears nothing, and session settings leak. kafkapg
// uses only transaction-scoped settings (SET LOCAL) and advisory locks (pg_advisory_xact_lock); it
// needs a query mode without named statements and polls instead of LISTENing.
package pooler

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Kind is how a client's connection reaches Postgres.
type Kind int

const (
	// Direct: a connection is one server session for its whole life (Postgres itself, or a pooler
	// in session mode).
	Direct Kind = iota
	// Transaction: a pooler in transaction mode; each transaction may run on another session.
	Transaction
	// Statement: a pooler in statement mode, which refuses transactions of more than one
	// statement: kafkapg cannot work through it.
	Statement
	// Pooler: a pooler whose transactions were not seen to change sessions: in session mode, or
	// in transaction mode without showing it this time (its other clients took the sessions the
	// probe's were given). What works in transaction mode is the safe choice.
	Pooler
)

func (k Kind) String() string {
	switch k {
	case Transaction:
		return "a pooler in transaction mode"
	case Statement:
		return "a pooler in statement mode"
	case Pooler:
		return "a pooler (session or transaction mode)"
	}
	return "direct"
}

// ErrStatementMode says that Postgres is reached through a pooler in statement mode.
var ErrStatementMode = errors.New("postgres is reached through a connection pooler in statement mode, which refuses transactions: " +
	"kafkapg commits each batch's effects and its offset in one transaction; use the pooler's transaction or session mode")

// wait is how long the probe waits for a statement that a direct session runs at once (see Detect).
const wait = 2 * time.Second

// Found is what Detect found.
type Found struct {
	Kind Kind
	// PreparedStatements says, for a pooler in transaction mode, that a statement a client
	// prepared is still there for it on another server session: the pooler keeps prepared
	// statements itself (PgBouncer 1.21 and later with max_prepared_statements > 0), and pgx's
	// default query mode works through it.
	PreparedStatements bool
}

// Detect tells how connections made with cfg reach Postgres. It opens two connections of its own
// (simple protocol: no prepared statements of pgx's). A connection whose server session is not
// the process its startup named is a pooler's (a sure sign, and the only one for session mode).
// Then it watches the server session (pg_backend_pid) each of their transactions runs on while
// the other holds a transaction open.
// Through a pooler in transaction mode, a session one client released is handed to the other (or,
// with a pool of one session, the second client's statement waits for the first's transaction):
// Transaction. A pooler that gave each client the same session every time (session mode, or other
// clients taking the sessions the probe's released) is Pooler. Through either it then prepares a
// statement on one client, has the other take the session it was prepared on, and runs it: see
// Found.PreparedStatements.
func Detect(ctx context.Context, cfg *pgx.ConnConfig) (Found, error) {
	c := cfg.Copy()
	c.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	c.StatementCacheCapacity, c.DescriptionCacheCapacity = 0, 0
	a, err := pgx.ConnectConfig(ctx, c)
	if err != nil {
		return Found{}, err
	}
	defer a.Close(context.WithoutCancel(ctx))
	b, err := pgx.ConnectConfig(ctx, c)
	if err != nil {
		return Found{}, err
	}
	defer b.Close(context.WithoutCancel(ctx))

	// A pooler answers a client's startup itself, with a cancel key of its own: the process id
	// in it is not the server session's. Postgres's own is.
	pid, err := backend(ctx, a)
	if err != nil {
		return Found{}, err
	}
	if a.PgConn().PID() == uint32(pid) {
		return Found{Kind: Direct}, nil
	}
	kind, err := sessions(ctx, a, b)
	if err != nil || kind == Statement {
		return Found{Kind: kind}, err
	}
	if kind == Direct { // not seen to change sessions, through a pooler all the same
		kind = Pooler
	}
	return Found{Kind: kind, PreparedStatements: keepsStatements(ctx, a, b)}, nil
}

// sessions tells Transaction (seen) from Direct (not seen) for a connection through a pooler (see
// Detect).
func sessions(ctx context.Context, a, b *pgx.Conn) (Kind, error) {
	var pidA, pidB int32 // each client's first session
	for range 3 {
		a1, err := backend(ctx, a)
		if err != nil {
			return Direct, err
		}
		// b holds a session in a transaction while a asks again.
		if _, err := b.Exec(ctx, "BEGIN"); err != nil {
			if statementMode(err) {
				return Statement, ErrStatementMode
			}
			return Direct, err
		}
		b1, err := backend(ctx, b)
		if err != nil {
			return Direct, err
		}
		wctx, cancel := context.WithTimeout(ctx, wait)
		a2, err := backend(wctx, a)
		cancel()
		if err != nil && ctx.Err() == nil && errors.Is(wctx.Err(), context.DeadlineExceeded) {
			return Transaction, nil // a's statement waited for b's transaction: they share one session
		}
		if err != nil {
			return Direct, err
		}
		if _, err := b.Exec(ctx, "COMMIT"); err != nil {
			return Direct, err
		}
		if pidA == 0 {
			pidA, pidB = a1, b1
		}
		if a1 != pidA || a2 != pidA || b1 != pidB || a1 == b1 {
			return Transaction, nil
		}
	}
	return Direct, nil
}

// keepsStatements reports whether a statement a prepared on one server session can still be run
// by a on another: a prepares it in a transaction (so it is prepared on the session that
// transaction ran on), then b takes that very session in a transaction of its own (tried a few
// times: the pooler hands out its idle sessions in an order of its own), and a runs the
// statement, necessarily elsewhere. Any failure, a wait (a pool of one session), or b never
// getting that session says no.
func keepsStatements(ctx context.Context, a, b *pgx.Conn) bool {
	for range 5 {
		// A name of its own each time: a statement an earlier try prepared stays on the session
		// it was prepared on (its DEALLOCATE may have run on another), and would answer for this
		// one there.
		name := fmt.Sprintf("kafkapg_pooler_probe_%d", rand.Uint64())
		tx, err := a.Begin(ctx)
		if err != nil {
			return false
		}
		_, err = tx.Prepare(ctx, name, "SELECT pg_backend_pid()")
		var prepared int32
		if err == nil {
			err = tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&prepared)
		}
		if err == nil {
			err = tx.Commit(ctx)
		}
		if err != nil {
			tx.Rollback(context.WithoutCancel(ctx))
			return false
		}
		if _, err := b.Exec(ctx, "BEGIN"); err != nil {
			return false
		}
		held, err := backend(ctx, b)
		if err != nil || held != prepared {
			b.Exec(context.WithoutCancel(ctx), "COMMIT")
			a.Deallocate(context.WithoutCancel(ctx), name)
			if err != nil {
				return false
			}
			continue
		}
		wctx, cancel := context.WithTimeout(ctx, wait)
		var ran int32
		err = a.QueryRow(wctx, name).Scan(&ran)
		cancel()
		b.Exec(context.WithoutCancel(ctx), "COMMIT")
		return err == nil && ran != prepared
	}
	return false
}

func backend(ctx context.Context, conn *pgx.Conn) (int32, error) {
	var pid int32
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return 0, fmt.Errorf("pooler probe: %w", err)
	}
	return pid, nil
}

// statementMode reports whether err is a statement-mode pooler refusing a transaction
// (PgBouncer: "transaction blocks not allowed in statement pooling mode").
func statementMode(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.Contains(pgErr.Message, "statement pooling mode")
	}
	return strings.Contains(err.Error(), "statement pooling mode")
}

// NamedStatements reports whether mode prepares named statements on the server, which a pooler in
// transaction mode loses unless it keeps them itself (Found.PreparedStatements).
func NamedStatements(mode pgx.QueryExecMode) bool { return mode == pgx.QueryExecModeCacheStatement }

// Pooled reports whether the connections go through a pooler that may run their transactions on
// other sessions and does not keep prepared statements: named ones are not safe there.
func (f Found) Pooled() bool {
	return (f.Kind == Transaction || f.Kind == Pooler) && !f.PreparedStatements
}

// Unsupported reports whether connections in mode were seen not to work where f was found: named
// statements through a pooler seen in transaction mode that does not keep them.
func (f Found) Unsupported(mode pgx.QueryExecMode) bool {
	return f.Kind == Transaction && !f.PreparedStatements && NamedStatements(mode)
}

// QueryExecMode is the query mode kafkapg uses through a pooler in transaction mode: statements are
// sent unnamed, with their descriptions cached in the client (one round trip, binary formats).
const QueryExecMode = pgx.QueryExecModeCacheDescribe
