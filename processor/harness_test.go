package processor_test

import (
	"testing"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
)

// Workers, relays and clients must all be gone once every processor has stopped.
func TestMain(m *testing.M) { testenv.RunWithoutLeaks(m) }

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
