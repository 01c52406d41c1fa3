package service

import (
	"context"
	"flag"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/kafkapg/kafkapg/internal/ops"
)

const positionsUsage = `usage: %[1]s positions [COMMAND] [flags]

  (none)   [--json]                                 every source partition: the stored position,
                                                    Kafka's committed offset, the end, the lag, the
                                                    owner, and whether it is paused (by whom, why)
  pause    --topic T [--partition N]                stop applying a topic (or a partition); every
           [--execute --reason R [--actor A]]       replica obeys until resumed
  resume   --topic T [--partition N] [--execute --reason R [--actor A]] [--json]
  set      --topic T [--partition N]                move the group's position: to an offset, the
           (--offset N | --time T | --start | --end) first record at or after a time (RFC 3339, or
           [--execute --reason R [--actor A]]       a duration: that long ago), the start or the end

The group's positions live in Postgres: Kafka's tools (kafka-consumer-groups --reset-offsets) do
nothing to them. Without --partition, pause, resume and set act on every partition of the topic.
pause, resume and set are dry runs without --execute: they print what they would do and change
nothing; set prints, per partition, where it is, where it would go, and how many records that
applies again (a rewind: everything between, by design; a record whose idempotency key is still
in the key ring is skipped as a duplicate instead) or skips (forward: never applied, and traced
as skipped_by_operator). With --execute they need --reason; --actor defaults to the OS user.
All are refused while the upgrade window is open (processors of the release before would not obey).
`

// positionsCmd runs `positions [COMMAND] ...`.
func positionsCmd(ctx context.Context, c *opsCmd, args []string) error {
	if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
		fmt.Fprintf(c.err, positionsUsage, c.prog)
		return errHelpShown
	}
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		return positionsList(ctx, c, args)
	}
	switch args[0] {
	case "list":
		return positionsList(ctx, c, args[1:])
	case "pause", "resume":
		return positionsPause(ctx, c, args[0], args[1:])
	case "set":
		return positionsSet(ctx, c, args[1:])
	}
	fmt.Fprintf(c.err, positionsUsage, c.prog)
	return usagef("unknown command %q", args[0])
}

func positionsList(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("positions")
	synopsis(c, fs, "positions [--json]")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := noArgs(fs); err != nil {
		return err
	}
	kc, err := c.kafka()
	if err != nil {
		return err
	}
	defer kc.Close()
	list, notes, err := c.ops.Partitions(ctx, kc)
	if err != nil {
		return err
	}
	for _, n := range notes {
		fmt.Fprintf(c.err, "note: %s\n", n)
	}
	if *asJSON {
		if list == nil {
			list = []ops.PartitionStatus{}
		}
		return c.json(map[string]any{"partitions": list, "notes": notes})
	}
	if len(list) == 0 {
		fmt.Fprintf(c.err, "no source partition in group %s\n", c.ops.Group())
		return nil
	}
	w := c.table()
	fmt.Fprintln(w, "TOPIC\tPARTITION\tPOSITION\tCOMMITTED\tEND\tLAG\tOWNER\tPAUSED")
	for _, p := range list {
		owner := p.Owner
		if owner == "" {
			owner = "-"
		}
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", p.Topic, p.Partition, offsetCell(p.Stored), offsetCell(p.Committed),
			offsetCell(p.End), offsetCell(p.Lag), owner, pausedCell(p.Paused))
	}
	return w.Flush()
}

func offsetCell(o *int64) string {
	if o == nil {
		return "-"
	}
	return fmt.Sprint(*o)
}

func pausedCell(p *ops.Pause) string {
	if p == nil {
		return "no"
	}
	what := "since"
	if p.Partition == ops.AllPartitions {
		what = "topic, since"
	}
	return fmt.Sprintf("%s %s by %s: %s", what, p.At.UTC().Format(time.RFC3339), oneLineCell(p.By, 40), oneLineCell(p.Reason, 80))
}

