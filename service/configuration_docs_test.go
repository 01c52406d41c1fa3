package service

import (
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestConfigurationStatesTheLimits: the limits docs/configuration.md's rows state for secrets
// and the console's sample interval are the ones loadEnv enforces: a secret as long as the row's
// "at least N characters" is taken, one a character shorter refused; the sample interval's bounds
// are taken, just outside them refused.
func TestConfigurationStatesTheLimits(t *testing.T) {
	b, err := os.ReadFile("../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	row := func(name string) string {
		r := regexp.MustCompile("(?m)^\\| `" + name + "` \\|.*$").FindString(string(b))
		if r == "" {
			t.Fatalf("docs/configuration.md has no %s row", name)
		}
		return r
	}
	least := func(name string) int {
		m := regexp.MustCompile(`(?i)at least (\d+) characters`).FindStringSubmatch(row(name))
		if m == nil {
			t.Fatalf("docs/configuration.md's %s row states no least length", name)
		}
		n, _ := strconv.Atoi(m[1])
		return n
	}
	secret := func(n int) string { return strings.Repeat("s", n) }
	accepts := func(vars map[string]string) bool {
		t.Helper()
		setEnv(t, vars)
		_, err := loadEnv(builtins())
		return err == nil
	}
	for _, c := range []struct {
		name string
		vars func(secret string) map[string]string
	}{
		{"OPERATOR_TOKEN", func(s string) map[string]string { return with("OPERATOR_TOKEN", s) }},
		{"OPERATOR_TOKENS", func(s string) map[string]string { return with("OPERATOR_TOKENS", "ci:operator:"+s) }},
		{"CONSOLE_USERS", func(s string) map[string]string {
			return with("CONSOLE_ADDR", "127.0.0.1:0", "CONSOLE_USERS", "ann:viewer:"+s)
		}},
		{"CONSOLE_TOKENS", func(s string) map[string]string {
			return with("CONSOLE_ADDR", "127.0.0.1:0", "CONSOLE_TOKENS", "proxy:viewer:"+s)
		}},
	} {
		n := least(c.name)
		if !accepts(c.vars(secret(n))) {
			t.Errorf("%s: a secret of %d characters, the least docs/configuration.md states, is refused", c.name, n)
		}
		if accepts(c.vars(secret(n - 1))) {
			t.Errorf("%s: a secret of %d characters is taken; docs/configuration.md says at least %d", c.name, n-1, n)
		}
	}
	m := regexp.MustCompile(`(\d+[a-z]+) to (\d+[a-z]+)\. \|$`).FindStringSubmatch(row("CONSOLE_SAMPLE_INTERVAL"))
	if m == nil {
		t.Fatal("docs/configuration.md's CONSOLE_SAMPLE_INTERVAL row states no bounds")
	}
	lo, err1 := time.ParseDuration(m[1])
	hi, err2 := time.ParseDuration(m[2])
	if err1 != nil || err2 != nil {
		t.Fatalf("CONSOLE_SAMPLE_INTERVAL's bounds %q, %q: %v %v", m[1], m[2], err1, err2)
	}
	for v, want := range map[string]bool{lo.String(): true, hi.String(): true, (lo - time.Millisecond).String(): false, (hi + time.Second).String(): false} {
		if got := accepts(with("CONSOLE_SAMPLE_INTERVAL", v)); got != want {
			t.Errorf("CONSOLE_SAMPLE_INTERVAL=%s: taken %v; docs/configuration.md says %s to %s", v, got, m[1], m[2])
		}
	}
}

// TestReadmeStatesTheServiceDefaults: what README.md says the ten-line service does with no more
// than the required variables — where it serves its endpoints, the exit status of a wrong
// value — is what loadEnv and Run do.
func TestReadmeStatesTheServiceDefaults(t *testing.T) {
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := strings.Join(strings.Fields(string(b)), " ")
	setEnv(t, minimal())
	e, err := loadEnv(builtins())
	if err != nil {
		t.Fatal(err)
	}
	if want := "serves `/metrics`, `/healthz` and `/readyz` on `" + e.HTTPAddr + "`"; !strings.Contains(readme, want) {
		t.Errorf("README.md does not say %q (HTTP_ADDR's default)", want)
	}
	setEnv(t, with("RETRY_TIER", "1s"))
	var out strings.Builder
	code := Run(nil, &out, builtinHandlers...)
	if want := "stops it with exit status " + strconv.Itoa(code) + " and a message naming it"; !strings.Contains(readme, want) || !strings.Contains(out.String(), "RETRY_TIER") {
		t.Errorf("README.md does not say %q, or the message (%q) does not name RETRY_TIER", want, out.String())
	}
}
