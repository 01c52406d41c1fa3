package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
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
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
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
//     from the cgroup as it does in Kubernetes (and GOGC=300 under it): it must drain the backlog
//     without being killed, at the unlimited rate. This needs a writable cgroup v1 memory
//     controller (root); without one it is skipped, and says so.
//
// BENCH_BACKLOG_EVENTS (default "100000,1000000") sets the backlogs, each drained at every
// partition count: the peak must not grow with the backlog. BENCH_BACKLOG_PARTITIONS (default
// "8,128") sets the partition counts, BENCH_ROUNDS (default 3) the interleaved rounds. BENCH_PROCESSOR_BIN runs another build of the processor;
// BENCH_BASELINE_BIN also drains each backlog with a second build (an earlier release) in the same
// run and reports the drain rate as a ratio of it. BENCH_BACKLOG_CONTAINER=off skips the
// container runs. BENCH_PROFILE_DIR saves a heap and a CPU profile of each processor there, taken
// once a fifth of the backlog is applied.
func BenchmarkBacklogMemory(b *testing.B) {
	backlogs := envInts(b, "BENCH_BACKLOG_EVENTS", []int{100_000, 1_000_000})
	counts := envInts(b, "BENCH_BACKLOG_PARTITIONS", []int{8, 128})
	rounds := envInt("BENCH_ROUNDS", 3)
	bin := processorBinary(b)
	baseline := os.Getenv("BENCH_BASELINE_BIN")
	k := brokerFor(b)

	for b.Loop() {
		for _, events := range backlogs {
			fmt.Printf("\nprocessor on a backlog of %d ledger events, %s broker, default settings:\n", events, k.Name)
			for _, parts := range counts {
				drainBacklogs(b, k, bin, baseline, events, parts, rounds)
			}
		}
		fmt.Println()
	}
}

// drainBacklogs produces a backlog of events ledger events to a new topic of parts partitions and
// drains it as BenchmarkBacklogMemory says, rounds times, the variants interleaved: peaks are the
// highest of the rounds, rates their medians (one drain's rate moves by ±15 % on this machine).
func drainBacklogs(b *testing.B, k *testenv.Kafka, bin, baseline string, events, parts, rounds int) {
	topic := k.CreateTopic(b, int32(parts))
	produceLedger(b, k, topic, events)
	type variant struct {
		name  string
		bin   string
		limit int64
		peak  int64
		rates []float64
	}
	vs := []*variant{{name: "no memory limit", bin: bin}}
	if baseline != "" {
		vs = append(vs, &variant{name: "BENCH_BASELINE_BIN", bin: baseline})
	}
	switch {
	case os.Getenv("BENCH_BACKLOG_CONTAINER") == "off":
	case !cgroupV1():
		fmt.Printf("  %3d partitions, 256 MiB container: skipped (no writable cgroup v1 memory controller here)\n", parts)
	default:
		vs = append(vs, &variant{name: "256 MiB container", bin: bin, limit: containerLimit / 2})
	}
	for range rounds {
		for _, v := range vs {
			peak, rate := drainBacklog(b, v.bin, k, topic, events, v.limit)
			v.peak = max(v.peak, peak)
			v.rates = append(v.rates, rate)
		}
	}
	suffix := fmt.Sprintf("%dp_%dk", parts, events/1000)
	unlimited := median(vs[0].rates)
	base := 0.0
	if baseline != "" {
		base = median(vs[1].rates)
	}
	for _, v := range vs {
		rate := median(v.rates)
		line := fmt.Sprintf("  %3d partitions, %-18s peak RSS %4d MiB, drained at %6.0f records/s %v", parts, v.name+":", v.peak>>20, rate, rounded(v.rates))
		switch {
		case v.name == "BENCH_BASELINE_BIN":
			b.ReportMetric(unlimited/rate, "x_rate_vs_baseline_"+suffix)
			line += fmt.Sprintf(" (this build unlimited: %.2fx its rate, %.2fx its peak)", unlimited/rate, float64(vs[0].peak)/float64(v.peak))
		case v.limit > 0:
			b.ReportMetric(float64(v.peak)/(1<<20), "peak_MiB_in_256MiB_"+suffix)
			b.ReportMetric(rate/unlimited, "x_rate_in_256MiB_"+suffix)
			line += fmt.Sprintf(" (%.2fx the unlimited rate", rate/unlimited)
			if base > 0 {
				b.ReportMetric(rate/base, "x_rate_in_256MiB_vs_baseline_"+suffix)
				line += fmt.Sprintf(", %.2fx BENCH_BASELINE_BIN's", rate/base)
			}
			line += "), never killed"
		default:
			b.ReportMetric(float64(v.peak)/(1<<20), "peak_MiB_"+suffix)
			b.ReportMetric(rate, "rec/s_"+suffix)
			line += fmt.Sprintf(" (%.2f of the Deployment's 512 MiB)", float64(v.peak)/containerLimit)
		}
		fmt.Println(line)
	}
}

