package ops

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// TestRunbookStatesTheNumbers: what docs/runbook.md says of a task's lease and of trace's
// default scan is the constant the code uses.
func TestRunbookStatesTheNumbers(t *testing.T) {
	b, err := os.ReadFile("../../docs/runbook.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := strings.Join(strings.Fields(string(b)), " ")
	for _, want := range []string{
		fmt.Sprintf("once its runner's %d-second lease has run out", int(lease.Seconds())),
		fmt.Sprintf("the last `--scan` records (default %s) of each partition", thousands(defaultTraceScan)),
	} {
		if !strings.Contains(doc, want) {
			t.Errorf("docs/runbook.md does not say %q", want)
		}
	}
}

// thousands writes n with a comma between thousands, as the docs write numbers.
func thousands(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
