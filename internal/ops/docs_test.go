package ops

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
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

// TestRunbookNamesTheAuditedActions: every action the operator commands write into the audit
// table (o.audit's literal actions in this package's code, and the task actions) is named in
// docs/runbook.md's guard rails, and no other.
func TestRunbookNamesTheAuditedActions(t *testing.T) {
	b, err := os.ReadFile("../../docs/runbook.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := strings.Join(strings.Fields(string(b)), " ")
	const lead = "its `action` one of "
	i := strings.Index(doc, lead)
	if i < 0 {
		t.Fatalf("docs/runbook.md does not say %q", lead)
	}
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(doc[i+len(lead):strings.Index(doc[i:], ", its `detail`")+i], -1) {
		listed[m[1]] = true
	}
	audited := map[string]bool{string(Replay): true, string(Discard): true}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	call := regexp.MustCompile(`o\.audit\(ctx, tx, a, "([a-z_]+)"`)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range call.FindAllStringSubmatch(string(src), -1) {
			audited[m[1]] = true
		}
	}
	if len(audited) < 8 {
		t.Fatalf("found %d audited actions in the code (%v): the pattern no longer matches o.audit's calls", len(audited), audited)
	}
	for a := range audited {
		if !listed[a] {
			t.Errorf("action %q is audited but docs/runbook.md does not list it", a)
		}
	}
	for a := range listed {
		if !audited[a] {
			t.Errorf("docs/runbook.md lists action %q, which nothing audits", a)
		}
	}
}
