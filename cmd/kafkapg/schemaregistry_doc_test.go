package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// TestSchemaRegistryExample builds and tests docs/handlers.md's Schema Registry example in a module
// of its own outside this repository, as a user would from the page alone: its .proto, its
// main.go, its end-to-end test, against the tests' real registry. The page's `protoc` line is run
// by internal/rig/protogen (protocompile and protoc-gen-go's own generator), protoc not being
// installed here.
func TestSchemaRegistryExample(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a module of its own (a minute or two)")
	}
	registryURL := testenv.SchemaRegistry(t)
	files, shell := docFiles(t, "../../docs/handlers.md")
	for _, cmd := range []string{"protoc --go_out=. --go_opt=paths=source_relative orderspb/orders.proto", "SCHEMA_REGISTRY_URL=http://localhost:8081 go test ./..."} {
		if !strings.Contains(shell, cmd) {
			t.Fatalf("docs/handlers.md does not say %q (its commands:\n%s)", cmd, shell)
		}
	}
	for _, f := range []string{"orderspb/orders.proto", "main.go", "e2e_test.go"} {
		if files[f] == "" {
			t.Fatalf("docs/handlers.md has no %q block", f)
		}
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil { // servicetest's Postgres runs as the postgres user when this is root
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	files["go.mod"] = "module example.com/orders\n\ngo 1.26\n\nrequire github.com/kafkapg/kafkapg v0.0.0\n\nreplace github.com/kafkapg/kafkapg => " + root + "\n"
	files["go.sum"] = string(sum)
	for name, content := range files {
		if !slices.Contains([]string{"orderspb/orders.proto", "main.go", "e2e_test.go", "go.mod", "go.sum"}, name) {
			continue
		}
		path := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "KAFKA_") || strings.HasPrefix(name, "TOPIC_") || strings.HasPrefix(name, "PG") ||
			slices.Contains([]string{"DATABASE_URL", "TEST_DATABASE_URL", "HANDLER", "GOFLAGS", "SCHEMA_REGISTRY_URL"}, name) {
			continue
		}
		env = append(env, kv)
	}
	env = append(env, "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off")
	run := func(extra []string, name string, args ...string) string {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Dir = dir
		cmd.Env = append(slices.Clone(env), extra...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	protogen := filepath.Join(t.TempDir(), "protogen")
	build := exec.Command("go", "build", "-o", protogen, "./internal/rig/protogen")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build protogen: %v\n%s", err, out)
	}
	run(nil, protogen, "-out", ".", "-I", ".", "orderspb/orders.proto") // the page's protoc line
	run(nil, "go", "mod", "tidy")
	if out := run(nil, "gofmt", "-l", "."); out != "" {
		t.Errorf("the page's Go files are not gofmt'd: %s", out)
	}
	start := time.Now()
	out := run([]string{"SCHEMA_REGISTRY_URL=" + registryURL}, "go", "test", "./...", "-v", "-count=1")
	t.Logf("the page's end-to-end test: %s\n%s", time.Since(start).Round(time.Second), out)
	if !regexp.MustCompile(`(?m)^--- PASS: TestOrdersInEachFormat `).MatchString(out) {
		t.Errorf("go test ./... did not pass TestOrdersInEachFormat:\n%s", out)
	}
}
