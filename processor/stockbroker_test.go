package processor_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
)

// stockMemberEnv, set in the environment of the test binary re-executed by TestStockBroker, makes
// TestStockBroker run one member of the group ("group topic database-url") until it is killed.
const stockMemberEnv = "KAFKAPG_STOCK_MEMBER"

// stockLimits are Apache Kafka 4's defaults for a consumer-protocol group's session timeout and
// heartbeat interval, in milliseconds.
var stockLimits = map[string]string{
	"group.consumer.min.session.timeout.ms":    "45000",
	"group.consumer.max.session.timeout.ms":    "60000",
	"group.consumer.min.heartbeat.interval.ms": "5000",
	"group.consumer.max.heartbeat.interval.ms": "15000",
}

// TestStockBroker runs processors against a broker with Apache Kafka's own group settings, at
// KAFKA_STOCK_BROKERS (`KAFKA_STOCK_GROUP_SETTINGS=1 scripts/kafka.sh start`; CI starts one), under
// the consumer protocol. The test brokers' lowered group.consumer.min.* settings hid that a stock
// broker refused the group's session timeout and heartbeat interval whole (min(500ms, a third of
// the session) is below its 5 s minimum), so that KAFKA_SESSION_TIMEOUT never applied.
//
// It checks that the group's config, as the broker describes it, holds what the processors asked
// within the broker's limits (45 s and 5 s, for a SessionTimeout of 10 s, below the minimum, and
// for the default 45 s alike), that the processor asking for 10 s says so in a warning naming the
// broker setting, and that records flow. Then it SIGKILLs one of two members (a child process)
// and measures how long its partitions sit idle before the other one applies their records: the
// figure docs/configuration.md states next to KAFKA_SESSION_TIMEOUT.
func TestStockBroker(t *testing.T) {
	if os.Getenv(stockMemberEnv) != "" {
		runStockMember(t)
		return
	}
	env := os.Getenv("KAFKA_STOCK_BROKERS")
	if env == "" {
		t.Skip("KAFKA_STOCK_BROKERS is unset: start a broker with stock group settings " +
			"(KAFKA_STOCK_GROUP_SETTINGS=1 KAFKA_PORT=... scripts/kafka.sh start) and set it to its address")
	}
	k := &testenv.Kafka{Name: "kafka-stock", Brokers: strings.Split(env, ",")}
	checkStockLimits(t, k)

	h := carelessHarness(t, k, 4)
	// B, in this process, asks for 10 s: below the broker's minimum.
	logs := &lockedBuffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("B's log:\n%s", logs.String())
		}
	})
	cfgB := h.Config(careless{})
	cfgB.SessionTimeout = 10 * time.Second
	cfgB.Logger = slog.New(slog.NewTextHandler(logs, nil))
	b := h.Start(cfgB)
	waitJoined(t, b)
	if got := groupType(t, k, h.Group); got != "consumer" {
		t.Fatalf("the group runs the %q protocol, want consumer", got)
	}
	if got := groupTimeoutConfigs(t, k, h.Group); got != "45000/5000" {
		t.Errorf("the group's session timeout/heartbeat interval are %s ms, want 45000/5000 (SessionTimeout 10s within the broker's limits)", got)
	}
	for _, want := range []string{"group.consumer.min.session.timeout.ms", "session_timeout=10s", "applied_session_timeout=45s"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("B's log does not say %q: the warning that SessionTimeout is below the broker's minimum", want)
		}
	}
	t.Logf("B's warning: %s", grepLines(logs.String(), "group.consumer.min.session.timeout.ms"))
	if strings.Contains(logs.String(), "refused") {
		t.Errorf("B logged that the broker refused: %s", grepLines(logs.String(), "refused"))
	}

	// A, a child process, at the default SessionTimeout (45 s).
	a := startStockMember(t, h)
	waitTwoMembers(t, k, h.Group)
	if got := groupTimeoutConfigs(t, k, h.Group); got != "45000/5000" {
		t.Errorf("the group's session timeout/heartbeat interval are %s ms, want 45000/5000 (the default SessionTimeout, 45s)", got)
	}
	before := make([]*kgo.Record, 4)
	for i := range before {
		before[i] = &kgo.Record{Topic: h.Topic, Partition: int32(i), Value: fmt.Appendf(nil, "before %d", i)}
	}
	manual := k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err := manual.ProduceSync(context.Background(), before...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	h.waitEffects(recordValues(before), 60*time.Second)
	t.Logf("the group before the kill: %s", describeConsumerGroup(t, k, h.Group))

	// SIGKILL A: it leaves nothing behind but its session, which the broker lets run out.
	if err := a.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	after := make([]*kgo.Record, 4)
	for i := range after {
		after[i] = &kgo.Record{Topic: h.Topic, Partition: int32(i), Value: fmt.Appendf(nil, "after %d", i)}
	}
	if err := manual.ProduceSync(context.Background(), after...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	flowed := map[int32]time.Duration{}
	testenv.Eventually(t, 90*time.Second, func() error {
		rows, err := h.Pool.Query(context.Background(), `SELECT part FROM effects WHERE value LIKE 'after %'`)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var part int32
			if err := rows.Scan(&part); err != nil {
				return err
			}
			if _, ok := flowed[part]; !ok {
				flowed[part] = time.Since(killed)
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		if len(flowed) < len(after) {
			return fmt.Errorf("%d of %d partitions flowing again after the kill", len(flowed), len(after))
		}
		return nil
	})
	h.waitEffects(slices.Concat(recordValues(before), recordValues(after)), 10*time.Second)
	idle := slices.Max(slices.Collect(maps.Values(flowed)))
	t.Logf("stock broker, default SessionTimeout: a SIGKILLed member's partitions sat idle %v (each partition's records applied after: %v)",
		idle.Round(100*time.Millisecond), flowed)
	// The broker notices the dead member when its session, restarted at its last heartbeat (at
	// most 5 s before the kill), runs out; B is told at its next heartbeat: 40 to 50 s. Here it
	// is near 50 s: A joined at one of B's heartbeats (the one that revoked A's partitions from
	// B), so A's heartbeats, its last included, fall just after B's, and its session runs out just
	// after one of B's heartbeats too; B learns of it at the next, 5 s later.
	if idle < 40*time.Second || idle > 70*time.Second {
		t.Errorf("a killed member's partitions sat idle %v; want about the 45 s session timeout (40-70 s)", idle)
	}
}

// checkStockLimits fails the test unless the broker's group limits are Apache Kafka's defaults.
func checkStockLimits(t *testing.T, k *testenv.Kafka) {
	t.Helper()
	adm := kadm.NewClient(k.Client(t))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	md, err := adm.BrokerMetadata(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rcs, err := adm.DescribeBrokerConfigs(ctx, md.Brokers.NodeIDs()...)
	if err != nil {
		t.Fatal(err)
	}
	for _, rc := range rcs {
		if rc.Err != nil {
			t.Fatalf("describe broker %s's configs: %v", rc.Name, rc.Err)
		}
		for _, c := range rc.Configs {
			if want, ok := stockLimits[c.Key]; ok && c.MaybeValue() != want {
				t.Fatalf("broker %s at %v has %s=%s, not Kafka's default %s: start it with KAFKA_STOCK_GROUP_SETTINGS=1",
					rc.Name, k.Brokers, c.Key, c.MaybeValue(), want)
			}
		}
	}
}

// groupTimeoutConfigs is the group's "consumer.session.timeout.ms/consumer.heartbeat.interval.ms"
// as the broker describes it.
func groupTimeoutConfigs(t *testing.T, k *testenv.Kafka, group string) string {
	t.Helper()
	req := kmsg.NewPtrDescribeConfigsRequest()
	res := kmsg.NewDescribeConfigsRequestResource()
	res.ResourceType, res.ResourceName = kmsg.ConfigResourceTypeGroupConfig, group
	req.Resources = append(req.Resources, res)
	resp, err := req.RequestWith(context.Background(), k.Client(t))
	if err != nil || len(resp.Resources) != 1 {
		t.Fatalf("describe the group's configs: %v", err)
	}
	if err := kerr.ErrorForCode(resp.Resources[0].ErrorCode); err != nil {
		t.Fatalf("describe the group's configs: %v", err)
	}
	got := map[string]string{}
	for _, c := range resp.Resources[0].Configs {
		got[c.Name] = derefStr(c.Value)
	}
	return got["consumer.session.timeout.ms"] + "/" + got["consumer.heartbeat.interval.ms"]
}

// waitTwoMembers waits until the group has settled with two members, each assigned partitions.
func waitTwoMembers(t *testing.T, k *testenv.Kafka, group string) {
	t.Helper()
	waitGroupSettled(t, k, group)
	cl := k.Client(t)
	testenv.Eventually(t, 60*time.Second, func() error {
		req := kmsg.NewPtrConsumerGroupDescribeRequest()
		req.Groups = []string{group}
		resp, err := req.RequestWith(context.Background(), cl)
		if err != nil {
			return err
		}
		for _, g := range resp.Groups {
			n := 0
			for _, m := range g.Members {
				if m.MemberEpoch == g.Epoch && len(m.Assignment.TopicPartitions) > 0 {
					n++
				}
			}
			if n != 2 {
				return fmt.Errorf("%d members hold partitions at the group's epoch, want 2: %s", n, describeConsumerGroup(t, k, group))
			}
		}
		return nil
	})
}

// startStockMember runs the test binary again as member A of h's group, at the default
// SessionTimeout. It is killed at the end of the test if it still runs; its log is shown if the
// test failed.
func startStockMember(t *testing.T, h *harness) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestStockBroker$", "-test.timeout=30m")
	cmd.Env = append(os.Environ(), stockMemberEnv+"="+strings.Join([]string{h.Group, h.Topic, h.DBURL}, " "))
	out := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
		if t.Failed() {
			t.Logf("A's log (pid %d):\n%s", cmd.Process.Pid, out.String())
		}
	})
	return cmd
}

// runStockMember is member A, in the child process: a processor with the default SessionTimeout
// that runs until the process is killed.
func runStockMember(t *testing.T) {
	f := strings.Fields(os.Getenv(stockMemberEnv))
	if len(f) != 3 {
		t.Fatalf("%s=%q: want group, topic and database URL", stockMemberEnv, os.Getenv(stockMemberEnv))
	}
	pool, err := pgxpool.New(context.Background(), f[2])
	if err != nil {
		t.Fatal(err)
	}
	k := &testenv.Kafka{Name: "kafka-stock", Brokers: strings.Split(os.Getenv("KAFKA_STOCK_BROKERS"), ",")}
	h := &harness{&testkit.Harness{T: t, K: k, Pool: pool, DBURL: f[2], Group: f[0], Topic: f[1]}}
	cfg := h.Config(careless{})
	cfg.SessionTimeout = 0 // the default
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	h.Start(cfg)
	select {} // until killed
}

// lockedBuffer is a bytes.Buffer safe for concurrent writers.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

var _ io.Writer = (*lockedBuffer)(nil)

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func recordValues(recs []*kgo.Record) []string {
	out := make([]string, len(recs))
	for i, r := range recs {
		out[i] = string(r.Value)
	}
	return out
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
