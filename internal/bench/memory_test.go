package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/testenv"
)

// containerLimit is the memory limit of the Deployment in deploy/kubernetes.
const containerLimit = 512 << 20

// BenchmarkBacklogMemory starts the processor binary (cmd/processor, HANDLER=ledger, default
// settings: MAX_BUFFERED_BYTES 64 MiB, three retry tiers) on a backlog that is already in the
// topic, as after an outage, and reports its peak resident memory (VmHWM) and how fast it drains
// the backlog, for each partition count, twice:
//
//   - with no memory limit: the Go runtime's soft limit is off, so the figure is the worst case;
//     the Deployment's container limit (512 MiB) is the bound it must stay under;
//   - in a container (a cgroup) of half that, 256 MiB, where the processor sets its soft limit
//     from the cgroup as it does in Kubernetes: it must drain the backlog without being killed.
//     This needs a writable cgroup v1 memory controller (root); without one it is skipped, and
//     says so.
//
// BENCH_BACKLOG_EVENTS (default 1000000) sets the backlog, BENCH_BACKLOG_PARTITIONS (default
// "8,32,128") the partition counts; BENCH_PROCESSOR_BIN runs another build of the processor (to
// compare releases in one run), BENCH_BACKLOG_CONTAINER=off skips the container runs.
func BenchmarkBacklogMemory(b *testing.B) {
	events := envInt("BENCH_BACKLOG_EVENTS", 1_000_000)
	counts := []int{8, 32, 128}
	if v := os.Getenv("BENCH_BACKLOG_PARTITIONS"); v != "" {
		counts = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 {
				b.Fatalf("BENCH_BACKLOG_PARTITIONS=%q: want a comma-separated list of partition counts", v)
			}
			counts = append(counts, n)
		}
	}
	bin := processorBinary(b)
	k := brokerFor(b)
	items := ledger.Generate(ledger.GenConfig{Events: events, Accounts: 10_000, Seed: 3, Prefix: "m"})

	for b.Loop() {
		fmt.Printf("\nprocessor on a backlog of %d ledger events, %s broker, default settings:\n", events, k.Name)
		for _, parts := range counts {
			topic := k.CreateTopic(b, int32(parts))
			produceAll(b, k, topic, items)
			peak, rate := drainBacklog(b, bin, k, topic, events, 0)
			b.ReportMetric(float64(peak)/(1<<20), fmt.Sprintf("peak_MiB_%dp", parts))
			b.ReportMetric(rate, fmt.Sprintf("rec/s_%dp", parts))
			fmt.Printf("  %3d partitions, no memory limit:   peak RSS %4d MiB (%.2f of the Deployment's 512 MiB), drained at %6.0f records/s\n",
				parts, peak>>20, float64(peak)/containerLimit, rate)
			if os.Getenv("BENCH_BACKLOG_CONTAINER") == "off" {
				continue
			}
			if !cgroupV1() {
				fmt.Printf("  %3d partitions, 256 MiB container: skipped (no writable cgroup v1 memory controller here)\n", parts)
				continue
			}
			peak, crate := drainBacklog(b, bin, k, topic, events, containerLimit/2)
			b.ReportMetric(crate/rate, fmt.Sprintf("x_rate_in_256MiB_%dp", parts))
			fmt.Printf("  %3d partitions, 256 MiB container: peak RSS %4d MiB, drained at %6.0f records/s (%.2fx the unlimited rate), not killed\n",
				parts, peak>>20, crate, crate/rate)
		}
		fmt.Println()
	}
}

// cgroupRoot is the cgroup v1 memory controller's mount point.
const cgroupRoot = "/sys/fs/cgroup/memory"

// cgroupV1 reports whether this process may create cgroup v1 memory cgroups.
func cgroupV1() bool {
	dir, err := os.MkdirTemp(cgroupRoot, "kafkapg-bench-probe-")
	if err != nil {
		return false
	}
	defer os.Remove(dir)
	_, err = os.Stat(filepath.Join(dir, "memory.limit_in_bytes"))
	return err == nil
}

