package doccheck

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// markdown lists the documents checked, relative to the repository root.
func markdown(t *testing.T) []string {
	t.Helper()
	files := []string{"README.md", "deploy/README.md"}
	more, err := filepath.Glob("../../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range more {
		files = append(files, strings.TrimPrefix(f, "../../../"))
	}
	return files
}

// anchors returns the GitHub anchors of a Markdown document's headings.
func anchors(doc string) map[string]bool {
	out := map[string]bool{}
	drop := regexp.MustCompile("[^a-z0-9 _-]")
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#")))
		h = drop.ReplaceAllString(h, "")
		out[strings.ReplaceAll(h, " ", "-")] = true
	}
	return out
}

// TestLinksLeadSomewhere: every relative link of the documents names a file or directory that
// exists and, with a #fragment, a heading of that document.
func TestLinksLeadSomewhere(t *testing.T) {
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	files := markdown(t)
	if len(files) < 5 {
		t.Fatalf("only %d documents found: %v", len(files), files)
	}
	checked := 0
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join("../../..", f))
		if err != nil {
			t.Fatal(err)
		}
		// Code (fenced blocks, inline spans) is not prose: `Avro[Order](schema)` is a call.
		prose := regexp.MustCompile("(?s)```.*?```").ReplaceAllString(string(b), "")
		prose = regexp.MustCompile("`[^`\n]*`").ReplaceAllString(prose, "")
		for _, m := range link.FindAllStringSubmatch(prose, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, frag, _ := strings.Cut(target, "#")
			full := filepath.Join("../../..", filepath.Dir(f), path)
			if path == "" {
				full = filepath.Join("../../..", f)
			}
			checked++
			if _, err := os.Stat(full); err != nil {
				t.Errorf("%s links to %s, which does not exist", f, target)
				continue
			}
			if frag != "" {
				doc, err := os.ReadFile(full)
				if err != nil || !anchors(string(doc))[frag] {
					t.Errorf("%s links to %s, which has no heading #%s", f, path, frag)
				}
			}
		}
	}
	if checked < 10 {
		t.Errorf("only %d relative links checked", checked)
	}
}

// goLine returns the go directive of the go.mod at path (relative to the repository root).
func goLine(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("../../..", path))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go ([0-9.]+)\s*$`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("%s has no go line", path)
	}
	return string(m[1])
}

// TestGoVersionIsGoMods: every "Go 1.N" the documents (and cmd/kafkapg's doc comment, what
// `go doc` shows a user who installs the tool) say a user needs is the go line of kafkapg's
// go.mod, the version the go command asks for. deploy/README.md may also name the go line of
// deploy/validate's own module.
func TestGoVersionIsGoMods(t *testing.T) {
	module := goLine(t, "go.mod")
	minor := regexp.MustCompile(`^1\.[0-9]+`).FindString(module)
	allowed := map[string]bool{module: true, minor: true}
	validate := goLine(t, "deploy/validate/go.mod")
	version := regexp.MustCompile(`\bGo \(?(1\.[0-9]+(?:\.[0-9]+)?)`)
	found := 0
	for _, f := range append(markdown(t), "cmd/kafkapg/main.go") {
		b, err := os.ReadFile(filepath.Join("../../..", f))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range version.FindAllStringSubmatch(strings.Join(strings.Fields(string(b)), " "), -1) {
			found++
			if allowed[m[1]] || (f == "deploy/README.md" && m[1] == validate) {
				continue
			}
			t.Errorf("%s says %q; go.mod's go line is %s", f, m[0], module)
		}
	}
	if found < 3 {
		t.Errorf("only %d mentions of a Go version found: README.md, docs/develop.md and cmd/kafkapg say which Go they need", found)
	}
}
