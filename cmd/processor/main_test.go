package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestConfigurationNamesEveryHandler: docs/configuration.md's HANDLER row names every handler
// this binary registers, and the package doc lists each.
func TestConfigurationNamesEveryHandler(t *testing.T) {
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	conf, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `HANDLER` \\|.*$").FindString(string(conf))
	names := regexp.MustCompile(`service\.Handler\{Name: "([^"]+)"`).FindAllStringSubmatch(string(src), -1)
	if len(names) < 2 {
		t.Fatalf("found %d handlers in main.go", len(names))
	}
	for _, n := range names {
		if !strings.Contains(row, "`"+n[1]+"`") {
			t.Errorf("docs/configuration.md's HANDLER row does not name %s, which cmd/processor registers", n[1])
		}
		if !strings.Contains(string(src), "//\tHANDLER="+n[1]+" ") {
			t.Errorf("cmd/processor's doc does not list HANDLER=%s", n[1])
		}
	}
}
