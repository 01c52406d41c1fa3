package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestBacklogMemoryAsDocumented: docs/guarantees.md says with which settings BenchmarkBacklogMemory
// runs the processor (its defaults but drainConns connections) and the bound it holds it to at
// the defaults (memoryBound of the default budget and batch, with one broker). The defaults it
// assumes are docs/configuration.md's (which the service's tests check against the code).
func TestBacklogMemoryAsDocumented(t *testing.T) {
	conf, err := os.ReadFile("../../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int{"MAX_BUFFERED_BYTES": defaultBudget, "BATCH_MAX_RECORDS": defaultBatch} {
		row := regexp.MustCompile("(?m)^\\| `" + name + "` \\| `([0-9]+)`").FindSubmatch(conf)
		if row == nil || string(row[1]) != fmt.Sprint(want) {
			t.Errorf("docs/configuration.md's default of %s is not %d, which the benchmark assumes", name, want)
		}
	}
	b, err := os.ReadFile("../../../docs/guarantees.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := strings.Join(strings.Fields(string(b)), " ")
	bound, _ := memoryBound(defaultBudget, 1, drainConns, defaultBatch)
	for _, want := range []string{
		fmt.Sprintf("with its defaults but `DB_MAX_CONNS=%d` (and the `ledger` handler)", drainConns),
		fmt.Sprintf("(%d MiB with the defaults, %d connections and one broker)", bound>>20, drainConns),
	} {
		if !strings.Contains(doc, want) {
			t.Errorf("docs/guarantees.md does not say %q, which is how BenchmarkBacklogMemory runs", want)
		}
	}
}

// TestBenchmarkFiguresHaveOneHome: a benchmark's figure (a ratio such as 0.91×, a measured rate
// in records/s, a p50 or p99, "N times faster") is quoted in docs/testing.md, its home, or, for
// memory, in docs/guarantees.md's Memory section, and nowhere else in README.md, docs/ and
// deploy/README.md: the other pages link there, so that one benchmark is not quoted with two
// different numbers. A rate that is an input ("up to 28 GB at 1,000 records/s") is not a figure.
func TestBenchmarkFiguresHaveOneHome(t *testing.T) {
	figure := regexp.MustCompile(`(^|[^\w.,])(\d[\d,]*(?:\.\d+)?×|\d[\d,]*(?:\.\d+)? records/s|p(?:50|95|99) (?:of )?\d|\d+ times faster)`)
	files, err := filepath.Glob("../../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, "../../../README.md", "../../../deploy/README.md")
	quoted := 0
	for _, f := range files {
		name := strings.TrimPrefix(f, "../../../")
		if name == "docs/testing.md" {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		doc := string(b)
		if name == "docs/guarantees.md" { // its Memory section is memory's home
			start := strings.Index(doc, "\n## Memory\n")
			end := strings.Index(doc[start+1:], "\n## ")
			if start < 0 || end < 0 {
				t.Fatal("docs/guarantees.md has no Memory section followed by another")
			}
			quoted += len(figure.FindAllString(doc[start:start+1+end], -1))
			doc = doc[:start] + doc[start+1+end:]
		}
		for i, line := range strings.Split(doc, "\n") {
			for _, m := range figure.FindAllStringSubmatchIndex(line, -1) {
				fig := line[m[4]:m[5]]
				if strings.HasSuffix(fig, "records/s") && strings.HasSuffix(line[:m[4]], "GB at ") {
					continue // a sizing: N GB at a given rate
				}
				t.Errorf("%s:%d quotes %q: a benchmark's figure belongs in docs/testing.md (memory's in guarantees.md's Memory section); link there", name, i+1, fig)
			}
		}
	}
	b, err := os.ReadFile("../../../docs/testing.md")
	if err != nil {
		t.Fatal(err)
	}
	if quoted += len(figure.FindAllString(string(b), -1)); quoted < 50 {
		t.Errorf("only %d figures found in their homes: the pattern no longer finds them", quoted)
	}
}
