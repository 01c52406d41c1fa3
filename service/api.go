package service

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/loginlimit"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/safetext"
)

// api is the operator JSON API under /api/v1/: the operations of the dlq, keys, positions and
// trace commands, over HTTP, for scripts and the console. It is served only when OPERATOR_TOKEN or
// OPERATOR_TOKENS is set, and every call must carry one of their tokens (Authorization: Bearer
// <token>); a call without gets 401 and nothing else, record values included. A named token of
// OPERATOR_TOKENS is who the audit names; a viewer's only reads.
//
// Replays and discards started here run in this process as tasks (see ops.RunTask): if the
// process stops, they are interrupted and can be resumed (POST /api/v1/tasks/{id}/resume, or
// `dlq resume`) from any replica.
type api struct {
	ops    *ops.Ops
	token  *[sha256.Size]byte // OPERATOR_TOKEN's hash; nil: unset
	tokens []namedToken       // OPERATOR_TOKENS
	log    *slog.Logger
	keys   keysAPI
	tasks  *taskRunner

	logins *loginlimit.Limiter // failed sign-ins by address
}

// taskRunner runs replay and discard tasks in this process, for the JSON API and the console.
type taskRunner struct {
	ops    *ops.Ops
	log    *slog.Logger
	runner string
	ctx    context.Context // ends when the service stops: running tasks are interrupted
	wg     sync.WaitGroup
}

func newTaskRunner(ctx context.Context, o *ops.Ops, name string, log *slog.Logger) *taskRunner {
	host, _ := os.Hostname()
	return &taskRunner{ops: o, log: log, runner: fmt.Sprintf("%s/%d/%s", host, os.Getpid(), name), ctx: ctx}
}

// run runs task id in the background until it ends or the service stops.
func (r *taskRunner) run(id int64) {
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		t, err := r.ops.RunTask(r.ctx, id, r.runner, nil)
		if err != nil {
			if r.ctx.Err() == nil {
				r.log.Error("task failed; resume it when the cause is fixed", "task", id, "err", err)
			} else {
				r.log.Info("task interrupted by the shutdown; resume it on any replica", "task", id)
			}
			return
		}
		r.log.Info("task ended", "task", id, "status", t.Status, "done", t.Done, "matched", t.Matched)
	}()
}

// wait waits for the running tasks to stop (after their chunk in flight, once the service's
// context ends).
func (r *taskRunner) wait() { r.wg.Wait() }

// keysAPI is what the keys and trace routes need beyond the dead letters (set by the service).
type keysAPI struct {
	keys    http.HandlerFunc
	release http.HandlerFunc
	trace   http.HandlerFunc
	// positions are the positions routes (they share the Kafka client).
	positions positionsAPI
	close     func() // releases what the routes hold (their Kafka client); nil: nothing
}

// namedToken is an entry of OPERATOR_TOKENS: a caller the audit names.
type namedToken struct {
	name string
	role console.Role
	sum  [sha256.Size]byte
}

// caller is who sent a request: the name of its named token, or "" for OPERATOR_TOKEN (whoever
// holds it; what it calls itself is its claim).
type caller struct {
	name string
	role console.Role
}

type callerKey struct{}

func callerOf(r *http.Request) caller { c, _ := r.Context().Value(callerKey{}).(caller); return c }

// newAPI serves the API to the holders of token (OPERATOR_TOKEN, may be "") and of tokens
// (OPERATOR_TOKENS).
func newAPI(ctx context.Context, o *ops.Ops, token string, tokens []console.User, log *slog.Logger) *api {
	log = log.With("component", "api")
	a := &api{ops: o, logins: loginlimit.New(), log: log, tasks: newTaskRunner(ctx, o, "api", log)}
	// Trimmed, as the request's header is (and as its length is checked): a token from a Secret
	// file often ends in a newline, which no caller can send.
	if token = strings.TrimSpace(token); token != "" {
		sum := sha256.Sum256([]byte(token))
		a.token = &sum
	}
	for _, t := range tokens {
		a.tokens = append(a.tokens, namedToken{name: t.Name, role: t.Role, sum: sha256.Sum256([]byte(strings.TrimSpace(t.Password)))})
	}
	return a
}

