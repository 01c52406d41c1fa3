package servicetest_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		// Each Service, its broker and its clients must be gone once its test has ended. The
		// goroutine that starts pgcluster's servers (processortest.DB's throwaway one) lives
		// as long as the process, on purpose.
		if err := goleak.Find(goleak.IgnoreTopFunction("github.com/kafkapg/kafkapg/internal/pgcluster.spawnLoop")); err != nil {
			fmt.Fprintf(os.Stderr, "goroutine leak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
