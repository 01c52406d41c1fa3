package ledger

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
)

// The mistakes Careless makes on an event's failing attempts (Event.Mistake).
const (
	// MistakeBinaryError: the error message formats the record's value, with binary bytes (NUL,
	// invalid UTF-8) in it.
	MistakeBinaryError = "binary-error"
	// MistakeOwnTimeout: a slow query under a timeout of the handler's own; its error is returned.
	MistakeOwnTimeout = "own-timeout"
	// MistakeSwallow: a statement fails and the handler returns nil ("ignore it"), leaving its
	// transaction aborted.
	MistakeSwallow = "swallow"
	// MistakeSwallowTimeout: a slow query under a timeout of the handler's own, whose error is
	// dropped: the handler returns nil on a connection pgx has closed.
	MistakeSwallowTimeout = "swallow-timeout"
)

// Mistakes lists the mistakes Careless can make.
var Mistakes = []string{MistakeBinaryError, MistakeOwnTimeout, MistakeSwallow, MistakeSwallowTimeout}

// CarelessSchema is Schema as a team in a hurry writes it: ledger_entries has no primary key, so
// an event applied twice is two rows, which Verify reports, instead of an error that hides it.
const CarelessSchema = `
CREATE TABLE IF NOT EXISTS ledger_entries (
    event_id      text      NOT NULL,
    account       text      NOT NULL,
    amount        bigint    NOT NULL,
    seq           bigint    NOT NULL,
    applied_order bigserial,
    attempt       integer   NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS ledger_balances (
    account  text   PRIMARY KEY,
    balance  bigint NOT NULL,
    last_seq bigint NOT NULL
);`

// Careless applies ledger events the way a handler written in a hurry does, for the chaos suite
// (HANDLER=ledger-careless): into CarelessSchema's tables, one statement at a time, and failing
// an event's attempts up to its fail_attempts with the event's Mistake instead of a clean error.
// Whatever the mistake, kafkapg must apply every event exactly once, at the same attempt Handler
// would: the mistakes are the handler's, the outcome is not.
type Careless struct{}

var _ processor.Handler = Careless{}

// slowQuery is what the timeout mistakes run, and ownTimeout the timeout they run it under.
const (
	slowQuery  = `SELECT pg_sleep(1)`
	ownTimeout = 20 * time.Millisecond
)

// Handle applies one event.
func (Careless) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	ev, err := Parse(rec.Value)
	if err != nil {
		return err
	}
	if rec.Attempt <= ev.FailAttempts {
		switch ev.Mistake {
		case MistakeBinaryError:
			return fmt.Errorf("ledger event %s: cannot apply payload %s", ev.EventID, append([]byte{0, 0xff, 0xfe, 0xc3}, rec.Value[:min(len(rec.Value), 64)]...))
		case MistakeOwnTimeout, MistakeSwallowTimeout:
			qctx, cancel := context.WithTimeout(ctx, ownTimeout)
			defer cancel()
			_, err := tx.Exec(qctx, slowQuery)
			if ev.Mistake == MistakeSwallowTimeout {
				return nil // "best effort"
			}
			return err
		case MistakeSwallow:
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // "cannot fail in practice"
			return nil
		}
		return fmt.Errorf("ledger event %s: simulated transient failure (attempt %d, fails while attempt <= %d)", ev.EventID, rec.Attempt, ev.FailAttempts)
	}
	if _, err := tx.Exec(ctx, InsertEntrySQL, ev.EventID, ev.Account, ev.Amount, ev.Seq, rec.Attempt); err != nil {
		return err
	}
	_, err = tx.Exec(ctx, AddBalanceSQL, ev.Account, ev.Amount, ev.Seq)
	return err
}
