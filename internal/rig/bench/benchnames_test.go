package bench

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestDocumentedBenchCommandsRun: every `make bench BENCH=<regexp>` the docs give picks at least
// one benchmark of this package (which is what `make bench` runs, with -bench '$(BENCH)'), and
// every BENCH_* variable they name is read by a benchmark somewhere in the repository. A
// renamed benchmark or variable would leave a command that measures nothing, silently (the docs'
// second audit found `make bench BENCH=…` untested).
func TestDocumentedBenchCommandsRun(t *testing.T) {
	const root = "../../.."
	makefile, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^\t.*\$\(GO\) test -run '\^\$\$' -bench '\$\(BENCH\)' .* \./internal/rig/bench/$`).Match(makefile) {
		t.Fatal("the Makefile's bench target does not run this package's benchmarks picked by -bench '$(BENCH)': this test reads it wrongly")
	}

	var benchmarks []string   // this package's
	read := map[string]bool{} // the BENCH_* variables Go code reads
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range regexp.MustCompile(`"(BENCH_[A-Z0-9_]+)"`).FindAllSubmatch(b, -1) {
			read[string(m[1])] = true
		}
		if filepath.Dir(path) == filepath.Join(root, "internal", "rig", "bench") {
			for _, m := range regexp.MustCompile(`(?m)^func (Benchmark\w*)\(b \*testing\.B\)`).FindAllSubmatch(b, -1) {
				benchmarks = append(benchmarks, string(m[1]))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(benchmarks) == 0 {
		t.Fatal("no benchmark found in this package: the test reads it wrongly")
	}

	docs, _ := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	docs = append(docs, filepath.Join(root, "README.md"), filepath.Join(root, "deploy", "README.md"), filepath.Join(root, "Makefile"))
	commands, variables := 0, 0
	for _, doc := range docs {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		name, _ := filepath.Rel(root, doc)
		for _, m := range regexp.MustCompile(`make bench BENCH=('([^']*)'|([A-Za-z0-9_|]+))`).FindAllSubmatch(b, -1) {
			commands++
			expr := string(m[2]) + string(m[3])
			if _, err := regexp.Compile(expr); err != nil {
				t.Errorf("%s: make bench BENCH=%s: not a regexp: %v", name, expr, err)
				continue
			}
			// go test matches -bench against the name, alternatives each on their own.
			for _, alt := range strings.Split(expr, "|") {
				if !slices.ContainsFunc(benchmarks, regexp.MustCompile(alt).MatchString) {
					t.Errorf("%s: make bench BENCH=%s: %q picks none of %v", name, expr, alt, benchmarks)
				}
			}
		}
		for _, m := range regexp.MustCompile(`\bBENCH_[A-Z0-9_]*[A-Z0-9]\b`).FindAll(b, -1) {
			variables++
			if !read[string(m)] {
				t.Errorf("%s names %s, which no benchmark reads", name, m)
			}
		}
	}
	if commands == 0 || variables == 0 {
		t.Errorf("the docs give %d make bench commands and %d BENCH_ variables: the test reads them wrongly", commands, variables)
	}
}
