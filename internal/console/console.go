// Package console is kafkapg's operator console: server-rendered pages (html/template, embedded,
// no JavaScript build) over the same operations as the CLI and the JSON API (package ops), served
// by the service on an address of its own (CONSOLE_ADDR).
//
// Every page needs a user (HTTP basic authentication against CONSOLE_USERS); a viewer may browse,
// only an operator may act. Requests that change state must be same-origin
// (http.CrossOriginProtection).
package console

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/loginlimit"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// Role is what a user may do.
type Role string

const (
	Viewer   Role = "viewer"   // browses every page
	Operator Role = "operator" // also replays, discards, releases, pauses, resumes and sets positions
)

// User is a console login.
type User struct {
	Name     string
	Role     Role
	Password string
}

// ParseUsers reads CONSOLE_USERS: comma-separated name:role:password entries (the password is
// everything after the second colon). Each entry is trimmed of surrounding spaces, its fields are
// not: a password keeps the spaces at its start and loses those at its end. Names must be
// unique, roles viewer or operator, and passwords at least 12 characters.
func ParseUsers(s string) ([]User, error) { return parseLogins(s, "user", "password", 12) }

// ParseTokens reads CONSOLE_TOKENS: comma-separated name:role:token entries, like ParseUsers's,
// with tokens of at least 16 characters. A request that carries "Authorization: Bearer <token>"
// is the token's name, with its role: for scripts, and for an authenticating proxy in front of
// the console that sets the header.
func ParseTokens(s string) ([]User, error) { return parseLogins(s, "token", "token", 16) }

func parseLogins(s, what, secret string, minLen int) ([]User, error) {
	// Every entry's shape is checked before any secret's length: a secret holding a comma splits
	// its entry in two, and the piece after the comma, with no name:role: prefix, is the fault to
	// name; read in order, the piece before it would first be refused as too short a secret.
	// Nothing of an entry is echoed: it may be a secret (an entry in the wrong order has it as
	// its role).
	commas := fmt.Sprintf("entries are separated by commas, so a %s cannot contain one", secret)
	var users []User
	for i, entry := range strings.Split(s, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		name, rest, ok1 := strings.Cut(entry, ":")
		role, password, ok2 := strings.Cut(rest, ":")
		if !ok1 || !ok2 || name == "" {
			return nil, fmt.Errorf("entry %d: want name:role:%s (%s)", i+1, secret, commas)
		}
		if Role(role) != Viewer && Role(role) != Operator {
			return nil, fmt.Errorf("entry %d: its second field, the role, must be viewer or operator (want name:role:%s); %s", i+1, secret, commas)
		}
		users = append(users, User{Name: name, Role: Role(role), Password: password})
	}
	seen := map[string]bool{}
	for _, u := range users {
		if len(u.Password) < minLen {
			return nil, fmt.Errorf("%s %q: the %s must be at least %d characters", what, u.Name, secret, minLen)
		}
		if seen[u.Name] {
			return nil, fmt.Errorf("%s %q is listed twice", what, u.Name)
		}
		seen[u.Name] = true
	}
	if len(users) == 0 {
		return nil, fmt.Errorf("no %ss: want name:role:%s entries", what, secret)
	}
	return users, nil
}

// Config is what a Console serves.
type Config struct {
	Ops   *ops.Ops     // the group's operations (and its name, and its topics: all a trace reads, ops.CheckTopic)
	Admin *kadm.Client // end offsets, for lag; nil: lag is not shown
	// Kafka reads the records a trace looks for; nil: traces read Postgres only.
	Kafka *kgo.Client
	// Stuck is what counts as a stuck key (the retry tiers of each source topic, and how long
	// without progress), for releases.
	Stuck retrytopics.StuckScope
	// Samples are the process's own metrics over the last hour, for the overview's chart, rates
	// and alerts; nil: the overview shows none.
	Samples *Sampler
	// HideValues hides record values and header values from viewers (operators see them).
	HideValues bool
	// Registry decodes values in the Schema Registry's wire format for the pages (as JSON, with
	// their schema); nil: they are shown as bytes.
	Registry *schemaregistry.Registry
	// TraceURL is the page of a trace in the team's trace viewer, {trace_id} standing for the
	// trace id (TRACE_URL); "" shows trace ids without a link.
	TraceURL string
	// Concurrency is CONCURRENCY of the source topics that prepare concurrently (above 1), for
	// the overview's prepares; nil or empty: none does.
	Concurrency map[string]int
	Users       []User // who may sign in with a password (basic authentication)
	Tokens      []User // who may send a bearer token (Password is the token)
	Log         *slog.Logger
	// Run runs a task StartTask created (in the background, as the JSON API does); nil: the
	// console cannot act, only browse.
	Run func(id int64)
}

