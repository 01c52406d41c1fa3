package service

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
)

const dlqUsage = `usage: %[1]s dlq COMMAND [flags]

  list     [filters] [--limit N] [--summary] [--json]    dead letters, newest first
  show     ID [--json]                                   one dead letter: record, headers, history
  replay   [filters] [--execute --reason R] [--rate N]   bring dead letters back through the pipeline
  discard  [filters] [--execute --reason R]              give up on dead letters (rows are kept)
  purge    --older-than D [--execute --reason R]         delete replayed and discarded rows
  tasks    [--limit N] [--json]                          replay and discard tasks, newest first
  cancel   TASK [--reason R]                             stop a running task
  resume   TASK                                          go on with a task whose runner stopped

Filters: --topic T, --key K (or --key-hex H), --class C, --status S (repeatable, or
comma-separated: any of them), --since T, --until T (RFC 3339, or a duration ago such as
24h), --error TEXT, --id N (repeatable, or comma-separated).

replay and discard are dry runs without --execute: they print what they would do and
change nothing. With --execute they need --reason; --actor defaults to the OS user.
`

// dlqCmd runs `dlq COMMAND ...`.
func dlqCmd(ctx context.Context, c *opsCmd, args []string) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprintf(c.err, dlqUsage, c.prog)
		if len(args) == 0 {
			return usagef("a command is required")
		}
		return errHelpShown
	}
	sub, args := args[0], args[1:]
	switch sub {
	case "list":
		return dlqList(ctx, c, args)
	case "show":
		return dlqShow(ctx, c, args)
	case "replay":
		return dlqAct(ctx, c, ops.Replay, args)
	case "discard":
		return dlqAct(ctx, c, ops.Discard, args)
	case "purge":
		return dlqPurge(ctx, c, args)
	case "tasks":
		return dlqTasks(ctx, c, args)
	case "cancel":
		return dlqCancel(ctx, c, args)
	case "resume":
		return dlqResume(ctx, c, args)
	}
	fmt.Fprintf(c.err, dlqUsage, c.prog)
	return usagef("unknown command %q", sub)
}

// filterFlags registers the filter flags on fs; call the returned function after parsing.
func filterFlags(fs *flag.FlagSet) func() (ops.Filter, error) {
	topic := fs.String("topic", "", "source `topic`")
	key := fs.String("key", "", "record `key`, as text")
	keyHex := fs.String("key-hex", "", "record key, in `hex`")
	class := fs.String("class", "", "error `class`: retryable, permanent, lost, ...")
	var status statusList
	fs.Var(&status, "status", "`status`: new, replaying, replayed, discarded (repeatable, or comma-separated)")
	since := fs.String("since", "", "dead-lettered at or after `time` (RFC 3339, or a duration ago: 24h)")
	until := fs.String("until", "", "dead-lettered before `time` (RFC 3339, or a duration ago)")
	errText := fs.String("error", "", "a `substring` of the error message")
	var ids idList
	fs.Var(&ids, "id", "dead letter `id` (repeatable, or comma-separated)")
	return func() (ops.Filter, error) {
		f := ops.Filter{Topic: *topic, Class: *class, Status: ops.JoinStatuses(status), Error: *errText, IDs: ids}
		set := map[string]bool{}
		fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
		switch {
		case set["key"] && set["key-hex"]:
			return f, usagef("--key and --key-hex: give one of them")
		case set["key"]:
			f.Key, f.HasKey = []byte(*key), true
		case set["key-hex"]:
			b, err := hex.DecodeString(strings.TrimPrefix(*keyHex, "0x"))
			if err != nil {
				return f, usagef("--key-hex %q: not hex: %v", *keyHex, err)
			}
			f.Key, f.HasKey = b, true
		}
		var err error
		if f.Since, err = parseWhen("since", *since); err != nil {
			return f, err
		}
		if f.Until, err = parseWhen("until", *until); err != nil {
			return f, err
		}
		return f, f.Validate()
	}
}

// parseWhen reads an RFC 3339 time or a duration ago; empty is the zero time.
func parseWhen(name, s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	return ops.ParseWhen("--"+name, s, time.Now())
}

// statusList is a repeatable, comma-separated list of statuses.
type statusList []string

