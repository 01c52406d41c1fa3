package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
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
// In both, the benchmark fails if the build under test breaks the bound docs/guarantees.md
// (Memory) promises, computed from the run's MAX_BUFFERED_BYTES, BATCH_MAX_RECORDS, connections
// and broker count (see memoryBound): the heap live at a garbage collection (its heap profile's
// in-use total, read once a second) must stay within the whole bound, and the buffered records
// (kafkapg_buffered_bytes, read from /metrics every 200 ms) within the budget and one poll.
// Resident memory is not held to that bound: without a limit the runtime lets the heap grow to
// twice what is live (GOGC=100), and in the container to the soft limit.
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
		name     string
		bin      string
		limit    int64
		peak     int64 // resident (VmHWM)
		live     int64 // heap live at a collection (heapInUse)
		buffered int64 // kafkapg_buffered_bytes
		rates    []float64
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
			m, rate := drainBacklog(b, v.bin, k, topic, events, v.limit)
			v.peak, v.live, v.buffered = max(v.peak, m.peak), max(v.live, m.live), max(v.buffered, m.buffered)
			v.rates = append(v.rates, rate)
		}
	}
	budget := int64(setting(b, "MAX_BUFFERED_BYTES", defaultBudget))
	bound, poll := memoryBound(budget, len(k.Brokers), drainConns, setting(b, "BATCH_MAX_RECORDS", defaultBatch))
	for _, v := range vs {
		if v.name == "BENCH_BASELINE_BIN" {
			continue // an earlier release: what it holds is measured, not promised
		}
		// A variant that never collected (or never answered /metrics) would pass unseen.
		if v.live == 0 || v.buffered == 0 {
			b.Errorf("%d partitions, %s: no heap profile read (%d) or no buffered bytes read from /metrics (%d)",
				parts, v.name, v.live, v.buffered)
		}
		if v.live > bound {
			b.Errorf("%d partitions, %s: the heap held %d MiB live at a collection, over the %d MiB docs/guarantees.md promises (memoryBound: MAX_BUFFERED_BYTES %d MiB, %d broker(s))",
				parts, v.name, v.live>>20, bound>>20, budget>>20, len(k.Brokers))
		}
		if v.buffered > budget+poll {
			b.Errorf("%d partitions, %s: kafkapg_buffered_bytes reached %d, over MAX_BUFFERED_BYTES (%d) and one poll (%d)",
				parts, v.name, v.buffered, budget, poll)
		}
		if v.limit == 0 && v.peak > containerLimit {
			b.Errorf("%d partitions, %s: peak RSS %d MiB, over the Deployment's %d MiB limit", parts, v.name, v.peak>>20, containerLimit>>20)
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
		line := fmt.Sprintf("  %3d partitions, %-18s peak RSS %4d MiB (heap live %3d MiB, buffered %3d MiB; bound %d MiB), drained at %6.0f records/s %v",
			parts, v.name+":", v.peak>>20, v.live>>20, v.buffered>>20, bound>>20, rate, rounded(v.rates))
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

// drainConns is the processor's DB_MAX_CONNS: how many transactions it has in flight at most.
const drainConns = 8

// defaultBudget and defaultBatch are the processor's MAX_BUFFERED_BYTES and BATCH_MAX_RECORDS
// when the environment does not set them.
const (
	defaultBudget = 64 << 20
	defaultBatch  = 500
)

// memoryUse is what drainBacklog measured of a processor, in bytes: its peak resident memory, the
// most its heap held live (heapInUse, once a second), and the most its buffered records cost
// (kafkapg_buffered_bytes, every 200 ms).
type memoryUse struct{ peak, live, buffered int64 }

// drainBacklog runs the processor binary on topic, as a new consumer group, until want events are
// applied, and returns its memory (see memoryUse) and the records applied per second from its
// start. A positive limit runs it in a memory cgroup of that size.
func drainBacklog(b *testing.B, bin string, k *testenv.Kafka, topic string, want int, limit int64) (m memoryUse, rate float64) {
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
		"DB_MAX_CONNS="+strconv.Itoa(drainConns),
		"HANDLER=ledger",
		"HTTP_ADDR="+addr,
		"LOG_LEVEL=warn",
	)
	// The heap profile's totals are what the last collection found live (see heapInUse).
	profiles := os.Getenv("BENCH_PROFILE_DIR")
	pprofAddr := testenv.FreeAddr(b)
	cmd.Env = append(cmd.Env, "PPROF_ADDR="+pprofAddr)
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
	applied, polls := 0, 0
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
		if n, ok := bufferedBytes(addr); ok {
			m.buffered = max(m.buffered, n)
		}
		if polls++; polls%5 == 0 { // a profile a second: it costs the processor a little CPU
			if n, ok := heapInUse(pprofAddr); ok {
				m.live = max(m.live, n)
			}
		}
		if err := countApplied(ctx, pool, group, topic, &applied); err != nil {
			continue // kafkapg's tables may not exist yet
		}
	}
	elapsed := time.Since(start)
	if n, ok := heapInUse(pprofAddr); ok { // a drain shorter than a second has no sample yet
		m.live = max(m.live, n)
	}
	m.peak = vmHWM(b, cmd.Process.Pid)
	cmd.Process.Signal(syscall.SIGTERM)
	if err := <-exited; err != nil {
		b.Fatalf("processor did not exit cleanly: %v", err)
	}
	if err := localrun.Ready(addr); err == nil {
		b.Fatal("the processor still answers after exiting")
	}
	return m, float64(want) / elapsed.Seconds()
}