// handler returns the API's routes, each behind the token check.
func (a *api) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /api/v1/dead-letters", a.list)
	mux.HandleFunc("GET /api/v1/dead-letters/summary", a.summary)
	mux.HandleFunc("GET /api/v1/dead-letters/{id}", a.show)
	mux.HandleFunc("POST /api/v1/dead-letters/replay", a.act(ops.Replay))
	mux.HandleFunc("POST /api/v1/dead-letters/discard", a.act(ops.Discard))
	mux.HandleFunc("POST /api/v1/dead-letters/purge", a.purge)
	mux.HandleFunc("GET /api/v1/tasks", a.taskList)
	mux.HandleFunc("GET /api/v1/tasks/{id}", a.task)
	mux.HandleFunc("POST /api/v1/tasks/{id}/cancel", a.cancel)
	mux.HandleFunc("POST /api/v1/tasks/{id}/resume", a.resume)
	mux.HandleFunc("GET /api/v1/audit", a.audit)
	if a.keys.keys != nil {
		mux.HandleFunc("GET /api/v1/keys", a.keys.keys)
		mux.HandleFunc("POST /api/v1/keys/release", a.keys.release)
		mux.HandleFunc("GET /api/v1/trace", a.keys.trace)
		mux.HandleFunc("GET /api/v1/positions", a.keys.positions.list)
		mux.HandleFunc("POST /api/v1/positions/pause", a.keys.positions.pause)
		mux.HandleFunc("POST /api/v1/positions/resume", a.keys.positions.resume)
		mux.HandleFunc("POST /api/v1/positions/set", a.keys.positions.set)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, ok := a.authorized(w, r)
		if !ok {
			return
		}
		if c.role == console.Viewer && r.Method != http.MethodGet && r.Method != http.MethodHead {
			writeError(w, http.StatusForbidden, fmt.Errorf("token %q is a viewer's: it may read, not act", c.name))
			return
		}
		mux.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey{}, c)))
	})
}

