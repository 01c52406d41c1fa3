package service

import (
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestDeployReadmeCountsEveryConnection: deploy/README.md sizes Postgres's connections per
// replica as its pool (DB_MAX_CONNS) and the connections opened beside it. This finds every
// connection the service's code opens (pgx and pgconn's Connect calls, pgxpool's New, read with
// go/parser in the packages a replica runs) and checks they are the ones the README names: a new
// one fails here until the README counts it.
func TestDeployReadmeCountsEveryConnection(t *testing.T) {
	b, err := os.ReadFile("../deploy/README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := strings.Join(strings.Fields(string(b)), " ")
	// Where each connection is opened, and what the README says of it.
	want := map[string]string{
		"service/service.go openPool pgxpool.NewWithConfig":  "Each replica's pool opens up to `DB_MAX_CONNS` (default 10) connections",
		"sink/relay.go listenOnce pgx.ConnectConfig":         "keeps one connection open, the outbox relay's `LISTEN`",
		"internal/pooler/pooler.go Detect pgx.ConnectConfig": "two at startup, to tell whether a connection pooler is in between",
		"sink/sink.go answers pgx.ConnectConfig":             "one when a transaction's connection ends under a handler, to tell whether Postgres still answers",
	}
	counts := map[string]int{"internal/pooler/pooler.go Detect pgx.ConnectConfig": 2}
	for _, phrase := range want {
		if !strings.Contains(readme, phrase) {
			t.Errorf("deploy/README.md does not say %q", phrase)
		}
	}
	if budget := "Budget `replicas × (DB_MAX_CONNS + 1)`"; !strings.Contains(readme, budget) {
		t.Errorf("deploy/README.md does not say %q (the pool and the LISTEN connection, held open)", budget)
	}

	got := map[string]int{}
	dirs := []string{"processor", "sink", "service", "retrytopics", "offsets"}
	internal, err := os.ReadDir("../internal")
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range internal {
		// Test rigs and the clusters tests start: not part of a replica.
		if d.IsDir() && !slices.Contains([]string{"rig", "testdb", "pgcluster"}, d.Name()) {
			dirs = append(dirs, "internal/"+d.Name())
		}
	}
	fset := token.NewFileSet()
	for _, dir := range dirs {
		files, _ := filepath.Glob(filepath.Join("..", dir, "*.go"))
		for _, path := range files {
			if strings.HasSuffix(path, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, path, nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			for _, decl := range f.Decls {
				fn, ok := decl.(*ast.FuncDecl)
				if !ok || fn.Body == nil {
					continue
				}
				ast.Inspect(fn.Body, func(n ast.Node) bool {
					call, ok := n.(*ast.CallExpr)
					if !ok {
						return true
					}
					sel, ok := call.Fun.(*ast.SelectorExpr)
					if !ok {
						return true
					}
					pkg, ok := sel.X.(*ast.Ident)
					if !ok {
						return true
					}
					opens := (pkg.Name == "pgx" || pkg.Name == "pgconn") && strings.HasPrefix(sel.Sel.Name, "Connect") ||
						pkg.Name == "pgxpool" && strings.HasPrefix(sel.Sel.Name, "New")
					if opens {
						got[filepath.ToSlash(strings.TrimPrefix(path, "../"))+" "+fn.Name.Name+" "+pkg.Name+"."+sel.Sel.Name]++
					}
					return true
				})
			}
		}
	}
	for _, where := range slices.Sorted(maps.Keys(got)) {
		if _, ok := want[where]; !ok {
			t.Errorf("%s opens a connection (%d call(s)) that deploy/README.md's Scaling does not count", where, got[where])
		}
	}
	for where := range want {
		if n := max(counts[where], 1); got[where] != n {
			t.Errorf("%s: %d call(s) found, deploy/README.md counts %d", where, got[where], n)
		}
	}
}