// oneLineCell is text for a table cell: on one line, at most n runes.
func oneLineCell(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

// partitionOrAll reads --partition: all partitions (ops.AllPartitions) if not given.
func partitionOrAll(fs *flag.FlagSet, p int) (int32, error) {
	set := false
	fs.Visit(func(fl *flag.Flag) { set = set || fl.Name == "partition" })
	if !set {
		return ops.AllPartitions, nil
	}
	if p < 0 || p > math.MaxInt32 {
		return 0, usagef("--partition %d is out of range (0 or more; leave it out for every partition)", p)
	}
	return int32(p), nil
}

// changeFlags are the flags every positions change takes: what (--topic, --partition), and
// --execute --reason --actor, --json.
type changeFlags struct {
	fs              *flag.FlagSet
	topic           *string
	partition       *int
	execute, asJSON *bool
	reason, actor   *string
	p               int32 // --partition, or ops.AllPartitions (see parse)
}

func newChangeFlags(fs *flag.FlagSet) *changeFlags {
	return &changeFlags{
		fs:        fs,
		topic:     fs.String("topic", "", "source `topic` (required)"),
		partition: fs.Int("partition", -1, "one `partition` (default: every partition of the topic)"),
		execute:   fs.Bool("execute", false, "do it (without: a dry run that changes nothing)"),
		reason:    fs.String("reason", "", "why (required with --execute; kept in the audit table)"),
		actor:     fs.String("actor", defaultActor(), "who (kept in the audit table)"),
		asJSON:    fs.Bool("json", false, "print JSON"),
	}
}

// parse parses args and checks the shared flags; why completes "--execute needs --reason: why
// you ...".
func (f *changeFlags) parse(args []string, why string) error {
	if err := parse(f.fs, args); err != nil {
		return err
	}
	if err := noArgs(f.fs); err != nil {
		return err
	}
	if *f.topic == "" {
		return usagef("--topic is required")
	}
	p, err := partitionOrAll(f.fs, *f.partition)
	if err != nil {
		return err
	}
	f.p = p
	if *f.execute && strings.TrimSpace(*f.reason) == "" {
		return usagef("--execute needs --reason: why you %s (kept in the audit table)", why)
	}
	return nil
}

func (f *changeFlags) who() ops.Actor { return ops.Actor{Name: *f.actor, Reason: *f.reason} }

func positionsPause(ctx context.Context, c *opsCmd, verb string, args []string) error {
	fs := c.flags("positions " + verb)
	synopsis(c, fs, "positions "+verb+" --topic T [--partition N] [--execute --reason R [--actor A]] [--json]")
	f := newChangeFlags(fs)
	if err := f.parse(args, verb+" it"); err != nil {
		return err
	}
	topic, p, asJSON := f.topic, f.p, f.asJSON
	kc, err := c.kafka()
	if err != nil {
		return err
	}
	defer kc.Close()
	do := c.ops.Pause
	if verb == "resume" {
		do = c.ops.Resume
	}
	ch, err := do(ctx, kc, *topic, p, *f.execute, f.who())
	if err != nil {
		return err
	}
	if *asJSON {
		return c.json(ch)
	}
	what := *topic
	if p != ops.AllPartitions {
		what = fmt.Sprintf("%s[%d]", *topic, p)
	}
	switch {
	case !ch.Changed:
		fmt.Fprintf(c.out, "%s: %s; nothing to do\n", what, ch.Note)
	case ch.Executed:
		fmt.Fprintf(c.out, "%s: %sd (audited)\n", what, verb)
	default:
		fmt.Fprintf(c.out, "%s: would %s\ndry run: nothing changed; add --execute --reason ... to %s\n", what, verb, verb)
	}
	return nil
}

func positionsSet(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("positions set")
	synopsis(c, fs, "positions set --topic T [--partition N] (--offset N | --time T | --start | --end) [--execute --reason R [--actor A]] [--json]")
	f := newChangeFlags(fs)
	offset := fs.Int64("offset", -1, "to this `offset`")
	at := fs.String("time", "", "to the first record at or after this `time`: RFC 3339 (2026-12-04T14:00:00Z) or a duration ago (90m)")
	start := fs.Bool("start", false, "to the log's start")
	end := fs.Bool("end", false, "to the log's end (skip everything there is)")
	if err := f.parse(args, "move the position"); err != nil {
		return err
	}
	execute, asJSON := f.execute, f.asJSON
	plan := ops.PositionPlan{Topic: *f.topic, Partition: f.p, Target: ops.Target{Start: *start, End: *end}}
	fs.Visit(func(fl *flag.Flag) {
		if fl.Name == "offset" {
			plan.Target.Offset = offset
		}
	})
	if *at != "" {
		var err error
		if plan.Target.Time, err = parseTimeOrAgo(*at, time.Now()); err != nil {
			return err
		}
	}
	kc, err := c.kafka()
	if err != nil {
		return err
	}
	defer kc.Close()
	moves, err := c.ops.SetPositions(ctx, kc, plan, *execute, f.who())
	if err != nil {
		return err
	}
	if *asJSON {
		return c.json(map[string]any{"moves": moves})
	}
	w := c.table()
	fmt.Fprintln(w, "TOPIC\tPARTITION\tFROM\tTO\tLOG\tAPPLIED AGAIN\tSKIPPED\tPAUSED")
	checks := map[string]bool{}
	for _, m := range moves {
		from := offsetCell(m.From)
		if m.From == nil {
			from = "- (no stored position)"
		}
		paused := "no: its owner goes on at once"
		if m.Paused != nil {
			paused = "since " + m.Paused.At.UTC().Format(time.RFC3339) + " by " + m.Paused.By
		}
		fmt.Fprintf(w, "%s\t%d\t%s\t%d\t%d-%d\t%d\t%d\t%s\n", m.Topic, m.Partition, from, m.To, m.Start, m.End, m.Reapplied, m.Skipped, paused)
		if m.KeyCheck != "" {
			checks[m.KeyCheck] = true
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for k := range checks {
		fmt.Fprintf(c.out, "idempotency keys: %s\n", k)
	}
	if len(moves) > 0 && !moves[0].Executed {
		fmt.Fprintln(c.out, "dry run: nothing changed; add --execute --reason ... to move (the positions may have moved on by then: the change records where each was)")
		return nil
	}
	fmt.Fprintln(c.out, "done (audited): each partition's owner restarts from its new position")
	return nil
}

// parseTimeOrAgo reads an RFC 3339 time, or a positive duration meaning that long before now.
func parseTimeOrAgo(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return time.Time{}, usagef("--time %q: neither an RFC 3339 time (2026-12-04T14:00:00Z) nor a positive duration ago (90m)", s)
	}
	return now.Add(-d), nil
}
