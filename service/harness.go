package service

import (
	"context"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"

	"github.com/kafkapg/kafkapg/internal/servicehook"
	"github.com/kafkapg/kafkapg/processor"
)

// A test harness (package servicetest) runs the service in the test binary, configured by a map
// of variables instead of the process's environment, through servicehook.Run.
func init() {
	servicehook.Run = func(ctx context.Context, args []string, vars map[string]string, handlers any, test processor.TestConfig, stdout, stderr io.Writer) int {
		h := &harness{vars: maps.Clone(vars), test: test}
		return runIn(ctx, args, stdout, stderr, h, handlers.([]Handler)...)
	}
}

// harness is what a test harness gives the service: its environment, and the processor's test
// hooks.
type harness struct {
	vars map[string]string
	test processor.TestConfig
}

// supports says whether the harness runs cmd: not the commands that only touch the database's
// schema (migrate, upgrade), which run reads its environment but once, at startup.
func (h *harness) supports(cmd string) bool {
	return slices.Contains([]string{"run", "config", "dlq", "keys", "positions", "trace", "help", "-h", "-help", "--help"}, cmd)
}

// harnessEnv serializes the harnesses' reads of the environment (h.read).
var harnessEnv sync.Mutex

// read runs fn, which reads the configuration from the environment (loadEnv and the like), with
// the environment h gives: h.vars, and none of the process's own variables of the service. It
// swaps them into the process's environment for the time of fn, under a lock: envconfig reads the
// process's environment and nothing else. Other goroutines of the test binary that read those
// variables meanwhile (not kafkapg's: it reads them only here) would see the harness's. With h
// nil it runs fn as it is.
func (h *harness) read(fn func()) {
	if h == nil {
		fn()
		return
	}
	harnessEnv.Lock()
	defer harnessEnv.Unlock()
	names := append(envNames(), otelEnv...)
	for _, kv := range os.Environ() {
		if n, _, _ := strings.Cut(kv, "="); strings.HasPrefix(n, topicPrefix) || strings.HasPrefix(n, "OTEL_") {
			names = append(names, n)
		}
	}
	names = append(names, slices.Collect(maps.Keys(h.vars))...)
	saved := map[string]string{}
	for _, n := range names {
		if v, ok := os.LookupEnv(n); ok {
			saved[n] = v
		}
		os.Unsetenv(n)
	}
	for n, v := range h.vars {
		os.Setenv(n, v)
	}
	defer func(before func() []string) {
		environ = before
		for _, n := range names {
			os.Unsetenv(n)
		}
		for n, v := range saved {
			os.Setenv(n, v)
		}
	}(environ)
	// The process's other variables are the test binary's, not the service's: none of them is
	// taken for a misspelt one of the service's.
	environ = func() []string {
		var out []string
		for n, v := range h.vars {
			out = append(out, n+"="+v)
		}
		return out
	}
	fn()
}
