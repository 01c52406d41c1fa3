// Package srproxy puts a proxy in front of the tests' real Schema Registry that plays its
// outages: what it forwards, the registry answers; otherwise it answers 503 or 401, hangs, or
// hangs up, as a registry restarting, rotating its credentials, overloaded or gone would.
package srproxy

import (
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
)

// Mode is how the proxy answers.
type Mode int32

const (
	Forward      Mode = iota // to the registry
	Unavailable              // 503, as a registry that is restarting
	Unauthorized             // 401, as a registry whose credentials were rotated
	Hang                     // no answer until the client gives up
	HangUp                   // the connection closed without an answer
)

// Proxy is a registry proxy for one test.
type Proxy struct {
	srv      *httptest.Server
	path     string
	mode     atomic.Int32
	byID     atomic.Int64
	released chan struct{}
}

// New starts a proxy in front of the registry at registryURL (its path kept), closed when the
// test ends.
func New(t testing.TB, registryURL string) *Proxy {
	t.Helper()
	target, err := url.Parse(registryURL)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: target.Scheme, Host: target.Host})
	p := &Proxy{path: target.Path, released: make(chan struct{})}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch Mode(p.mode.Load()) {
		case Unavailable:
			http.Error(w, `{"error_code":50301,"message":"the registry is restarting"}`, http.StatusServiceUnavailable)
			return
		case Unauthorized:
			http.Error(w, `{"error_code":40101,"message":"unauthorized"}`, http.StatusUnauthorized)
			return
		case Hang:
			select {
			case <-r.Context().Done():
			case <-p.released:
			}
			return
		case HangUp:
			if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
				conn.Close()
			}
			return
		}
		if strings.Contains(r.URL.Path, "/schemas/ids/") {
			p.byID.Add(1)
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		close(p.released)
		p.srv.Close()
	})
	return p
}

// URL is the registry's URL through the proxy.
func (p *Proxy) URL() string { return p.srv.URL + p.path }

// Set makes the proxy answer as m from now on.
func (p *Proxy) Set(m Mode) { p.mode.Store(int32(m)) }

// SchemaRequests counts the requests for a schema by id that reached the registry.
func (p *Proxy) SchemaRequests() int64 { return p.byID.Load() }

// ResetSchemaRequests sets that count back to 0.
func (p *Proxy) ResetSchemaRequests() { p.byID.Store(0) }
