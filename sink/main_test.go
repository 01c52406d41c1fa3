package sink_test

import (
	"testing"

	"go.uber.org/goleak"
)

// pgcluster (TestStreamsForkAtEveryStart) keeps one goroutine for the life of the process: the
// thread it starts servers from.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/kafkapg/kafkapg/internal/pgcluster.spawnLoop"))
}