// envInts reads a comma-separated list of positive integers from the environment.
func envInts(b *testing.B, name string, def []int) []int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	var out []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			b.Fatalf("%s=%q: want a comma-separated list of positive integers", name, v)
		}
		out = append(out, n)
	}
	return out
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

// produceLedger produces events ledger events (10,000 accounts) to topic, generated and produced
// in chunks so that a backlog of ten million is never held in this process twice.
func produceLedger(b *testing.B, k *testenv.Kafka, topic string, events int) {
	cl := k.Client(b, kgo.ProducerLinger(5*time.Millisecond))
	ctx := context.Background()
	const chunk = 50_000
	for i := 0; i < events; i += chunk {
		items := ledger.Generate(ledger.GenConfig{Events: min(chunk, events-i), Accounts: 10_000, Seed: uint64(3 + i), Prefix: fmt.Sprintf("m%d-", i)})
		recs := make([]*kgo.Record, 0, len(items))
		for _, it := range items {
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
	group := fmt.Sprintf("mem-%s-%d-%d", topic, limit, time.Now().UnixNano())
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(),
		"KAFKA_BROKERS="+strings.Join(k.Brokers, ","),
		"KAFKA_GROUP_ID="+group,
		"KAFKA_TOPICS="+topic,
		"DATABASE_URL="+url,
		"DB_MAX_CONNS=8",
		"HANDLER=ledger",
		"HTTP_ADDR="+addr,
		"LOG_LEVEL=warn",
	)
	profiles := os.Getenv("BENCH_PROFILE_DIR")
	pprofAddr := ""
	if profiles != "" {
		pprofAddr = testenv.FreeAddr(b)
		cmd.Env = append(cmd.Env, "PPROF_ADDR="+pprofAddr)
	}
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
	profiled := profiles == ""
	for applied < want {
		if !profiled && applied >= want/5 {
			profiled = true
			name := filepath.Join(profiles, fmt.Sprintf("%s-%s-%d", filepath.Base(bin), topic, limit))
			go saveProfiles(b, pprofAddr, name)
		}
		select {
		case err := <-exited:
			b.Fatalf("processor exited after %d of %d events: %v (killed for memory?)", applied, want, err)
		case <-time.After(200 * time.Millisecond):
		}
		if err := countApplied(ctx, pool, group, topic, &applied); err != nil {
			continue // kafkapg's tables may not exist yet
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

// saveProfiles saves a heap profile and a 5-second CPU profile of the processor serving pprof
// on addr, as name.heap.pb.gz and name.cpu.pb.gz (BENCH_PROFILE_DIR).
func saveProfiles(b *testing.B, addr, name string) {
	for _, p := range []struct{ path, suffix string }{{"heap", ".heap.pb.gz"}, {"profile?seconds=5", ".cpu.pb.gz"}} {
		resp, err := http.Get("http://" + addr + "/debug/pprof/" + p.path)
		if err != nil {
			b.Logf("profile %s: %v", p.path, err)
			return
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err == nil {
			err = os.WriteFile(name+p.suffix, body, 0o644)
		}
		if err != nil {
			b.Logf("profile %s: %v", p.path, err)
		}
	}
}

// countApplied reads how many records of topic the group has applied: the sum of its partitions'
// stored offsets (the backlog starts at offset 0 and every ledger event applies). Counting the
// ledger's rows would scan ten million of them.
func countApplied(ctx context.Context, pool *pgxpool.Pool, group, topic string, n *int) error {
	return pool.QueryRow(ctx, `SELECT coalesce(sum(next_offset), 0) FROM kafkapg.offsets
		WHERE consumer_group = $1 AND topic = $2`, group, topic).Scan(n)
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
