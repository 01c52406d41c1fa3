package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
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

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/pgcluster"
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
// files, its commands, nothing else. The handler tests and the end-to-end test of the service
// (servicetest: its own broker and database) run with no database set up; the dev
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
	for _, f := range []string{"main.go", "main_test.go", "e2e_test.go", "orders.jsonl"} {
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
	out := run(nil, page("go test ./..."), "-v")
	t.Logf("the handler tests and the end-to-end test (servicetest), a throwaway Postgres included: %s\n%s", time.Since(start).Round(time.Second), out)
	// The page's tests all ran, and passed: the end-to-end one too (servicetest).
	for _, test := range []string{"TestReserve", "TestInventoryEndToEnd"} {
		if !regexp.MustCompile(`(?m)^--- PASS: ` + test + ` `).MatchString(out) {
			t.Errorf("go test ./... did not pass %s:\n%s", test, out)
		}
	}

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
	if len(env) != 5 {
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
	for _, want := range []string{`1s, 30s, 5m0s`, `service.Handler{Name: "inventory"}.RetryTiers`, `service.Handler{Name: "inventory"}.IdempotencyKey`, `KeyFromJSON("order_id")`, "orders.inventory.dlq"} {
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

// The dev loop's paths and its Postgres's credential (security issue 41, findings 1 and 7).

// nobody is the uid and gid an attacker's files get in these tests: another local user.
const nobody = 65534

// needRoot skips a test of what root's dev loop does with paths other users can plant.
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the dev loop runs Postgres as the postgres user only then")
	}
}

// enterableDir makes a dir of ours of mode 0755 under /tmp, which the postgres user can enter
// (t.TempDir() is 0700), removed at the end of the test.
func enterableDir(t *testing.T, prefix string) string {
	t.Helper()
	d, err := os.MkdirTemp("/tmp", prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	if err := os.Chmod(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

// withDataBase points devDataBase, where root's dev loop keeps Postgres's data when the
// postgres user cannot enter -dir, at a dir of the test's, and returns it.
func withDataBase(t *testing.T) string {
	t.Helper()
	base := filepath.Join(enterableDir(t, "kafkapg-dev-base-"), "base")
	old := devDataBase
	devDataBase = base
	t.Cleanup(func() { devDataBase = old })
	return base
}

// runDev runs the dev loop with dir and args on free ports, with `-- true`: it starts both
// servers, writes the env file, runs true and stops.
func runDev(t *testing.T, dir string, args ...string) (string, error) {
	t.Helper()
	t.Setenv("KAFKA_TOPICS", "")
	var out syncBuffer
	all := append([]string{"-dir", dir, "-kafka", "127.0.0.1:0", "-postgres-port", "0"}, args...)
	err := devCmd(t.Context(), append(all, "--", "true"), &out, &out)
	return out.String(), err
}

// startDev starts the dev loop with dir on free ports, waits for its env file, and returns
// its environment; it is stopped (Ctrl-C) at the end of the test.
func startDev(t *testing.T, dir string) map[string]string {
	t.Helper()
	t.Setenv("KAFKA_TOPICS", "")
	ctx, cancel := context.WithCancel(t.Context())
	out := &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- devCmd(ctx, []string{"-dir", dir, "-kafka", "127.0.0.1:0", "-postgres-port", "0"}, out, out)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("kafkapg dev: %v\n%s", err, out)
		}
	})
	envFile := filepath.Join(dir, "env")
	testenv.Eventually(t, 2*time.Minute, func() error {
		select {
		case err := <-done:
			done <- err
			t.Fatalf("kafkapg dev exited: %v\n%s", err, out)
		default:
		}
		if pid, _, err := readEnv(envFile); err != nil || pid != os.Getpid() {
			return fmt.Errorf("%s not written by this loop yet (pid %d, %v)", envFile, pid, err)
		}
		return nil
	})
	_, env, err := readEnv(envFile)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, kv := range env {
		m[kv[0]] = kv[1]
	}
	return m
}

// mustBeEmpty fails the test if dir, which an attacker pointed the dev loop at, has entries.
func mustBeEmpty(t *testing.T, dir string) {
	t.Helper()
	if entries, err := os.ReadDir(dir); err != nil || len(entries) > 0 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("%s, where the attacker pointed the dev loop, holds %q (%v): the dev loop wrote there", dir, names, err)
	}
}

