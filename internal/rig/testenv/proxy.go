package testenv

import (
	"testing"

	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/rig/faultproxy"
)

// FreeAddr returns a local address (127.0.0.1:port) that was free a moment ago.
func FreeAddr(t testing.TB) string {
	t.Helper()
	addr, err := localrun.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

// NewProxy starts a fault-injecting TCP proxy on a free local port in front of upstream
// (host:port), closed at the end of the test.
func NewProxy(t testing.TB, upstream string) *faultproxy.Proxy {
	t.Helper()
	p, err := faultproxy.Listen("127.0.0.1:0", upstream)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}
