package kafkacluster

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/goleak"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestInSync(t *testing.T) {
	t.Parallel()
	part := func(p, leader int32, replicas, isr []int32) kmsg.MetadataResponseTopicPartition {
		return kmsg.MetadataResponseTopicPartition{Partition: p, Leader: leader, Replicas: replicas, ISR: isr}
	}
	topic := func(name string, parts ...kmsg.MetadataResponseTopicPartition) kmsg.MetadataResponseTopic {
		return kmsg.MetadataResponseTopic{Topic: kmsg.StringPtr(name), Partitions: parts}
	}
	tests := []struct {
		name    string
		topics  []kmsg.MetadataResponseTopic
		wantErr string
	}{
		{name: "no topics"},
		{
			name: "in sync, ISR in another order",
			topics: []kmsg.MetadataResponseTopic{
				topic("a", part(0, 1, []int32{1, 2, 3}, []int32{3, 1, 2}), part(1, 2, []int32{2, 3, 1}, []int32{2, 3, 1})),
			},
		},
		{
			name: "a replica out of the ISR",
			topics: []kmsg.MetadataResponseTopic{
				topic("b", part(0, 1, []int32{1, 2, 3}, []int32{1, 2, 3})),
				topic("a", part(1, 1, []int32{1, 2, 3}, []int32{1, 3}), part(0, 1, []int32{1, 2}, []int32{1, 2})),
			},
			wantErr: "partition a/1: ISR [1 3], replicas [1 2 3]",
		},
		{
			name:    "no leader",
			topics:  []kmsg.MetadataResponseTopic{topic("a", part(0, -1, []int32{1}, []int32{1}))},
			wantErr: "partition a/0 has no leader",
		},
		{
			name: "partition error",
			topics: []kmsg.MetadataResponseTopic{topic("a", kmsg.MetadataResponseTopicPartition{
				Leader: 1, Replicas: []int32{1}, ISR: []int32{1}, ErrorCode: 5,
			})},
			wantErr: "partition a/0: LEADER_NOT_AVAILABLE",
		},
		{
			name:    "topic error",
			topics:  []kmsg.MetadataResponseTopic{{Topic: kmsg.StringPtr("a"), ErrorCode: 3}},
			wantErr: "topic a: UNKNOWN_TOPIC_OR_PARTITION",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := InSync(&kmsg.MetadataResponse{Topics: tt.topics})
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("InSync = %v, want nil", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("InSync = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestReadNode(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		props    string
		wantID   int32
		wantAddr string
		wantErr  string
	}{
		{
			name:     "advertised listener",
			props:    "# c\nnode.id=2\nlisteners=PLAINTEXT://0.0.0.0:9193,CONTROLLER://127.0.0.1:9293\nadvertised.listeners=PLAINTEXT://127.0.0.1:9193\n",
			wantID:   2,
			wantAddr: "127.0.0.1:9193",
		},
		{
			name:     "listeners only",
			props:    "node.id = 3\nlisteners=CONTROLLER://127.0.0.1:9294, PLAINTEXT://127.0.0.1:9194\n",
			wantID:   3,
			wantAddr: "127.0.0.1:9194",
		},
		{name: "no node id", props: "listeners=PLAINTEXT://127.0.0.1:9194\n", wantErr: "node.id"},
		{name: "no plaintext listener", props: "node.id=1\nlisteners=CONTROLLER://127.0.0.1:9292\n", wantErr: "no PLAINTEXT listener"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p := filepath.Join(t.TempDir(), "server.properties")
			if err := os.WriteFile(p, []byte(tt.props), 0o644); err != nil {
				t.Fatal(err)
			}
			n, err := readNode(p)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("readNode = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if n.id != tt.wantID || n.addr != tt.wantAddr {
				t.Fatalf("readNode = id %d addr %q, want %d %q", n.id, n.addr, tt.wantID, tt.wantAddr)
			}
		})
	}
}

func TestAttachWithoutCluster(t *testing.T) {
	t.Parallel()
	script := scriptPath(t)

	empty := t.TempDir()
	if _, err := Attach(script, empty); err == nil || !strings.Contains(err.Error(), "no cluster in") {
		t.Fatalf("Attach(empty dir) = %v, want a 'no cluster in' error", err)
	}

	// A cluster's files, but no JVM: this test process's own pid is in the pid file, and it is not
	// a Kafka JVM, so it must not count (nor ever be signalled).
	stopped := t.TempDir()
	dir := filepath.Join(stopped, "node-1")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	props := "node.id=1\nlisteners=PLAINTEXT://127.0.0.1:1\n"
	if err := os.WriteFile(filepath.Join(dir, "server.properties"), []byte(props), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "kafka.pid"), fmt.Appendf(nil, "%d\n", os.Getpid()), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Attach(script, stopped); err == nil || !strings.Contains(err.Error(), "none of the nodes") {
		t.Fatalf("Attach(stopped cluster) = %v, want a 'none of the nodes' error", err)
	}

	if _, err := Attach(filepath.Join(empty, "no-such-script"), empty); err == nil {
		t.Fatal("Attach with a missing script succeeded")
	}
}

func scriptPath(t *testing.T) string {
	t.Helper()
	p, err := filepath.Abs(filepath.Join("..", "..", "..", "scripts", "kafka.sh"))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

const scriptTestEnv = "KAFKA_CLUSTER_SCRIPT_TEST"

// TestFaults starts a three-node cluster with the script, produces to it with acks=all
// throughout, injects every fault the package offers, and checks that every acknowledged record
// is readable exactly once at the end.
func TestFaults(t *testing.T) {
	if os.Getenv(scriptTestEnv) != "1" {
		t.Skipf("starts a three-node Kafka cluster through scripts/kafka.sh and runs faults on it (about 4 minutes); "+
			"run it with: %s=1 go test -run TestFaults -v -timeout 20m ./internal/rig/kafkacluster/", scriptTestEnv)
	}
	script := scriptPath(t)
	dir := os.Getenv("KAFKA_CLUSTER_DIR")
	if dir == "" {
		// Kept after the test (the next start wipes it), so the nodes' logs can be read.
		dir = filepath.Join(os.TempDir(), "kafkapg-kafka-cluster-test")
	}
	ctx := t.Context()

	t0 := time.Now()
	runScript(t, script, dir, "cluster", "start")
	t.Logf("cluster start: %s", time.Since(t0).Round(time.Second))
	t.Cleanup(func() {
		runScript(t, script, dir, "cluster", "stop")
	})

	c, err := Attach(script, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	if got := c.Nodes(); !slices.Equal(got, []int32{1, 2, 3}) {
		t.Fatalf("Nodes = %v, want [1 2 3]", got)
	}
	t.Logf("brokers %v", c.Brokers())

	admCl, err := kgo.NewClient(kgo.SeedBrokers(c.Brokers()...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admCl.Close)
	adm := kadm.NewClient(admCl)

	// A topic created without a replication factor gets the broker's default: Kafka's own 1.
	if _, err := adm.CreateTopic(ctx, 1, -1, nil, "defaults"); err != nil {
		t.Fatal(err)
	}
	checkDescribe(t, c, "defaults", 1, "1")

	const topic, partitions = "faults", 3
	if _, err := adm.CreateTopic(ctx, partitions, 3, map[string]*string{"min.insync.replicas": kadm.StringPtr("2")}, topic); err != nil {
		t.Fatal(err)
	}
	checkDescribe(t, c, topic, 3, "2")
	if err := c.WaitInSync(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}

	p := startProducer(t, c.Brokers(), topic)
	p.waitProgress(t, 200, time.Minute, "before any fault")
	p.stalls(t, "before any fault")

	t.Run("kill the leader", func(t *testing.T) {
		leader := leaderOf(t, c, topic, 0)
		if err := c.Kill(ctx, leader); err != nil {
			t.Fatal(err)
		}
		killed := time.Now()
		if c.Running(leader) {
			t.Fatalf("node %d still running after Kill", leader)
		}
		var next int32
		testenv.Eventually(t, time.Minute, func() error {
			l, err := c.Leader(ctx, topic, 0)
			if err != nil {
				return err
			}
			if l == leader {
				return fmt.Errorf("node %d (killed) still leads %s/0", leader, topic)
			}
			next = l
			return nil
		})
		t.Logf("killed node %d, leader of %s/0: node %d leads it after %s", leader, topic, next, time.Since(killed).Round(100*time.Millisecond))
		p.waitProgress(t, 200, time.Minute, fmt.Sprintf("with node %d dead", leader))

		restartNode(t, c, leader)
		p.stalls(t, "kill, restart")
	})

	t.Run("freeze a node", func(t *testing.T) {
		leader := leaderOf(t, c, topic, 0)
		frozen := leader%3 + 1 // a follower of partition 0
		if err := c.Freeze(frozen); err != nil {
			t.Fatal(err)
		}
		at := time.Now()
		thawed := false
		defer func() {
			if !thawed { // do not leave a stopped JVM behind a failed check
				_ = c.Thaw(frozen)
			}
		}()
		if !c.Frozen(frozen) || !c.Running(frozen) {
			t.Fatalf("node %d: Frozen %v, Running %v after Freeze", frozen, c.Frozen(frozen), c.Running(frozen))
		}
		testenv.Eventually(t, time.Minute, func() error {
			for part := range int32(partitions) {
				d, err := c.Partition(ctx, topic, part)
				if err != nil {
					return err
				}
				if slices.Contains(d.ISR, frozen) {
					return fmt.Errorf("frozen node %d still in the ISR %v of %s/%d", frozen, d.ISR, topic, part)
				}
			}
			return nil
		})
		t.Logf("froze node %d: out of every ISR of %s after %s", frozen, topic, time.Since(at).Round(100*time.Millisecond))
		p.waitProgress(t, 200, time.Minute, fmt.Sprintf("with node %d frozen", frozen))
		if rest := 13*time.Second - time.Since(at); rest > 0 {
			time.Sleep(rest)
		}
		if err := c.Thaw(frozen); err != nil {
			t.Fatal(err)
		}
		thawed = true
		t.Logf("thawed node %d after %s frozen", frozen, time.Since(at).Round(100*time.Millisecond))
		at = time.Now()
		waitInSync(t, c)
		t.Logf("node %d: back in every ISR %s after thawing", frozen, time.Since(at).Round(100*time.Millisecond))
		p.stalls(t, "freeze, thaw")
	})

	t.Run("stop a node", func(t *testing.T) {
		leader := leaderOf(t, c, topic, 0)
		at := time.Now()
		if err := c.Stop(ctx, leader); err != nil {
			t.Fatal(err)
		}
		t.Logf("stopped node %d (controlled shutdown) in %s", leader, time.Since(at).Round(100*time.Millisecond))
		// A controlled shutdown hands leadership over before the JVM exits (give the other
		// brokers' metadata a moment to catch up with the controller).
		testenv.Eventually(t, 5*time.Second, func() error {
			if l, err := c.Leader(ctx, topic, 0); err != nil || l == leader {
				return fmt.Errorf("after node %d's controlled shutdown: leader of %s/0 = %d, %v; want another node", leader, topic, l, err)
			}
			return nil
		})
		p.waitProgress(t, 200, time.Minute, fmt.Sprintf("with node %d stopped", leader))
		restartNode(t, c, leader)
		p.stalls(t, "controlled stop, restart")
	})

	t.Run("rolling restart", func(t *testing.T) {
		at := time.Now()
		if err := c.RollingRestart(ctx); err != nil {
			t.Fatal(err)
		}
		t.Logf("rolling restart: %s", time.Since(at).Round(time.Second))
		p.waitProgress(t, 200, time.Minute, "after the rolling restart")
		p.stalls(t, "rolling restart")
	})

	p.stop(t)
	checkDescribe(t, c, topic, 3, "2")
	checkExactlyOnce(t, c.Brokers(), topic, p)

	runScript(t, script, dir, "cluster", "stop")
	for _, id := range c.Nodes() {
		if c.Running(id) {
			t.Errorf("node %d still running after cluster stop", id)
		}
	}
}

func runScript(t *testing.T, script, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command(script, args...)
	cmd.Env = append(os.Environ(), "KAFKA_CLUSTER_DIR="+dir)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", script, strings.Join(args, " "), err, out)
	}
}

func checkDescribe(t *testing.T, c *Cluster, topic string, wantRF int, wantMinInsync string) {
	t.Helper()
	rf, mi, err := c.Describe(t.Context(), topic)
	if err != nil {
		t.Fatal(err)
	}
	if rf != wantRF || mi != wantMinInsync {
		t.Fatalf("Describe(%s) = replication factor %d, min.insync.replicas %q; want %d, %q", topic, rf, mi, wantRF, wantMinInsync)
	}
}

func leaderOf(t *testing.T, c *Cluster, topic string, partition int32) int32 {
	t.Helper()
	l, err := c.Leader(t.Context(), topic, partition)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func restartNode(t *testing.T, c *Cluster, id int32) {
	t.Helper()
	at := time.Now()
	if err := c.Start(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	started := time.Since(at)
	waitInSync(t, c)
	t.Logf("node %d: started in %s, all partitions in sync %s later", id, started.Round(100*time.Millisecond), (time.Since(at) - started).Round(100*time.Millisecond))
}

func waitInSync(t *testing.T, c *Cluster) {
	t.Helper()
	if err := c.WaitInSync(t.Context(), 3*time.Minute); err != nil {
		t.Fatal(err)
	}
}

// producer produces records with unique values (their sequence numbers) to a topic, acks=all,
// one every couple of milliseconds, and remembers which ones the cluster acknowledged.
type producer struct {
	cl   *kgo.Client
	done chan struct{}
	quit chan struct{}

	sent  atomic.Int64
	acked atomic.Int64
	mu    sync.Mutex
	ack   map[string]bool         // value → acknowledged
	fail  map[string]error        // value → final produce error
	last  map[int32]time.Time     // partition → when its latest record was acknowledged
	gap   map[int32]time.Duration // partition → longest pause between acknowledgements
}

func startProducer(t *testing.T, brokers []string, topic string) *producer {
	t.Helper()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(brokers...),
		kgo.DefaultProduceTopic(topic),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(5*time.Millisecond),
	)
	if err != nil {
		t.Fatal(err)
	}
	p := &producer{cl: cl, done: make(chan struct{}), quit: make(chan struct{}), ack: map[string]bool{}, fail: map[string]error{},
		last: map[int32]time.Time{}, gap: map[int32]time.Duration{}}
	t.Cleanup(func() { p.stop(t) })
	go func() {
		defer close(p.done)
		for seq := 0; ; seq++ {
			select {
			case <-p.quit:
				return
			case <-time.After(2 * time.Millisecond):
			}
			v := fmt.Sprintf("v%08d", seq)
			r := &kgo.Record{Key: fmt.Appendf(nil, "k%d", seq%64), Value: []byte(v)}
			p.sent.Add(1)
			// context.Background: stopping the loop must not fail records already handed over.
			cl.Produce(context.Background(), r, func(r *kgo.Record, err error) {
				now := time.Now()
				p.mu.Lock()
				defer p.mu.Unlock()
				if err != nil {
					p.fail[v] = err
					return
				}
				p.ack[v] = true
				p.acked.Add(1)
				if last, ok := p.last[r.Partition]; ok {
					p.gap[r.Partition] = max(p.gap[r.Partition], now.Sub(last))
				}
				p.last[r.Partition] = now
			})
		}
	}()
	return p
}

// waitProgress waits until n more records than now are acknowledged.
func (p *producer) waitProgress(t *testing.T, n int64, timeout time.Duration, when string) {
	t.Helper()
	from := p.acked.Load()
	at := time.Now()
	testenv.Eventually(t, timeout, func() error {
		if got := p.acked.Load() - from; got < n {
			return fmt.Errorf("producing %s: %d records acknowledged, want %d", when, got, n)
		}
		return nil
	})
	t.Logf("producing %s: %d records acknowledged in %s", when, n, time.Since(at).Round(10*time.Millisecond))
}

// stalls logs, and forgets, the longest pause between acknowledgements of each partition since
// the last call: how long a fault held up acks=all writes.
func (p *producer) stalls(t *testing.T, phase string) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	parts := slices.Sorted(maps.Keys(p.gap))
	var s []string
	for _, part := range parts {
		s = append(s, fmt.Sprintf("p%d %s", part, p.gap[part].Round(10*time.Millisecond)))
	}
	t.Logf("%s: longest pause between acknowledgements: %s", phase, strings.Join(s, ", "))
	clear(p.gap)
}

// stop stops producing and waits for every record handed over to be acknowledged or failed.
func (p *producer) stop(t *testing.T) {
	select {
	case <-p.done:
		return
	default:
	}
	close(p.quit)
	<-p.done
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := p.cl.Flush(ctx); err != nil {
		t.Errorf("flush producer: %v", err)
	}
	p.cl.Close()
}

// checkExactlyOnce reads the whole topic and checks that every acknowledged record is there
// exactly once, that no record is there twice, and that nothing is there that was never sent.
func checkExactlyOnce(t *testing.T, brokers []string, topic string, p *producer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	admCl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer admCl.Close()
	ends, err := kadm.NewClient(admCl).ListEndOffsets(ctx, topic)
	if err != nil || ends.Error() != nil {
		t.Fatalf("list end offsets: %v, %v", err, ends.Error())
	}
	want := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) { want[o.Partition] = o.Offset })

	cl, err := kgo.NewClient(
		kgo.SeedBrokers(brokers...),
		kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
	)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	next := map[int32]int64{}
	count := map[string]int{}
	reached := func() bool {
		for part, end := range want {
			if next[part] < end {
				return false
			}
		}
		return true
	}
	for !reached() {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("reading %s: stopped at %v of end offsets %v: %v", topic, next, want, ctx.Err())
		}
		fs.EachError(func(_ string, part int32, err error) { t.Logf("fetch %s/%d: %v", topic, part, err) })
		fs.EachRecord(func(r *kgo.Record) {
			count[string(r.Value)]++
			next[r.Partition] = r.Offset + 1
		})
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	var missing, dup, unknown []string
	for v := range p.ack {
		if count[v] == 0 {
			missing = append(missing, v)
		}
	}
	total := 0
	for v, n := range count {
		total += n
		if n > 1 {
			dup = append(dup, fmt.Sprintf("%s×%d", v, n))
		}
		if !p.ack[v] && p.fail[v] == nil {
			unknown = append(unknown, v)
		}
	}
	slices.Sort(missing)
	slices.Sort(dup)
	var failErrs []error
	for _, err := range p.fail {
		failErrs = append(failErrs, err)
	}
	t.Logf("sent %d, acknowledged %d, failed %d; read %d records (%d distinct) up to end offsets %v",
		p.sent.Load(), len(p.ack), len(p.fail), total, len(count), want)
	if len(p.fail) > 0 {
		t.Logf("produce failures (each such record may or may not be in the topic): %v", errors.Join(failErrs[:min(3, len(failErrs))]...))
	}
	if len(missing) > 0 {
		t.Errorf("%d acknowledged records are missing, e.g. %v", len(missing), missing[:min(10, len(missing))])
	}
	if len(dup) > 0 {
		t.Errorf("%d records were written more than once, e.g. %v", len(dup), dup[:min(10, len(dup))])
	}
	if len(unknown) > 0 {
		t.Errorf("%d records in the topic were never sent, e.g. %v", len(unknown), unknown[:min(10, len(unknown))])
	}
	if int64(len(p.ack)+len(p.fail)) != p.sent.Load() {
		t.Errorf("%d records sent, but only %d acknowledged or failed", p.sent.Load(), len(p.ack)+len(p.fail))
	}
}

func TestExited(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	st, ok := readStat(pid)
	if !ok || st.state == 'Z' || st.threads != 1 {
		t.Fatalf("readStat(running sleep) = %+v, %v", st, ok)
	}
	if exited(pid, st.start) {
		t.Fatal("exited(running process) = true")
	}
	if exited(pid, st.start+1) != true {
		t.Fatal("exited(pid with another start time) = false: a reused pid must not count as the process")
	}
	if got := processState(pid, "/no/such/server.properties"); got != procGone {
		t.Fatalf("processState(sleep) = %v, want procGone: it is not a Kafka JVM", got)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	// Not reaped yet: a zombie with its only thread gone has exited.
	testenv.Eventually(t, 5*time.Second, func() error {
		if !exited(pid, st.start) {
			return errors.New("killed process not reported exited")
		}
		return nil
	})
	_ = cmd.Wait()
	if !exited(pid, st.start) {
		t.Fatal("exited(reaped process) = false")
	}
}