// TestDevDoesNotFollowAPlantedDataDir is finding 1's attack: root runs the dev loop from a dir
// the postgres user cannot enter; another user has planted a symlink at the name an older
// kafkapg dev put Postgres's data at (/tmp/kafkapg-dev-<hash>), pointing at a dir root owns.
// Nothing may be written there: the data goes to a root-only dir instead, and still works.
func TestDevDoesNotFollowAPlantedDataDir(t *testing.T) {
	needRoot(t)
	withDataBase(t)
	dir := filepath.Join(t.TempDir(), ".kafkapg") // t.TempDir() is 0700: closed to postgres
	victim := enterableDir(t, "victim-")          // /usr/local/bin, say
	sum := sha256.Sum256([]byte(dir))
	planted := filepath.Join(os.TempDir(), "kafkapg-dev-"+hex.EncodeToString(sum[:6]))
	if err := os.Symlink(victim, planted); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(planted) })
	if err := os.Lchown(planted, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	out, err := runDev(t, dir)
	if err != nil {
		t.Fatalf("kafkapg dev: %v\n%s", err, out)
	}
	mustBeEmpty(t, victim)
	if !strings.Contains(out, planted+", where an older kafkapg dev kept Postgres's data, is not used any more") {
		t.Errorf("no word about %s:\n%s", planted, out)
	}
	// The data is kept between runs: a second run finds the cluster the first made.
	out, err = runDev(t, dir)
	if err != nil || strings.Contains(out, "initdb") {
		t.Errorf("second run: %v\n%s", err, out)
	}
}

// TestDevRefusesUnsafeDirs: a -dir, or a dir of root's data base, that another user could
// have planted or could replace is refused with an error naming it and what is wrong, and
// nothing is written through it.
func TestDevRefusesUnsafeDirs(t *testing.T) {
	needRoot(t)
	for _, tt := range []struct {
		name string
		// plant prepares the attack: work is a root-owned dir of mode 0755, base is
		// devDataBase, victim the dir the attacker wants root to write to. It returns -dir.
		plant func(t *testing.T, work, base, victim string) string
		want  string
	}{
		{"-dir is a symlink", func(t *testing.T, work, base, victim string) string {
			return symlink(t, victim, filepath.Join(work, ".kafkapg"), 0)
		}, "is a symlink: refusing to follow it"},
		{"-dir is another user's", func(t *testing.T, work, base, victim string) string {
			dir := filepath.Join(work, ".kafkapg")
			mkdir(t, dir, 0o755, nobody)
			return dir
		}, "is owned by uid 65534, not by you"},
		{"-dir is writable by others", func(t *testing.T, work, base, victim string) string {
			dir := filepath.Join(work, ".kafkapg")
			mkdir(t, dir, 0o777, 0)
			return dir
		}, "is writable by others (mode -rwxrwxrwx)"},
		{"a parent of -dir is writable by others and not sticky", func(t *testing.T, work, base, victim string) string {
			mkdir(t, filepath.Join(work, "shared"), 0o777, 0)
			return filepath.Join(work, "shared", ".kafkapg")
		}, "and not sticky: another user could replace what is under it"},
		{"a parent of -dir is another user's", func(t *testing.T, work, base, victim string) string {
			mkdir(t, filepath.Join(work, "bob"), 0o755, nobody)
			return filepath.Join(work, "bob", ".kafkapg")
		}, "is owned by uid 65534, neither root nor you"},
		{"a parent of -dir is another user's symlink", func(t *testing.T, work, base, victim string) string {
			return filepath.Join(symlink(t, victim, filepath.Join(work, "proj"), nobody), ".kafkapg")
		}, "is a symlink owned by uid 65534, neither root nor you"},
		{"root's data dir is a symlink", func(t *testing.T, work, base, victim string) string {
			dir := filepath.Join(t.TempDir(), ".kafkapg") // closed to postgres: the data goes to base
			sum := sha256.Sum256([]byte(dir))
			mkdir(t, base, 0o755, 0)
			symlink(t, victim, filepath.Join(base, hex.EncodeToString(sum[:8])), 0)
			return dir
		}, "is a symlink: refusing to follow it"},
		{"root's data base is another user's symlink", func(t *testing.T, work, base, victim string) string {
			symlink(t, victim, base, nobody)
			return filepath.Join(t.TempDir(), ".kafkapg")
		}, "is a symlink owned by uid 65534, neither root nor you"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			base := withDataBase(t)
			work, victim := enterableDir(t, "work-"), enterableDir(t, "victim-")
			dir := tt.plant(t, work, base, victim)
			out, err := runDev(t, dir)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("kafkapg dev -dir %s: %v, want an error saying %q\n%s", dir, err, tt.want, out)
			}
			mustBeEmpty(t, victim)
		})
	}
}