// authorized checks the bearer token in constant time against every token (OPERATOR_TOKEN's
// and OPERATOR_TOKENS'); if it is none of them, it answers 401, and 429 to an address that
// failed too often (see loginlimit), without checking.
func (a *api) authorized(w http.ResponseWriter, r *http.Request) (caller, bool) {
	if d := a.logins.Wait(r); d > 0 {
		w.Header().Set("Retry-After", loginlimit.RetryAfter(d))
		writeError(w, http.StatusTooManyRequests, errors.New("too many failed sign-ins from this address; try again later"))
		return caller{}, false
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	sum := sha256.Sum256([]byte(got))
	var found caller
	var n int
	if a.token != nil && subtle.ConstantTimeCompare(sum[:], a.token[:]) == 1 {
		found, n = caller{role: console.Operator}, n+1
	}
	for _, t := range a.tokens {
		if subtle.ConstantTimeCompare(sum[:], t.sum[:]) == 1 {
			found, n = caller{name: t.name, role: t.role}, n+1
		}
	}
	if ok && got != "" && n == 1 { // a token two entries share names no one
		return found, true
	}
	if r.Header.Get("Authorization") != "" && a.logins.Failed(r) {
		a.log.Warn("too many failed sign-ins: this address is refused for a while", "client", r.RemoteAddr)
	}
	w.Header().Set("WWW-Authenticate", `Bearer realm="kafkapg"`)
	writeError(w, http.StatusUnauthorized, errors.New("a valid operator token is required (Authorization: Bearer <a token of OPERATOR_TOKEN or OPERATOR_TOKENS>)"))
	return caller{}, false
}

// wait waits for the tasks this process runs to stop (they stop with the service's context),
// then closes the keys and trace routes' Kafka client.
func (a *api) wait() {
	a.tasks.wait()
	if a.keys.close != nil {
		a.keys.close()
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	// curl prints it to a terminal: the C1 and bidirectional controls are escaped too.
	enc := json.NewEncoder(safetext.JSONWriter(w))
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, status int, err error) {
	writeJSON(w, status, map[string]string{"error": err.Error()})
}

// respond writes v, or err with the status it calls for.
func respond(w http.ResponseWriter, v any, err error) {
	if err != nil {
		fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// fail writes err with the status it calls for.
func fail(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, ops.ErrUsage):
		writeError(w, http.StatusBadRequest, err)
	case errors.Is(err, ops.ErrNotFound):
		writeError(w, http.StatusNotFound, err)
	case errors.Is(err, ops.ErrTaskBusy):
		writeError(w, http.StatusConflict, err)
	case errors.Is(err, ops.ErrBusy):
		// As many traces as the process runs at once are running: not queued, refused.
		w.Header().Set("Retry-After", "5")
		writeError(w, http.StatusTooManyRequests, err)
	default:
		writeError(w, http.StatusInternalServerError, err)
	}
}

// maxLimit bounds a page of the API: with each row's key and error message bounded too
// (ops.ListedKeyBytes, ops.ListedMessageBytes), a page costs at most a few megabytes.
const maxLimit = 1000

func limit(r *http.Request, def int) (int, error) {
	s := r.URL.Query().Get("limit")
	if s == "" {
		return def, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 || n > maxLimit {
		return 0, fmt.Errorf("%w: limit %q: want 1 to %d", ops.ErrUsage, s, maxLimit)
	}
	return n, nil
}

func (a *api) list(w http.ResponseWriter, r *http.Request) {
	f, err := ops.FilterFromQuery(r.URL.Query(), time.Now())
	if err != nil {
		fail(w, err)
		return
	}
	n, err := limit(r, 50)
	if err != nil {
		fail(w, err)
		return
	}
	dls, err := a.ops.List(r.Context(), f, n)
	respond(w, map[string]any{"dead_letters": dls}, err)
}

func (a *api) summary(w http.ResponseWriter, r *http.Request) {
	f, err := ops.FilterFromQuery(r.URL.Query(), time.Now())
	if err != nil {
		fail(w, err)
		return
	}
	counts, err := a.ops.Summary(r.Context(), f)
	respond(w, map[string]any{"counts": counts}, err)
}

func pathID(w http.ResponseWriter, r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		writeError(w, http.StatusBadRequest, fmt.Errorf("id %q is not a number", r.PathValue("id")))
		return 0, false
	}
	return id, true
}

func (a *api) show(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r)
	if !ok {
		return
	}
	// A value shows its first value_bytes (ops.ShownValueBytes by default, at most
	// ops.MaxShownValueBytes); with values=false, none (nor the headers' values).
	q := r.URL.Query()
	opt := ops.ShowOptions{HideValues: q.Get("values") == "false"}
	if s := q.Get("value_bytes"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			fail(w, fmt.Errorf("%w: value_bytes %q: want 1 to %d", ops.ErrUsage, s, ops.MaxShownValueBytes))
			return
		}
		opt.ValueBytes = n
	}
	d, err := a.ops.Show(r.Context(), id, opt)
	respond(w, d, err)
}

// actRequest is the body of a replay or discard: without execute, a dry run.
type actRequest struct {
	Filter  ops.Filter `json:"filter"`
	Execute bool       `json:"execute"`
	Reason  string     `json:"reason"`
	Actor   string     `json:"actor"`
	Rate    float64    `json:"rate"`
	Sample  int        `json:"sample"`
}

// decode reads r's JSON body into v; a body that is not v's JSON gets 400, one longer than
// httpMaxBodyBytes 413.
func decode(w http.ResponseWriter, r *http.Request, v any) bool {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, httpMaxBodyBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		status := http.StatusBadRequest
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			status = http.StatusRequestEntityTooLarge
		}
		writeError(w, status, fmt.Errorf("request body: %v", err))
		return false
	}
	return true
}

// actor is who acts, as the audit records it (marked as coming through the API): a named
// token's name (OPERATOR_TOKENS: a claim of another name is refused), or, for OPERATOR_TOKEN,
// which anyone who holds it sends, the name the request claims, marked as claimed.
func actor(r *http.Request, claim string) (string, error) {
	claim = safetext.Text(strings.Join(strings.Fields(claim), " "), 100)
	if c := callerOf(r); c.name != "" {
		if claim != "" && claim != c.name {
			return "", fmt.Errorf("%w: actor %q: this token is %q's, and the audit names it; leave actor out", ops.ErrUsage, claim, c.name)
		}
		return "api:" + c.name, nil
	}
	if claim == "" {
		return "api:anonymous", nil
	}
	return "api:" + claim + " (claimed)", nil
}