func (l *statusList) String() string { return strings.Join(*l, ",") }
func (l *statusList) Set(s string) error {
	*l = append(*l, s)
	return nil
}

// idList is a repeatable, comma-separated list of ids.
type idList []int64

func (l *idList) String() string { return fmt.Sprint([]int64(*l)) }
func (l *idList) Set(s string) error {
	ids, err := ops.ParseIDs(s)
	*l = append(*l, ids...)
	return err
}

func dlqList(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("dlq list")
	filter := filterFlags(fs)
	limit := fs.Int("limit", 50, "show at most `N` dead letters")
	summary := fs.Bool("summary", false, "count by topic, error class and status instead")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	f, err := filter()
	if err != nil {
		return err
	}
	if *limit < 1 || *limit > 10000 {
		return usagef("--limit %d: want 1 to 10000", *limit)
	}
	if *summary {
		counts, err := c.ops.Summary(ctx, f)
		if err != nil {
			return err
		}
		if *asJSON {
			return c.json(counts)
		}
		printCounts(c, counts)
		return nil
	}
	dls, err := c.ops.List(ctx, f, *limit)
	if err != nil {
		return err
	}
	if *asJSON {
		return c.json(dls)
	}
	if len(dls) == 0 {
		fmt.Fprintln(c.out, "no dead letters match")
		return nil
	}
	tw := c.table()
	fmt.Fprintln(tw, "ID\tTOPIC\tPARTITION\tOFFSET\tKEY\tCLASS\tSTATUS\tATTEMPTS\tDEAD-LETTERED\tERROR")
	for _, d := range dls {
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%s\t%s\t%s\t%d\t%s\t%s\n", d.ID, d.Topic, d.Partition, d.Offset, shortBytes(d.Key, 24),
			d.Class, d.Status, d.Attempts, d.DeadLetteredAt.UTC().Format(time.RFC3339), safetext.Text(oneLine(d.Message), 60))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(dls) == *limit {
		fmt.Fprintf(c.err, "(first %d shown; --limit for more, --summary for counts)\n", *limit)
	}
	return nil
}

func printCounts(c *opsCmd, counts []ops.Count) {
	if len(counts) == 0 {
		fmt.Fprintln(c.out, "no dead letters match")
		return
	}
	tw := c.table()
	fmt.Fprintln(tw, "TOPIC\tCLASS\tSTATUS\tCOUNT\tOLDEST\tNEWEST")
	var total int64
	for _, n := range counts {
		total += n.N
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", n.Topic, n.Class, n.Status, n.N,
			n.Oldest.UTC().Format(time.RFC3339), n.Newest.UTC().Format(time.RFC3339))
	}
	fmt.Fprintf(tw, "total\t\t\t%d\t\t\n", total)
	_ = tw.Flush()
}

