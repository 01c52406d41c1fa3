package service

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// keysCmdEnv is an operator command's environment for group kg consuming orders (two retry
// tiers), writing to buffers; pool may be nil for commands that fail before using it.
func keysCmdEnv(pool *pgxpool.Pool, brokers ...string) (*opsCmd, *bytes.Buffer, *bytes.Buffer) {
	var out, errOut bytes.Buffer
	e := &env{KafkaBrokers: brokers, KafkaGroupID: "kg", KafkaTopics: []string{"orders"}, StallTimeout: time.Minute,
		tiers: []time.Duration{time.Second, time.Minute}}
	e.DBSchema = "kafkapg"
	c := newOpsCmd("kafkapg", e, pool, &out, &errOut)
	if pool == nil {
		c.ops = nil
	}
	return c, &out, &errOut
}

// TestKeysAndTraceUsage: every subcommand has -h, and bad usage is a usage error naming the
// flag, found before anything is read.
func TestKeysAndTraceUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string // in the usage error, or "help" for -h
	}{
		{[]string{"keys"}, "a command is required: list or release"},
		{[]string{"keys", "-h"}, "help"},
		{[]string{"keys", "bogus"}, `unknown command "bogus"`},
		{[]string{"keys", "list", "-h"}, "help"},
		{[]string{"keys", "list", "--limit", "0"}, "--limit must be positive"},
		{[]string{"keys", "list", "extra"}, `unexpected argument "extra"`},
		{[]string{"keys", "list", "--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"keys", "release", "-h"}, "help"},
		{[]string{"keys", "release"}, "--topic is required"},
		{[]string{"keys", "release", "--topic", "orders"}, "--partition is required"},
		{[]string{"keys", "release", "--topic", "orders", "--partition", "0"}, "--key or --key-hex is required"},
		{[]string{"keys", "release", "--topic", "orders", "--partition", "0", "--key", "a", "--key-hex", "61"}, "--key and --key-hex: give one of them"},
		{[]string{"keys", "release", "--topic", "orders", "--partition", "0", "--key-hex", "zz"}, `--key-hex "zz": not hex`},
		{[]string{"keys", "release", "--topic", "orders", "--partition", "0", "--key", "a", "--stuck-after", "0s"}, "--stuck-after must be positive"},
		{[]string{"keys", "release", "--topic", "orders", "--partition", "0", "--key", "a", "--execute"}, "--execute needs --reason"},
		{[]string{"trace", "-h"}, "help"},
		{[]string{"trace"}, "--topic is required"},
		{[]string{"trace", "--topic", "orders", "--offset", "3"}, "--partition and --offset are required (or --key)"},
		{[]string{"trace", "--topic", "orders", "--partition", "0", "--offset", "-2"}, "--offset must be 0 or more"},
		{[]string{"trace", "--topic", "orders", "--key", "k", "--offset", "3"}, "give one or the other"},
		{[]string{"trace", "--topic", "orders", "--partition", "0", "--offset", "1", "--scan", "5"}, "--limit and --scan go with --key"},
		{[]string{"trace", "--topic", "orders", "--key", "k", "--limit", "0"}, "--limit must be positive"},
	} {
		c, _, errOut := keysCmdEnv(nil)
		run := keysCmd
		if tc.args[0] == "trace" {
			run = traceCmd
		}
		err := run(context.Background(), c, tc.args[1:])
		var uerr *usageError
		switch {
		case tc.want == "help":
			if !errors.Is(err, errHelpShown) || !strings.Contains(errOut.String(), "usage: kafkapg "+tc.args[0]) {
				t.Errorf("%q: %v, help %q; want the help shown", tc.args, err, errOut)
			}
		case !errors.As(err, &uerr) || !strings.Contains(err.Error(), tc.want):
			t.Errorf("%q: %v; want a usage error containing %q", tc.args, err, tc.want)
		}
	}
}

// TestKeysCmd: keys list shows each held key and why; keys release is a dry run until
// --execute --reason, then releases the key with the actor in the audit table.
func TestKeysCmd(t *testing.T) {
	pool := testenv.Migrated(t)
	ctx := context.Background()
	store := retrytopics.NewStore("kafkapg", "kg")
	key := []byte{0xff, 0x00}
	move := func(off int64, key []byte) retrytopics.Move {
		return retrytopics.Move{Rec: retrytopics.Rec{Origin: retrytopics.Origin{Topic: "orders", Partition: 1, Offset: off}, Key: key, Timestamp: time.Now()},
			Held: true, From: retrytopics.FromSource, Attempt: 1, Tier: 1, Class: "permanent", Message: "bad", FirstFailedAt: time.Now(),
			DueAt: time.Date(2099, 1, 1, 0, 0, 0, 0, time.UTC), Block: true}
	}
	// Two transactions: the blocked key is held first.
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return store.DeadLetter(ctx, tx, move(20, key)) })
	if err == nil {
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return store.ToTier(ctx, tx, move(21, []byte("acct-7"))) })
	}
	if err != nil {
		t.Fatal(err)
	}

	c, out, _ := keysCmdEnv(pool)
	if err := keysCmd(ctx, c, []string{"list"}); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	want := []*regexp.Regexp{
		regexp.MustCompile(`^TOPIC +PARTITION +KEY +STATE +SINCE +HELD +WHY$`),
		regexp.MustCompile(`^orders +1 +0xff00 +blocked +\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ +0 +record at offset 20 was dead-lettered \(dead letter #1, permanent, new\)$`),
		regexp.MustCompile(`^orders +1 +acct-7 +retrying +\S+ +0 +record at offset 21 is in retry tier 1 \(orders\.kg\.retry\.1\), attempt 2, due 2099-01-01T00:00:00Z, last error permanent: bad$`),
	}
	if len(lines) != len(want) {
		t.Fatalf("keys list:\n%s\nwant %d lines", out, len(want))
	}
	for i, re := range want {
		if !re.MatchString(lines[i]) {
			t.Errorf("keys list line %d:\n%s\nwant %s", i, lines[i], re)
		}
	}

	out.Reset()
	if err := keysCmd(ctx, c, []string{"list", "--json", "--limit", "1"}); err != nil {
		t.Fatal(err)
	}
	var keys []ops.HeldKey
	if err := json.Unmarshal(out.Bytes(), &keys); err != nil || len(keys) != 1 || keys[0].KeyText != "0xff00" || string(keys[0].Key) != string(key) {
		t.Errorf("keys list --json --limit 1: %v, %s", err, out)
	}

	state := func() string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT state FROM kafkapg.held_keys WHERE key = $1`, key).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	out.Reset()
	if err := keysCmd(ctx, c, []string{"release", "--topic", "orders", "--partition", "1", "--key-hex", "0xff00"}); err != nil {
		t.Fatal(err)
	}
	wantOut := `orders[1] key 0xff00: blocked since TIME, 0 held records
  why: record at offset 20 was dead-lettered (dead letter #1, permanent, new)
would release the blocked key: it has no held records, so it is no longer held and its next records are applied as they come; the dead letter stays as it is (replay or discard it with dlq)
dry run: nothing changed; add --execute --reason ... to release
`
	got := regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ`).ReplaceAllString(out.String(), "TIME")
	if got != wantOut || state() != "blocked" {
		t.Errorf("keys release (dry run):\n%s\nwant\n%s\nkey %s", out, wantOut, state())
	}

	out.Reset()
	if err := keysCmd(ctx, c, []string{"release", "--topic", "orders", "--partition", "1", "--key-hex", "ff00", "--execute", "--reason", "INC-9", "--actor", "bob"}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "\ndone (audited): release the blocked key: ") || state() != "ready" {
		t.Errorf("keys release --execute:\n%s\nkey %s, want ready", out, state())
	}
	var actor, reason string
	if err := pool.QueryRow(ctx, `SELECT actor, reason FROM kafkapg.audit WHERE action = 'release_key'`).Scan(&actor, &reason); err != nil || actor != "bob" || reason != "INC-9" {
		t.Errorf("audit: %s, %s, %v; want bob, INC-9", actor, reason, err)
	}

	// A key retrying and not stuck is not released: a usage error (exit status 2).
	err = keysCmd(ctx, c, []string{"release", "--topic", "orders", "--partition", "1", "--key", "acct-7"})
	if !errors.Is(err, ops.ErrUsage) || !strings.Contains(err.Error(), "is retrying and not stuck") {
		t.Errorf("releasing a retrying key: %v, want ErrUsage", err)
	}
}

