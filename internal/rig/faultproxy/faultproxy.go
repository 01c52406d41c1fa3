// Package faultproxy is a TCP proxy that injects network faults on command: it sits in front of a
// service (Postgres, a Kafka broker) and can drop its connections, refuse new ones, or stall the
// traffic like a network partition. The tests and the chaos suite (make chaos) use it to break
// things on purpose.
package faultproxy

import (
	"net"
	"sync"
)

// Proxy forwards TCP connections to an upstream address until told to misbehave.
type Proxy struct {
	ln net.Listener

	mu       sync.Mutex
	upstream string // where new connections go (Retarget)
	refuse   bool
	conns    map[net.Conn]struct{}
	stalled  chan struct{} // non-nil while stalled: copying waits until it is closed
}

// Listen starts a proxy on addr ("127.0.0.1:0" picks a free port) that forwards connections to
// upstream (host:port).
func Listen(addr, upstream string) (*Proxy, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, upstream: upstream, conns: map[net.Conn]struct{}{}}
	go p.accept()
	return p, nil
}

// Addr is the proxy's listening address.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Close stops the proxy and closes every connection.
func (p *Proxy) Close() {
	p.ln.Close()
	p.Restore() // release stalled copies
	p.Cut()
}

// Drop closes every open connection, as a connection reset would; new connections are accepted.
func (p *Proxy) Drop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
}

// Cut closes every open connection and refuses new ones until Restore: the service is down.
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.refuse = true
	p.mu.Unlock()
	p.Drop()
}

// Stall stops forwarding bytes until Restore; connections stay open, as in a network partition.
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

// Retarget makes the proxy forward new connections to upstream, and drops the ones it has: what a
// virtual IP or a cloud endpoint does when it moves to a database's new primary.
func (p *Proxy) Retarget(upstream string) {
	p.mu.Lock()
	p.upstream = upstream
	p.mu.Unlock()
	p.Drop()
}

func (p *Proxy) serve(down net.Conn) {
	p.mu.Lock()
	target := p.upstream
	p.mu.Unlock()
	up, err := net.Dial("tcp", target)
	if err != nil {
		down.Close()
		return
	}
	p.mu.Lock()
	if p.refuse || p.upstream != target { // cut, closed or retargeted while we dialed: this pair must not survive it
		p.mu.Unlock()
		down.Close()
		up.Close()
		return
	}
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
