package processor

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

// recordingRegisterer is a real registry that keeps what was registered on it.
type recordingRegisterer struct {
	*prometheus.Registry
	collectors []prometheus.Collector
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	r.collectors = append(r.collectors, c)
	return r.Registry.Register(c)
}

func (r *recordingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// serviceMetrics are the kafkapg metrics package service registers beside the processor's, with
// their labels (service's TestDeployQueriesUseExportedMetrics scrapes a running service and
// finds each documented).
var serviceMetrics = map[string][]string{"kafkapg_ready": nil}

// registeredMetrics returns the metrics New registers, by name, with their labels (sorted), and
// their types as the registry gathers them (histogram, counter, gauge), franz-go's kprom family
// aside.
func registeredMetrics(t *testing.T) (labels map[string][]string, types map[string]string, values map[string][]string) {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig("postgres://kafkapg@127.0.0.1:1/kafkapg?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg) // never used: it connects on demand
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	reg := &recordingRegisterer{Registry: prometheus.NewRegistry()}
	c := validConfig()
	c.Logger, c.Registerer = slog.New(slog.DiscardHandler), reg
	if _, err := New(pool, c); err != nil {
		t.Fatal(err)
	}
	desc := regexp.MustCompile(`fqName: "([^"]+)".*variableLabels: \{([^}]*)\}`)
	labels, values = map[string][]string{}, map[string][]string{}
	for _, col := range reg.collectors {
		ch := make(chan *prometheus.Desc, 16)
		go func() { col.Describe(ch); close(ch) }()
		for d := range ch {
			m := desc.FindStringSubmatch(d.String())
			if m == nil {
				t.Fatalf("cannot read %s", d)
			}
			if strings.HasPrefix(m[1], "kafkapg_kafka_") {
				continue
			}
			var ls []string
			if m[2] != "" {
				ls = strings.Split(m[2], ",")
			}
			sort.Strings(ls)
			labels[m[1]] = ls
		}
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	types = map[string]string{}
	for _, f := range families {
		types[f.GetName()] = strings.ToLower(f.GetType().String())
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if enumerated[l.GetName()] {
					key := f.GetName() + "{" + l.GetName() + "}"
					if !slices.Contains(values[key], l.GetValue()) {
						values[key] = append(values[key], l.GetValue())
					}
				}
			}
		}
	}
	for _, col := range reg.collectors { // the vectors New left without a series
		var kind string
		switch col.(type) {
		case *prometheus.CounterVec:
			kind = "counter"
		case *prometheus.GaugeVec:
			kind = "gauge"
		case *prometheus.HistogramVec:
			kind = "histogram"
		default:
			continue
		}
		ch := make(chan *prometheus.Desc, 1)
		col.Describe(ch)
		if m := desc.FindStringSubmatch((<-ch).String()); m != nil && types[m[1]] == "" {
			types[m[1]] = kind
		}
	}
	return labels, types, values
}

// enumerated are the labels whose values are a fixed set, which New creates at zero and
// docs/operations.md's rows list.
var enumerated = map[string]bool{"outcome": true, "cause": true, "reason": true, "event": true}

// documentedMetrics reads docs/operations.md's table of metrics: each name of a row's first
// cell, with the labels it lists, and the row's type.
func documentedMetrics(t *testing.T) (labels map[string][]string, types map[string]string, rows map[string]string) {
	t.Helper()
	b, err := os.ReadFile("../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| (`kafkapg_[^|]*) \\| (\\w+) \\|.*$")
	name := regexp.MustCompile("`(kafkapg_\\w+)(?:\\{([a-z_,]*)\\})?`")
	labels, types, rows = map[string][]string{}, map[string]string{}, map[string]string{}
	for _, r := range row.FindAllStringSubmatch(string(b), -1) {
		for _, n := range name.FindAllStringSubmatch(r[1], -1) {
			var ls []string
			if n[2] != "" {
				ls = strings.Split(n[2], ",")
			}
			sort.Strings(ls)
			if _, dup := labels[n[1]]; dup {
				t.Errorf("docs/operations.md has two rows for %s", n[1])
			}
			labels[n[1]], types[n[1]], rows[n[1]] = ls, r[2], r[0]
		}
	}
	return labels, types, rows
}

// TestMetricsAsDocumented: docs/operations.md's table of metrics and the metrics the processor
// registers (New, on a real registry) are the same, both ways: every metric registered has a
// row with its type and exactly its labels (and the values of an enumerated label, those New
// creates at zero: outcome, cause, reason, event), and every row names a metric registered (or
// one package service adds). Every other mention of a kafkapg metric in README.md, docs/ and
// deploy/README.md names one that exists, with labels it has.
func TestMetricsAsDocumented(t *testing.T) {
	t.Parallel()
	reg, regTypes, values := registeredMetrics(t)
	doc, docTypes, rows := documentedMetrics(t)
	if len(reg) < 40 {
		t.Fatalf("only %d metrics registered: %v", len(reg), reg)
	}
	for name, ls := range serviceMetrics {
		reg[name], regTypes[name] = ls, "gauge"
	}
	for name, ls := range reg {
		dl, ok := doc[name]
		if !ok {
			t.Errorf("docs/operations.md has no row for %s (labels %v)", name, ls)
			continue
		}
		if !slices.Equal(dl, ls) {
			t.Errorf("docs/operations.md gives %s the labels %v; the code registers %v", name, dl, ls)
		}
		if docTypes[name] != regTypes[name] {
			t.Errorf("docs/operations.md says %s is a %s; it is a %s", name, docTypes[name], regTypes[name])
		}
	}
	// The values of an enumerated label, each named in its metric's row, in backquotes.
	if len(values) < 4 {
		t.Errorf("only %d enumerated labels with values: %v", len(values), values)
	}
	for key, vs := range values {
		name, _, _ := strings.Cut(key, "{")
		for _, v := range vs {
			if !strings.Contains(rows[name], "`"+v+"`") {
				t.Errorf("docs/operations.md's row of %s does not name the value %q of %s", name, v, key)
			}
		}
	}
	for name := range doc {
		if _, ok := reg[name]; !ok {
			t.Errorf("docs/operations.md has a row for %s, which nothing registers", name)
		}
	}

	// Mentions elsewhere: a name, perhaps with labels ({a,b}) or a selector ({a="x"}).
	mention := regexp.MustCompile(`\bkafkapg_(\w+)(\{[^}]*\})?`)
	labelName := regexp.MustCompile(`([a-z_]+)\s*(?:=~|!=|!~|=|,|$)`)
	files, _ := filepath.Glob("../docs/*.md")
	files = append(files, "../README.md", "../deploy/README.md")
	seen := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range mention.FindAllStringSubmatch(string(b), -1) {
			name := "kafkapg_" + m[1]
			if name == "kafkapg_kafka_" || name == "kafkapg_demo" { // kprom's family (kafkapg_kafka_*); the demo's schema
				continue
			}
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				if base, ok := strings.CutSuffix(name, s); ok && regTypes[base] == "histogram" {
					name = base
				}
			}
			seen++
			ls, ok := reg[name]
			if !ok {
				t.Errorf("%s names %s, which nothing registers", f, m[0])
				continue
			}
			for _, l := range labelName.FindAllStringSubmatch(strings.Trim(m[2], "{}"), -1) {
				if !slices.Contains(ls, l[1]) && l[1] != "le" {
					t.Errorf("%s names %s with the label %s; it has %v", f, m[0], l[1], ls)
				}
			}
		}
	}
	if seen < 50 {
		t.Errorf("only %d mentions of kafkapg metrics found", seen)
	}
}
