package loginlimit

import (
	"math"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"
)

// The allowance of one client address.
const (
	// Burst is how many failed sign-ins an address may make at once.
	Burst = 10
	// Every is how long it takes for one failure to be forgiven: past the burst, an address
	// may try once every Every (10 a minute: a password of 12 characters or a token of 16, as
	// the console and the API require, is not guessed at that rate).
	Every = 6 * time.Second
	// MaxClients bounds how many addresses are tracked at once (about 100 bytes each).
	MaxClients = 4096
)

// Limiter counts failed sign-ins by client address. Its methods may be called concurrently.
type Limiter struct {
	burst float64
	every time.Duration
	max   int
	now   func() time.Time

	mu      sync.Mutex
	clients map[netip.Prefix]*failures
	// overflow is the allowance that addresses share once clients is full of addresses that
	// failed recently (many addresses guessing at once).
	overflow failures
}

// failures are an address's failed sign-ins not yet forgiven, as of at.
type failures struct {
	n  float64
	at time.Time
}

// New returns a Limiter with the allowance of Burst, Every and MaxClients.
func New() *Limiter { return newLimiter(Burst, Every, MaxClients, time.Now) }

func newLimiter(burst int, every time.Duration, maxClients int, now func() time.Time) *Limiter {
	return &Limiter{burst: float64(burst), every: every, max: maxClients, now: now, clients: map[netip.Prefix]*failures{}}
}

// level returns f's failures not yet forgiven at now.
func (l *Limiter) level(f *failures, now time.Time) float64 {
	return max(0, f.n-float64(now.Sub(f.at))/float64(l.every))
}

// Wait returns how long r's client must wait before it may try to sign in again; 0: it may now.
// A request that Wait refuses must be refused without checking its credentials: an answer that
// told a right guess from a wrong one would let the guessing go on.
func (l *Limiter) Wait(r *http.Request) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := l.clients[client(r)]
	if f == nil {
		f = &l.overflow
	}
	// Blocked while Burst failures are not forgiven; free again once one of them is.
	lvl := l.level(f, l.now())
	if lvl <= l.burst-1 {
		return 0
	}
	return time.Duration((lvl - (l.burst - 1)) * float64(l.every))
}

// Failed counts a failed sign-in by r's client: a request that carried credentials that match
// no one (a request without any, as a browser's first, is not a failure). It reports whether
// that client is now refused, for the caller to log.
func (l *Limiter) Failed(r *http.Request) (refused bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	key := client(r)
	f := l.clients[key]
	if f == nil {
		if len(l.clients) >= l.max {
			l.forget(now)
		}
		if len(l.clients) < l.max {
			f = &failures{}
			l.clients[key] = f
		} else {
			f = &l.overflow
		}
	}
	f.n, f.at = l.level(f, now)+1, now
	return f.n > l.burst-1
}

// forget drops the addresses whose failures are all forgiven.
func (l *Limiter) forget(now time.Time) {
	for k, f := range l.clients {
		if l.level(f, now) == 0 {
			delete(l.clients, k)
		}
	}
}

// RetryAfter is d as the value of a Retry-After header: whole seconds, rounded up, at least 1.
func RetryAfter(d time.Duration) string {
	return strconv.Itoa(max(1, int(math.Ceil(d.Seconds()))))
}

// client returns the address r came from: its IPv4 address, or its IPv6 address's /64 (what
// one host, or one attacker, is usually given).
func client(r *http.Request) netip.Prefix {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	a, err := netip.ParseAddr(host)
	if err != nil {
		return netip.Prefix{} // not an IP address (a test's, a unix socket's): all such share one
	}
	a = a.Unmap().WithZone("")
	bits := 32
	if a.Is6() {
		bits = 64
	}
	p, _ := a.Prefix(bits)
	return p
}
