package ops

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// Filter chooses dead letters. Zero fields match everything.
type Filter struct {
	Topic string `json:"topic,omitempty"`
	// Key matches the record's key exactly; HasKey says Key is set (an empty key is a key, and
	// with HasKey a nil Key is the empty key: JSON leaves it out).
	Key    []byte `json:"key,omitempty"`
	HasKey bool   `json:"has_key,omitempty"`
	Class  string `json:"class,omitempty"`
	// Status is new, replaying, replayed or discarded; several, comma-separated ("new,replaying"),
	// match a dead letter in any of them.
	Status string    `json:"status,omitempty"`
	Since  time.Time `json:"since,omitzero"`  // dead-lettered at or after
	Until  time.Time `json:"until,omitzero"`  // dead-lettered before
	Error  string    `json:"error,omitempty"` // a substring of the error message, case-insensitive
	IDs    []int64   `json:"ids,omitempty"`
}

// Validate reports a filter that cannot match what it means to.
func (f Filter) Validate() error {
	// Postgres refuses text with a NUL or invalid UTF-8: say which field, as bad usage.
	for name, v := range map[string]string{"topic": f.Topic, "class": f.Class, "status": f.Status, "error": f.Error} {
		if err := text(name, v); err != nil {
			return err
		}
	}
	for _, st := range f.statuses() {
		if !slices.Contains(retrytopics.DeadLetterStatuses, st) {
			return usage("status %q: want one or more of %s", st, strings.Join(retrytopics.DeadLetterStatuses, ", "))
		}
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && !f.Since.Before(f.Until) {
		return usage("since (%s) must be before until (%s)", f.Since.Format(time.RFC3339), f.Until.Format(time.RFC3339))
	}
	return nil
}

// statuses returns the statuses f.Status names, none if it is empty.
func (f Filter) statuses() []string {
	var out []string
	for st := range strings.SplitSeq(f.Status, ",") {
		if st = strings.TrimSpace(st); st != "" && !slices.Contains(out, st) {
			out = append(out, st)
		}
	}
	return out
}

// JoinStatuses returns the statuses of values, each a status or several comma-separated (a
// repeated flag or query parameter), as Filter.Status takes them.
func JoinStatuses(values []string) string {
	return strings.Join(Filter{Status: strings.Join(values, ",")}.statuses(), ",")
}

// where returns the filter as SQL conditions on dead_letters (alias d), appending its arguments
// to args ($1 is the consumer group).
func (f Filter) where(args *[]any) string {
	arg := func(v any) string {
		*args = append(*args, v)
		return "$" + strconv.Itoa(len(*args))
	}
	conds := []string{"d.consumer_group = $1"}
	if f.Topic != "" {
		conds = append(conds, "d.topic = "+arg(f.Topic))
	}
	if f.HasKey {
		// The empty key is a key: never NULL, whatever way it came (stored as JSON, a task's
		// filter reads back as nil).
		key := f.Key
		if key == nil {
			key = []byte{}
		}
		k := arg(key)
		conds = append(conds, "d.key_hash = sha256("+k+"::bytea) AND d.key = "+k)
	}
	if f.Class != "" {
		conds = append(conds, "d.error_class = "+arg(f.Class))
	}
	if st := f.statuses(); len(st) > 0 {
		conds = append(conds, "d.status = ANY("+arg(st)+")")
	}
	if !f.Since.IsZero() {
		conds = append(conds, "d.dead_lettered_at >= "+arg(f.Since))
	}
	if !f.Until.IsZero() {
		conds = append(conds, "d.dead_lettered_at < "+arg(f.Until))
	}
	if f.Error != "" {
		conds = append(conds, "strpos(lower(d.error_message), lower("+arg(f.Error)+")) > 0")
	}
	if len(f.IDs) > 0 {
		conds = append(conds, "d.id = ANY("+arg(f.IDs)+")")
	}
	return strings.Join(conds, " AND ")
}

// DeadLetter is a dead_letters row. Value and Headers are read by Show only (as much of them as
// it shows); List gives ValueSize.
type DeadLetter struct {
	ID        int64  `json:"id"`
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	Offset    int64  `json:"offset"`
	Key       []byte `json:"key"`
	KeySize   int    `json:"key_size"`
	// KeyTruncated: Key is the key's first ListedKeyBytes (in a list) or ShownKeyBytes (Show).
	KeyTruncated bool `json:"key_truncated,omitempty"`
	// Value is the value's first bytes Show read (ShowOptions); nil when hidden or null
	// (ValueHidden tells them apart, as omitempty in JSON does not).
	Value       []byte `json:"value,omitempty"`
	ValueSize   int    `json:"value_size"`
	ValueHidden bool   `json:"value_hidden,omitempty"`
	// ValueTruncated: Value is the value's first bytes, ValueSize is its length.
	ValueTruncated  bool      `json:"value_truncated,omitempty"`
	Headers         []Header  `json:"headers,omitempty"`
	Timestamp       time.Time `json:"timestamp"`
	Class           string    `json:"error_class"`
	Message         string    `json:"error_message"`
	Attempts        int       `json:"attempts"`
	FirstFailedAt   time.Time `json:"first_failed_at"`
	DeadLetteredAt  time.Time `json:"dead_lettered_at"`
	Status          string    `json:"status"`
	StatusChangedAt time.Time `json:"status_changed_at"`
	Replays         int       `json:"replays"`
	Events          []Event   `json:"events,omitempty"`
	BlocksKey       bool      `json:"blocks_key"` // its key waits for it (ON_DEAD_LETTER=block)
}

// Header is a record header. In a dead letter Show reads, Key and Value are their first
// ShownHeaderBytes, and Value is nil when values are hidden.
type Header struct {
	Key       string `json:"key"`
	Value     []byte `json:"value"`
	ValueSize int    `json:"value_size"`
}

// Event is a step of a dead letter's history.
type Event struct {
	At      time.Time `json:"at"`
	Event   string    `json:"event"` // dead_lettered, replay_queued, replayed, skipped_duplicate, discarded
	TaskID  int64     `json:"task_id,omitempty"`
	Attempt int       `json:"attempt,omitempty"`
	Class   string    `json:"error_class,omitempty"`
	Message string    `json:"error_message,omitempty"`
}

// ListedKeyBytes and ListedMessageBytes bound what a list reads of each dead letter's key and
// error message (Show reads them whole): a list costs its limit times a few kilobytes, whatever
// the records (a list of 51 dead letters with 900 KB keys took 46 MB a page).
const (
	ListedKeyBytes     = 1024
	ListedMessageBytes = 2048
)

var listColumns = `d.id, d.topic, d.partition, d."offset", substring(d.key from 1 for ` + strconv.Itoa(ListedKeyBytes) + `), octet_length(d.key),
	coalesce(octet_length(d.value), 0), d."timestamp", d.error_class, left(d.error_message, ` + strconv.Itoa(ListedMessageBytes) + `),
	d.attempts, d.first_failed_at, d.dead_lettered_at, d.status, d.status_changed_at, d.replays`

func scanList(rows pgx.Rows) ([]DeadLetter, error) {
	var out []DeadLetter
	var dl DeadLetter
	var ms int64
	var keySize *int
	_, err := pgx.ForEachRow(rows, []any{&dl.ID, &dl.Topic, &dl.Partition, &dl.Offset, &dl.Key, &keySize, &dl.ValueSize, &ms,
		&dl.Class, &dl.Message, &dl.Attempts, &dl.FirstFailedAt, &dl.DeadLetteredAt, &dl.Status, &dl.StatusChangedAt, &dl.Replays}, func() error {
		dl.Timestamp = time.UnixMilli(ms).UTC()
		if keySize != nil {
			dl.KeySize = *keySize
			dl.KeyTruncated = *keySize > len(dl.Key)
		}
		out = append(out, dl)
		dl = DeadLetter{}
		return nil
	})
	return out, err
}

// List returns up to limit dead letters that f matches, newest first.
func (o *Ops) List(ctx context.Context, f Filter, limit int) ([]DeadLetter, error) {
	return o.ListBefore(ctx, f, 0, limit)
}

// ListBefore is List for the dead letters older than id before (0: from the newest): a page of a
// long list, found along the primary key however many there are.
func (o *Ops) ListBefore(ctx context.Context, f Filter, before int64, limit int) ([]DeadLetter, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	args := []any{o.group}
	where := f.where(&args)
	if before > 0 {
		args = append(args, before)
		where += " AND d.id < $" + strconv.Itoa(len(args))
	}
	args = append(args, limit)
	rows, err := o.pool.Query(ctx, `SELECT `+listColumns+` FROM `+o.table("dead_letters")+` d WHERE `+where+`
		ORDER BY d.id DESC LIMIT $`+strconv.Itoa(len(args)), args...)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	out, err := scanList(rows)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return out, nil
}

// Count is how many dead letters of a topic, error class and status there are.
type Count struct {
	Topic  string    `json:"topic"`
	Class  string    `json:"error_class"`
	Status string    `json:"status"`
	N      int64     `json:"count"`
	Oldest time.Time `json:"oldest"` // dead-lettered first
	Newest time.Time `json:"newest"`
}

// Summary counts the dead letters f matches by topic, error class and status.
func (o *Ops) Summary(ctx context.Context, f Filter) ([]Count, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	args := []any{o.group}
	where := f.where(&args)
	rows, err := o.pool.Query(ctx, `SELECT d.topic, d.error_class, d.status, count(*), min(d.dead_lettered_at), max(d.dead_lettered_at)
		FROM `+o.table("dead_letters")+` d WHERE `+where+` GROUP BY 1, 2, 3 ORDER BY 1, 2, 3`, args...)
	if err != nil {
		return nil, fmt.Errorf("count dead letters: %w", err)
	}
	out := []Count{}
	var c Count
	_, err = pgx.ForEachRow(rows, []any{&c.Topic, &c.Class, &c.Status, &c.N, &c.Oldest, &c.Newest}, func() error {
		out = append(out, c)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("count dead letters: %w", err)
	}
	return out, nil
}

// ShowOptions chooses what Show reads of a dead letter's record: a read for display reads only
// the bytes it shows.
type ShowOptions struct {
	// HideValues leaves out the value and the headers' values: Show reads their sizes, never
	// their bytes.
	HideValues bool
	// ValueBytes is how much of the value Show reads, from its start (DeadLetter.ValueTruncated
	// says when there is more). Defaults to ShownValueBytes; at most MaxShownValueBytes.
	ValueBytes int
}

// What Show reads of a dead letter's record at most: ShownValueBytes of its value (unless asked
// for more, up to MaxShownValueBytes), ShownKeyBytes of its key, and ShownHeaderBytes of each
// header's key and value. A dead letter keeps a whole record, which may be many megabytes: a
// page showing it costs what it shows (40 requests for a 16 MB dead letter took 786 MB).
const (
	ShownValueBytes    = 64 << 10
	MaxShownValueBytes = 1 << 20
	ShownKeyBytes      = 64 << 10
	ShownHeaderBytes   = 1 << 10
)

// Show returns dead letter id: its record (as much of it as opt says), headers, history, and
// whether its key waits for it.
func (o *Ops) Show(ctx context.Context, id int64, opt ShowOptions) (DeadLetter, error) {
	if opt.ValueBytes == 0 {
		opt.ValueBytes = ShownValueBytes
	}
	if opt.ValueBytes < 0 || opt.ValueBytes > MaxShownValueBytes {
		return DeadLetter{}, usage("value bytes must be between 1 and %d, got %d", MaxShownValueBytes, opt.ValueBytes)
	}
	valueBytes := opt.ValueBytes
	if opt.HideValues {
		valueBytes = 0
	}
	rows, err := o.pool.Query(ctx, `SELECT `+listColumns+` FROM `+o.table("dead_letters")+` d WHERE d.consumer_group = $1 AND d.id = $2`, o.group, id)
	if err != nil {
		return DeadLetter{}, fmt.Errorf("read dead letter %d: %w", id, err)
	}
	found, err := scanList(rows)
	if err != nil {
		return DeadLetter{}, fmt.Errorf("read dead letter %d: %w", id, err)
	}
	if len(found) == 0 {
		return DeadLetter{}, fmt.Errorf("dead letter %d of group %s: %w", id, o.group, ErrNotFound)
	}
	dl := found[0]
	var hkeys, hvals [][]byte
	var hsizes []int32
	// More than a list: up to ShownKeyBytes of its key, its error message (bounded when it was
	// written: retrytopics.MaxErrorMessage), and the bytes of the value and headers it shows. The
	// value is read in Postgres's substring only: with hidden values (valueBytes 0), not at all.
	err = o.pool.QueryRow(ctx, `SELECT substring(d.key from 1 for $2), d.error_message,
			CASE WHEN $3 > 0 THEN substring(d.value from 1 for $3) END,
			ARRAY(SELECT substring(k from 1 for $4) FROM unnest(d.header_keys) WITH ORDINALITY u(k, i) ORDER BY i),
			ARRAY(SELECT CASE WHEN $3 > 0 THEN substring(v from 1 for $4) END FROM unnest(d.header_values) WITH ORDINALITY u(v, i) ORDER BY i),
			ARRAY(SELECT coalesce(octet_length(v), 0) FROM unnest(d.header_values) WITH ORDINALITY u(v, i) ORDER BY i),
			EXISTS (SELECT 1 FROM `+o.table("held_keys")+` h WHERE h.consumer_group = d.consumer_group AND h.topic = d.topic
				AND h.partition = d.partition AND h.key_hash = d.key_hash AND h.key = d.key AND h.state = 'blocked' AND h.head_offset = d."offset")
		FROM `+o.table("dead_letters")+` d WHERE d.id = $1`, id, ShownKeyBytes, valueBytes, ShownHeaderBytes).Scan(
		&dl.Key, &dl.Message, &dl.Value, &hkeys, &hvals, &hsizes, &dl.BlocksKey)
	dl.KeyTruncated = dl.KeySize > len(dl.Key)
	dl.ValueTruncated = !opt.HideValues && dl.ValueSize > len(dl.Value)
	dl.ValueHidden = opt.HideValues
	if err != nil {
		return dl, fmt.Errorf("read dead letter %d: %w", id, err)
	}
	hs, err := sink.JoinHeaders(hkeys, hvals)
	if err != nil {
		return dl, fmt.Errorf("dead letter %d: %w", id, err)
	}
	for i, h := range hs {
		dl.Headers = append(dl.Headers, Header{Key: h.Key, Value: h.Value, ValueSize: int(hsizes[i])})
	}
	rows, err = o.pool.Query(ctx, `SELECT at, event, coalesce(task_id, 0), coalesce(attempt, 0), coalesce(error_class, ''), coalesce(error_message, '')
		FROM `+o.table("dead_letter_events")+` WHERE dead_letter_id = $1 ORDER BY id`, id)
	if err != nil {
		return dl, fmt.Errorf("read history of dead letter %d: %w", id, err)
	}
	var e Event
	_, err = pgx.ForEachRow(rows, []any{&e.At, &e.Event, &e.TaskID, &e.Attempt, &e.Class, &e.Message}, func() error {
		dl.Events = append(dl.Events, e)
		return nil
	})
	if err != nil {
		return dl, fmt.Errorf("read history of dead letter %d: %w", id, err)
	}
	return dl, nil
}

// Action is what a task does to the dead letters it matches.
type Action string

const (
	Replay  Action = "replay"
	Discard Action = "discard"
)

// Preview is a dry run: what a replay or discard of a filter would do.
type Preview struct {
	Action Action  `json:"action"`
	Filter Filter  `json:"filter"`
	Counts []Count `json:"counts"` // of the new dead letters it would act on
	// Matched is how many dead letters it would act on (status new); NotNew how many more the
	// filter matches that it would leave alone (replaying, replayed, discarded).
	Matched int64        `json:"matched"`
	NotNew  int64        `json:"not_new"`
	Sample  []DeadLetter `json:"sample"`
	// BlockingKeys is how many of them block their key (ON_DEAD_LETTER=block): a replay applies
	// each before the records held behind it.
	BlockingKeys int64 `json:"blocking_keys"`
	// Keyed is how many of them have a key: those that do not block it are applied after the
	// key's records that came later (as with ON_DEAD_LETTER=skip).
	Keyed int64 `json:"keyed"`
	// Lost is how many of them are records lost in the retry path (class lost), whose value
	// Postgres never had: a replay leaves them alone.
	Lost int64 `json:"lost"`
	// OfTiers is how many of them are records of a retry tier's topic itself (not kafkapg's
	// copies: their headers were missing): a replay leaves them alone too.
	OfTiers int64    `json:"of_tiers"`
	Notes   []string `json:"notes"`
}

// actionable returns f for the dead letters an action may act on: the new ones.
func actionable(f Filter) (Filter, error) {
	if st := f.statuses(); len(st) > 0 && !slices.Equal(st, []string{"new"}) {
		return f, usage("only new dead letters can be replayed or discarded (status %s was asked for)", f.Status)
	}
	f.Status = "new"
	return f, nil
}

// Preview says what act would do to the dead letters f matches, changing nothing; sample is how
// many of them to show.
func (o *Ops) Preview(ctx context.Context, act Action, f Filter, sample int) (Preview, error) {
	p := Preview{Action: act, Filter: f, Counts: []Count{}, Sample: []DeadLetter{}, Notes: []string{}}
	if act != Replay && act != Discard {
		return p, usage("unknown action %q", act)
	}
	all := f
	all.Status = ""
	nf, err := actionable(f)
	if err != nil {
		return p, err
	}
	if err := nf.Validate(); err != nil {
		return p, err
	}
	if p.Counts, err = o.Summary(ctx, nf); err != nil {
		return p, err
	}
	for _, c := range p.Counts {
		p.Matched += c.N
	}
	counts, err := o.Summary(ctx, all)
	if err != nil {
		return p, err
	}
	for _, c := range counts {
		if c.Status != "new" {
			p.NotNew += c.N
		}
	}
	if sample > 0 {
		if p.Sample, err = o.List(ctx, nf, sample); err != nil {
			return p, err
		}
	}
	if p.Sample == nil {
		p.Sample = []DeadLetter{}
	}
	args := []any{o.group}
	where := nf.where(&args)
	args = append(args, retrytopics.TierTopicPattern(o.group))
	err = o.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE d.key IS NOT NULL), count(*) FILTER (WHERE d.error_class = 'lost' AND d.value IS NULL),
			count(*) FILTER (WHERE EXISTS (SELECT 1 FROM `+o.table("held_keys")+` h WHERE h.consumer_group = d.consumer_group AND h.topic = d.topic
				AND h.partition = d.partition AND h.key_hash = d.key_hash AND h.key = d.key AND h.state = 'blocked' AND h.head_offset = d."offset")),
			count(*) FILTER (WHERE d.topic ~ $`+strconv.Itoa(len(args))+`)
		FROM `+o.table("dead_letters")+` d WHERE `+where, args...).Scan(&p.Keyed, &p.Lost, &p.BlockingKeys, &p.OfTiers)
	if err != nil {
		return p, fmt.Errorf("preview: %w", err)
	}
	if p.NotNew > 0 {
		p.Notes = append(p.Notes, fmt.Sprintf("%d more dead letters match but are not new (replaying, replayed or discarded): they are left alone", p.NotNew))
	}
	if act == Replay && p.Matched > 0 {
		if p.BlockingKeys > 0 {
			p.Notes = append(p.Notes, fmt.Sprintf("%d of them block their key: each is applied before the records held behind it, which follow in order", p.BlockingKeys))
		}
		if n := p.Keyed - p.BlockingKeys; n > 0 {
			p.Notes = append(p.Notes, fmt.Sprintf("%d of them have a key they do not block: each is applied after the key's records that came later (the key's records that arrive after the replay wait behind it)", n))
		}
		if p.Lost > 0 {
			p.Notes = append(p.Notes, fmt.Sprintf("%d of them were lost in the retry path (class lost): Postgres never had their value, so a replay leaves them alone; read them from the source topic at their coordinates", p.Lost))
		}
		if p.OfTiers > 0 {
			p.Notes = append(p.Notes, fmt.Sprintf("%d of them are records of a retry tier's topic itself, without kafkapg's headers (produced there by hand, or garbled): "+
				"no processor applies a tier's own records, so a replay leaves them alone; produce them to their source topic again, or discard them", p.OfTiers))
		}
		p.Notes = append(p.Notes, "a replayed record that fails again goes round the retry tiers and, if it still fails, back into its own dead_letters row (status new)")
	}
	if act == Discard && p.BlockingKeys > 0 {
		p.Notes = append(p.Notes, fmt.Sprintf("%d of them block their key; discarding does not release it: use keys release", p.BlockingKeys))
	}
	return p, nil
}
