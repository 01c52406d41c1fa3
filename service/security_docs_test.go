package service

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/internal/loginlimit"
	"github.com/kafkapg/kafkapg/internal/ops"
)

// TestSecuritySectionIsTheCode checks the limits docs/operations.md's Security section states
// against the constants that set them.
func TestSecuritySectionIsTheCode(t *testing.T) {
	b, err := os.ReadFile("../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## Security\n")
	if !ok {
		t.Fatal("docs/operations.md has no Security section")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	section = strings.Join(strings.Fields(section), " ")
	secs := func(d time.Duration) string { return fmt.Sprintf("%d s", int(d/time.Second)) }
	for _, want := range []string{
		fmt.Sprintf("Headers up to %d KB", httpMaxHeaderBytes>>10),
		fmt.Sprintf("bodies up to %d MB", httpMaxBodyBytes>>20),
		fmt.Sprintf("at most %d connections at once per listener", httpMaxConns),
		secs(httpReadHeaderTimeout) + " to send the headers",
		secs(httpReadTimeout) + " to read a request",
		secs(httpIdleTimeout) + " idle",
		fmt.Sprintf("after %d, one more try every %s", loginlimit.Burst, secs(loginlimit.Every)),
		fmt.Sprintf("At most %d,%03d addresses", loginlimit.MaxClients/1000, loginlimit.MaxClients%1000),
		"reused for a second",
		fmt.Sprintf("at most %d traces at once", ops.MaxTraces),
		fmt.Sprintf("value's first %d KiB (at most %d MiB on request)", ops.ShownValueBytes>>10, ops.MaxShownValueBytes>>20),
	} {
		if !strings.Contains(section, want) {
			t.Errorf("the Security section does not say %q", want)
		}
	}
	if readyFresh != time.Second {
		t.Errorf("readyFresh is %v: the Security section says a check is reused for a second", readyFresh)
	}
}
