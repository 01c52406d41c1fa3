package ops

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// TestRunbookStatesTheNumbers: what docs/runbook.md says of a task's lease, of trace's default
// scan and of how much of a dead letter's value show reads (the CLI and the API) is the constant
// the code uses.
func TestRunbookStatesTheNumbers(t *testing.T) {
	b, err := os.ReadFile("../../docs/runbook.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := strings.Join(strings.Fields(string(b)), " ")
	for _, want := range []string{
		fmt.Sprintf("once its runner's %d-second lease has run out", int(lease.Seconds())),
		fmt.Sprintf("the last `--scan` records (default %s) of each partition", thousands(defaultTraceScan)),
		fmt.Sprintf("the value's first %s, `--value-bytes` up to %s)", sizeText(ShownValueBytes), sizeText(MaxShownValueBytes)),
		fmt.Sprintf("its value's first `value_bytes` (%s by default, at most %s;", sizeText(ShownValueBytes), sizeText(MaxShownValueBytes)),
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

// sizeText writes a size as the docs do: "64 KiB", "1 MiB".
func sizeText(n int) string {
	if n >= 1<<20 && n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d KiB", n>>10)
}
