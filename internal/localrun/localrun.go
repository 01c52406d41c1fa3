// Package localrun holds what the programs that run kafkapg's binaries on one machine (cmd/demo,
// the chaos suite, the process tests) need: finding the sibling binaries, free ports, a Postgres
// URL pointed at a schema, waiting for a condition, and asking a processor whether it is ready.
package localrun

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// BinDir returns the directory of the running program, after checking that the devbroker and
// processor binaries are there too (make build puts them all in bin/). tool names the program
// and its make target in the error.
func BinDir(tool string) (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	dir := filepath.Dir(exe)
	for _, b := range []string{"devbroker", "processor"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return "", fmt.Errorf("%s not found next to the %s binary (%s): build with `make build` or run `make %s`", b, tool, dir, tool)
		}
	}
	return dir, nil
}

// FreeAddr returns a local TCP address that was free a moment ago.
func FreeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// PostgresURL rewrites a postgres:// URL to use schema as its search_path and, if host
// (host:port) is not empty, to connect there instead.
func PostgresURL(raw, host, schema string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", errors.New("DATABASE_URL must be a postgres:// URL")
	}
	if host != "" {
		u.Host = host
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String(), nil
}

// WaitFor calls check every 100 ms until it succeeds, timeout passes or ctx ends, and then
// returns check's last error (or ctx's).
func WaitFor(ctx context.Context, timeout time.Duration, check func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Ready asks the processor serving HTTP at addr whether it is ready (/readyz answers 200: in its
// group and reaching Postgres).
func Ready(addr string) error {
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/readyz: %s", resp.Status)
	}
	return nil
}
