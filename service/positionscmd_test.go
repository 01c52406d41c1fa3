package service

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// TestPositionsUsage: bad usage of positions is a usage error naming the flag, found before
// anything is read.
func TestPositionsUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-h"}, "help"},
		{[]string{"bogus"}, `unknown command "bogus"`},
		{[]string{"pause"}, "--topic is required"},
		{[]string{"pause", "--topic", "orders", "--partition", "-3"}, "--partition -3 is out of range"},
		{[]string{"pause", "--topic", "orders", "--execute"}, "--execute needs --reason"},
		{[]string{"resume", "--topic", "orders", "--execute"}, "--execute needs --reason"},
		{[]string{"set", "--topic", "orders", "--time", "yesterday"}, `--time "yesterday": neither`},
		{[]string{"set", "--topic", "orders", "--end", "--execute"}, "--execute needs --reason"},
		{[]string{"list", "extra"}, `unexpected argument "extra"`},
	} {
		c, _, errOut := keysCmdEnv(nil)
		err := positionsCmd(context.Background(), c, tc.args)
		var uerr *usageError
		switch {
		case tc.want == "help":
			if !errors.Is(err, errHelpShown) || !strings.Contains(errOut.String(), "usage: kafkapg positions") {
				t.Errorf("%q: %v, help %q; want the help shown", tc.args, err, errOut)
			}
		case !errors.As(err, &uerr) || !strings.Contains(err.Error(), tc.want):
			t.Errorf("%q: %v; want a usage error containing %q", tc.args, err, tc.want)
		}
	}
	at, err := parseTimeOrAgo("90m", time.Date(2026, 12, 4, 15, 30, 0, 0, time.UTC))
	if err != nil || !at.Equal(time.Date(2026, 12, 4, 14, 0, 0, 0, time.UTC)) {
		t.Errorf("--time 90m: %v, %v", at, err)
	}
}

// TestPositionsCmd: positions lists each source partition with its stored position, end, lag
// and pause; pause and set are dry runs until --execute --reason, then change Postgres; --json
// prints what the table does.
func TestPositionsCmd(t *testing.T) {
	k := testenv.NewKfake(t)
	k.CreateTopicNamed(t, "orders", 2)
	var recs []*kgo.Record
	for range 6 {
		recs = append(recs, &kgo.Record{Topic: "orders", Partition: 0, Value: []byte("v")})
	}
	if err := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner())).ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	pool := testenv.Migrated(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset, owner) VALUES ('kg', 'orders', 0, 4, 'pod-a')`); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (string, string) {
		t.Helper()
		c, out, errOut := keysCmdEnv(pool, k.Brokers...)
		if err := positionsCmd(ctx, c, args); err != nil {
			t.Fatalf("positions %q: %v (%s)", args, err, errOut)
		}
		return out.String(), errOut.String()
	}

	out, _ := run()
	if !regexp.MustCompile(`orders\s+0\s+4\s+-\s+6\s+2\s+pod-a\s+no`).MatchString(out) || !regexp.MustCompile(`orders\s+1\s+-\s+-\s+0\s+-\s+-\s+no`).MatchString(out) {
		t.Errorf("positions:\n%s", out)
	}
	if out, _ = run("pause", "--topic", "orders", "--partition", "0"); !strings.Contains(out, "would pause") {
		t.Errorf("pause, dry run:\n%s", out)
	}
	if out, _ = run("pause", "--topic", "orders", "--partition", "0", "--execute", "--reason", "downstream down", "--actor", "ana"); !strings.Contains(out, "orders[0]: paused (audited)") {
		t.Errorf("pause:\n%s", out)
	}
	if out, _ = run(); !regexp.MustCompile(`orders\s+0\s+.*since \S+ by ana: downstream down`).MatchString(out) {
		t.Errorf("positions after the pause:\n%s", out)
	}
	out, _ = run("--json")
	var listed struct{ Partitions []ops.PartitionStatus }
	if err := json.Unmarshal([]byte(out), &listed); err != nil || len(listed.Partitions) != 2 || listed.Partitions[0].Paused == nil || *listed.Partitions[0].Lag != 2 {
		t.Errorf("positions --json: %v\n%s", err, out)
	}

	if out, _ = run("set", "--topic", "orders", "--partition", "0", "--offset", "1"); !regexp.MustCompile(`orders\s+0\s+4\s+1\s+0-6\s+3\s+0\s+since \S+ by ana`).MatchString(out) ||
		!strings.Contains(out, "dry run: nothing changed") || !strings.Contains(out, "idempotency keys: not checked") {
		t.Errorf("set, dry run:\n%s", out)
	}
	if out, _ = run("set", "--topic", "orders", "--partition", "1", "--offset", "0"); !regexp.MustCompile(`orders\s+1\s+- \(no stored position\)\s+0\s+0-\d+\s+0\s+0\s+no: its owner goes on at once`).MatchString(out) {
		t.Errorf("set of a partition not paused, dry run:\n%s", out)
	}
	if out, _ = run("set", "--topic", "orders", "--end", "--execute", "--reason", "skip test events", "--json"); !strings.Contains(out, `"executed": true`) || !strings.Contains(out, `"paused_by": "ana"`) {
		t.Errorf("set --end --execute --json:\n%s", out)
	}
	var next int64
	if err := pool.QueryRow(ctx, `SELECT next_offset FROM kafkapg.offsets WHERE consumer_group = 'kg' AND topic = 'orders' AND partition = 0`).Scan(&next); err != nil || next != 6 {
		t.Errorf("the position after set --end: %d, %v", next, err)
	}
}

// TestPositionsSetChecksTheServicesKeys: the service gives a rewind's dry run its topics'
// idempotency key functions (here TOPIC_orders_IDEMPOTENCY_KEY=header:x-id) and its key ring:
// the dry run counts the records of the range whose key the ring has.
func TestPositionsSetChecksTheServicesKeys(t *testing.T) {
	k := testenv.NewKfake(t)
	k.CreateTopicNamed(t, "orders", 1)
	var recs []*kgo.Record
	for i := range 4 {
		recs = append(recs, &kgo.Record{Topic: "orders", Value: []byte("v"), Headers: []kgo.RecordHeader{{Key: "x-id", Value: []byte(fmt.Sprint("id-", i))}}})
	}
	k.Produce(t, recs...)
	pool := testenv.Migrated(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ('kg', 'orders', 0, 4)`); err != nil {
		t.Fatal(err)
	}
	ring := keyring.New("kafkapg")
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := ring.Record(ctx, tx, [][32]byte{keyring.Hash("kg", "orders", []byte("id-2"))})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	hs, err := newRegistry(builtinHandlers)
	if err != nil {
		t.Fatal(err)
	}
	c, out, errOut := keysCmdEnv(pool, k.Brokers...)
	c.env.topics = map[string]topicPolicy{"orders": {idempotencyKeySet: true, policy: processor.TopicPolicy{IdempotencyKey: processor.KeyFromHeader("x-id")}}}
	c.ops = c.ops.WithIdempotencyKeys(c.env.idempotencyKeys(hs))
	if err := positionsCmd(ctx, c, []string{"set", "--topic", "orders", "--start"}); err != nil {
		t.Fatalf("%v (%s)", err, errOut)
	}
	if !strings.Contains(out.String(), "idempotency keys: 1 of the 4 records read would be skipped as duplicates") {
		t.Errorf("set --start, dry run:\n%s", out)
	}
}
