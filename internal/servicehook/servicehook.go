// Package servicehook lets package servicetest run a service as service.Main runs it, with an
// environment given as a map in place of the process's, without package service exporting a way
// to do so to everyone.
package servicehook

import (
	"context"
	"io"

	"github.com/kafkapg/kafkapg/processor"
)

// Run runs the command args of a service (run, config, dlq, keys or trace; run if args is
// empty) with handlers (a []service.Handler) until ctx ends, reading its configuration from vars
// alone, and returns its exit status as service.Run does. The processor it starts gets test as
// its Config.Test. Package service sets it.
var Run func(ctx context.Context, args []string, vars map[string]string, handlers any, test processor.TestConfig, stdout, stderr io.Writer) int