// Console serves the pages.
type Console struct {
	cfg    Config
	users  []hashedUser
	tokens []hashedUser
	pages  map[string]*template.Template
	logins *loginlimit.Limiter // failed sign-ins by address
}

type hashedUser struct {
	name     string
	role     Role
	password [sha256.Size]byte
}

//go:embed templates static
var files embed.FS

// New returns the console's handler.
func New(cfg Config) (*Console, error) {
	c := &Console{cfg: cfg, pages: map[string]*template.Template{}, logins: loginlimit.New()}
	for _, u := range cfg.Users {
		c.users = append(c.users, hashedUser{u.Name, u.Role, sha256.Sum256([]byte(u.Password))})
	}
	for _, u := range cfg.Tokens {
		c.tokens = append(c.tokens, hashedUser{u.Name, u.Role, sha256.Sum256([]byte(u.Password))})
	}
	for _, page := range []string{"overview", "deadletters", "deadletter", "confirm", "task", "retrypath", "release", "trace", "positions", "position", "error", "nothing"} {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(files, "templates/layout.html", "templates/"+page+".html")
		if err != nil {
			return nil, fmt.Errorf("console template %s: %w", page, err)
		}
		c.pages[page] = t
	}
	return c, nil
}

// Handler returns the routes, each behind authentication and cross-origin protection.
func (c *Console) Handler() http.Handler {
	mux := http.NewServeMux()
	static, _ := fs.Sub(files, "static")
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /{$}", c.overview)
	mux.HandleFunc("GET /dead-letters", c.deadLetters)
	mux.HandleFunc("GET /dead-letters/{id}", c.deadLetter)
	mux.HandleFunc("POST /dead-letters/confirm", c.operator(c.confirm))
	mux.HandleFunc("POST /dead-letters/act", c.operator(c.act))
	mux.HandleFunc("GET /tasks/{id}", c.task)
	mux.HandleFunc("POST /tasks/{id}/cancel", c.operator(c.cancel))
	mux.HandleFunc("GET /retry-path", c.retryPath)
	mux.HandleFunc("POST /keys/confirm", c.operator(c.confirmRelease))
	mux.HandleFunc("POST /keys/release", c.operator(c.release))
	mux.HandleFunc("GET /trace", c.trace)
	mux.HandleFunc("GET /positions", c.positions)
	mux.HandleFunc("POST /positions/confirm", c.operator(c.confirmPosition))
	mux.HandleFunc("POST /positions/act", c.operator(c.actPosition))
	return http.NewCrossOriginProtection().Handler(sameSiteReads(c.authenticate(mux)))
}

// sameSiteReads refuses what another site's page makes a signed-in browser fetch from the
// console (an image, a script, a fetch: not a link followed), which would be read with the
// user's credentials; CrossOriginProtection covers the requests that change something.
func sameSiteReads(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Sec-Fetch-Site") == "cross-site" && r.Header.Get("Sec-Fetch-Mode") != "navigate" {
			http.Error(w, "cross-site requests for the console's pages are refused", http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}

type ctxKey struct{}

// authenticate lets through requests with a console user's credentials (HTTP basic
// authentication) or a console token; others get 401 and nothing else. An address that failed
// to sign in too often gets 429 and is not even checked (see loginlimit).
func (c *Console) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if d := c.logins.Wait(r); d > 0 {
			w.Header().Set("Retry-After", loginlimit.RetryAfter(d))
			http.Error(w, "kafkapg console: too many failed sign-ins from this address; try again later", http.StatusTooManyRequests)
			return
		}
		u, ok := c.user(r)
		if !ok {
			if r.Header.Get("Authorization") != "" && c.logins.Failed(r) {
				c.cfg.Log.Warn("too many failed sign-ins: this address is refused for a while", "client", r.RemoteAddr)
			}
			w.Header().Set("WWW-Authenticate", `Basic realm="kafkapg console", charset="UTF-8"`)
			http.Error(w, "kafkapg console: sign in with a user of CONSOLE_USERS (or send a token of CONSOLE_TOKENS)", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, u)))
	})
}

