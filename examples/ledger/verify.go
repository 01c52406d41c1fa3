package ledger

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// Querier runs queries; *pgxpool.Pool and *pgx.Conn satisfy it.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Report sums up a verification.
type Report struct {
	Applied  int // rows in ledger_entries
	Expected int // events expected to be applied
	Accounts int
}

// Verify checks the ledger tables against items, given how many delivery attempts records got
// (1 without retry tiers): every event that should be applied is applied exactly once and no
// other, at the first delivery attempt its simulated failures let through; each account's balance is the sum of its applied entries and of the expected amounts,
// and its last_seq is its highest applied seq; and each account's entries were applied in seq
// order. It returns every violation it finds (at most 20 listed), joined.
func Verify(ctx context.Context, db Querier, items []Item, maxAttempt int) (Report, error) {
	return VerifyWith(ctx, db, items, maxAttempt, VerifyOptions{})
}

// VerifyOptions relax Verify for runs that failed records for reasons of their own.
type VerifyOptions struct {
	// ExternalFailures says the handler also failed records outside their events' simulated
	// failures (a downstream outage in a test): an event may then be applied at a later attempt
	// than its simulated failures alone would give, never at an earlier one.
	ExternalFailures bool
	// Recovered are the events (by id) that were dead-lettered and then applied by a replay:
	// they are expected applied, and, replayed after their account's later events (as with
	// ON_DEAD_LETTER=skip), they are left out of the order check.
	Recovered map[string]bool
	// Unordered are events (by id) expected applied, but after their account's later events: an
	// operator set their partition's position forward past them and later back over them, so
	// they were applied by the rewind, after the later events the group went on with. They are
	// left out of the order check only.
	Unordered map[string]bool
}

// VerifyWith is Verify with options.
func VerifyWith(ctx context.Context, db Querier, items []Item, maxAttempt int, opts VerifyOptions) (Report, error) {
	var rep Report
	want := map[string]Event{}
	for _, it := range items {
		if it.Kind != KindMalformed && (!it.Dead(maxAttempt) || opts.Recovered[it.Event.EventID]) {
			want[it.Event.EventID] = it.Event
		}
	}
	rep.Expected = len(want)

	var problems []string
	add := func(format string, args ...any) {
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf(format, args...))
		}
	}

	rows, err := db.Query(ctx, `SELECT event_id, account, amount, seq, attempt FROM ledger_entries ORDER BY applied_order`)
	if err != nil {
		return rep, fmt.Errorf("read ledger_entries: %w", err)
	}
	type acct struct {
		sum     int64
		lastSeq int64 // the highest seq applied in order
		last    int64 // the seq of the entry applied last
		n       int
	}
	got := map[string]*acct{}
	seen := map[string]bool{}
	for rows.Next() {
		var id, account string
		var amount, seq int64
		var attempt int
		if err := rows.Scan(&id, &account, &amount, &seq, &attempt); err != nil {
			rows.Close()
			return rep, err
		}
		rep.Applied++
		if seen[id] {
			add("event %s applied twice", id) // impossible with the primary key; kept as a guard
		}
		seen[id] = true
		ev, ok := want[id]
		if !ok {
			add("event %s was applied but should have been dead-lettered", id)
		} else if ev.Account != account || ev.Amount != amount || ev.Seq != seq {
			add("event %s applied as (%s, %d, seq %d), produced as (%s, %d, seq %d)", id, account, amount, seq, ev.Account, ev.Amount, ev.Seq)
		} else if attempt != ev.FailAttempts+1 && !(opts.ExternalFailures && attempt > ev.FailAttempts) {
			add("event %s applied at delivery attempt %d, want %d (it fails while the attempt is at most %d)", id, attempt, ev.FailAttempts+1, ev.FailAttempts)
		}
		a := got[account]
		if a == nil {
			a = &acct{}
			got[account] = a
		}
		outOfOrder := opts.Recovered[id] || opts.Unordered[id]
		if seq <= a.lastSeq && !outOfOrder {
			add("account %s: seq %d applied after seq %d (order broken)", account, seq, a.lastSeq)
		}
		a.sum += amount
		if !outOfOrder {
			a.lastSeq = max(a.lastSeq, seq)
		}
		a.last = seq
		a.n++
	}
	if err := rows.Err(); err != nil {
		return rep, err
	}
	var missing []string
	for id := range want {
		if !seen[id] {
			missing = append(missing, id)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		add("%d events never applied, e.g. %s", len(missing), strings.Join(missing[:min(5, len(missing))], ", "))
	}

	wantSum := map[string]int64{}
	for _, ev := range want {
		wantSum[ev.Account] += ev.Amount
	}
	rows, err = db.Query(ctx, `SELECT account, balance, last_seq FROM ledger_balances`)
	if err != nil {
		return rep, fmt.Errorf("read ledger_balances: %w", err)
	}
	for rows.Next() {
		var account string
		var balance, lastSeq int64
		if err := rows.Scan(&account, &balance, &lastSeq); err != nil {
			rows.Close()
			return rep, err
		}
		rep.Accounts++
		a := got[account]
		switch {
		case a == nil:
			add("account %s has a balance row but no entries", account)
		case balance != a.sum:
			add("account %s: balance %d, but its entries sum to %d", account, balance, a.sum)
		case balance != wantSum[account]:
			add("account %s: balance %d, expected %d from the produced events", account, balance, wantSum[account])
		case lastSeq != a.last:
			add("account %s: last_seq %d, but the last applied entry has seq %d", account, lastSeq, a.last)
		}
	}
	if err := rows.Err(); err != nil {
		return rep, err
	}
	if rep.Accounts != len(got) {
		add("%d accounts have entries but %d have balance rows", len(got), rep.Accounts)
	}
	if len(problems) > 0 {
		return rep, errors.New(strings.Join(problems, "\n"))
	}
	return rep, nil
}

