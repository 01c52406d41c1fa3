package bench

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
)

// The performance table: one row per path that kafkapg offers in place of something people write
// by hand, each a ratio against that counterpart measured in the same run (docs/testing.md's
// Performance shows them; the README links there). The benchmarks that measure a path record
// its row with summarize; TestMain prints the rows recorded, in the table's order, once every
// benchmark of the run has finished, so that `make bench` ends with the whole table.

// A path is a row of the table.
type path int

const (
	ledgerPath path = iota
	copyPath
	keysPath
	chainKeysPath
	outboxPath
	heldPath
	replayPath
	latencyPath
	avroPath
)

// paths describes each row: what is compared, and the target (higher is better unless lower).
var paths = map[path]struct {
	name   string
	target float64
	lower  bool
}{
	ledgerPath:    {"ledger handler / hand-written batched loop, same SQL", 1.0, false},
	copyPath:      {"COPY BatchHandlerFunc / hand-written COPY loop", 0.95, false},
	keysPath:      {"idempotency keys on / off", 0.85, false},
	chainKeysPath: {"message ids of a kafkapg service, deduplicated / off", 0.85, false},
	outboxPath:    {"outbox, highest sustained rate / produce after commit", 0.9, false},
	heldPath:      {"held records drained after release / same from topic", 0.8, false},
	replayPath:    {"dead-letter replay, applied / fast path", 0.5, false},
	latencyPath:   {"p99 produce→committed at 5,000/s / hand-written loop", 1.5, true},
	avroPath:      {"ledger on Avro (Schema Registry) / the same events as JSON", 0.9, false},
}

type summaryRow struct {
	path     path
	ratio    float64
	measured string
}

var summary struct {
	sync.Mutex
	rows []summaryRow
}

// summarize records the row of p: ratio, and what it was computed from (the two figures).
func summarize(p path, ratio float64, measured string, args ...any) {
	summary.Lock()
	defer summary.Unlock()
	summary.rows = append(summary.rows, summaryRow{p, ratio, fmt.Sprintf(measured, args...)})
}

func TestMain(m *testing.M) {
	code := m.Run()
	summary.Lock()
	s := summaryTable(summary.rows)
	summary.Unlock()
	fmt.Print(s)
	os.Exit(code)
}

// summaryTable formats rows in the table's order, or returns "" if there are none.
func summaryTable(rows []summaryRow) string {
	if len(rows) == 0 {
		return ""
	}
	rows = slices.Clone(rows)
	slices.SortStableFunc(rows, func(a, b summaryRow) int { return int(a.path) - int(b.path) })
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nperformance table (ratios within this run; this machine is shared: ±0.05 between runs)\n")
	fmt.Fprintf(&sb, "  %-56s %7s  %-8s  %s\n", "path", "ratio", "target", "measured")
	for _, r := range rows {
		d := paths[r.path]
		target, met := fmt.Sprintf(">= %.2f", d.target), r.ratio >= d.target
		if d.lower {
			target, met = fmt.Sprintf("<= %.2f", d.target), r.ratio <= d.target
		}
		mark := ""
		if !met {
			mark = "  (target missed)"
		}
		fmt.Fprintf(&sb, "  %-56s %6.2fx  %-8s  %s%s\n", d.name, r.ratio, target, r.measured, mark)
	}
	return sb.String()
}

// TestSummaryTable: rows come out in the table's order whatever order the benchmarks ran in, and a
// row is marked missed by its own direction (a latency ratio is better lower).
func TestSummaryTable(t *testing.T) {
	if s := summaryTable(nil); s != "" {
		t.Errorf("no rows: %q; want nothing printed", s)
	}
	s := summaryTable([]summaryRow{
		{latencyPath, 1.6, "p99 16 vs 10 ms"},
		{ledgerPath, 1.01, "101 vs 100 records/s"},
		{replayPath, 0.15, "15 vs 100 records/s"},
		{keysPath, 0.9, "90 vs 100 records/s"},
	})
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) != 6 {
		t.Fatalf("table:\n%s\nwant a title, a header and 4 rows", s)
	}
	for i, want := range []struct {
		name   string
		missed bool
	}{{paths[ledgerPath].name, false}, {paths[keysPath].name, false}, {paths[replayPath].name, true}, {paths[latencyPath].name, true}} {
		line := lines[2+i]
		if !strings.Contains(line, want.name) || strings.Contains(line, "(target missed)") != want.missed {
			t.Errorf("row %d: %q; want %q, missed %t", i, line, want.name, want.missed)
		}
	}
	if !strings.Contains(lines[5], "<= 1.50") || !strings.Contains(lines[2], ">= 1.00") {
		t.Errorf("targets not shown with their direction:\n%s", s)
	}
}