// TestTraceCmd: trace prints a header line per record, then its steps, for an offset and for a
// key.
func TestTraceCmd(t *testing.T) {
	pool := testenv.Migrated(t)
	ctx := context.Background()
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 1)
	k.Produce(t, &kgo.Record{Topic: topic, Key: []byte("acct-7"), Value: []byte("v"), Timestamp: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)})
	c, out, errOut := keysCmdEnv(pool, k.Brokers...)
	// The group's topics (KAFKA_TOPICS) are all trace may read: another is bad usage, naming them.
	k.CreateTopicNamed(t, "hr.salaries", 1)
	k.Produce(t, &kgo.Record{Topic: "hr.salaries", Key: []byte("ceo"), Value: []byte("1")})
	out.Reset()
	err := traceCmd(ctx, c, []string{"--topic", "hr.salaries", "--partition", "0", "--offset", "0"})
	if !errors.Is(err, ops.ErrUsage) || !strings.Contains(err.Error(), `topic "hr.salaries" is not one of group kg's topics: only its source topics (orders)`) ||
		strings.Contains(out.String(), "ceo") {
		t.Errorf("trace of another topic: %v, printed %q; want bad usage naming the group's topics", err, out)
	}
	c.ops = c.ops.WithTopics(topic)

	want := topic + "[0]@0 key=acct-7: not consumed yet: the group has no position in the partition yet\n" +
		"  2026-01-02T03:04:05Z  produced (record timestamp)\n"
	for _, args := range [][]string{
		{"--topic", topic, "--partition", "0", "--offset", "0"},
		{"--topic", topic, "--key", "acct-7"},
		{"--topic", topic, "--key-hex", "616363742d37", "--scan", "1", "--limit", "1"},
	} {
		out.Reset()
		errOut.Reset()
		if err := traceCmd(ctx, c, args); err != nil {
			t.Fatalf("trace %q: %v", args, err)
		}
		if out.String() != want || errOut.Len() != 0 {
			t.Errorf("trace %q:\n%s\nstderr %q\nwant\n%s", args, out, errOut, want)
		}
	}

	out.Reset()
	if err := traceCmd(ctx, c, []string{"--topic", topic, "--key", "acct-7", "--json"}); err != nil {
		t.Fatal(err)
	}
	var res ops.TraceResult
	if err := json.Unmarshal(out.Bytes(), &res); err != nil || len(res.Records) != 1 || res.Records[0].State != ops.TraceNotConsumed {
		t.Errorf("trace --json: %v\n%s", err, out)
	}

	errOut.Reset()
	if err := traceCmd(ctx, c, []string{"--topic", topic, "--key", "nobody"}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(errOut.String(), "no record of key nobody in "+topic) {
		t.Errorf("trace of an unknown key: stderr %q", errOut)
	}

	// A copy skipped by its idempotency key (offset 1, of offset 0), and a record that waited
	// five seconds behind offset 0 (offset 2), as the processor keeps them (skipped_duplicates, held_history): the
	// CLI and its JSON tell them as they happened (issue 42).
	k.Produce(t, &kgo.Record{Topic: topic, Key: []byte("acct-7"), Value: []byte("v")}, &kgo.Record{Topic: topic, Key: []byte("acct-7"), Value: []byte("w")})
	heldAt := time.Date(2026, 1, 2, 3, 4, 6, 0, time.UTC)
	for _, q := range []string{
		`INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ('kg', $1, 0, 3)`,
		`INSERT INTO kafkapg.skipped_duplicates (consumer_group, topic, partition, "offset", skipped_at, idempotency_key, key_hash, first_partition, first_offset)
			VALUES ('kg', $1, 0, 1, $2, 'pay-1', '\xabcdef0123456789ab', 0, 0)`,
		`INSERT INTO kafkapg.held_history (consumer_group, topic, partition, key_hash, first_offset, offsets, held_at, behind, until)
			VALUES ('kg', $1, 0, sha256('acct-7'), 2, '{2}', ARRAY[$2::timestamptz], '{0}', $2::timestamptz + interval '5 seconds')`,
	} {
		args := []any{topic}
		if strings.Contains(q, "$2") {
			args = append(args, heldAt)
		}
		if _, err := pool.Exec(ctx, q, args...); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		offset string
		want   []string
	}{
		{"1", []string{topic + `[0]@1 key=acct-7: skipped as a duplicate by its idempotency key "pay-1" (idempotency key hash abcdef0123456789…): the copy at ` + topic + "[0]@0 was applied before it (2026-01-02T03:04:06Z)\n",
			`  2026-01-02T03:04:06Z  skipped as a duplicate by its idempotency key "pay-1"`}},
		{"2", []string{topic + "[0]@2 key=acct-7: applied after waiting 5s behind the record at offset 0 of its key (2026-01-02T03:04:11Z)\n",
			"  2026-01-02T03:04:06Z  held behind the record at offset 0 of its key for 5s, until 2026-01-02T03:04:11Z\n" +
				"  2026-01-02T03:04:11Z  applied, taken from held_records once the earlier records of its key were settled\n"}},
	} {
		out.Reset()
		if err := traceCmd(ctx, c, []string{"--topic", topic, "--partition", "0", "--offset", tc.offset}); err != nil {
			t.Fatal(err)
		}
		for _, w := range tc.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("trace of offset %s:\n%s\nwant it to contain\n%s", tc.offset, out, w)
			}
		}
	}
	out.Reset()
	if err := traceCmd(ctx, c, []string{"--topic", topic, "--key", "acct-7", "--json"}); err != nil {
		t.Fatal(err)
	}
	res = ops.TraceResult{}
	if err := json.Unmarshal(out.Bytes(), &res); err != nil || len(res.Records) != 3 {
		t.Fatalf("trace --json: %v\n%s", err, out)
	}
	var got []string
	for _, r := range res.Records {
		for _, s := range r.Steps {
			switch {
			case s.Kind == ops.StepSkippedDuplicate && s.First != nil:
				got = append(got, fmt.Sprintf("%d:%s:%s:first=%d@%d", r.Offset, r.State, s.IdempotencyKey, s.First.Partition, s.First.Offset))
			case s.Kind == ops.StepHeld && s.Behind != nil && s.Until != nil:
				got = append(got, fmt.Sprintf("%d:%s:behind=%d:for=%s", r.Offset, r.State, *s.Behind, s.Until.Sub(s.At)))
			}
		}
	}
	if want := "2:applied:behind=0:for=5s 1:skipped_duplicate:pay-1:first=0@0"; strings.Join(got, " ") != want {
		t.Errorf("trace --json tells %q, want %q:\n%s", strings.Join(got, " "), want, out)
	}
}
