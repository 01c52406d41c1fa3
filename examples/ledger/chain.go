package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/sink"
)

// A chain of two services, exactly once end to end, is built from these handlers:
//
//   - stage 1, Forward, applies ledger events like Handler and, in the same transaction, emits a
//     Posting for each through the outbox (processor.Record.Emit); its topic deduplicates on the
//     event's id (KeyFromJSON("event_id")), so an event its producer sent twice is applied and
//     forwarded once;
//   - stage 2, Post, consumes the postings and inserts them into ledger_postings, which has no
//     unique constraint (as a careless handler would have it): only its topic's deduplication on
//     the message id (KeyFromHeader(sink.HeaderMessageID)) keeps a posting the relay published
//     twice from being applied twice.

// Posting is the JSON value of the record Forward emits for an applied event.
type Posting struct {
	EventID string `json:"event_id"`
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
	Seq     int64  `json:"seq"`
}

// ChainSchema creates stage 2's table (if missing) in the connection's current schema.
const ChainSchema = `
CREATE TABLE IF NOT EXISTS ledger_postings (
    event_id      text      NOT NULL,
    account       text      NOT NULL,
    amount        bigint    NOT NULL,
    seq           bigint    NOT NULL,
    message_id    text      NOT NULL,
    applied_order bigserial
);`

// StageOneKey and StageTwoKey are the idempotency keys of the chain's two topics.
var (
	StageOneKey = processor.KeyFromJSON("event_id")
	StageTwoKey = processor.KeyFromHeader(sink.HeaderMessageID)
)

// Forward is stage 1: Handler, plus a Posting emitted to Topic, keyed by account, for every
// applied event.
type Forward struct {
	// Topic receives the postings. Defaults to the event's topic followed by ".postings".
	Topic string
}

// PostingsTopic is where Forward{} emits the postings of the events of topic.
func PostingsTopic(topic string) string { return topic + ".postings" }

var _ processor.BatchHandler = Forward{}

// Handle applies one event and emits its posting.
func (f Forward) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	return f.HandleBatch(ctx, tx, []*processor.Record{rec})
}

// HandleBatch applies a batch of events and emits their postings.
func (f Forward) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	if err := (Handler{}).HandleBatch(ctx, tx, recs); err != nil {
		return err
	}
	for _, rec := range recs {
		ev, err := Parse(rec.Value)
		if err != nil {
			return err // Handler has applied it: cannot happen
		}
		v, _ := json.Marshal(Posting{EventID: ev.EventID, Account: ev.Account, Amount: ev.Amount, Seq: ev.Seq})
		topic := f.Topic
		if topic == "" {
			topic = PostingsTopic(rec.Topic)
		}
		if err := rec.Emit(ctx, tx, sink.Event{Topic: topic, Key: []byte(ev.Account), Value: v}); err != nil {
			return err
		}
	}
	return nil
}

// Post is stage 2: it inserts each posting into ledger_postings.
type Post struct{}

// Handle inserts one posting.
func (Post) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	var p Posting
	if err := json.Unmarshal(rec.Value, &p); err != nil || p.EventID == "" {
		return processor.Permanent(fmt.Errorf("invalid posting: %q", short(rec.Value)))
	}
	id, err := StageTwoKey(rec)
	if err != nil {
		return processor.Permanent(err)
	}
	_, err = tx.Exec(ctx, `INSERT INTO ledger_postings (event_id, account, amount, seq, message_id) VALUES ($1, $2, $3, $4, $5)`,
		p.EventID, p.Account, p.Amount, p.Seq, string(id))
	return err
}

// Duplicate returns items with a share (per mille) of their valid events sent again by their
// producer: each copy, the same key and value, goes some records after its original (a retried
// request, an upstream replay). The copies are marked Copy.
func Duplicate(items []Item, perMille int, seed uint64) []Item {
	rng := rand.New(rand.NewPCG(seed, seed^0x5bd1e995))
	out := slices.Clone(items)
	for _, it := range items {
		if it.Kind == KindMalformed || rng.IntN(1000) >= perMille {
			continue
		}
		c := it
		c.Copy = true
		at := min(len(out), slices.IndexFunc(out, func(o Item) bool { return o.Event.EventID == it.Event.EventID && !o.Copy })+1+rng.IntN(50))
		out = slices.Insert(out, at, c)
	}
	return out
}

// VerifyChain checks stage 2's table against items (some of them Copies), given how many
// delivery attempts stage 1's records got: every event stage 1 must apply was posted exactly
// once (a copy or a republished posting never twice) and no other; each account's postings were
// applied in seq order. It returns the violations it finds (at most five of each kind listed),
// joined.
func VerifyChain(ctx context.Context, db Querier, items []Item, maxAttempt int) (posted int, err error) {
	return VerifyChainWith(ctx, db, items, maxAttempt, VerifyOptions{})
}

// VerifyChainWith is VerifyChain with options. Recovered events (dead-lettered, then applied by
// a replay, which emitted their postings) must be posted exactly once too, and are left out of
// the order check, as are Unordered ones; ExternalFailures has no bearing on stage 2, which records no attempts.
func VerifyChainWith(ctx context.Context, db Querier, items []Item, maxAttempt int, opts VerifyOptions) (posted int, err error) {
	want := map[string]bool{}
	for _, it := range items {
		if it.Kind != KindMalformed && (!it.Dead(maxAttempt) || opts.Recovered[it.Event.EventID]) {
			want[it.Event.EventID] = true
		}
	}
	rows, err := db.Query(ctx, `SELECT event_id, account, seq FROM ledger_postings ORDER BY applied_order`)
	if err != nil {
		return 0, fmt.Errorf("read ledger_postings: %w", err)
	}
	type row struct {
		ID, Account string
		Seq         int64
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		return 0, fmt.Errorf("read ledger_postings: %w", err)
	}
	// Each kind of violation is counted, and five of it listed, so that a flood of one kind does
	// not hide another.
	var errs []error
	var totals []func()
	kind := func(what string) func(format string, args ...any) {
		n := 0
		totals = append(totals, func() {
			if n > 5 {
				errs = append(errs, fmt.Errorf("... %d %s in all", n, what))
			}
		})
		return func(format string, args ...any) {
			if n++; n <= 5 {
				errs = append(errs, fmt.Errorf(format, args...))
			}
		}
	}
	unexpected, order, twice, never := kind("postings of events that must not be applied"), kind("postings out of order"),
		kind("events posted more than once"), kind("events never posted")
	count := map[string]int{}
	last := map[string]int64{}
	for _, r := range got {
		count[r.ID]++
		if !want[r.ID] {
			unexpected("posting %s: its event must not be applied", r.ID)
		}
		if opts.Recovered[r.ID] || opts.Unordered[r.ID] {
			continue // posted when it was replayed or rewound over, after its account's later events
		}
		if r.Seq < last[r.Account] {
			order("account %s: posting of seq %d applied after seq %d", r.Account, r.Seq, last[r.Account])
		}
		last[r.Account] = r.Seq
	}
	for _, id := range slices.Sorted(maps.Keys(count)) {
		if n := count[id]; n > 1 {
			twice("event %s posted %d times", id, n)
		}
	}
	for _, id := range slices.Sorted(maps.Keys(want)) {
		if count[id] == 0 {
			never("event %s never posted", id)
		}
	}
	for _, total := range totals {
		total()
	}
	return len(got), errors.Join(errs...)
}