func (a *api) act(act ops.Action) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req actRequest
		if !decode(w, r, &req) {
			return
		}
		if !req.Execute {
			if req.Sample <= 0 || req.Sample > 100 {
				req.Sample = 5
			}
			p, err := a.ops.Preview(r.Context(), act, req.Filter, req.Sample)
			if err != nil {
				fail(w, err)
				return
			}
			writeJSON(w, http.StatusOK, map[string]any{"dry_run": true, "preview": p})
			return
		}
		who, err := actor(r, req.Actor)
		if err != nil {
			fail(w, err)
			return
		}
		t, err := a.ops.StartTask(r.Context(), act, req.Filter, ops.Actor{Name: who, Reason: req.Reason}, req.Rate)
		var nothing *ops.NothingNewError
		if errors.As(err, &nothing) {
			writeJSON(w, http.StatusOK, nothingNewJSON(nothing)) // the same replay again: nothing new, no task
			return
		}
		if err != nil {
			fail(w, err)
			return
		}
		a.tasks.run(t.ID)
		writeJSON(w, http.StatusAccepted, map[string]any{"task": t})
	}
}

type purgeRequest struct {
	OlderThan string `json:"older_than"`
	Execute   bool   `json:"execute"`
	Reason    string `json:"reason"`
	Actor     string `json:"actor"`
}

func (a *api) purge(w http.ResponseWriter, r *http.Request) {
	var req purgeRequest
	if !decode(w, r, &req) {
		return
	}
	older, err := time.ParseDuration(req.OlderThan)
	if err != nil {
		writeError(w, http.StatusBadRequest, fmt.Errorf("older_than %q: want a duration such as 720h", req.OlderThan))
		return
	}
	who, err := actor(r, req.Actor)
	if err != nil {
		fail(w, err)
		return
	}
	n, err := a.ops.Purge(r.Context(), older, req.Execute, ops.Actor{Name: who, Reason: req.Reason})
	respond(w, map[string]any{"dry_run": !req.Execute, "rows": n}, err)
}

func (a *api) taskList(w http.ResponseWriter, r *http.Request) {
	n, err := limit(r, 20)
	if err != nil {
		fail(w, err)
		return
	}
	ts, err := a.ops.Tasks(r.Context(), n)
	respond(w, map[string]any{"tasks": ts}, err)
}

func (a *api) task(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r)
	if !ok {
		return
	}
	t, err := a.ops.Task(r.Context(), id)
	respond(w, t, err)
}

type cancelRequest struct {
	Reason string `json:"reason"`
	Actor  string `json:"actor"`
}

func (a *api) cancel(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r)
	if !ok {
		return
	}
	var req cancelRequest
	if !decode(w, r, &req) {
		return
	}
	who, err := actor(r, req.Actor)
	if err != nil {
		fail(w, err)
		return
	}
	t, err := a.ops.Cancel(r.Context(), id, ops.Actor{Name: who, Reason: req.Reason})
	respond(w, t, err)
}

func (a *api) resume(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r)
	if !ok {
		return
	}
	t, err := a.ops.Task(r.Context(), id)
	if err != nil {
		fail(w, err)
		return
	}
	if t.Status != "running" {
		fail(w, fmt.Errorf("%w: task %d is %s: nothing to resume", ops.ErrUsage, id, t.Status))
		return
	}
	if !t.Interrupted {
		fail(w, fmt.Errorf("task %d: %w (%s)", id, ops.ErrTaskBusy, t.Runner))
		return
	}
	a.tasks.run(id)
	writeJSON(w, http.StatusAccepted, t)
}

func (a *api) audit(w http.ResponseWriter, r *http.Request) {
	n, err := limit(r, 50)
	if err != nil {
		fail(w, err)
		return
	}
	es, err := a.ops.Audit(r.Context(), n)
	respond(w, map[string]any{"audit": es}, err)
}
