package testenv

import (
	"net"
	"sync"
	"testing"
)

// Proxy is a TCP proxy a test controls, to cut a service (Postgres, a broker) off on demand.
type Proxy struct {
	ln       net.Listener
	upstream string

	mu      sync.Mutex
	refuse  bool
	conns   map[net.Conn]struct{}
	stalled chan struct{} // non-nil while stalled: copying waits until it is closed
}

// NewProxy listens on a free local port and forwards connections to upstream (host:port).
func NewProxy(t testing.TB, upstream string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{ln: ln, upstream: upstream, conns: map[net.Conn]struct{}{}}
	go p.accept()
	t.Cleanup(func() {
		ln.Close()
		p.Restore() // release stalled copies
		p.Cut()
	})
	return p
}

// Addr is the proxy's listening address.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Cut closes every open connection and refuses new ones until Restore.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse = true
	for c := range p.conns {
		c.Close()
	}
}

// Stall stops forwarding bytes (connections stay open, as with a network partition) until
// Restore.
func (p *Proxy) Stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stalled == nil {
		p.stalled = make(chan struct{})
	}
}

// Restore accepts and forwards again.
func (p *Proxy) Restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse = false
	if p.stalled != nil {
		close(p.stalled)
		p.stalled = nil
	}
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.refuse
		p.mu.Unlock()
		if refuse {
			c.Close()
			continue
		}
		go p.serve(c)
	}
}

func (p *Proxy) serve(down net.Conn) {
	up, err := net.Dial("tcp", p.upstream)
	if err != nil {
		down.Close()
		return
	}
	p.mu.Lock()
	p.conns[down], p.conns[up] = struct{}{}, struct{}{}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.conns, down)
		delete(p.conns, up)
		p.mu.Unlock()
		down.Close()
		up.Close()
	}()
	done := make(chan struct{}, 2)
	go func() { p.copy(up, down); done <- struct{}{} }()
	go func() { p.copy(down, up); done <- struct{}{} }()
	<-done
}

func (p *Proxy) copy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			stalled := p.stalled
			p.mu.Unlock()
			if stalled != nil {
				<-stalled
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
