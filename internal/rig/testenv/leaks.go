package testenv

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// RunWithoutLeaks is a package's TestMain: it runs the tests and, if they passed, fails the run
// when goroutines outlive them (workers, relays, clients, brokers). The goroutine that starts
// pgcluster's servers lives as long as the process, on purpose.
func RunWithoutLeaks(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("github.com/kafkapg/kafkapg/internal/pgcluster.spawnLoop")); err != nil {
			fmt.Fprintf(os.Stderr, "goroutine leak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
