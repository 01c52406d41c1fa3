package ops_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestRunbookListsEveryTraceState: the runbook's table of the states a trace answers with lists
// each Trace* constant of trace.go, and nothing else: its list had nothing for a skipped
// duplicate (issue 42). The constants are read from the source, so a new state fails here until
// the runbook tells it.
func TestRunbookListsEveryTraceState(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "trace.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var code []string
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, s := range g.Specs {
			v := s.(*ast.ValueSpec)
			for i, n := range v.Names {
				if !strings.HasPrefix(n.Name, "Trace") || i >= len(v.Values) {
					continue
				}
				if lit, ok := v.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
					s, _ := strconv.Unquote(lit.Value)
					code = append(code, s)
				}
			}
		}
	}
	doc, err := os.ReadFile("../../docs/runbook.md")
	if err != nil {
		t.Fatal(err)
	}
	_, table, ok := strings.Cut(string(doc), "| State | The record |")
	if !ok {
		t.Fatal(`docs/runbook.md has no table of trace states ("| State | The record |")`)
	}
	table, _, _ = strings.Cut(table, "\n\n")
	var docs []string
	for _, m := range regexp.MustCompile("(?m)^\\| `([a-z_]+)` \\|").FindAllStringSubmatch(table, -1) {
		docs = append(docs, m[1])
	}
	slices.Sort(code)
	slices.Sort(docs)
	if len(code) < 8 || !slices.Equal(code, docs) {
		t.Errorf("trace states in trace.go: %q\nin the runbook's table: %q", code, docs)
	}
}