// symlink makes link point at target, owned by uid, and returns link.
func symlink(t *testing.T, target, link string, uid int) string {
	t.Helper()
	if err := errors.Join(os.Symlink(target, link), os.Lchown(link, uid, uid)); err != nil {
		t.Fatal(err)
	}
	return link
}

// mkdir makes dir with mode perm, owned by uid.
func mkdir(t *testing.T, dir string, perm os.FileMode, uid int) {
	t.Helper()
	if err := errors.Join(os.Mkdir(dir, perm), os.Chmod(dir, perm), os.Chown(dir, uid, uid)); err != nil {
		t.Fatal(err)
	}
}

// TestDevPostgresAsksForAPassword is finding 7: the dev loop's Postgres must not let any
// local user in as superuser. A connection without the password is refused; DATABASE_URL
// carries it; the env file and the password file are private (0600), an env file an older
// kafkapg dev left at 0644 included.
func TestDevPostgresAsksForAPassword(t *testing.T) {
	dir := filepath.Join(enterableDir(t, "dev-"), ".kafkapg")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	// An older dev loop's env file, readable by all (its pid is not running).
	if err := os.WriteFile(filepath.Join(dir, "env"), []byte("# kafkapg dev, pid 999999999: old\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := startDev(t, dir)
	for _, name := range []string{"env", "postgres-password"} {
		if fi, err := os.Lstat(filepath.Join(dir, name)); err != nil {
			t.Errorf("%s: %v", name, err)
		} else if fi.Mode() != 0o600 {
			t.Errorf("%s: mode %v, want a regular file of mode 0600", name, fi.Mode())
		}
	}
	assertPasswordRequired(t, env["DATABASE_URL"])
	hba, err := os.ReadFile(filepath.Join(dir, "postgres", "data", "pg_hba.conf"))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(hba)) {
		if f := strings.Fields(line); len(f) > 0 && !strings.HasPrefix(f[0], "#") && f[len(f)-1] != "scram-sha-256" {
			t.Errorf("pg_hba.conf: %q is not scram-sha-256", line)
		}
	}
}

// assertPasswordRequired checks that dbURL without its password, or with another, is refused,
// and that dbURL, which must carry the password, connects.
func assertPasswordRequired(t *testing.T, dbURL string) {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	for _, user := range []*url.Userinfo{url.User("postgres"), url.UserPassword("postgres", "guess")} {
		other := *u
		other.User = user
		if conn, err := pgx.Connect(ctx, other.String()); err == nil {
			conn.Close(ctx)
			t.Errorf("%s connected: any local user is superuser", other.Redacted())
		}
	}
	if pw, ok := u.User.Password(); !ok || len(pw) < 20 {
		t.Fatalf("DATABASE_URL %s carries no password (or a short one)", dbURL)
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatalf("with the password: %v", err)
	}
	conn.Close(ctx)
}

// TestDevUpgradesATrustCluster: a cluster an older kafkapg dev made (trust for every local
// connection) is given the password and pg_hba.conf of this one, and keeps its data.
func TestDevUpgradesATrustCluster(t *testing.T) {
	dir := filepath.Join(enterableDir(t, "dev-"), ".kafkapg")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	old, err := pgcluster.Start(t.Context(), pgcluster.Options{Dir: filepath.Join(dir, "postgres")})
	if err != nil {
		t.Fatal(err)
	}
	if err := old.CreateDatabase(t.Context(), devDatabase); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(t.Context(), old.URL(devDatabase))
	if err == nil {
		_, err = conn.Exec(t.Context(), "CREATE TABLE kept AS SELECT 42 AS answer")
		conn.Close(t.Context())
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	old.Close()

	env := startDev(t, dir)
	assertPasswordRequired(t, env["DATABASE_URL"])
	conn, err = pgx.Connect(t.Context(), env["DATABASE_URL"])
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	var answer int
	if err := conn.QueryRow(t.Context(), "SELECT answer FROM kept").Scan(&answer); err != nil || answer != 42 {
		t.Errorf("the older cluster's data: %d %v", answer, err)
	}
}

// TestDevBrokerAsksForSASL is issue 41's "local services it starts require a credential" for
// the broker: a client without SASL, or with another password, gets nothing from the dev
// loop's broker; the env file carries the login (SCRAM-SHA-256, user kafkapg, the password of
// <dir>/kafka-password, 0600), and with it produce, consume and topics work.
func TestDevBrokerAsksForSASL(t *testing.T) {
	dir := filepath.Join(enterableDir(t, "dev-"), ".kafkapg")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	env := startDev(t, dir)
	brokers := strings.Split(env["KAFKA_BROKERS"], ",")
	if env["KAFKA_SASL_MECHANISM"] != "SCRAM-SHA-256" || env["KAFKA_SASL_USERNAME"] != "kafkapg" || len(env["KAFKA_SASL_PASSWORD"]) < 20 {
		t.Errorf("the env file's SASL login: mechanism %q, user %q, a password of %d bytes; want SCRAM-SHA-256, kafkapg and one",
			env["KAFKA_SASL_MECHANISM"], env["KAFKA_SASL_USERNAME"], len(env["KAFKA_SASL_PASSWORD"]))
	}
	path := filepath.Join(dir, "kafka-password")
	if fi, err := os.Lstat(path); err != nil || fi.Mode() != 0o600 {
		t.Errorf("%s: %v, %v; want a regular file of mode 0600", path, fi, err)
	}
	if b, err := os.ReadFile(path); err != nil || strings.TrimSpace(string(b)) != env["KAFKA_SASL_PASSWORD"] {
		t.Errorf("%s does not hold KAFKA_SASL_PASSWORD (%v)", path, err)
	}

	for _, tt := range []struct {
		name string
		opts []kgo.Opt
	}{
		{"no SASL", nil},
		{"another password", []kgo.Opt{kgo.SASL(scram.Auth{User: "kafkapg", Pass: "guess"}.AsSha256Mechanism())}},
		{"kfake's default login", []kgo.Opt{kgo.SASL(scram.Auth{User: "admin", Pass: "admin"}.AsSha256Mechanism())}},
	} {
		cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...), kgo.RequestRetries(1)}, tt.opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		ts, err := kadm.NewClient(cl).ListTopics(ctx)
		cancel()
		cl.Close()
		if err == nil {
			t.Errorf("%s: the broker answered, topics %q: any local user reads and writes every topic", tt.name, ts.Names())
		}
	}

	// The tool's own clients log in with the environment's KAFKA_SASL_*.
	for name, v := range env {
		if strings.HasPrefix(name, "KAFKA_") {
			t.Setenv(name, v)
		}
	}
	for _, args := range [][]string{
		{"topics", "create", "t1:1"},
		{"produce", "-topic", "t1", "-key", "k", "-value", "v"},
	} {
		if code, _, errOut := cli(t, "", args...); code != 0 {
			t.Fatalf("%q: exit %d: %s", args, code, errOut)
		}
	}
	if code, out, errOut := cli(t, "", "consume", "-topic", "t1"); code != 0 || !strings.Contains(out, `"key":"k","value":"v"`) {
		t.Errorf("consume: exit %d: %s%s", code, out, errOut)
	}
	if code, out, errOut := cli(t, "", "topics"); code != 0 || !strings.Contains(out, "t1") {
		t.Errorf("topics: exit %d: %s%s", code, out, errOut)
	}
	t.Setenv("KAFKA_SASL_MECHANISM", "GSSAPI")
	want := `KAFKA_SASL_MECHANISM must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, got "GSSAPI"`
	if code, _, errOut := cli(t, "", "topics"); code == 0 || !strings.Contains(errOut, want) {
		t.Errorf("topics with KAFKA_SASL_MECHANISM=GSSAPI: exit %d: %s; want an error saying %q", code, errOut, want)
	}
}

