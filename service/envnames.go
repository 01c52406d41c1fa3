package service

import (
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
)

// A misspelt optional variable (RETRY_TIER=5s for RETRY_TIERS) would otherwise be ignored: the
// service would start with the default and the operator would never know. Names a letter or two
// from one kafkapg reads are refused instead, with the name meant. Names further away are other
// programs' (Kubernetes adds KAFKA_PORT and the like for a Service named kafka), and left alone.

// envNames returns the variables the service reads (the envconfig names of env's structs).
func envNames() []string {
	var names []string
	var walk func(t reflect.Type)
	walk = func(t reflect.Type) {
		for i := range t.NumField() {
			f := t.Field(i)
			if f.Anonymous && f.Type.Kind() == reflect.Struct {
				walk(f.Type)
				continue
			}
			if n := f.Tag.Get("envconfig"); n != "" {
				names = append(names, n)
			}
		}
	}
	walk(reflect.TypeFor[env]())
	slices.Sort(names)
	return slices.Compact(names)
}

// misspelt returns an error for each variable of environ that is not one the service reads but
// is at most two edits from one (and that one is not set).
func misspelt(environ []string) []error {
	known := envNames()
	set := map[string]bool{}
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		set[name] = true
	}
	var errs []error
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if len(name) < 6 || slices.Contains(known, name) || strings.HasPrefix(name, topicPrefix) {
			continue
		}
		for _, k := range known {
			if !set[k] && editDistance(name, k) <= 2 {
				errs = append(errs, fmt.Errorf("%s is not a variable kafkapg reads: did you mean %s? (docs/configuration.md lists them)", name, k))
				break
			}
		}
	}
	return errs
}

// editDistance is the Levenshtein distance between a and b (bytes: the names are ASCII).
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// environ is the process's environment, for misspelt.
var environ = os.Environ