func dlqShow(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("dlq show")
	asJSON := fs.Bool("json", false, "print JSON")
	valueBytes := fs.Int("value-bytes", ops.ShownValueBytes, fmt.Sprintf("read the value's first `N` bytes (at most %d)", ops.MaxShownValueBytes))
	pos, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("dlq show takes one dead letter id")
	}
	id, err := strconv.ParseInt(pos[0], 10, 64)
	if err != nil {
		return usagef("dead letter id %q is not a number", pos[0])
	}
	if *valueBytes <= 0 || *valueBytes > ops.MaxShownValueBytes {
		return usagef("--value-bytes must be between 1 and %d, got %d", ops.MaxShownValueBytes, *valueBytes)
	}
	d, err := c.ops.Show(ctx, id, ops.ShowOptions{ValueBytes: *valueBytes})
	if err != nil {
		return err
	}
	decoded, notDecoded := c.decoded(ctx, d.Value, d.ValueTruncated)
	if *asJSON {
		out := struct {
			ops.DeadLetter
			// Decoded is the value decoded with its schema (the Schema Registry's wire format);
			// NotDecoded says why a value in that format was not.
			Decoded    *decodedValue `json:"decoded_value,omitempty"`
			NotDecoded string        `json:"not_decoded,omitempty"`
		}{d, decoded, notDecoded}
		return c.json(out)
	}
	w := c.out
	fmt.Fprintf(w, "dead letter %d: %s[%d]@%d, status %s since %s", d.ID, d.Topic, d.Partition, d.Offset, d.Status, d.StatusChangedAt.UTC().Format(time.RFC3339))
	if d.Replays > 0 {
		fmt.Fprintf(w, ", replayed %d time(s)", d.Replays)
	}
	fmt.Fprintln(w)
	if d.BlocksKey {
		fmt.Fprintln(w, "its key is blocked behind it (ON_DEAD_LETTER=block): replay it, or release the key with keys release")
	}
	fmt.Fprintf(w, "  error:      %s\n", safetext.Text(ops.ErrorText(d.Class, d.Message), 2000))
	fmt.Fprintf(w, "  attempts:   %d (first failed %s, dead-lettered %s)\n", d.Attempts,
		d.FirstFailedAt.UTC().Format(time.RFC3339), d.DeadLetteredAt.UTC().Format(time.RFC3339))
	fmt.Fprintf(w, "  timestamp:  %s\n", d.Timestamp.Format(time.RFC3339Nano))
	fmt.Fprintf(w, "  key:        %s\n", showBytes(d.Key))
	switch {
	case decoded != nil:
		fmt.Fprintf(w, "  value:      %s, decoded:\n", decoded.Schema)
		for _, line := range strings.Split(decoded.rendered, "\n") {
			fmt.Fprintf(w, "              %s\n", line)
		}
	case notDecoded != "":
		fmt.Fprintf(w, "  value:      %s\n", showBytes(d.Value))
		fmt.Fprintf(w, "              (%s)\n", notDecoded)
	default:
		fmt.Fprintf(w, "  value:      %s\n", showBytes(d.Value))
	}
	if d.ValueTruncated {
		fmt.Fprintf(w, "              (its first %d bytes of %d were read; --value-bytes reads more)\n", len(d.Value), d.ValueSize)
	}
	if len(d.Headers) > 0 {
		fmt.Fprintln(w, "  headers:")
		for _, h := range d.Headers {
			fmt.Fprintf(w, "    %s: %s\n", safetext.Text(oneLine(h.Key), 200), showBytes(h.Value))
		}
	}
	fmt.Fprintln(w, "  history:")
	for _, e := range d.Events {
		fmt.Fprintf(w, "    %s  %s", e.At.UTC().Format(time.RFC3339), e.Event)
		if e.Attempt > 0 {
			fmt.Fprintf(w, " (attempt %d)", e.Attempt)
		}
		if e.TaskID > 0 {
			fmt.Fprintf(w, " by task %d", e.TaskID)
		}
		if e.Class != "" {
			fmt.Fprintf(w, ": %s", safetext.Text(ops.ErrorText(e.Class, e.Message), 200))
		}
		fmt.Fprintln(w)
	}
	return nil
}

