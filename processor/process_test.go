package processor_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kafkapg/kafkapg/internal/service"
	"github.com/kafkapg/kafkapg/internal/testenv"
)

// TestMain lets the test binary play cmd/processor: tests re-execute it as a child process that
// they can SIGKILL, SIGSTOP and SIGTERM.
func TestMain(m *testing.M) {
	if os.Getenv("KAFKAPG_TEST_CHILD") == "processor" {
		os.Exit(service.Main([]string{"run"}, os.Stderr))
	}
	code := m.Run()
	if code == 0 {
		// Workers, relays and clients must all be gone once every processor has stopped.
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goroutine leak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// child is a processor running as a separate process.
type child struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	stderr bytes.Buffer
	done   chan struct{}
	err    error
}

// startChild runs the processor (the test binary in child mode) with the harness's settings
// plus extra environment variables.
func (h *harness) startChild(extra ...string) *child {
	h.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		"KAFKAPG_TEST_CHILD=processor",
		"KAFKA_BROKERS="+strings.Join(h.k.Brokers, ","),
		"KAFKA_GROUP_ID="+h.group,
		"KAFKA_TOPICS="+h.topic,
		"DATABASE_URL="+h.dbURL,
		"HANDLER=ledger",
		"HTTP_ADDR=127.0.0.1:0",
		"KAFKA_SESSION_TIMEOUT=3s",
		"RETRY_BACKOFF_BASE=5ms",
		"RETRY_BACKOFF_MAX=50ms",
		"BATCH_MAX_RECORDS=100",
		"LOG_LEVEL=info",
	)
	cmd.Env = append(cmd.Env, extra...)
	c := &child{cmd: cmd, done: make(chan struct{})}
	pr, pw := io.Pipe()
	cmd.Stderr = pw
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			c.mu.Lock()
			c.stderr.Write(sc.Bytes())
			c.stderr.WriteByte('\n')
			c.mu.Unlock()
		}
	}()
	if err := cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	go func() {
		c.err = cmd.Wait()
		pw.Close()
		close(c.done)
	}()
	h.t.Cleanup(func() {
		c.signal(syscall.SIGCONT)
		c.signal(syscall.SIGKILL)
		<-c.done
		if os.Getenv("KAFKAPG_TEST_DEBUG") != "" {
			h.t.Logf("child %d stderr:\n%s", cmd.Process.Pid, c.tail(1<<30))
		} else if h.t.Failed() {
			h.t.Logf("child %d stderr (last 8KB):\n%s", cmd.Process.Pid, c.tail(8192))
		}
	})
	return c
}

func (c *child) signal(sig syscall.Signal) { _ = c.cmd.Process.Signal(sig) }

func (c *child) tail(n int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	b := c.stderr.Bytes()
	return string(b[max(0, len(b)-n):])
}

// wait waits for the child to exit and returns its exit code (-1 if killed by a signal).
func (c *child) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-c.done:
	case <-time.After(timeout):
		t.Fatalf("child did not exit within %v", timeout)
	}
	return c.cmd.ProcessState.ExitCode()
}

// metric scrapes the child's /metrics and returns the sum of a counter's series.
func (c *child) metric(t *testing.T, name string) float64 {
	t.Helper()
	var addr string
	testenv.Eventually(t, 30*time.Second, func() error {
		c.mu.Lock()
		defer c.mu.Unlock()
		sc := bufio.NewScanner(bytes.NewReader(c.stderr.Bytes()))
		for sc.Scan() {
			var line struct{ Msg, Addr string }
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "http listening" {
				addr = line.Addr
				return nil
			}
		}
		return fmt.Errorf("child has not logged its HTTP address")
	})
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	total := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, name+" ") || strings.HasPrefix(line, name+"{") {
			var v float64
			fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v)
			total += v
		}
	}
	return total
}

// TestKilledProcessesApplyExactlyOnce SIGKILLs the processor process again and again while it
// applies a backlog (so kills land mid-batch, mid-commit, mid-publish), restarting it each time,
// then lets a last one finish and stops it with SIGTERM. Every event must be applied exactly
// once and every dead letter published.
func TestKilledProcessesApplyExactlyOnce(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		seed := rand.Uint64()
		t.Logf("seed %d", seed)
		rng := rand.New(rand.NewPCG(seed, seed))
		h := newHarness(t, k, 4)
		items := mixed(20000, seed, "kill")
		h.produce(items)
		wantApplied := 0
		for _, it := range items {
			if !it.Dead(1) {
				wantApplied++
			}
		}

		const kills = 5
		for i := range kills {
			c := h.startChild()
			target := h.applied() + 1 + rng.IntN(wantApplied/(kills+1))
			h.waitApplied(min(target, wantApplied), 60*time.Second)
			time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
			c.signal(syscall.SIGKILL)
			c.wait(t, 10*time.Second)
			t.Logf("kill %d: %d of %d applied", i+1, h.applied(), wantApplied)
		}

		c := h.startChild("SHUTDOWN_TIMEOUT=5s")
		h.waitSettled(items, 1, 120*time.Second)
		start := time.Now()
		c.signal(syscall.SIGTERM)
		if code := c.wait(t, 10*time.Second); code != 0 {
			t.Fatalf("exit status after SIGTERM = %d, want 0", code)
		}
		t.Logf("SIGTERM to exit: %v", time.Since(start).Round(time.Millisecond))
		h.verify(items, 1, true)
	})
}

// TestPausedProcessComesBackAsZombie freezes a processor (SIGSTOP) mid-stream for longer than its session
// and transaction idle timeouts, so the group gives its partitions to another process, then
// thaws it (SIGCONT): it comes back as a zombie that still believes it owns its partitions.
// Nothing it does from then on may apply twice.
func TestPausedProcessComesBackAsZombie(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		h := newHarness(t, k, 4)
		items := mixed(20000, 11, "pause")
		go h.produce(items)
		env := []string{"DB_TX_IDLE_TIMEOUT=2s", "BATCH_MAX_RECORDS=20"}
		a := h.startChild(env...)
		h.waitApplied(2000, 60*time.Second)
		a.signal(syscall.SIGSTOP)
		b := h.startChild(env...)
		frozenAt := h.applied()
		testenv.Eventually(t, 60*time.Second, func() error {
			if got := h.applied(); got < frozenAt+2000 {
				return fmt.Errorf("only %d applied since A froze", got-frozenAt)
			}
			return nil
		})
		a.signal(syscall.SIGCONT)
		h.waitSettled(items, 1, 120*time.Second)
		t.Logf("thawed zombie: %v transactions fenced, %v infrastructure retries",
			a.metric(t, "kafkapg_fenced_transactions_total"), a.metric(t, "kafkapg_infrastructure_retries_total"))
		a.signal(syscall.SIGTERM)
		b.signal(syscall.SIGTERM)
		if code := a.wait(t, 15*time.Second); code != 0 {
			t.Errorf("A exit status %d", code)
		}
		if code := b.wait(t, 15*time.Second); code != 0 {
			t.Errorf("B exit status %d", code)
		}
		h.verify(items, 1, true)
	})
}
