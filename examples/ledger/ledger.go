// Package ledger is kafkapg's example handler: account ledger events applied to two tables. It
// is the built-in HANDLER=ledger of cmd/processor, the demo, and the subject of the exactly-once
// tests: ledger_entries has event_id as its primary key and a plain INSERT (no ON CONFLICT), so
// an event applied twice fails loudly instead of being hidden; applied_order and seq make the
// order in which a key's events were applied visible.
//
// A record's value is JSON:
//
//	{"event_id":"e-1","account":"acct-7","amount":42,"seq":3,"fail_attempts":0,"poison":false}
//
// and is handled like this:
//
//   - invalid JSON, or a missing event_id or account: permanent error;
//   - "poison": true: permanent error;
//   - "fail_attempts": N: a retryable error while the delivery Attempt is at most N (retries
//     within one delivery do not change Attempt); Careless fails those attempts the way its
//     "mistake" says;
//   - otherwise the event is inserted into ledger_entries and its amount added to the account's
//     balance in ledger_balances, with last_seq set to seq.
//
// The handler does not check seq: keeping order is the framework's job.
package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
)

// Event is the JSON value of a ledger record.
type Event struct {
	EventID      string `json:"event_id" avro:"event_id"`
	Account      string `json:"account" avro:"account"`
	Amount       int64  `json:"amount" avro:"amount"`
	Seq          int64  `json:"seq" avro:"seq"`
	FailAttempts int    `json:"fail_attempts,omitempty" avro:"fail_attempts"`
	Poison       bool   `json:"poison,omitempty" avro:"poison"`
	// Mistake says how Careless fails the event's attempts up to FailAttempts (Handler fails them
	// all the same way): one of the Mistake constants, or empty for a plain error.
	Mistake string `json:"mistake,omitempty" avro:"mistake"`
	// Pad makes the record large (see GenConfig.OversizedPerMille); the handlers ignore it.
	Pad string `json:"pad,omitempty" avro:"pad"`
}

// EventAvroSchema is Event's Avro schema, for the topics whose events are Avro in the Schema
// Registry's wire format (HANDLER=ledger-avro): the handlers read Record.Decoded then.
const EventAvroSchema = `{"type": "record", "name": "Event", "namespace": "kafkapg.ledger", "fields": [
	{"name": "event_id", "type": "string"},
	{"name": "account", "type": "string"},
	{"name": "amount", "type": "long"},
	{"name": "seq", "type": "long"},
	{"name": "fail_attempts", "type": "int", "default": 0},
	{"name": "poison", "type": "boolean", "default": false},
	{"name": "mistake", "type": "string", "default": ""},
	{"name": "pad", "type": "string", "default": ""}]}`

// Schema creates the ledger tables (if missing) in the connection's current schema.
const Schema = `
CREATE TABLE IF NOT EXISTS ledger_entries (
    event_id      text      PRIMARY KEY,
    account       text      NOT NULL,
    amount        bigint    NOT NULL,
    seq           bigint    NOT NULL,
    applied_order bigserial,
    attempt       integer   NOT NULL DEFAULT 1
);
ALTER TABLE ledger_entries ADD COLUMN IF NOT EXISTS attempt integer NOT NULL DEFAULT 1;
CREATE TABLE IF NOT EXISTS ledger_balances (
    account  text   PRIMARY KEY,
    balance  bigint NOT NULL,
    last_seq bigint NOT NULL
);`

// SQL the handler runs for every applied event, exported so benchmarks can run the very same.
const (
	InsertEntrySQL = `INSERT INTO ledger_entries (event_id, account, amount, seq, attempt) VALUES ($1, $2, $3, $4, $5)`
	AddBalanceSQL  = `INSERT INTO ledger_balances (account, balance, last_seq) VALUES ($1, $2, $3)
		ON CONFLICT (account) DO UPDATE SET balance = ledger_balances.balance + EXCLUDED.balance, last_seq = EXCLUDED.last_seq`
)

// Handler applies ledger events. The zero value is ready to use.
type Handler struct{}

var (
	_ processor.Handler      = Handler{}
	_ processor.BatchHandler = Handler{}
)

// ErrPoison is the permanent error of an event marked poison.
var ErrPoison = errors.New("poison event")

// Parse decodes and validates an event. Its errors are permanent.
func Parse(value []byte) (Event, error) {
	var ev Event
	if err := json.Unmarshal(value, &ev); err != nil {
		return ev, processor.Permanent(fmt.Errorf("invalid ledger event JSON: %w", err))
	}
	return ev, validate(ev)
}

// validate says what is wrong with ev, decoded from JSON or Avro: nothing, or a permanent error.
func validate(ev Event) error {
	switch {
	case ev.EventID == "":
		return processor.Permanent(errors.New("ledger event has no event_id"))
	case ev.Account == "":
		return processor.Permanent(fmt.Errorf("ledger event %s has no account", ev.EventID))
	case ev.Poison:
		return processor.Permanent(fmt.Errorf("ledger event %s: %w", ev.EventID, ErrPoison))
	}
	return nil
}

// check returns the error the event's delivery attempt fails with, if any.
func check(rec *processor.Record) (Event, error) {
	ev, decoded := rec.Decoded.(Event) // a topic decoded by its Decoder (EventAvroSchema)
	var err error
	if decoded {
		err = validate(ev)
	} else {
		ev, err = Parse(rec.Value)
	}
	if err != nil {
		return ev, err
	}
	if rec.Attempt <= ev.FailAttempts {
		return ev, fmt.Errorf("ledger event %s: simulated transient failure (attempt %d, fails while attempt <= %d)",
			ev.EventID, rec.Attempt, ev.FailAttempts)
	}
	return ev, nil
}

// Handle applies one event.
func (h Handler) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	return h.HandleBatch(ctx, tx, []*processor.Record{rec})
}

// HandleBatch applies the events of a batch in one round trip to Postgres.
func (Handler) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	b := &pgx.Batch{}
	for i, rec := range recs {
		ev, err := check(rec)
		if err != nil {
			return processor.RecordFailed(i, err)
		}
		b.Queue(InsertEntrySQL, ev.EventID, ev.Account, ev.Amount, ev.Seq, rec.Attempt)
		b.Queue(AddBalanceSQL, ev.Account, ev.Amount, ev.Seq)
	}
	return tx.SendBatch(ctx, b).Close()
}
