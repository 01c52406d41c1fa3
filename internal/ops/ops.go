// Package ops is what an operator does to a consumer group's dead letters, held keys, records and
// positions: list, show, replay, discard, purge, release, trace; pause, resume and set positions.
// The service binary's dlq, keys, positions and trace commands, its JSON API and its console call
// these functions; there is one implementation of each operation.
//
// Every change an operation makes is recorded in the audit table with its actor and reason, in
// the transaction that makes it.
package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// Ops operates on one consumer group's state in one Postgres schema.
type Ops struct {
	pool   *pgxpool.Pool
	schema string
	group  string
	store  *retrytopics.Store
	// sources are source topics of the group given by WithTopics (see CheckTopic).
	sources []string
	// keys finds a rewind's records' idempotency keys (WithIdempotencyKeys); nil: not checked.
	keys *IdempotencyKeys
}

// New returns the operations on group's state in schema.
func New(pool *pgxpool.Pool, schema, group string) *Ops {
	return &Ops{pool: pool, schema: schema, group: group, store: retrytopics.NewStore(schema, group)}
}

// Group returns the consumer group operated on.
func (o *Ops) Group() string { return o.group }

// table returns the quoted name of one of kafkapg's tables.
func (o *Ops) table(name string) string { return pgx.Identifier{o.schema, name}.Sanitize() }

// ErrUsage wraps every error caused by what the operator asked for (a missing reason, an unknown
// id): the command reports it as bad usage.
var ErrUsage = errors.New("usage")

func usage(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrUsage, fmt.Sprintf(format, args...))
}

// text refuses, as bad usage naming the field, text Postgres would refuse (a NUL byte, invalid
// UTF-8) with an error of its own.
func text(field, v string) error {
	if !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
		return usage("%s: not valid text (a NUL byte or invalid UTF-8)", field)
	}
	return nil
}

// ErrNotFound wraps errors about a dead letter, task or key that does not exist.
var ErrNotFound = errors.New("not found")

// Actor names who acts and why, for the audit table.
type Actor struct {
	Name   string
	Reason string
}

func (a Actor) check() error {
	if err := text("actor", a.Name); err != nil {
		return err
	}
	if err := text("reason", a.Reason); err != nil {
		return err
	}
	if strings.TrimSpace(a.Name) == "" {
		return usage("an actor is required")
	}
	if strings.TrimSpace(a.Reason) == "" {
		return usage("a reason is required (--reason): it is kept in the audit table with your name")
	}
	return nil
}

// audit records an action in tx.
func (o *Ops) audit(ctx context.Context, tx pgx.Tx, a Actor, action string, task int64, detail any) error {
	d, err := json.Marshal(detail)
	if err != nil {
		return fmt.Errorf("audit %s: %w", action, err)
	}
	_, err = tx.Exec(ctx, `INSERT INTO `+o.table("audit")+` (consumer_group, actor, action, reason, task_id, detail)
		VALUES ($1, $2, $3, $4, nullif($5::bigint, 0), $6)`, o.group, a.Name, action, a.Reason, task, d)
	if err != nil {
		return fmt.Errorf("audit %s: %w", action, err)
	}
	return nil
}

// AuditEntry is a row of the audit table.
type AuditEntry struct {
	ID     int64           `json:"id"`
	At     time.Time       `json:"at"`
	Actor  string          `json:"actor"`
	Action string          `json:"action"`
	Reason string          `json:"reason"`
	TaskID int64           `json:"task_id,omitempty"`
	Detail json.RawMessage `json:"detail"`
}

// Audit returns the group's latest audit entries, newest first.
func (o *Ops) Audit(ctx context.Context, limit int) ([]AuditEntry, error) {
	rows, err := o.pool.Query(ctx, `SELECT id, at, actor, action, reason, coalesce(task_id, 0), detail FROM `+o.table("audit")+`
		WHERE consumer_group = $1 ORDER BY id DESC LIMIT $2`, o.group, limit)
	if err != nil {
		return nil, fmt.Errorf("read audit: %w", err)
	}
	var out []AuditEntry
	var e AuditEntry
	_, err = pgx.ForEachRow(rows, []any{&e.ID, &e.At, &e.Actor, &e.Action, &e.Reason, &e.TaskID, &e.Detail}, func() error {
		out = append(out, e)
		e = AuditEntry{}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read audit: %w", err)
	}
	return out, nil
}

// Position is where the group stands in a source partition, as Postgres has it.
type Position struct {
	Topic     string    `json:"topic"`
	Partition int32     `json:"partition"`
	Owner     string    `json:"owner"` // the processor that claimed it last; "" if none
	Next      *int64    `json:"next_offset"`
	UpdatedAt time.Time `json:"updated_at"`
}

// Positions returns the group's source partitions with their positions, by topic and
// partition.
func (o *Ops) Positions(ctx context.Context) ([]Position, error) {
	rows, err := o.pool.Query(ctx, `SELECT topic, partition, owner, next_offset, updated_at FROM `+o.table("offsets")+`
		WHERE consumer_group = $1 ORDER BY topic, partition`, o.group)
	if err != nil {
		return nil, fmt.Errorf("read positions: %w", err)
	}
	ps, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Position])
	if err != nil {
		return nil, fmt.Errorf("read positions: %w", err)
	}
	return ps, nil
}