// user returns the user whose credentials r carries: a bearer token, or a name and password.
// Every secret is compared, in constant time, whatever matches.
func (c *Console) user(r *http.Request) (hashedUser, bool) {
	if token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
		return match(c.tokens, "", token, false)
	}
	name, password, ok := r.BasicAuth()
	if !ok {
		return hashedUser{}, false
	}
	return match(c.users, name, password, true)
}

// match returns the login of logins whose secret is secret (and, if byName, whose name is name).
func match(logins []hashedUser, name, secret string, byName bool) (hashedUser, bool) {
	sum := sha256.Sum256([]byte(secret))
	var found hashedUser
	n := 0
	for _, u := range logins {
		ok := subtle.ConstantTimeCompare(sum[:], u.password[:])
		if byName {
			ok &= subtle.ConstantTimeCompare([]byte(name), []byte(u.name))
		}
		if ok == 1 {
			found, n = u, n+1
		}
	}
	return found, n == 1 // a token two logins share names no one
}

func userOf(r *http.Request) hashedUser { u, _ := r.Context().Value(ctxKey{}).(hashedUser); return u }

// operator lets through operators only: a viewer gets 403 and nothing is done.
func (c *Console) operator(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if userOf(r).role != Operator {
			http.Error(w, "kafkapg console: only an operator may do this", http.StatusForbidden)
			return
		}
		if c.cfg.Run == nil {
			http.Error(w, "kafkapg console: this console may not act", http.StatusForbidden)
			return
		}
		next(w, r)
	}
}

// mayAct reports whether r's user may act here (an operator, on a console that may act).
func (c *Console) mayAct(r *http.Request) bool { return userOf(r).role == Operator && c.cfg.Run != nil }

// page is what every template gets.
type page struct {
	Refresh bool // reload every second (a task in progress)
	Title   string
	Nav     string
	User    string
	Role    Role
	Group   string
	Now     time.Time
	Data    any
}

func (c *Console) render(w http.ResponseWriter, r *http.Request, name, title string, data any) {
	c.renderStatus(w, r, http.StatusOK, name, title, data)
}

