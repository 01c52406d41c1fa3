package testenv

import (
	"context"
	"errors"
	"net"
	"sync"
)

// NetFault is a dialer (for kgo.Dialer) whose connections a test can cut: it models a process
// that is cut off from the Kafka cluster while it keeps running, the classic way to make a
// zombie consumer.
type NetFault struct {
	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]struct{}
}

// NewNetFault returns a NetFault that lets connections through until Cut.
func NewNetFault() *NetFault { return &NetFault{conns: map[net.Conn]struct{}{}} }

// Dial dials like net.Dialer unless the network is cut.
func (f *NetFault) Dial(ctx context.Context, network, host string) (net.Conn, error) {
	f.mu.Lock()
	cut := f.cut
	f.mu.Unlock()
	if cut {
		return nil, errors.New("netfault: network cut by the test")
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, network, host)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cut {
		c.Close()
		return nil, errors.New("netfault: network cut by the test")
	}
	f.conns[c] = struct{}{}
	return c, nil
}

// Cut closes every connection and fails new dials until Restore.
func (f *NetFault) Cut() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cut = true
	for c := range f.conns {
		c.Close()
	}
	clear(f.conns)
}

// Restore lets new dials through again.
func (f *NetFault) Restore() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cut = false
}
