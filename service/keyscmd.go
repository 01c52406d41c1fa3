package service

import (
	"context"
	"encoding/hex"
	"flag"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/internal/tracing"
)

const keysUsage = `usage: %[1]s keys COMMAND [flags]

  list     [--limit N] [--json]                  held keys, the longest held first, and what each waits for
  release  --topic T --partition P --key K       let a blocked or stuck key go on with its held records
           [--key-hex H] [--stuck-after D] [--execute --reason R [--actor A]] [--json]

A key is held while a record of it is in a retry tier (retrying), was dead-lettered with
ON_DEAD_LETTER=block (blocked), or has settled and its held records are being applied (ready).
release releases a blocked key, or a stuck one (no progress for --stuck-after, STALL_TIMEOUT by
default): the record a stuck key waits for is dead-lettered as lost. It is a dry run without
--execute: it prints what it would do and changes nothing. With --execute it needs --reason;
--actor defaults to the OS user.
`

// keysCmd runs `keys COMMAND ...`.
func keysCmd(ctx context.Context, c *opsCmd, args []string) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprintf(c.err, keysUsage, c.prog)
		if len(args) == 0 {
			return usagef("a command is required: list or release")
		}
		return errHelpShown
	}
	switch args[0] {
	case "list":
		return keysList(ctx, c, args[1:])
	case "release":
		return keysRelease(ctx, c, args[1:])
	}
	fmt.Fprintf(c.err, keysUsage, c.prog)
	return usagef("unknown command %q", args[0])
}

// synopsis makes fs's help start with a usage line.
func synopsis(c *opsCmd, fs *flag.FlagSet, line string) {
	fs.Usage = func() {
		fmt.Fprintf(c.err, "usage: %s %s\n\n", c.prog, line)
		fs.PrintDefaults()
	}
}

// noArgs rejects positional arguments left after the flags.
func noArgs(fs *flag.FlagSet) error {
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q (every option is a flag: -h lists them)", fs.Arg(0))
	}
	return nil
}

func keysList(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("keys list")
	synopsis(c, fs, "keys list [--limit N] [--json]")
	limit := fs.Int("limit", 100, "show at most `N` keys")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := noArgs(fs); err != nil {
		return err
	}
	if *limit <= 0 {
		return usagef("--limit must be positive, got %d", *limit)
	}
	keys, err := c.ops.Keys(ctx, *limit)
	if err != nil {
		return err
	}
	if *asJSON {
		return c.json(keys)
	}
	if len(keys) == 0 {
		fmt.Fprintf(c.err, "no held keys in group %s\n", c.ops.Group())
		return nil
	}
	w := c.table()
	fmt.Fprintln(w, "TOPIC\tPARTITION\tKEY\tSTATE\tSINCE\tHELD\tWHY")
	for _, k := range keys {
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%d\t%s\n", k.Topic, k.Partition, keyCell(k.Key), k.State,
			k.Since.UTC().Format(time.RFC3339), k.Held, k.Why)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if len(keys) == *limit {
		fmt.Fprintf(c.err, "showing the %d longest held keys; --limit shows more\n", *limit)
	}
	return nil
}

// keyCell is a key for a table cell: as ops.KeyText writes it, shortened.
func keyCell(key []byte) string { return safetext.Truncate(ops.KeyText(key), 64) }

// keyFlags registers --key and --key-hex on fs; call the returned function after parsing. It
// returns nil if neither was given.
func keyFlags(fs *flag.FlagSet) func() ([]byte, error) {
	text := fs.String("key", "", "record `key`, as text")
	hexKey := fs.String("key-hex", "", "record key, in `hex` (with or without 0x)")
	return func() ([]byte, error) {
		set := map[string]bool{}
		fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
		switch {
		case set["key"] && set["key-hex"]:
			return nil, usagef("--key and --key-hex: give one of them")
		case set["key"]:
			return []byte(*text), nil
		case set["key-hex"]:
			b, err := hex.DecodeString(strings.TrimPrefix(*hexKey, "0x"))
			if err != nil {
				return nil, usagef("--key-hex %q: not hex: %v", *hexKey, err)
			}
			return b, nil
		}
		return nil, nil
	}
}

// partitionFlag checks a --partition value.
func partitionFlag(p int) (int32, error) {
	if p < 0 {
		return 0, usagef("--partition is required (0 or more)")
	}
	if p > math.MaxInt32 {
		return 0, usagef("--partition %d is out of range", p)
	}
	return int32(p), nil
}