// CheckDeadLetters checks the records read from the dead-letter topic against items: every item
// that must be dead-lettered is there with its original key and value and parseable kafkapg
// headers (an event sent twice, Copy, twice), and nothing else is. Publication is at least once,
// so a record may appear more often only if allowDuplicates (tests that kill processes); it
// returns how many duplicates it saw.
func CheckDeadLetters(items []Item, dlq []*kgo.Record, maxAttempt int, allowDuplicates bool) (dups int, err error) {
	byValue := map[string]Item{}
	want := map[string]int{}       // dead-lettered records by value: an event and its Copies each die
	oversized := map[string]Item{} // by key and size: their DLQ copies carry no value
	for _, it := range items {
		byValue[string(it.Value)] = it
		if it.Dead(maxAttempt) {
			want[string(it.Value)]++
		}
		if it.Oversized() {
			oversized[fmt.Sprintf("%s/%d", it.Key, len(it.Value))] = it
		}
	}
	var problems []string
	add := func(format string, args ...any) {
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf(format, args...))
		}
	}
	seen := map[string]int{}
	for _, r := range dlq {
		value := r.Value
		for _, h := range r.Headers {
			if h.Key == retrytopics.HeaderValueOmitted {
				if it, ok := oversized[fmt.Sprintf("%s/%s", r.Key, h.Value)]; ok {
					value = it.Value
				}
			}
		}
		r := *r
		r.Value = value
		it, ok := byValue[string(r.Value)]
		switch {
		case !ok:
			add("dead letter at %s[%d]@%d matches no produced record: %s", r.Topic, r.Partition, r.Offset, short(r.Value))
			continue
		case !it.Dead(maxAttempt):
			add("%s record (key %s, event %q) was dead-lettered but should have been applied", it.Kind, it.Key, it.Event.EventID)
		case string(r.Key) != string(it.Key):
			add("dead letter of %s has key %q, want %q", short(r.Value), r.Key, it.Key)
		}
		if _, err := retrytopics.ParseFailure(r.Headers); err != nil {
			add("dead letter of %s: headers: %v", short(r.Value), err)
		}
		seen[string(r.Value)]++
		if seen[string(r.Value)] > want[string(r.Value)] {
			dups++
			if !allowDuplicates {
				add("record %s dead-lettered more than once", short(r.Value))
			}
		}
	}
	missing := 0
	for v, n := range want {
		if seen[v] < n {
			missing++
			if missing <= 5 {
				add("%s record %s was not dead-lettered (%d of %d copies)", byValue[v].Kind, short([]byte(v)), seen[v], n)
			}
		}
	}
	if missing > 5 {
		add("... %d records missing from the dead-letter topic in all", missing)
	}
	if len(problems) > 0 {
		return dups, errors.New(strings.Join(problems, "\n"))
	}
	return dups, nil
}

// CheckDeadLetterRows checks kafkapg's dead_letters table (in schema, for group) against items:
// exactly one row for every item that must be dead-lettered (an event sent twice, Copy: one row
// each), with attempts between 1 and maxAttempt and an error class, and no other row. It returns how many rows it checked.
func CheckDeadLetterRows(ctx context.Context, db Querier, schema, group string, items []Item, maxAttempt int) (int, error) {
	rows, err := db.Query(ctx, `SELECT value, attempts, error_class FROM `+pgx.Identifier{schema, "dead_letters"}.Sanitize()+
		` WHERE consumer_group = $1`, group)
	if err != nil {
		return 0, fmt.Errorf("read dead_letters: %w", err)
	}
	var problems []string
	add := func(format string, args ...any) {
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf(format, args...))
		}
	}
	got := map[string]int{}
	total := 0
	var value []byte
	var attempts int
	var class string
	_, err = pgx.ForEachRow(rows, []any{&value, &attempts, &class}, func() error {
		total++
		got[string(value)]++
		if attempts < 1 || attempts > maxAttempt || class == "" {
			add("dead_letters row of %s: attempts %d, class %q", short(value), attempts, class)
		}
		return nil
	})
	if err != nil {
		return total, fmt.Errorf("read dead_letters: %w", err)
	}
	want := map[string]int{}
	kind := map[string]Kind{}
	for _, it := range items {
		kind[string(it.Value)] = it.Kind
		if it.Dead(maxAttempt) {
			want[string(it.Value)]++
		} else {
			want[string(it.Value)] += 0
		}
	}
	for v, n := range want {
		if got[v] != n {
			add("%s record %s has %d dead_letters rows, want %d", kind[v], short([]byte(v)), got[v], n)
		}
		delete(got, v)
	}
	for v := range got {
		add("dead_letters row %s matches no produced record", short([]byte(v)))
	}
	if len(problems) > 0 {
		return total, errors.New(strings.Join(problems, "\n"))
	}
	return total, nil
}

// short quotes a record's value for a problem report, cut at 200 bytes (oversized events are
// a mebibyte).
func short(v []byte) string {
	if len(v) <= 200 {
		return fmt.Sprintf("%q", v)
	}
	return fmt.Sprintf("%q… (%d bytes)", v[:200], len(v))
}
