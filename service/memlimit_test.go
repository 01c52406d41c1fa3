package service

import (
	"errors"
	"io"
	"log/slog"
	"math"
	"os"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// unsetEnv unsets names for the test, and restores them after it. The test must not be parallel.
func unsetEnv(t *testing.T, names ...string) {
	t.Helper()
	for _, n := range names {
		t.Setenv(n, "")
		os.Unsetenv(n)
	}
}

// gcPercent returns the garbage collector's GOGC now.
func gcPercent() int {
	p := debug.SetGCPercent(100)
	debug.SetGCPercent(p)
	return p
}

// TestSoftMemoryLimitFromTheContainer: the soft memory limit is 90 % of the container's memory
// limit, an explicit GOMEMLIMIT wins, and GOGC is 300 under a limit unless GOGC is set; without
// a limit the runtime's settings stay. Which file of which cgroup holds the container's limit is
// memlimit.FromCgroup's (automemlimit's own tests cover cgroup v1 and v2, their hierarchies and
// their "no limit" values, which it reports as memlimit.ErrNoLimit): here the container's limit
// is what it would report.
func TestSoftMemoryLimitFromTheContainer(t *testing.T) {
	const gib = 1 << 30
	const before = 123 << 20 // the soft limit before, as GOMEMLIMIT=123MiB would set it
	tests := []struct {
		name      string
		env       map[string]string // GOMEMLIMIT, GOGC
		container memlimit.Provider
		wantLimit int64 // in force after, and returned
		wantGC    int   // in force after
		wantGOGC  string
		wantErr   bool
	}{
		{name: "a container limit, nothing set", container: memlimit.Limit(gib),
			wantLimit: gib * 9 / 10, wantGC: 300, wantGOGC: "300"},
		{name: "a container limit and GOGC set: GOGC stays", env: map[string]string{"GOGC": "50"}, container: memlimit.Limit(gib),
			wantLimit: gib * 9 / 10, wantGC: 100, wantGOGC: "50"},
		{name: "GOMEMLIMIT set: it wins over the container's", env: map[string]string{"GOMEMLIMIT": "123MiB"}, container: memlimit.Limit(gib),
			wantLimit: before, wantGC: 300, wantGOGC: "300"},
		{name: "GOMEMLIMIT and GOGC set: both stay", env: map[string]string{"GOMEMLIMIT": "123MiB", "GOGC": "50"}, container: memlimit.Limit(gib),
			wantLimit: before, wantGC: 100, wantGOGC: "50"},
		{name: "no container limit (memory.max is max; v1's unlimited value)", container: func() (uint64, error) { return 0, memlimit.ErrNoLimit },
			wantLimit: math.MaxInt64, wantGC: 100},
		{name: "no cgroup: an error, nothing changed", container: func() (uint64, error) { return 0, memlimit.ErrNoCgroup },
			wantLimit: before, wantGC: 100, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			unsetEnv(t, "GOMEMLIMIT", "GOGC", "AUTOMEMLIMIT")
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			oldLimit, oldGC := debug.SetMemoryLimit(before), debug.SetGCPercent(100)
			t.Cleanup(func() {
				debug.SetMemoryLimit(oldLimit)
				debug.SetGCPercent(oldGC)
			})
			called := false
			container := func() (uint64, error) {
				called = true
				return tt.container()
			}

			limit, gogc, err := setSoftMemoryLimit(container, slog.New(slog.NewTextHandler(io.Discard, nil)))
			if (err != nil) != tt.wantErr {
				t.Fatalf("setSoftMemoryLimit: err = %v, want an error: %v", err, tt.wantErr)
			}
			if err == nil && limit != tt.wantLimit {
				t.Errorf("setSoftMemoryLimit returned the limit %d, want %d", limit, tt.wantLimit)
			}
			if got := debug.SetMemoryLimit(-1); got != tt.wantLimit {
				t.Errorf("soft memory limit in force %d, want %d", got, tt.wantLimit)
			}
			if got := gcPercent(); got != tt.wantGC {
				t.Errorf("GOGC in force %d, want %d", got, tt.wantGC)
			}
			if gogc != tt.wantGOGC {
				t.Errorf("setSoftMemoryLimit returned GOGC %q, want %q", gogc, tt.wantGOGC)
			}
			if _, set := tt.env["GOMEMLIMIT"]; set && called {
				t.Error("the container's limit was read although GOMEMLIMIT is set")
			}
			if tt.wantErr && !errors.Is(err, memlimit.ErrNoCgroup) && !strings.Contains(err.Error(), "cgroup") {
				t.Errorf("error %q does not say what failed", err)
			}
		})
	}
}
