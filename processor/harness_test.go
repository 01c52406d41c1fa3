package processor_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		// Workers, relays and clients must all be gone once every processor has stopped. The
		// goroutine that starts pgcluster's servers lives as long as the process, on purpose.
		if err := goleak.Find(goleak.IgnoreTopFunction("github.com/kafkapg/kafkapg/internal/pgcluster.spawnLoop")); err != nil {
			fmt.Fprintf(os.Stderr, "goroutine leak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// harness is testkit's, with the helpers only these tests need (methods in their files).
type harness struct{ *testkit.Harness }

func newHarness(t *testing.T, k *testenv.Kafka, partitions int32) *harness {
	return &harness{testkit.New(t, k, partitions)}
}

// running is a processor started by the harness.
type running = testkit.Running

// testLogger logs to the test.
var testLogger = testkit.TestLogger

const tiersMaxAttempt = testkit.TiersMaxAttempt

var (
	flakyMix = testkit.FlakyMix
	mixed    = testkit.Mixed
)