// parseArgs parses args with fs, flags and positional arguments in any order ("show 7 --json"
// as well as "show --json 7"), and returns the positional ones.
func parseArgs(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := parse(fs, args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

func dlqAct(ctx context.Context, c *opsCmd, act ops.Action, args []string) error {
	name := "dlq " + string(act)
	fs := c.flags(name)
	filter := filterFlags(fs)
	execute := fs.Bool("execute", false, "do it (without: a dry run that changes nothing)")
	reason := fs.String("reason", "", "why (required with --execute; kept in the audit table)")
	actor := fs.String("actor", defaultActor(), "who (kept in the audit table)")
	sample := fs.Int("sample", 5, "dry run: show `N` of the matching dead letters")
	asJSON := fs.Bool("json", false, "print JSON")
	var rate float64
	var wait time.Duration
	if act == ops.Replay {
		fs.Float64Var(&rate, "rate", 0, "replay at most `N` records per second (0: no limit)")
		fs.DurationVar(&wait, "wait", 30*time.Second, "after queuing, wait up to this long for the replayed records to settle (0: do not wait)")
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	f, err := filter()
	if err != nil {
		return err
	}
	if *sample < 0 || *sample > 100 {
		return usagef("--sample %d: want 0 to 100", *sample)
	}
	if !*execute {
		p, err := c.ops.Preview(ctx, act, f, *sample)
		if err != nil {
			return err
		}
		if act == ops.Replay {
			p.Notes = append(p.Notes, c.unconsumed(p.Counts)...)
		}
		if *asJSON {
			return c.json(p)
		}
		printPreview(c, p)
		return nil
	}
	if strings.TrimSpace(*reason) == "" {
		return usagef("--execute needs --reason: why you %s these dead letters (kept in the audit table)", act)
	}
	// Rows the filter names that are not new are refused; say so before acting on the others.
	if p, err := c.ops.Preview(ctx, act, f, 0); err == nil && p.NotNew > 0 && p.Matched > 0 {
		fmt.Fprintf(c.err, "refused: %d matching dead letters are not new (replaying, replayed or discarded); they are left alone\n", p.NotNew)
	}
	t, err := c.ops.StartTask(ctx, act, f, ops.Actor{Name: *actor, Reason: *reason}, rate)
	var nothing *ops.NothingNewError
	if errors.As(err, &nothing) {
		// The same replay run again: nothing new to act on is what a safe repeat finds.
		if *asJSON {
			return c.json(nothingNewJSON(nothing))
		}
		fmt.Fprintln(c.out, nothing.Error())
		return nil
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(c.err, "task %d: %s %d dead letters (actor %s)\n", t.ID, act, t.Matched, safetext.Text(oneLine(t.Actor), 80))
	return runTask(ctx, c, t.ID, wait, *asJSON)
}

// nothingNewJSON is what the CLI's --json and the API answer when a replay or discard finds no new
// dead letter among those its filter matches: a success, saying so.
func nothingNewJSON(e *ops.NothingNewError) map[string]any {
	return map[string]any{"nothing_new": true, "message": e.Error(), "action": e.Action, "not_new": e.NotNew, "replaying": e.Replaying}
}

// unconsumed warns of the topics among counts that this service does not consume: a replayed
// record waits for a processor of its topic to apply it.
func (c *opsCmd) unconsumed(counts []ops.Count) []string {
	var notes []string
	seen := map[string]bool{}
	for _, n := range counts {
		if seen[n.Topic] || slices.Contains(c.env.KafkaTopics, n.Topic) {
			continue
		}
		seen[n.Topic] = true
		notes = append(notes, fmt.Sprintf("topic %s is not in this service's KAFKA_TOPICS: its replayed records wait until a processor of group %s that consumes it runs", n.Topic, c.ops.Group()))
	}
	return notes
}

func printPreview(c *opsCmd, p ops.Preview) {
	w := c.out
	fmt.Fprintf(w, "dry run: %s would act on %d new dead letters; nothing changed.\n\n", p.Action, p.Matched)
	printCounts(c, p.Counts)
	if len(p.Sample) > 0 {
		fmt.Fprintln(w, "\nsample:")
		tw := c.table()
		fmt.Fprintln(tw, "ID\tTOPIC\tPARTITION\tOFFSET\tKEY\tCLASS\tATTEMPTS\tERROR")
		for _, d := range p.Sample {
			fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%s\t%s\t%d\t%s\n", d.ID, d.Topic, d.Partition, d.Offset, shortBytes(d.Key, 24),
				d.Class, d.Attempts, safetext.Text(oneLine(d.Message), 60))
		}
		_ = tw.Flush()
	}
	if len(p.Notes) > 0 {
		fmt.Fprintln(w)
		for _, n := range p.Notes {
			fmt.Fprintf(w, "note: %s\n", n)
		}
	}
	if p.Matched > 0 {
		fmt.Fprintf(w, "\nto do it: add --execute --reason \"...\"\n")
	}
}

// runTask runs task id, printing progress, then waits up to wait for a replay's records to
// settle and prints where the task stands.
func runTask(ctx context.Context, c *opsCmd, id int64, wait time.Duration, asJSON bool) error {
	host, _ := os.Hostname()
	runner := fmt.Sprintf("%s/%d", host, os.Getpid())
	last := time.Time{}
	t, err := c.ops.RunTask(ctx, id, runner, func(t ops.Task) {
		if time.Since(last) >= time.Second || t.Status != "running" {
			last = time.Now()
			fmt.Fprintf(c.err, "task %d: %d of %d done (%s)\n", t.ID, t.Done, t.Matched, t.Status)
		}
	})
	if err != nil {
		return err
	}
	if t.Status == "running" {
		return fmt.Errorf("task %d is still running elsewhere", t.ID)
	}
	deadline := time.Now().Add(wait)
	for t.Action == ops.Replay && t.Pending > 0 && time.Now().Before(deadline) {
		if err := sleepCtx(ctx, 500*time.Millisecond); err != nil {
			break
		}
		if t2, err := c.ops.Task(ctx, id); err == nil {
			if t2.Pending != t.Pending {
				fmt.Fprintf(c.err, "task %d: %d applied, %s skipped, %d dead again, %d on their way\n", id, t2.Applied, duplicates(t2.SkippedDuplicate), t2.DeadAgain, t2.Pending)
			}
			t = t2
		}
	}
	if asJSON {
		return c.json(t)
	}
	printTask(c, t)
	return nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// duplicates counts n duplicates in words: "1 duplicate", "2 duplicates".
func duplicates(n int64) string {
	if n == 1 {
		return "1 duplicate"
	}
	return fmt.Sprintf("%d duplicates", n)
}

func printTask(c *opsCmd, t ops.Task) {
	w := c.out
	fmt.Fprintf(w, "task %d (%s): %s", t.ID, t.Action, t.Status)
	if t.Interrupted {
		fmt.Fprintf(w, ", interrupted: its runner stopped; resume it with: dlq resume %d", t.ID)
	}
	fmt.Fprintf(w, "\n  %d matched, %d done, %d passed over (no longer new when reached)\n", t.Matched, t.Done, t.Skipped)
	if t.Action == ops.Replay {
		fmt.Fprintf(w, "  %d applied, %s skipped (a copy with their idempotency key was applied before), %d dead-lettered again, %d still on their way (held behind their key or in the retry tiers)\n",
			t.Applied, duplicates(t.SkippedDuplicate), t.DeadAgain, t.Pending)
		if t.Pending > 0 {
			fmt.Fprintf(w, "  follow them with: dlq tasks, or dlq list --status replaying\n")
		}
		if t.DeadAgain > 0 {
			fmt.Fprintf(w, "  the ones that failed again are back in their rows: dlq list --status new\n")
		}
	}
}

func dlqTasks(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("dlq tasks")
	limit := fs.Int("limit", 20, "show at most `N` tasks")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *limit < 1 || *limit > 10000 {
		return usagef("--limit %d: want 1 to 10000", *limit)
	}
	ts, err := c.ops.Tasks(ctx, *limit)
	if err != nil {
		return err
	}
	if *asJSON {
		return c.json(ts)
	}
	if len(ts) == 0 {
		fmt.Fprintln(c.out, "no tasks")
		return nil
	}
	tw := c.table()
	fmt.Fprintln(tw, "ID\tACTION\tSTATUS\tMATCHED\tDONE\tAPPLIED\tSKIPPED-DUPLICATE\tDEAD-AGAIN\tPENDING\tACTOR\tCREATED\tREASON")
	for _, t := range ts {
		status := t.Status
		if t.Interrupted {
			status = "interrupted"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", t.ID, t.Action, status, t.Matched, t.Done,
			t.Applied, t.SkippedDuplicate, t.DeadAgain, t.Pending, safetext.Text(oneLine(t.Actor), 40), t.CreatedAt.UTC().Format(time.RFC3339), safetext.Text(oneLine(t.Reason), 50))
	}
	return tw.Flush()
}

// taskID parses args with fs and returns the one task id they name.
func taskID(fs *flag.FlagSet, args []string, cmd string) (int64, error) {
	pos, err := parseArgs(fs, args)
	if err != nil {
		return 0, err
	}
	if len(pos) != 1 {
		return 0, usagef("%s takes one task id", cmd)
	}
	id, err := strconv.ParseInt(pos[0], 10, 64)
	if err != nil {
		return 0, usagef("task id %q is not a number", pos[0])
	}
	return id, nil
}

func dlqCancel(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("dlq cancel")
	reason := fs.String("reason", "", "why (kept in the audit table)")
	actor := fs.String("actor", defaultActor(), "who (kept in the audit table)")
	id, err := taskID(fs, args, "dlq cancel")
	if err != nil {
		return err
	}
	t, err := c.ops.Cancel(ctx, id, ops.Actor{Name: *actor, Reason: *reason})
	if err != nil {
		return err
	}
	printTask(c, t)
	return nil
}

func dlqResume(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("dlq resume")
	wait := fs.Duration("wait", 30*time.Second, "after queuing, wait up to this long for the replayed records to settle")
	asJSON := fs.Bool("json", false, "print JSON")
	id, err := taskID(fs, args, "dlq resume")
	if err != nil {
		return err
	}
	err = runTask(ctx, c, id, *wait, *asJSON)
	if errors.Is(err, ops.ErrTaskBusy) {
		return usagef("%v", err)
	}
	return err
}

func dlqPurge(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("dlq purge")
	older := fs.Duration("older-than", 0, "purge replayed and discarded rows whose status changed longer ago than this (720h: 30 days)")
	execute := fs.Bool("execute", false, "do it (without: count only)")
	reason := fs.String("reason", "", "why (required with --execute)")
	actor := fs.String("actor", defaultActor(), "who (kept in the audit table)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *older <= 0 {
		return usagef("--older-than is required: purge rows replayed or discarded longer ago than this (e.g. 720h)")
	}
	if *execute && strings.TrimSpace(*reason) == "" {
		return usagef("--execute needs --reason")
	}
	n, err := c.ops.Purge(ctx, *older, *execute, ops.Actor{Name: *actor, Reason: *reason})
	if err != nil {
		return err
	}
	if !*execute {
		fmt.Fprintf(c.out, "dry run: %d replayed or discarded dead letters changed status more than %s ago; nothing deleted (add --execute --reason \"...\")\n", n, *older)
		return nil
	}
	fmt.Fprintf(c.out, "deleted %d replayed or discarded dead letters (and their history)\n", n)
	return nil
}

// showBytes writes b as text if it is printable UTF-8, otherwise as base64 with its size.
// Values longer than maxShown bytes are cut (--json has them whole).
func showBytes(b []byte) string {
	const maxShown = 16 << 10
	cut := ""
	if len(b) > maxShown {
		cut = fmt.Sprintf(" (%d bytes read; --json shows them all)", len(b))
	}
	switch {
	case b == nil:
		return "(none)"
	case printable(b):
		return safetext.Truncate(string(b), maxShown) + cut
	}
	return fmt.Sprintf("(%d bytes, not text) base64:%s%s", len(b), base64.StdEncoding.EncodeToString(b[:min(len(b), maxShown)]), cut)
}

// shortBytes is a key for a table cell (ops.KeyText), at most n bytes.
func shortBytes(b []byte, n int) string { return safetext.Truncate(ops.KeyText(b), n) }

// printable reports whether b is text to show as it is: valid UTF-8, printable characters,
// newlines and tabs (no carriage returns or other control characters that would rewrite the
// terminal).
func printable(b []byte) bool {
	if !utf8.Valid(b) {
		return false
	}
	for _, r := range string(b) {
		if !unicode.IsPrint(r) && r != '\n' && r != '\t' {
			return false
		}
	}
	return true
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// decodedValue is a value decoded with its schema, as dlq show gives it.
type decodedValue struct {
	Schema   string          `json:"schema"` // what it is: type, schema id, subjects
	SchemaID int             `json:"schema_id"`
	Value    json.RawMessage `json:"value"`
	rendered string
}

// decoded decodes v with its schema when it is in the Schema Registry's wire format and
// SCHEMA_REGISTRY_URL is set; notDecoded says why a value in that format was not (a truncated
// one cannot be: --value-bytes reads more).
func (c *opsCmd) decoded(ctx context.Context, v []byte, truncated bool) (*decodedValue, string) {
	if c.env.sr == nil || !schemaregistry.LooksLikeWireFormat(v) {
		return nil, ""
	}
	if truncated {
		return nil, fmt.Sprintf("in the Schema Registry's wire format, not decoded: only its first %d bytes were read; --value-bytes reads more", len(v))
	}
	rd, err := c.env.sr.Render(ctx, v)
	if err != nil {
		return nil, "in the Schema Registry's wire format, not decoded: " + err.Error()
	}
	return &decodedValue{Schema: rd.Describe(), SchemaID: rd.SchemaID, Value: json.RawMessage(rd.JSON), rendered: rd.JSON}, ""
}
