package testkit

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/promscrape"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// childEnv is set in a child's environment: its TestMain must then run the service (ChildMain).
const childEnv = "KAFKAPG_TEST_CHILD"

// ChildMain, called first thing in a test binary's TestMain, runs service when the binary was
// started by StartChild, and exits with its status; otherwise it returns.
func ChildMain(service func() int) {
	if os.Getenv(childEnv) == "service" {
		os.Exit(service())
	}
}

// Child is a service running as a separate process: the test binary, re-executed in the mode
// ChildMain serves.
type Child struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	stderr bytes.Buffer
	done   chan struct{}
	err    error
}

// StartChild runs the service (the test binary, whose TestMain calls ChildMain) with the
// harness's settings (the ledger handler) plus extra environment variables. It is killed at the
// end of the test; its log is shown if the test failed.
func (h *Harness) StartChild(extra ...string) *Child {
	h.T.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		childEnv+"=service",
		"KAFKA_BROKERS="+strings.Join(h.K.Brokers, ","),
		"KAFKA_GROUP_ID="+h.Group,
		"KAFKA_TOPICS="+h.Topic,
		"DATABASE_URL="+h.DBURL,
		"HANDLER=ledger",
		"HTTP_ADDR=127.0.0.1:0",
		"KAFKA_SESSION_TIMEOUT=3s",
		"KAFKA_REBALANCE_TIMEOUT=8s",
		"RETRY_BACKOFF_BASE=5ms",
		"RETRY_BACKOFF_MAX=50ms",
		"BATCH_MAX_RECORDS=100",
		"LOG_LEVEL=info",
	)
	cmd.Env = append(cmd.Env, extra...)
	c := &Child{cmd: cmd, done: make(chan struct{})}
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
		h.T.Fatal(err)
	}
	go func() {
		c.err = cmd.Wait()
		pw.Close()
		close(c.done)
	}()
	h.T.Cleanup(func() {
		c.Signal(syscall.SIGCONT)
		c.Signal(syscall.SIGKILL)
		<-c.done
		if os.Getenv("KAFKAPG_TEST_DEBUG") != "" {
			h.T.Logf("child %d stderr:\n%s", cmd.Process.Pid, c.Tail(1<<30))
		} else if h.T.Failed() {
			h.T.Logf("child %d stderr (last 8KB):\n%s", cmd.Process.Pid, c.Tail(8192))
		}
	})
	return c
}

// Signal sends the child sig.
func (c *Child) Signal(sig syscall.Signal) { _ = c.cmd.Process.Signal(sig) }

// Pid is the child's process id.
func (c *Child) Pid() int { return c.cmd.Process.Pid }

// Tail returns the last n bytes of the child's log.
func (c *Child) Tail(n int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	b := c.stderr.Bytes()
	return string(b[max(0, len(b)-n):])
}

// Wait waits for the child to exit and returns its exit code (-1 if killed by a signal).
func (c *Child) Wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-c.done:
	case <-time.After(timeout):
		t.Fatalf("child did not exit within %v", timeout)
	}
	return c.cmd.ProcessState.ExitCode()
}

// HTTPAddr returns the address the child serves HTTP on, from its log.
func (c *Child) HTTPAddr(t *testing.T) string {
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
	return addr
}

// WaitReady waits until the child's /readyz answers 200: it is in the group and reaches Postgres.
func (c *Child) WaitReady(t *testing.T) {
	t.Helper()
	addr := c.HTTPAddr(t)
	testenv.Eventually(t, 60*time.Second, func() error { return localrun.Ready(addr) })
}

// Metric scrapes the child's /metrics and returns the sum of a metric's series.
func (c *Child) Metric(t *testing.T, name string) float64 {
	t.Helper()
	sums, err := promscrape.Sums(context.Background(), "http://"+c.HTTPAddr(t)+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	return sums[name]
}