// renderStatus renders page name with data, answering status.
func (c *Console) renderStatus(w http.ResponseWriter, r *http.Request, status int, name, title string, data any) {
	u := userOf(r)
	var b strings.Builder
	// A task's page reloads while it runs, and while a replay's records are on their way.
	t, isTask := data.(ops.Task)
	refresh := isTask && (t.Status == "running" || t.Action == ops.Replay && t.Pending > 0)
	err := c.pages[name].Execute(&b, page{Refresh: refresh, Title: title, Nav: name, User: u.name, Role: u.role, Group: c.cfg.Ops.Group(), Now: time.Now().UTC(), Data: data})
	if err != nil {
		c.fail(w, r, fmt.Errorf("render %s: %w", name, err))
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Security-Policy", "default-src 'self'; style-src 'self'; img-src 'self' data:")
	w.Header().Set("X-Frame-Options", "DENY")
	w.WriteHeader(status)
	fmt.Fprint(w, safetext.HTML(b.String())) // html/template leaves controls (U+202E, ESC) as they are
}

// nothingData is the page of a replay or discard whose filter matches dead letters, none of them
// new (ops.NothingNewError): a repeated one.
type nothingData struct {
	*ops.NothingNewError
	Matching url.Values // the filter without its status: the dead letters it matched
	Filter   url.Values // the filter as given
}

type errorData struct {
	Message string
	Back    string // the page to go back to
}

// fail answers an error. The user's mistakes (ops.ErrUsage: a bad filter, a key that cannot be
// released, a reason missing) get 400 and a page saying what is wrong; anything else is logged
// and gets 500.
func (c *Console) fail(w http.ResponseWriter, r *http.Request, err error) {
	if !errors.Is(err, ops.ErrUsage) {
		c.cfg.Log.Error("console", "path", r.URL.Path, "err", err)
		http.Error(w, safetext.HTML(err.Error()), http.StatusInternalServerError)
		return
	}
	back := "/"
	for _, prefix := range []string{"/dead-letters", "/retry-path", "/trace", "/positions"} {
		if strings.HasPrefix(r.URL.Path, prefix) {
			back = prefix
		}
	}
	switch {
	case strings.HasPrefix(r.URL.Path, "/keys/"):
		back = "/retry-path"
	case strings.HasPrefix(r.URL.Path, "/tasks/"):
		back = r.URL.Path
		if r.Method != http.MethodGet {
			back = strings.TrimSuffix(back, "/cancel")
		}
	}
	// The person reading it needs the mistake, not the error's kind.
	msg := strings.TrimPrefix(err.Error(), ops.ErrUsage.Error()+": ")
	c.renderStatus(w, r, http.StatusBadRequest, "error", "Not done", errorData{Message: msg, Back: back})
}

// partitionRow is a partition of the group on the overview: its position in Postgres, and the
// broker's end offset.
type partitionRow struct {
	ops.Position
	End    int64
	Lag    int64
	HasLag bool
	Paused bool // by an operator (the Positions page says who and why)
}

type overviewData struct {
	// From the process's samples (Config.Samples).
	Sampled        bool
	Chart          template.HTML
	Span           time.Duration // the chart's
	Alerts         []Alert
	Applied        float64 // per second, over the last 5 minutes
	Failed         float64
	DeadLettered   float64
	HasRates       bool
	BreakerOpen    bool
	SampleInterval time.Duration
	// Concurrency is the topics that prepare concurrently ("orders 100, payments 8"), Preparing
	// the prepares in flight at the last sample and PreparingMax the most at one sample.
	Concurrency  string
	Preparing    int64
	PreparingMax int64

	Partitions []partitionRow
	Counts     []ops.Count
	Held       int
	Blocked    int
	Tasks      []ops.Task
	TotalLag   int64
	HasLag     bool
	// NewDeadLetters counts the dead letters not yet replayed nor discarded.
	NewDeadLetters int64
}

func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var d overviewData
	positions, err := c.cfg.Ops.Positions(ctx)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	pauses, err := c.cfg.Ops.Pauses(ctx)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	for _, p := range positions {
		paused := slices.ContainsFunc(pauses, func(q ops.Pause) bool {
			return q.Topic == p.Topic && (q.Partition == ops.AllPartitions || q.Partition == p.Partition)
		})
		d.Partitions = append(d.Partitions, partitionRow{Position: p, Paused: paused})
	}
	if c.cfg.Admin != nil && len(d.Partitions) > 0 {
		topics := map[string]bool{}
		for _, p := range d.Partitions {
			topics[p.Topic] = true
		}
		var names []string
		for t := range topics {
			names = append(names, t)
		}
		lctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		ends, err := c.cfg.Admin.ListEndOffsets(lctx, names...)
		cancel()
		if err == nil {
			for i := range d.Partitions {
				p := &d.Partitions[i]
				// A partition with no stored position yet shows none: where its first owner
				// starts depends on the broker's start offset and KAFKA_START_OFFSET.
				if o, ok := ends.Lookup(p.Topic, p.Partition); ok && o.Err == nil && p.Next != nil {
					p.End, p.HasLag = o.Offset, true
					p.Lag = max(o.Offset-*p.Next, 0)
					d.TotalLag += p.Lag
					d.HasLag = true
				}
			}
		} else {
			c.cfg.Log.Warn("console: cannot read end offsets; lag not shown", "err", err)
		}
	}
	if d.Counts, err = c.cfg.Ops.Summary(ctx, ops.Filter{}); err != nil {
		c.fail(w, r, err)
		return
	}
	for _, n := range d.Counts {
		if n.Status == "new" {
			d.NewDeadLetters += n.N
		}
	}
	st, err := c.cfg.Ops.RetryPath(ctx)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	d.Held, d.Blocked = st.HeldKeys, st.BlockedKeys
	if d.Tasks, err = c.cfg.Ops.Tasks(ctx, 5); err != nil {
		c.fail(w, r, err)
		return
	}
	if s := c.cfg.Samples; s != nil {
		samples, now := s.Samples(), time.Now()
		d.Sampled, d.SampleInterval = true, s.every
		// The last hour, or as much of it as the process has sampled, so that a young
		// process's samples are not squeezed into the right edge: a multiple of 4 minutes, for
		// the chart's four intervals of whole minutes.
		d.Span = time.Hour
		if len(samples) > 0 {
			d.Span = min(now.Sub(samples[0].At).Truncate(4*time.Minute)+4*time.Minute, time.Hour)
		}
		d.Chart = Chart(samples, now, d.Span)
		d.Alerts = Alerts(samples, now)
		d.Applied, d.Failed, d.DeadLettered, d.HasRates = Rates(samples, 5*time.Minute)
		if len(samples) > 0 {
			d.BreakerOpen = samples[len(samples)-1].BreakerOpen
			d.Preparing = samples[len(samples)-1].Preparing
		}
		for _, s := range samples {
			d.PreparingMax = max(d.PreparingMax, s.Preparing)
		}
	}
	var conc []string
	for _, t := range slices.Sorted(maps.Keys(c.cfg.Concurrency)) {
		conc = append(conc, fmt.Sprintf("%s %d", t, c.cfg.Concurrency[t]))
	}
	d.Concurrency = strings.Join(conc, ", ")
	c.render(w, r, "overview", "Overview", d)
}

