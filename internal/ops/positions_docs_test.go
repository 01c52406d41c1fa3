package ops_test

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/kafkapg/kafkapg/internal/ops"
)

// TestDocsTellPositions: the runbook has the entries an operator looks for (stop consuming,
// reprocess after a bug fix, skip test events), says plainly what a rewind re-applies and what
// idempotency keys do to it, lists every positions command and target; the README's operating
// part names the command and links the runbook's section.
func TestDocsTellPositions(t *testing.T) {
	read := func(path string) string {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(strings.Fields(string(b)), " ")
	}
	runbook := read("../../docs/runbook.md")
	for _, want := range []string{
		"## Positions: pause, rewind, skip",
		"### Stop consuming a topic while the downstream is fixed",
		"### Reprocess after a bug fix",
		"### Skip test events",
		"a rewind applies again **every record between**",
		"is **skipped as a duplicate**, not applied again",
		"kafkapg has no command to forget keys",
		fmt.Sprintf("it reads the records of the range (at most %s and %s in all, over the partitions)", fmt.Sprintf("%d,%03d", ops.KeyCheckRecords/1000, ops.KeyCheckRecords%1000), fmt.Sprintf("%d MiB", ops.KeyCheckBytes>>20)),
		"`positions [--json]`",
		"`positions pause --topic T [--partition N] [--execute --reason R]`",
		"`positions set --topic T [--partition N] (--offset N \\| --time T \\| --start \\| --end) [--execute --reason R]`",
		"`skipped_by_operator`",
		"`GET /api/v1/positions`, `POST /api/v1/positions/pause`, `.../resume`, `.../set`",
	} {
		if !strings.Contains(runbook, want) {
			t.Errorf("docs/runbook.md does not say %q", want)
		}
	}
	readme := read("../../README.md")
	for _, want := range []string{"**Positions in the operator's hand.**", "`positions pause|resume`", "`positions set`",
		"A rewind applies again **every record between**, by design", "(docs/runbook.md#positions-pause-rewind-skip)"} {
		if !strings.Contains(readme, want) {
			t.Errorf("README.md does not say %q", want)
		}
	}
}
