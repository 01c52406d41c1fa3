package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Progress is how far a group has got with a run of events: what is applied and dead-lettered,
// and what kafkapg still has under way in Postgres.
type Progress struct {
	Applied     int // rows in ledger_entries
	DeadRows    int // the group's dead_letters rows
	Outbox      int // retry and dead-letter records not yet published
	Tiers       int // records waiting in a retry tier
	HeldKeys    int // keys held behind a record in the retry path
	HeldRecords int // records held behind their key
}

// InFlight is the number of records kafkapg still has under way: not yet published, in a tier,
// or held behind their key. A run is over only when it is 0.
func (p Progress) InFlight() int { return p.Outbox + p.Tiers + p.HeldRecords + p.HeldKeys }

func (p Progress) String() string {
	return fmt.Sprintf("%d applied, %d dead_letters rows, %d outbox rows not yet published, %d records in tiers, %d held keys, %d held records",
		p.Applied, p.DeadRows, p.Outbox, p.Tiers, p.HeldKeys, p.HeldRecords)
}

// ReadProgress reads group's Progress from the ledger tables and kafkapg's tables in schema.
func ReadProgress(ctx context.Context, db Querier, schema, group string) (Progress, error) {
	table := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	var p Progress
	err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM ledger_entries),
		(SELECT count(*) FROM `+table("dead_letters")+` WHERE consumer_group = $1),
		(SELECT count(*) FROM `+table("outbox")+` WHERE consumer_group = $1 AND published_at IS NULL),
		(SELECT count(*) FROM `+table("retries")+` WHERE consumer_group = $1),
		(SELECT count(*) FROM `+table("held_keys")+` WHERE consumer_group = $1),
		(SELECT count(*) FROM `+table("held_records")+` WHERE consumer_group = $1)`, group).
		Scan(&p.Applied, &p.DeadRows, &p.Outbox, &p.Tiers, &p.HeldKeys, &p.HeldRecords)
	if err != nil {
		return p, fmt.Errorf("read progress: %w", err)
	}
	return p, nil
}

// Expect returns how many of items must end applied and dead-lettered, given the delivery
// attempts records get. A Copy of an event is dead-lettered as its original is (its original was
// never applied, so its idempotency key does not stop it), and otherwise skipped as a duplicate.
func Expect(items []Item, maxAttempt int) (applied, dead int) {
	for _, it := range items {
		switch {
		case it.Dead(maxAttempt):
			dead++
		case !it.Copy:
			applied++
		}
	}
	return applied, dead
}

// Settled returns nil once every one of items is accounted for — the events that must be
// applied are, every record that must be dead-lettered has its dead_letters row and at least
// dlqPublished copies in the dead-letter topic, and nothing is in flight — and otherwise an error
// saying what is missing. This is the "run is over" check of the tests, the chaos suite and the
// demo; dlqPublished < 0 skips the dead-letter topic.
func Settled(p Progress, items []Item, maxAttempt, dlqPublished int) error {
	applied, dead := Expect(items, maxAttempt)
	var errs []error
	if p.Applied < applied {
		errs = append(errs, fmt.Errorf("%d of %d events applied", p.Applied, applied))
	}
	if p.DeadRows < dead {
		errs = append(errs, fmt.Errorf("%d of %d dead_letters rows", p.DeadRows, dead))
	}
	if dlqPublished >= 0 && dlqPublished < dead {
		errs = append(errs, fmt.Errorf("%d of %d dead letters published", dlqPublished, dead))
	}
	if p.InFlight() > 0 {
		errs = append(errs, fmt.Errorf("in flight: %d outbox rows, %d records in tiers, %d held keys, %d held records", p.Outbox, p.Tiers, p.HeldKeys, p.HeldRecords))
	}
	return errors.Join(errs...)
}
