package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/promscrape"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// build compiles the quickstart service, as a user would, and returns the binary's path.
func build(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "quickstart")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// TestQuickstartService runs the quickstart service as a user would deploy it: the built binary,
// configured by environment variables only.
func TestQuickstartService(t *testing.T) {
	runService(t, build(t))
}

// TestReadmeService builds the README's ten-line service from the README's text alone, in a
// module of its own outside this repository (a replace directive pointing here, as a user with a
// checkout would write), and runs it like TestQuickstartService.
func TestReadmeService(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(readme)
	start := strings.Index(text, "## Your service in ten lines")
	code := strings.Index(text[start:], "```go\n")
	if start < 0 || code < 0 {
		t.Fatal(`README.md has no "## Your service in ten lines" section with a Go block`)
	}
	code += start + len("```go\n")
	end := strings.Index(text[code:], "```")
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{
		"main.go": text[code : code+end],
		"go.mod":  "module example.com/orders\n\ngo 1.26\n\nrequire github.com/kafkapg/kafkapg v0.0.0\n\nreplace github.com/kafkapg/kafkapg => " + root + "\n",
		"go.sum":  string(sum), // the modules are those of this repository: no download needed
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	bin := filepath.Join(dir, "orders")
	for _, args := range [][]string{{"mod", "tidy"}, {"build", "-o", bin, "."}} {
		cmd := exec.Command("go", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s in a module of its own: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	runService(t, bin)
}

// runService runs a built service binary (the quickstart's handler, under any name) with
// environment variables only. It must become ready, serve metrics, apply the good records
// exactly once, dead-letter the bad one, and exit 0 on SIGTERM.
func runService(t *testing.T, bin string) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		pool, dbURL := testenv.Postgres(t)
		topic := k.CreateTopic(t, 2)
		group := k.Group(t)
		addr := testenv.FreeAddr(t)
		k.Produce(t,
			&kgo.Record{Topic: topic, Key: []byte("o-1"), Value: []byte(`{"order_id":"o-1","amount":42}`)},
			&kgo.Record{Topic: topic, Key: []byte("o-2"), Value: []byte("not json")},
			&kgo.Record{Topic: topic, Key: []byte("o-3"), Value: []byte(`{"order_id":"o-3","amount":7}`)},
		)

		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(),
			"DATABASE_URL="+dbURL,
			"KAFKA_BROKERS="+strings.Join(k.Brokers, ","),
			"KAFKA_GROUP_ID="+group,
			"KAFKA_TOPICS="+topic,
			"HTTP_ADDR="+addr,
		)
		var logs strings.Builder
		cmd.Stderr = &logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		t.Cleanup(func() {
			cmd.Process.Kill()
			if t.Failed() {
				t.Logf("service logs:\n%s", logs.String())
			}
		})

		testenv.Eventually(t, 60*time.Second, func() error { return localrun.Ready(addr) })
		testenv.Eventually(t, 60*time.Second, func() error {
			var n, sum int64
			if err := pool.QueryRow(context.Background(), `SELECT count(*), coalesce(sum(amount), 0) FROM orders`).Scan(&n, &sum); err != nil {
				return err
			}
			if n != 2 || sum != 49 {
				return fmt.Errorf("orders: %d rows, sum %d; want 2 rows, sum 49", n, sum)
			}
			return nil
		})
		testenv.Eventually(t, 60*time.Second, func() error {
			if got := len(k.ReadAll(t, retrytopics.DLQTopic(topic, group))); got != 1 {
				return fmt.Errorf("%d records in the DLQ topic, want 1 (the bad JSON)", got)
			}
			return nil
		})
		var dead int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.dead_letters WHERE topic = $1 AND error_class = 'permanent'`, topic).Scan(&dead); err != nil || dead != 1 {
			t.Errorf("dead_letters rows = %d (%v), want 1 permanent", dead, err)
		}
		m, err := promscrape.Sums(context.Background(), "http://"+addr+"/metrics")
		if err != nil {
			t.Fatal(err)
		}
		if m["kafkapg_records_applied_total"] != 2 || m["kafkapg_records_dead_lettered_total"] != 1 {
			t.Errorf("kafkapg_records_applied_total = %v, kafkapg_records_dead_lettered_total = %v; want 2 and 1",
				m["kafkapg_records_applied_total"], m["kafkapg_records_dead_lettered_total"])
		}

		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("after SIGTERM: %v, want exit status 0", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("still running 30s after SIGTERM")
		}
	})
}

// TestQuickstartBadConfiguration: a bad variable makes the binary exit 2 at once, naming it.
func TestQuickstartBadConfiguration(t *testing.T) {
	bin := build(t)
	for _, tt := range []struct {
		name string
		env  []string
		want string
	}{
		{"garbled number", []string{"BATCH_MAX_RECORDS=many"}, `BATCH_MAX_RECORDS="many" is not a valid integer`},
		{"unknown handler", []string{"HANDLER=payments"}, `HANDLER="payments" is not a handler of this binary (it has: orders)`},
		{"per-topic variable for another topic", []string{"TOPIC_REFUNDS_RETRY_TIERS=1s"}, "TOPIC_REFUNDS_RETRY_TIERS names no topic of KAFKA_TOPICS"},
		{"nothing set", nil, "DATABASE_URL is required"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cmd := exec.Command(bin)
			cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
			if tt.env != nil {
				cmd.Env = append(cmd.Env, "DATABASE_URL=postgres://x@127.0.0.1:1/x", "KAFKA_BROKERS=127.0.0.1:1",
					"KAFKA_GROUP_ID=g", "KAFKA_TOPICS=orders")
				cmd.Env = append(cmd.Env, tt.env...)
			}
			out, err := cmd.CombinedOutput()
			if code := cmd.ProcessState.ExitCode(); code != 2 {
				t.Fatalf("exit status %d (%v), want 2; output:\n%s", code, err, out)
			}
			if !strings.Contains(string(out), "quickstart: configuration error: ") || !strings.Contains(string(out), tt.want) {
				t.Errorf("output %q does not name the problem %q", out, tt.want)
			}
		})
	}
}

// TestQuickstartHelp: the binary lists its commands and its handlers.
func TestQuickstartHelp(t *testing.T) {
	out, err := exec.Command(build(t), "help").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "migrate") || !strings.Contains(string(out), "(HANDLER): orders") {
		t.Fatalf("help: %v\n%s", err, out)
	}
}
