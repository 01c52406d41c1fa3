package loginlimit

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// clock is a test's time, moved by hand.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func from(addr string) *http.Request {
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = addr
	return r
}

// TestLimiterAllowance: an address gets its burst of failures, is then refused for as long as
// one failure takes to be forgiven, and gets one more try each time one is; another address is
// not affected.
func TestLimiterAllowance(t *testing.T) {
	t.Parallel()
	c := &clock{t: time.Unix(1_000_000, 0)}
	l := newLimiter(3, 10*time.Second, 100, c.now)
	a, b := from("192.0.2.1:1000"), from("192.0.2.2:1000")
	for i := range 3 {
		if d := l.Wait(a); d != 0 {
			t.Fatalf("failure %d: wait %v, want none within the burst", i+1, d)
		}
		if refused := l.Failed(a); refused != (i == 2) {
			t.Errorf("failure %d: refused %v, want %v", i+1, refused, i == 2)
		}
	}
	if d := l.Wait(a); d != 10*time.Second {
		t.Errorf("after the burst: wait %v, want 10s (one failure forgiven)", d)
	}
	if d := l.Wait(from("192.0.2.1:2000")); d == 0 {
		t.Errorf("same address, another port: not refused")
	}
	if d := l.Wait(b); d != 0 {
		t.Errorf("another address: wait %v, want none", d)
	}
	c.t = c.t.Add(4 * time.Second)
	if d := l.Wait(a); d != 6*time.Second {
		t.Errorf("4s later: wait %v, want 6s", d)
	}
	c.t = c.t.Add(6 * time.Second)
	if d := l.Wait(a); d != 0 {
		t.Fatalf("10s later: wait %v, want none", d)
	}
	l.Failed(a)
	if d := l.Wait(a); d != 10*time.Second {
		t.Errorf("one more failure: wait %v, want 10s", d)
	}
	if got := RetryAfter(l.Wait(a) - time.Millisecond); got != "10" {
		t.Errorf("Retry-After %q, want 10 (rounded up)", got)
	}
}

// TestLimiterIPv6: the addresses of one /64 share an allowance; IPv4 written as IPv6 is IPv4.
func TestLimiterIPv6(t *testing.T) {
	t.Parallel()
	c := &clock{t: time.Unix(1_000_000, 0)}
	l := newLimiter(1, time.Minute, 100, c.now)
	l.Failed(from("[2001:db8:1:2::1]:1000"))
	if l.Wait(from("[2001:db8:1:2:ffff::9]:1000")) == 0 {
		t.Errorf("another address of the same /64: not refused")
	}
	if l.Wait(from("[2001:db8:1:3::1]:1000")) != 0 {
		t.Errorf("an address of another /64: refused")
	}
	l.Failed(from("[::ffff:192.0.2.7]:1000"))
	if l.Wait(from("192.0.2.7:1000")) == 0 {
		t.Errorf("an IPv4 address seen as IPv4-mapped IPv6 first: not refused")
	}
}

// TestLimiterBoundedMemory: however many addresses fail, at most max are tracked; once the
// table is full of recent failures the others share one allowance (so spreading the guesses
// over more addresses does not buy more than that), and forgiven addresses make room again.
func TestLimiterBoundedMemory(t *testing.T) {
	t.Parallel()
	c := &clock{t: time.Unix(1_000_000, 0)}
	l := newLimiter(2, time.Minute, 50, c.now)
	for i := range 1000 {
		l.Failed(from(fmt.Sprintf("10.0.%d.%d:1", i/256, i%256)))
	}
	if n := len(l.clients); n != 50 {
		t.Errorf("%d addresses tracked, want 50", n)
	}
	if l.Wait(from("10.9.9.9:1")) == 0 {
		t.Errorf("an untracked address while 950 shared the overflow's allowance: not refused")
	}
	if l.Wait(from("10.0.0.0:1")) != 0 {
		t.Errorf("a tracked address with one failure: refused")
	}
	c.t = c.t.Add(time.Hour)
	l.Failed(from("10.9.9.9:1"))
	if n := len(l.clients); n != 1 {
		t.Errorf("an hour later, one more failure: %d addresses tracked, want 1 (the forgiven ones forgotten)", n)
	}
}