// listPage is how many dead letters a page of the list shows.
const listPage = 50

type deadLettersData struct {
	Form map[string]string // the filter's fields as typed, for its inputs
	// Filter is the filter as the replay and discard forms carry it (ops.Filter.Query): times
	// made absolute, so that the confirmation and the task act on the window the list showed.
	Filter  url.Values
	Rows    []ops.DeadLetter
	Counts  []ops.Count
	Older   url.Values // the next page's query, or nil
	Matched int64
}

func (c *Console) deadLetters(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f, err := filterOf(q)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var before int64
	if b := q.Get("before"); b != "" {
		var err error
		if before, err = strconv.ParseInt(b, 10, 64); err != nil || before < 1 {
			http.Error(w, "before: want a dead letter id", http.StatusBadRequest)
			return
		}
	}
	ctx := r.Context()
	rows, err := c.cfg.Ops.ListBefore(ctx, f, before, listPage+1)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	d := deadLettersData{Form: map[string]string{}, Filter: f.Query()}
	for _, k := range []string{"topic", "key", "class", "status", "since", "until", "error"} {
		d.Form[k] = q.Get(k)
	}
	if len(rows) > listPage {
		rows = rows[:listPage]
		older := r.URL.Query()
		older.Set("before", strconv.FormatInt(rows[len(rows)-1].ID, 10))
		d.Older = older
	}
	d.Rows = rows
	if d.Counts, err = c.cfg.Ops.Summary(ctx, f); err != nil {
		c.fail(w, r, err)
		return
	}
	for _, n := range d.Counts {
		d.Matched += n.N
	}
	c.render(w, r, "deadletters", "Dead letters", d)
}

// filterOf reads a dead-letter filter from the list's query or an action's form, as the JSON API
// does (ops.FilterFromQuery), except that an empty field means any: a form sends every input.
func filterOf(q url.Values) (ops.Filter, error) {
	set := url.Values{}
	for k, vs := range q {
		for _, v := range vs {
			if v != "" {
				set.Add(k, v)
			}
		}
	}
	return ops.FilterFromQuery(set, time.Now())
}

type confirmData struct {
	Action  ops.Action
	Preview ops.Preview
	Filter  url.Values // the filter, carried to the action (ops.Filter.Query)
}

// confirm shows what a replay or discard of a filter would do (the dry run's counts and a
// sample) and asks for the reason the audit trail records.
func (c *Console) confirm(w http.ResponseWriter, r *http.Request) {
	act, ok := actionOf(w, r)
	if !ok {
		return
	}
	f, err := filterOf(r.PostForm)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	p, err := c.cfg.Ops.Preview(r.Context(), act, f, 5)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	title := "Replay dead letters"
	if act == ops.Discard {
		title = "Discard dead letters"
	}
	c.render(w, r, "confirm", title, confirmData{Action: act, Preview: p, Filter: f.Query()})
}