// inCgroup makes cmd run in a new memory cgroup limited to limit bytes (swap included), removed
// by the returned function once cmd has exited.
func inCgroup(b *testing.B, cmd *exec.Cmd, limit int64) func() {
	dir, err := os.MkdirTemp(cgroupRoot, "kafkapg-bench-")
	if err != nil {
		b.Fatal(err)
	}
	write := func(file string, v int64) {
		if err := os.WriteFile(filepath.Join(dir, file), []byte(strconv.FormatInt(v, 10)), 0o644); err != nil && file != "memory.memsw.limit_in_bytes" {
			b.Fatalf("cgroup %s: %v", file, err)
		}
	}
	write("memory.limit_in_bytes", limit)
	write("memory.memsw.limit_in_bytes", limit) // absent without swap accounting: fine
	// The shell joins the cgroup and then becomes the processor, which reads its limit at start.
	cmd.Args = []string{"sh", "-c", `echo $$ > "$0"/cgroup.procs && exec "$1"`, dir, cmd.Path}
	cmd.Path = "/bin/sh"
	return func() { os.Remove(dir) }
}

// processorBinary builds cmd/processor into a temporary directory, unless BENCH_PROCESSOR_BIN
// names one.
func processorBinary(b *testing.B) string {
	if bin := os.Getenv("BENCH_PROCESSOR_BIN"); bin != "" {
		return bin
	}
	bin := filepath.Join(b.TempDir(), "processor")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/kafkapg/kafkapg/cmd/processor")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build cmd/processor: %v\n%s", err, out)
	}
	return bin
}

// produceAll produces items to topic in chunks (one huge ProduceSync would hold them all twice).
func produceAll(b *testing.B, k *testenv.Kafka, topic string, items []ledger.Item) {
	cl := k.Client(b, kgo.ProducerLinger(5*time.Millisecond))
	ctx := context.Background()
	const chunk = 50_000
	for i := 0; i < len(items); i += chunk {
		recs := make([]*kgo.Record, 0, chunk)
		for _, it := range items[i:min(i+chunk, len(items))] {
			recs = append(recs, it.Record(topic))
		}
		if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			b.Fatalf("produce: %v", err)
		}
	}
}

// drainBacklog runs the processor binary on topic, as a new consumer group, until want events are
// applied, and returns its peak resident memory in bytes and the records applied per second from
// its start. A positive limit runs it in a memory cgroup of that size.
func drainBacklog(b *testing.B, bin string, k *testenv.Kafka, topic string, want int, limit int64) (peak int64, rate float64) {
	_, url := testenv.Postgres(b)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url) // the processor creates the tables itself
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	addr := testenv.FreeAddr(b)
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(),
		"KAFKA_BROKERS="+strings.Join(k.Brokers, ","),
		fmt.Sprintf("KAFKA_GROUP_ID=mem-%s-%d", topic, limit),
		"KAFKA_TOPICS="+topic,
		"DATABASE_URL="+url,
		"DB_MAX_CONNS=8",
		"HANDLER=ledger",
		"HTTP_ADDR="+addr,
		"LOG_LEVEL=warn",
	)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if limit > 0 {
		defer inCgroup(b, cmd, limit)()
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	applied := 0
	for applied < want {
		select {
		case err := <-exited:
			b.Fatalf("processor exited after %d of %d events: %v (killed for memory?)", applied, want, err)
		case <-time.After(200 * time.Millisecond):
		}
		if err := countApplied(ctx, pool, &applied); err != nil {
			continue // the handler's tables may not exist yet
		}
	}
	elapsed := time.Since(start)
	peak = vmHWM(b, cmd.Process.Pid)
	cmd.Process.Signal(syscall.SIGTERM)
	if err := <-exited; err != nil {
		b.Fatalf("processor did not exit cleanly: %v", err)
	}
	if err := localrun.Ready(addr); err == nil {
		b.Fatal("the processor still answers after exiting")
	}
	return peak, float64(want) / elapsed.Seconds()
}

func countApplied(ctx context.Context, pool *pgxpool.Pool, n *int) error {
	return pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entries`).Scan(n)
}

// vmHWM reads a process's peak resident set size.
func vmHWM(b *testing.B, pid int) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatalf("read the processor's memory: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				b.Fatalf("VmHWM %q: %v", v, err)
			}
			return kb << 10
		}
	}
	b.Fatal("no VmHWM in /proc/PID/status")
	return 0
}
