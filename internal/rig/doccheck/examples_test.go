package doccheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestHandlersExamplesCompile: every Go block of docs/handlers.md that names a file
// ("```go file=slow/main.go") is a whole file as shown; the blocks of one directory are built
// together, as a package of a module that requires kafkapg (this checkout's module: the files
// are built from the repository's root). docs/develop.md's blocks are built and run by
// cmd/kafkapg's TestDevelopYourService.
func TestHandlersExamplesCompile(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the examples (half a minute)")
	}
	b, err := os.ReadFile("../../../docs/handlers.md")
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile("(?s)```go file=(\\S+)\n(.*?)```")
	// A package generated from one of the page's .proto blocks does not exist here: the files
	// that import it (the Schema Registry's example) are built and run, the .proto generated, by
	// cmd/kafkapg's TestSchemaRegistryExample.
	var generated []string
	for _, m := range regexp.MustCompile(`option go_package = "([^"]+)";`).FindAllStringSubmatch(string(b), -1) {
		generated = append(generated, `"`+m[1]+`"`)
	}
	tmp := t.TempDir()
	dirs := map[string][]string{}
	for _, m := range block.FindAllStringSubmatch(string(b), -1) {
		if slices.ContainsFunc(generated, func(pkg string) bool { return strings.Contains(m[2], pkg) }) {
			continue
		}
		path := filepath.Join(tmp, filepath.FromSlash(m[1]))
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(m[2]), 0o644); err != nil {
			t.Fatal(err)
		}
		dirs[filepath.Dir(path)] = append(dirs[filepath.Dir(path)], path)
	}
	if len(dirs) == 0 {
		t.Fatal("docs/handlers.md has no ```go file=… block: the slow handler's example is one")
	}
	for dir, files := range dirs {
		cmd := exec.Command("go", append([]string{"vet"}, files...)...)
		cmd.Dir = "../../.."
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("docs/handlers.md's %s does not build: %v\n%s", strings.TrimPrefix(dir, tmp+"/"), err, out)
		}
	}
}