// actionOf parses a posted form and reads its action; a bad one gets 400.
func actionOf(w http.ResponseWriter, r *http.Request) (ops.Action, bool) {
	if err := r.ParseForm(); err != nil {
		http.Error(w, safetext.HTML(err.Error()), http.StatusBadRequest)
		return "", false
	}
	act := ops.Action(r.PostForm.Get("action"))
	if act != ops.Replay && act != ops.Discard {
		http.Error(w, "action: want replay or discard", http.StatusBadRequest)
		return "", false
	}
	return act, true
}

// act starts the task a confirmation asked for, in the name of the signed-in operator, and shows
// its progress.
func (c *Console) act(w http.ResponseWriter, r *http.Request) {
	act, ok := actionOf(w, r)
	if !ok {
		return
	}
	f, err := filterOf(r.PostForm)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	t, err := c.cfg.Ops.StartTask(r.Context(), act, f,
		ops.Actor{Name: "console:" + userOf(r).name, Reason: strings.TrimSpace(r.PostForm.Get("reason"))}, 0)
	var nothing *ops.NothingNewError
	if errors.As(err, &nothing) {
		// The same replay again: not a mistake, and no task to show.
		all := f
		all.Status = ""
		c.render(w, r, "nothing", "Nothing to "+string(act), nothingData{NothingNewError: nothing, Matching: all.Query(), Filter: f.Query()})
		return
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.cfg.Run(t.ID)
	http.Redirect(w, r, fmt.Sprintf("/tasks/%d", t.ID), http.StatusSeeOther)
}

// task shows a task's progress; the page reloads itself while it runs.
func (c *Console) task(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r, "task")
	if !ok {
		return
	}
	t, err := c.cfg.Ops.Task(r.Context(), id)
	if errors.Is(err, ops.ErrNotFound) {
		http.NotFound(w, r)
		return
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "task", fmt.Sprintf("Task %d", id), t)
}

// cancel cancels a running task in the name of the signed-in operator.
func (c *Console) cancel(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r, "task")
	if !ok {
		return
	}
	if _, err := c.cfg.Ops.Cancel(r.Context(), id, ops.Actor{Name: "console:" + userOf(r).name, Reason: "cancelled in the console"}); err != nil {
		c.fail(w, r, err)
		return
	}
	http.Redirect(w, r, fmt.Sprintf("/tasks/%d", id), http.StatusSeeOther)
}

// pathID reads the {id} of the path; a bad one gets 400.
func pathID(w http.ResponseWriter, r *http.Request, what string) (int64, bool) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id < 1 {
		http.Error(w, what+" id: want a positive number", http.StatusBadRequest)
		return 0, false
	}
	return id, true
}

type deadLetterData struct {
	DL       ops.DeadLetter
	Value    string
	Encoding string // json, text or hex; or what the registry decoded it as
	Hidden   bool   // the value and the headers' values are hidden from this viewer
	// NotDecoded says why a value in the Schema Registry's wire format is shown as bytes.
	NotDecoded string
}

func (c *Console) deadLetter(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r, "dead letter")
	if !ok {
		return
	}
	// Values may hold personal data: with HideValues a viewer sees their size, not their bytes,
	// which are not even read. Others see the value's first maxShown bytes, all that is read.
	hidden := c.cfg.HideValues && userOf(r).role != Operator
	dl, err := c.cfg.Ops.Show(r.Context(), id, ops.ShowOptions{HideValues: hidden, ValueBytes: maxShown})
	if errors.Is(err, ops.ErrNotFound) {
		http.NotFound(w, r)
		return
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	d := deadLetterData{DL: dl, Hidden: hidden}
	if !hidden {
		d.Value, d.Encoding, d.NotDecoded = c.decodeValue(r.Context(), dl.Value, dl.ValueTruncated)
		if dl.ValueTruncated { // never decoded: see decodeValue
			d.Value += fmt.Sprintf("\n… (%d bytes more)", dl.ValueSize-len(dl.Value))
		}
	}
	c.render(w, r, "deadletter", fmt.Sprintf("Dead letter %d", id), d)
}