func keysRelease(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("keys release")
	synopsis(c, fs, "keys release --topic T --partition P (--key K | --key-hex H) [--execute --reason R [--actor A]]")
	topic := fs.String("topic", "", "source `topic` of the key (required)")
	partition := fs.Int("partition", -1, "source `partition` of the key (required)")
	key := keyFlags(fs)
	execute := fs.Bool("execute", false, "do it (without: a dry run that changes nothing)")
	reason := fs.String("reason", "", "why (required with --execute; kept in the audit table)")
	actor := fs.String("actor", defaultActor(), "who (kept in the audit table)")
	stuckAfter := fs.Duration("stuck-after", c.env.StallTimeout, "a key that made no progress for this long is stuck (default: STALL_TIMEOUT)")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := noArgs(fs); err != nil {
		return err
	}
	if *topic == "" {
		return usagef("--topic is required")
	}
	p, err := partitionFlag(*partition)
	if err != nil {
		return err
	}
	k, err := key()
	if err != nil {
		return err
	}
	if k == nil {
		return usagef("--key or --key-hex is required")
	}
	if *stuckAfter <= 0 {
		return usagef("--stuck-after must be positive, got %v", *stuckAfter)
	}
	if *execute && strings.TrimSpace(*reason) == "" {
		return usagef("--execute needs --reason: why you release this key (kept in the audit table)")
	}
	scope := c.env.stuckScope()
	scope.Older = *stuckAfter
	rel, err := c.ops.ReleaseKey(ctx, *topic, p, k, scope, *execute, ops.Actor{Name: *actor, Reason: *reason})
	if err != nil {
		return err
	}
	if *asJSON {
		return c.json(rel)
	}
	w := c.out
	fmt.Fprintf(w, "%s[%d] key %s: %s since %s, %d held records\n", rel.Topic, rel.Partition, keyCell(rel.Key), rel.State,
		rel.Since.UTC().Format(time.RFC3339), rel.Held)
	fmt.Fprintf(w, "  why: %s\n", rel.Why)
	if rel.Reason != "blocked" {
		fmt.Fprintf(w, "  stuck: %s (no progress for %s)\n", rel.Reason, *stuckAfter)
	}
	if !rel.Executed {
		fmt.Fprintf(w, "would %s\n", rel.Action)
		fmt.Fprintln(w, "dry run: nothing changed; add --execute --reason ... to release")
		return nil
	}
	fmt.Fprintf(w, "done (audited): %s\n", rel.Action)
	if rel.LostDeadLetterID != 0 {
		fmt.Fprintf(w, "the lost record is dead letter #%d (%s dlq show %d)\n", rel.LostDeadLetterID, c.prog, rel.LostDeadLetterID)
	}
	return nil
}

const traceUsage = `usage: %[1]s trace --topic T --partition P --offset O [--json]
       %[1]s trace --topic T (--key K | --key-hex H) [--limit N] [--scan N] [--json]

Where a record is now (not consumed, applied, in a retry tier, in the outbox, held,
dead-lettered, beyond the broker's retention) and how it got there. With a key: the key's
records that the retry path keeps in Postgres, and those among the last --scan records of
each partition of the topic, newest first.

`

// traceCmd runs `trace ...`.
func traceCmd(ctx context.Context, c *opsCmd, args []string) error {
	fs := c.flags("trace")
	fs.Usage = func() {
		fmt.Fprintf(c.err, traceUsage, c.prog)
		fs.PrintDefaults()
	}
	topic := fs.String("topic", "", "source `topic` (required)")
	partition := fs.Int("partition", -1, "the record's `partition`")
	offset := fs.Int64("offset", -1, "the record's `offset`")
	key := keyFlags(fs)
	limit := fs.Int("limit", 20, "with a key: at most `N` records")
	scan := fs.Int("scan", 1000, "with a key: read the last `N` records of each partition from Kafka")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := noArgs(fs); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	if *topic == "" {
		return usagef("--topic is required")
	}
	k, err := key()
	if err != nil {
		return err
	}
	q := ops.TraceQuery{Topic: *topic, Key: k}
	if k != nil {
		if set["partition"] || set["offset"] {
			return usagef("--partition and --offset trace one record, --key the records of a key: give one or the other")
		}
		if *limit <= 0 {
			return usagef("--limit must be positive, got %d", *limit)
		}
		if *scan <= 0 {
			return usagef("--scan must be positive, got %d", *scan)
		}
		q.Limit, q.Scan = *limit, *scan
	} else {
		if set["limit"] || set["scan"] {
			return usagef("--limit and --scan go with --key")
		}
		if !set["partition"] || !set["offset"] {
			return usagef("--partition and --offset are required (or --key)")
		}
		if q.Partition, err = partitionFlag(*partition); err != nil {
			return err
		}
		if *offset < 0 {
			return usagef("--offset must be 0 or more, got %d", *offset)
		}
		q.Offset = *offset
	}
	kc, err := c.kafka()
	if err != nil {
		return err
	}
	defer kc.Close()
	res, err := c.ops.Trace(ctx, q, kc)
	if err != nil {
		return err
	}
	for _, n := range res.Notes {
		fmt.Fprintf(c.err, "note: %s\n", n)
	}
	if *asJSON {
		return c.json(res)
	}
	if len(res.Records) == 0 {
		fmt.Fprintf(c.err, "no record of key %s in %s: none in Postgres, none in the last %d records of each partition\n",
			keyCell(k), *topic, q.Scan)
		return nil
	}
	printTrace(c, res.Records)
	return nil
}

// printTrace writes each record's trace: a line saying where it is, then its steps.
func printTrace(c *opsCmd, recs []ops.RecordTrace) {
	w := c.out
	for i, r := range recs {
		if i > 0 {
			fmt.Fprintln(w)
		}
		key := ""
		if r.KeyText != "" {
			key = " key=" + safetext.Truncate(r.KeyText, 64)
		}
		fmt.Fprintf(w, "%s[%d]@%d%s: %s\n", r.Topic, r.Partition, r.Offset, key, r.Now)
		if r.TraceID != "" {
			link := ""
			if u := tracing.ViewerURL(c.env.TraceURL, r.TraceID); u != "" {
				link = " " + u
			}
			fmt.Fprintf(w, "  trace %s%s\n", r.TraceID, link)
		}
		for _, s := range r.Steps {
			fmt.Fprintf(w, "  %s  %s\n", s.At.UTC().Format(time.RFC3339), s.What)
		}
	}
}
