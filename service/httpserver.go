package service

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/netutil"
)

// The limits of every HTTP server the service runs (HTTP_ADDR's metrics, health checks and
// operator API; CONSOLE_ADDR's console; PPROF_ADDR's profiles): what one client, or many, can
// make the process hold before they sign in. A client that sends nothing, reads nothing, or keeps
// an idle connection open cannot hold a connection (a file descriptor, a goroutine) for long; one
// that sends large headers holds at most httpMaxHeaderBytes (Go's default is 1 MB: 800 slow
// connections held 1.1 GB); and no more than httpMaxConns connections are served at once on each
// listener, the others waiting in the kernel's accept queue. So the unauthenticated memory of one
// listener is bounded by about httpMaxConns × (httpMaxHeaderBytes + 12 KB of buffers), 12 MB.
//
// Variables, for the tests.
var (
	httpReadHeaderTimeout = 5 * time.Second
	httpReadTimeout       = 30 * time.Second
	httpWriteTimeout      = time.Minute
	httpIdleTimeout       = 30 * time.Second
	// The request line and headers (Go allows 4 KB more). The service's requests need a few
	// hundred bytes: a bearer token or basic credentials, a browser's headers.
	httpMaxHeaderBytes = 32 << 10
	// A request's body: the operator API's JSON and the console's forms (a filter, a reason, a
	// list of ids), which is more than they need; bodies are read only once signed in.
	httpMaxBodyBytes int64 = 1 << 20
	// Connections served at once on one listener: Prometheus, probes and a few operators need
	// a handful (kept-alive ones are closed after httpIdleTimeout).
	httpMaxConns = 256
)

// serveHTTP serves h on ln in the background, within the limits above; write, if not zero,
// replaces the write timeout (a response that streams for longer). It returns the server, to
// shut down or close (which closes ln).
func serveHTTP(ln net.Listener, h http.Handler, write time.Duration) *http.Server {
	srv := &http.Server{
		Handler:           limitBody(h),
		ReadHeaderTimeout: httpReadHeaderTimeout,
		ReadTimeout:       httpReadTimeout,
		WriteTimeout:      cmp.Or(write, httpWriteTimeout),
		IdleTimeout:       httpIdleTimeout,
		MaxHeaderBytes:    httpMaxHeaderBytes,
	}
	go srv.Serve(netutil.LimitListener(ln, httpMaxConns))
	return srv
}

// limitBody refuses a request whose body is longer than httpMaxBodyBytes: at once with 413 if it
// says so (Content-Length); else its handler's read fails past the limit (*http.MaxBytesError),
// as a handler that reads a body answers (the API's with 413, a form's with 400).
func limitBody(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > httpMaxBodyBytes {
			w.Header().Set("Connection", "close")
			http.Error(w, "request body too large", http.StatusRequestEntityTooLarge)
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, httpMaxBodyBytes)
		h.ServeHTTP(w, r)
	})
}

// errStarting: the processor does not exist yet (the service waits for Postgres, migrates).
var errStarting = errors.New("starting: waiting for postgres")

// How often readiness is checked at most, and how long a check may take.
var (
	// readyFresh is how long a check's result is reused: /readyz (whoever calls it, an
	// unauthenticated flood included) and every scrape's kafkapg_ready ping Postgres at most
	// once per readyFresh, on one connection of the pool, never more than one at a time. A
	// probe sees a change (the lame duck of a shutdown included) at most readyFresh late.
	readyFresh        = time.Second
	readyCheckTimeout = 2 * time.Second
)

// readiness shares one readiness check among its concurrent callers and reuses its result for
// readyFresh. It logs each change of readiness with its detail, which /readyz does not say.
type readiness struct {
	check func(context.Context) error
	log   *slog.Logger

	mu      sync.Mutex
	err     error
	at      time.Time     // when err was found; zero: never checked
	running chan struct{} // closed when the check in flight ends; nil: none is
	logged  string        // the state logged last
}

// ready returns the result of a check that ended less than readyFresh ago, or waits for the one
// in flight (starting it if none is) until ctx ends.
func (r *readiness) ready(ctx context.Context) error {
	r.mu.Lock()
	if r.running == nil && !r.at.IsZero() && time.Since(r.at) < readyFresh {
		err := r.err
		r.mu.Unlock()
		return err
	}
	if r.running == nil {
		r.running = make(chan struct{})
		go r.run(r.running)
	}
	running := r.running
	r.mu.Unlock()
	select {
	case <-running:
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// run checks readiness, not on behalf of one caller (whose request may end first) but within
// readyCheckTimeout, and closes done.
func (r *readiness) run(done chan struct{}) {
	ctx, cancel := context.WithTimeout(context.Background(), readyCheckTimeout)
	err := r.check(ctx)
	cancel()
	r.mu.Lock()
	r.err, r.at, r.running = err, time.Now(), nil
	state := "ready"
	if err != nil {
		state = err.Error()
	}
	changed := state != r.logged
	r.logged = state
	r.mu.Unlock()
	close(done)
	switch {
	case !changed || errors.Is(err, errStarting):
	case err == nil:
		r.log.Info("ready")
	default:
		r.log.Warn("not ready", "dependency", notReadyReason(err), "err", err)
	}
}

// notReadyReason says in general terms why err (errStarting, or the processor's Ready) is not
// ready, for /readyz's unauthenticated answer: its detail (the database's user and hosts, the
// brokers) goes to the log.
func notReadyReason(err error) string {
	msg := err.Error()
	switch {
	case errors.Is(err, errStarting):
		return "starting: waiting for postgres"
	case msg == "shutting down":
		return "shutting down"
	// Ready's "postgres: <ping's error>"; or not in the group yet because the processor waits
	// for Postgres before it joins.
	case strings.HasPrefix(msg, "postgres: "), strings.Contains(msg, "waiting for postgres"):
		return "postgres"
	case strings.HasPrefix(msg, "not a member of the consumer group"):
		return "kafka: not a member of the consumer group yet"
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return "the check did not end in time"
	}
	return "see the log"
}
