package faultproxy

import (
	"bufio"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// echo serves an echo server until the test ends and returns its address.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
	return ln.Addr().String()
}

// roundTrip sends a line over c and waits up to d for it to come back.
func roundTrip(c net.Conn, d time.Duration) error {
	c.SetDeadline(time.Now().Add(d))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	_, err := bufio.NewReader(c).ReadString('\n')
	return err
}

func dial(t *testing.T, p *Proxy) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestFaults(t *testing.T) {
	p, err := Listen("127.0.0.1:0", echo(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	c := dial(t, p)
	if err := roundTrip(c, 2*time.Second); err != nil {
		t.Fatalf("forwarding: %v", err)
	}

	p.Drop()
	if err := roundTrip(c, 2*time.Second); err == nil {
		t.Fatal("a dropped connection still works")
	}
	if err := roundTrip(dial(t, p), 2*time.Second); err != nil {
		t.Fatalf("after Drop, a new connection fails: %v", err)
	}

	p.Stall()
	stalled := dial(t, p)
	if err := roundTrip(stalled, 300*time.Millisecond); err == nil {
		t.Fatal("traffic flows through a stalled proxy")
	}
	p.Restore()
	if err := roundTrip(dial(t, p), 2*time.Second); err != nil {
		t.Fatalf("after Restore from a stall: %v", err)
	}

	p.Cut()
	if err := roundTrip(dial(t, p), 2*time.Second); err == nil {
		t.Fatal("a new connection works through a cut proxy")
	}
	p.Restore()
	if err := roundTrip(dial(t, p), 2*time.Second); err != nil {
		t.Fatalf("after Restore from a cut: %v", err)
	}
}

// TestRetarget: after Retarget, the connections to the old upstream are gone and new ones reach
// the new upstream (which, unlike the old one, answers in upper case).
func TestRetarget(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						c.Close()
						return
					}
					c.Write([]byte(strings.ToUpper(line)))
				}
			}()
		}
	}()
	p, err := Listen("127.0.0.1:0", echo(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	old := dial(t, p)
	if err := roundTrip(old, 2*time.Second); err != nil {
		t.Fatalf("forwarding: %v", err)
	}
	p.Retarget(ln.Addr().String())
	if err := roundTrip(old, 2*time.Second); err == nil {
		t.Error("a connection to the old upstream survived Retarget")
	}
	c := dial(t, p)
	c.SetDeadline(time.Now().Add(2 * time.Second))
	c.Write([]byte("ping\n"))
	got, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || got != "PING\n" {
		t.Errorf("after Retarget: %q, %v; want the new upstream's PING", got, err)
	}
}