// TestDevBrokerKeepsItsPassword: the broker's password is the same from one run to the next
// (its data is kept), a new one is generated when <dir>/kafka-password is removed, and a
// broker's data an older kafkapg dev left (no SASL) is taken over: the dev loop's own client
// creates its topics, with the password, each time.
func TestDevBrokerKeepsItsPassword(t *testing.T) {
	dir := filepath.Join(enterableDir(t, "dev-"), ".kafkapg")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	// An older dev loop's broker data: kfake without SASL, closed (its state written).
	old, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.DataDir(filepath.Join(dir, "kafka")), kfake.SeedTopics(1, "kept"))
	if err != nil {
		t.Fatal(err)
	}
	old.Close()
	path := filepath.Join(dir, "kafka-password")
	password := func() string {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	runs := []string{"the older data", "a second run", "a new password"}
	var first string
	for i, name := range runs {
		if i == 2 {
			os.Remove(path)
		}
		out, err := runDev(t, dir, "-topics", fmt.Sprintf("kept,t%d", i))
		if err != nil {
			t.Fatalf("%s: kafkapg dev: %v\n%s", name, err, out)
		}
		if !strings.Contains(out, "topic kept (exists)") {
			t.Errorf("%s: the broker's data was not kept:\n%s", name, out)
		}
		switch i {
		case 0:
			first = password()
		case 1:
			if password() != first {
				t.Errorf("%s: the password changed", name)
			}
		case 2:
			if password() == first {
				t.Errorf("%s: the removed password file came back with the same password", name)
			}
		}
	}
}
