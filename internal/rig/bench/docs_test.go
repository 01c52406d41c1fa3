package bench

import (
	"fmt"
	"os"
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