// fetchDecoded is how many times its size on the wire a fetch takes once franz-go has decoded it
// and kafkapg has counted its records ("a few times" in docs/guarantees.md): three to four for
// ledger records, whose 448 bytes of counted overhead dwarf their 150-byte values.
const fetchDecoded = 4

// ledgerBatchBytes is what the ledger handler allocates per record of a batch it is applying (the
// parsed event, its statements queued in a pgx.Batch): 26 MB in the heap profile of a processor
// with 8 transactions of 500 records in flight (BENCH_PROFILE_DIR, 128 partitions), rounded up.
const ledgerBatchBytes = 8 << 10

// memoryBound returns the bound docs/guarantees.md (Memory) promises for the memory of a
// processor with a buffer budget of budget bytes fetching from brokers brokers, with conns
// transactions of up to batch records in flight, and the part of it that is one poll's records,
// by which the budget itself may be overshot:
//
//   - fetched records: the budget, plus the poll that crossed it (a poll hands out at most what
//     franz-go had fetched: one fetch per broker);
//   - franz-go's fetches not yet handed out: one per broker, each of at most budget/32 on the
//     wire (group.go's FetchMaxBytes: between 1 and 50 MiB), decoded;
//   - held records being applied: a quarter of the budget; outbox batches: 16 MiB;
//   - the handler's own allocations for the batches in flight (the ledger's: ledgerBatchBytes a
//     record);
//   - the runtime, connection pools and metrics: 40 MiB.
func memoryBound(budget int64, brokers, conns, batch int) (bound, poll int64) {
	fetch := min(max(budget/32, 1<<20), 50<<20) * fetchDecoded
	poll = int64(brokers) * fetch
	inFlight := int64(conns) * int64(batch) * ledgerBatchBytes
	return budget + poll + int64(brokers)*fetch + budget/4 + 16<<20 + inFlight + 40<<20, poll
}

// setting returns the processor's setting name in this run: the environment's, which the processor
// inherits, or def.
func setting(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}

// bufferedBytes reads kafkapg_buffered_bytes from the processor's /metrics on addr; false if it
// does not answer yet.
func bufferedBytes(addr string) (int64, bool) {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "kafkapg_buffered_bytes "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return int64(f), err == nil
		}
	}
	return 0, false
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

// heapInUse reads what the heap of the processor serving pprof on addr held live at its last
// garbage collection: the in-use bytes of its heap profile, each sample scaled up as pprof does
// (the text form's figures are the sampled allocations, one per 512 KiB on average). Unlike
// gctrace's live heap, it does not count what was allocated while that collection ran, which on
// two busy cores was 50 MiB more. False if the processor does not answer yet.
func heapInUse(addr string) (int64, bool) {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + "/debug/pprof/heap?debug=1")
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	var rate float64
	var total float64
	for sc.Scan() {
		line := sc.Text()
		if rate == 0 {
			// heap profile: <objects>: <bytes> [<objects>: <bytes>] @ heap/<2 × sampling rate>
			_, r, ok := strings.Cut(line, "@ heap/")
			if !ok {
				return 0, false
			}
			if n, err := strconv.ParseFloat(r, 64); err == nil && n > 0 {
				rate = n / 2
				continue
			}
			return 0, false
		}
		if strings.HasPrefix(line, "#") || !strings.Contains(line, "] @") {
			continue
		}
		var objects, bytes, allocObjects, allocBytes float64
		if _, err := fmt.Sscanf(strings.TrimSpace(line), "%g: %g [%g: %g]", &objects, &bytes, &allocObjects, &allocBytes); err != nil || objects == 0 {
			continue
		}
		// runtime/pprof's scaleHeapSample: a sample of average size s stands for 1/(1-e^(-s/rate)).
		total += bytes / (1 - math.Exp(-bytes/objects/rate))
	}
	return int64(total), rate > 0 && sc.Err() == nil
}
