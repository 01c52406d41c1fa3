package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// docFiles returns the files of a page: its code blocks whose info string names one
// ("```go file=main.go"), by name, and the text of its sh blocks.
func docFiles(t *testing.T, page string) (files map[string]string, shell string) {
	t.Helper()
	b, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	files = map[string]string{}
	block := regexp.MustCompile("(?s)```([a-z]+)( file=(\\S+))?\n(.*?)```")
	for _, m := range block.FindAllStringSubmatch(string(b), -1) {
		switch {
		case m[3] != "":
			files[m[3]] = m[4]
		case m[1] == "sh":
			shell += m[4]
		}
	}
	return files, shell
}

// TestDevelopYourService walks docs/develop.md as a user would, in a module of its own outside
// this repository (a replace directive pointing here, for want of a published version): its
// files, its commands, nothing else. The handler tests run with no database set up; the dev
// loop starts a broker and Postgres and creates the topics; the service runs on them, is fed
// with produce, and what it emitted is read with consume; its dlq and config commands answer.
func TestDevelopYourService(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a module of its own (a minute or two)")
	}
	files, shell := docFiles(t, "../../docs/develop.md")
	// Each command run below is the page's, verbatim (extra flags aside).
	page := func(cmd string) string {
		t.Helper()
		if !strings.Contains(shell, cmd) {
			t.Fatalf("docs/develop.md does not say %q (its commands:\n%s)", cmd, shell)
		}
		return cmd
	}
	for _, f := range []string{"main.go", "main_test.go", "orders.jsonl"} {
		if files[f] == "" {
			t.Fatalf("docs/develop.md has no %q block", f)
		}
	}

	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "develop-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	// As root, the dev loop's Postgres runs as the postgres user, who must enter the module.
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	// `go mod init` and `go get github.com/kafkapg/kafkapg@latest`, offline: the modules are
	// this repository's (its go.sum), and kafkapg is this checkout.
	page("go mod init example.com/inventory")
	page("go get github.com/kafkapg/kafkapg@latest")
	files["go.mod"] = "module example.com/inventory\n\ngo 1.26\n\nrequire github.com/kafkapg/kafkapg v0.0.0\n\nreplace github.com/kafkapg/kafkapg => " + root + "\n"
	files["go.sum"] = string(sum)
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// The user's environment: none of this repository's test settings (CI's KAFKA_BROKERS and
	// TEST_DATABASE_URL above all), Go offline.
	var base []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "KAFKA_") || strings.HasPrefix(name, "TOPIC_") || strings.HasPrefix(name, "PG") ||
			slices.Contains([]string{"DATABASE_URL", "TEST_DATABASE_URL", "HANDLER", "GOFLAGS"}, name) {
			continue
		}
		base = append(base, kv)
	}
	base = append(base, "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off")
	sh := func(env []string, line string, extra ...string) *exec.Cmd {
		args := append(strings.Fields(line), extra...)
		for len(args) > 0 && strings.Contains(args[0], "=") { // NAME=value, as a shell takes it
			env = append(slices.Clone(env), args[0])
			args = args[1:]
		}
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Dir = dir
		cmd.Env = append(slices.Clone(base), env...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // signalled as a group, as a terminal's Ctrl-C does
		return cmd
	}
	run := func(env []string, line string, extra ...string) string {
		t.Helper()
		out, err := sh(env, line, extra...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", line, strings.Join(extra, " "), err, out)
		}
		return string(out)
	}

	run(nil, page("go get -tool github.com/kafkapg/kafkapg/cmd/kafkapg"))
	run(nil, "go mod tidy")
	start := time.Now()
	out := run(nil, page("go test ./..."))
	t.Logf("the handler tests, a throwaway Postgres included: %s\n%s", time.Since(start).Round(time.Second), out)

	// The dev loop, on free ports (the page's defaults may be taken on a test machine).
	devOut := &syncBuffer{}
	dev := sh(nil, page("go tool kafkapg dev -topics orders,inventory.reserved"), "-kafka", "127.0.0.1:0", "-postgres-port", "0")
	dev.Stdout, dev.Stderr = devOut, devOut
	if err := dev.Start(); err != nil {
		t.Fatal(err)
	}
	devDone := make(chan error, 1)
	go func() { devDone <- dev.Wait() }()
	t.Cleanup(func() {
		syscall.Kill(-dev.Process.Pid, syscall.SIGKILL)
		if t.Failed() {
			t.Logf("kafkapg dev:\n%s", devOut)
		}
	})
	envFile := filepath.Join(dir, ".kafkapg", "env")
	testenv.Eventually(t, 3*time.Minute, func() error {
		select {
		case err := <-devDone:
			t.Fatalf("kafkapg dev exited: %v\n%s", err, devOut)
		default:
		}
		_, err := os.Stat(envFile)
		return err
	})
	// `. .kafkapg/env`
	page(". .kafkapg/env")
	_, devEnv, err := readEnv(envFile)
	if err != nil {
		t.Fatal(err)
	}
	var env []string
	for _, kv := range devEnv {
		env = append(env, kv[0]+"="+kv[1])
	}
	if len(env) != 2 {
		t.Fatalf(".kafkapg/env: %q", env)
	}

	// The service: the page's `go run .`, built first, so that SIGTERM reaches it alone.
	page("KAFKA_GROUP_ID=inventory KAFKA_TOPICS=orders HTTP_ADDR=127.0.0.1:9090 LOG_FORMAT=text go run .")
	run(nil, "go build -o inventory .")
	httpAddr := testenv.FreeAddr(t)
	svcEnv := append(slices.Clone(env), "KAFKA_GROUP_ID=inventory", "KAFKA_TOPICS=orders", "HTTP_ADDR="+httpAddr, "LOG_FORMAT=text")
	svc := sh(svcEnv, "./inventory")
	svcOut := &syncBuffer{}
	svc.Stdout, svc.Stderr = svcOut, svcOut
	if err := svc.Start(); err != nil {
		t.Fatal(err)
	}
	svcDone := make(chan error, 1)
	go func() { svcDone <- svc.Wait() }()
	t.Cleanup(func() {
		svc.Process.Kill()
		if t.Failed() {
			t.Logf("the service:\n%s", svcOut)
		}
	})
	testenv.Eventually(t, time.Minute, func() error { return localrun.Ready(httpAddr) })

	// Fed from a shell without the environment: produce and consume find the dev loop's broker.
	run(nil, page("go tool kafkapg produce -topic orders -key-field order_id orders.jsonl"))
	reserved := run(nil, "go tool kafkapg consume -topic inventory.reserved -n 2 -wait 60s")
	keys := func(lines string) []string {
		var ks []string
		sc := bufio.NewScanner(strings.NewReader(lines))
		for sc.Scan() {
			var r struct {
				Key   string
				Value struct {
					OrderID string `json:"order_id"`
				}
			}
			if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
				continue // go's own output
			}
			ks = append(ks, r.Key+"="+r.Value.OrderID)
		}
		slices.Sort(ks)
		return ks
	}
	if got := keys(reserved); !slices.Equal(got, []string{"o-1=o-1", "o-3=o-3"}) {
		t.Fatalf("inventory.reserved: %q, want o-1 (once) and o-3\n%s", got, reserved)
	}
	// Up to the end of the topic: still o-1 once (its copy skipped), and o-3.
	if got := keys(run(nil, page("go tool kafkapg consume -topic inventory.reserved"))); !slices.Equal(got, []string{"o-1=o-1", "o-3=o-3"}) {
		t.Errorf("inventory.reserved, read to its end: %q", got)
	}

	// The service's commands, in the dev loop's environment.
	testenv.Eventually(t, 30*time.Second, func() error {
		out := run(env, page("KAFKA_GROUP_ID=inventory go run . dlq list"))
		if !strings.Contains(out, "o-2") || !strings.Contains(out, "not enough pear in stock for 5") {
			return fmt.Errorf("dlq list does not show o-2:\n%s", out)
		}
		return nil
	})
	config := run(env, page("KAFKA_GROUP_ID=inventory KAFKA_TOPICS=orders go run . config"))
	for _, want := range []string{`1s, 30s, 5m0s`, `service.Handler{Name: "inventory"}.RetryTiers`, `service.Handler{Name: "inventory"}.IdempotencyKey`, "orders.inventory.dlq"} {
		if !strings.Contains(config, want) {
			t.Errorf("config does not say %q:\n%s", want, config)
		}
	}

	svc.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-svcDone:
		if err != nil {
			t.Errorf("the service after SIGTERM: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Error("the service still runs 30s after SIGTERM")
	}
	syscall.Kill(-dev.Process.Pid, syscall.SIGINT) // Ctrl-C
	select {
	case err := <-devDone:
		if err != nil {
			t.Errorf("kafkapg dev after Ctrl-C: %v\n%s", err, devOut)
		}
	case <-time.After(60 * time.Second):
		t.Error("kafkapg dev still runs 60s after Ctrl-C")
	}
	if _, err := os.Stat(envFile); !os.IsNotExist(err) {
		t.Errorf("%s is left after the dev loop stopped (%v)", envFile, err)
	}
}

// syncBuffer is a bytes.Buffer that a process's output and the test share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
