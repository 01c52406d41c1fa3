package sink_test

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/kafkapg/kafkapg/sink"
)

// TestDeployStatesTheLanes: deploy/README.md's count of the outbox's lanes is sink.Lanes.
func TestDeployStatesTheLanes(t *testing.T) {
	b, err := os.ReadFile("../deploy/README.md")
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("share the outbox's %d lanes", sink.Lanes); !strings.Contains(strings.Join(strings.Fields(string(b)), " "), want) {
		t.Errorf("deploy/README.md does not say %q", want)
	}
}
