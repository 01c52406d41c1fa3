package console_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/testenv"
	"github.com/kafkapg/kafkapg/internal/testkit"
)

const (
	operatorPassword = "operator-password-1"
	viewerPassword   = "viewer-password-12"
)

// consoleOf starts a processor on a ledger workload with every kind of failure, waits until it
// settled (dead letters included), and serves the console over its database.
func consoleOf(t *testing.T) (*testkit.Harness, *httptest.Server, []ledger.Item) {
	k := testenv.NewKfake(t)
	h := testkit.New(t, k, 4)
	items := testkit.Mixed(600, 11, "console")
	h.Produce(items)
	h.Start(h.Config(ledger.Handler{}))
	h.WaitSettled(items, 1, 60*time.Second)
	users, err := console.ParseUsers("alice:operator:" + operatorPassword + ", victor:viewer:" + viewerPassword)
	if err != nil {
		t.Fatal(err)
	}
	o := ops.New(h.Pool, "kafkapg", h.Group)
	ctx, cancel := context.WithCancel(context.Background())
	var tasks sync.WaitGroup
	t.Cleanup(func() { cancel(); tasks.Wait() })
	c, err := console.New(console.Config{
		Ops: o, Pool: h.Pool, Schema: "kafkapg", Group: h.Group,
		Admin: kadm.NewClient(k.Client(t)), Users: users, Log: slog.New(slog.DiscardHandler),
		Run: func(id int64) {
			tasks.Go(func() {
				if _, err := o.RunTask(ctx, id, "console-test", nil); err != nil && ctx.Err() == nil {
					t.Errorf("task %d: %v", id, err)
				}
			})
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c.Handler())
	t.Cleanup(srv.Close)
	return h, srv, items
}

// TestConsoleNeedsAUser: without credentials, or with wrong ones, every page answers 401 and
// nothing of the group's data.
func TestConsoleNeedsAUser(t *testing.T) {
	h, srv, _ := consoleOf(t)
	for _, path := range []string{"/", "/dead-letters", "/dead-letters/1", "/static/console.css"} {
		for _, auth := range []struct{ name, user, password string }{
			{"none", "", ""},
			{"wrong password", "alice", viewerPassword},
			{"unknown user", "mallory", operatorPassword},
		} {
			req, _ := http.NewRequest("GET", srv.URL+path, nil)
			if auth.user != "" {
				req.SetBasicAuth(auth.user, auth.password)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			var body strings.Builder
			_, _ = fmt.Fprint(&body, readAll(resp))
			if resp.StatusCode != http.StatusUnauthorized {
				t.Errorf("GET %s with %s: %d, want 401", path, auth.name, resp.StatusCode)
			}
			if strings.Contains(body.String(), h.Topic) || strings.Contains(body.String(), h.Group) {
				t.Errorf("GET %s with %s: the answer names the topic or group: %q", path, auth.name, body.String())
			}
		}
	}
}

// TestConsoleRefusesBadFilters: a filter Postgres could not compare (a NUL, invalid UTF-8) or a
// bad id is the user's mistake, answered with 400 naming it, not a server error.
func TestConsoleRefusesBadFilters(t *testing.T) {
	_, srv, _ := consoleOf(t)
	for path, want := range map[string]string{
		"/dead-letters?error=a%00b":   "error: not valid text",
		"/dead-letters?topic=%ff%fe":  "topic: not valid text",
		"/dead-letters?status=gone":   `status "gone"`,
		"/dead-letters/0":             "dead letter id: want a positive number",
		"/tasks/x":                    "task id: want a positive number",
		"/dead-letters?before=banana": "before: want a dead letter id",
	} {
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		req.SetBasicAuth("victor", viewerPassword)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if body := readAll(resp); resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, want) {
			t.Errorf("GET %s: %d %q, want 400 saying %q", path, resp.StatusCode, body, want)
		}
	}
}

func readAll(resp *http.Response) string {
	defer resp.Body.Close()
	var b strings.Builder
	buf := make([]byte, 4096)
	for {
		n, err := resp.Body.Read(buf)
		b.Write(buf[:n])
		if err != nil {
			return b.String()
		}
	}
}

// TestConsoleInABrowser reads the overview of a processor that drained a workload with
// failures, filters the dead letters and opens one, in Chromium, checking each page against the
// database, and saves a screenshot of each (in KAFKAPG_SCREENSHOTS, if set).
func TestConsoleInABrowser(t *testing.T) {
	ctx := browser(t)
	h, srv, _ := consoleOf(t)
	dir := os.Getenv("KAFKAPG_SCREENSHOTS")
	if dir == "" {
		dir = t.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	text := func(sel string) string {
		t.Helper()
		v, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
		must(err)
		return v
	}
	count := func(sel string) int {
		t.Helper()
		n, err := chromedp.Run(ctx, chromedp.Evaluate[int](fmt.Sprintf(`document.querySelectorAll(%q).length`, sel)))
		must(err)
		return n
	}
	// waitFor waits until a JavaScript condition holds: after a click, until the next page is
	// the one shown.
	waitFor := func(cond string) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](cond))
			if err == nil && ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("waited 15s for %s (last error: %v)", cond, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	shot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		must(err)
		must(os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644))
	}
	auth := "Basic " + base64.StdEncoding.EncodeToString([]byte("victor:"+viewerPassword))
	for _, path := range []string{"/", "/dead-letters"} {
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		req.Header.Set("Authorization", auth)
		resp, err := http.DefaultClient.Do(req)
		must(err)
		if body := readAll(resp); resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s as a viewer: %d %s", path, resp.StatusCode, body)
		}
	}
	_, err := chromedp.Call(ctx, network.Enable, network.EnableParams{})
	must(err)
	_, err = chromedp.Call(ctx, network.SetExtraHTTPHeaders, network.SetExtraHTTPHeadersParams{Headers: network.Headers{"Authorization": auth}})
	must(err)

	// The overview: every partition of the topic, at its end (the processor drained it), with
	// the position Postgres holds.
	must(chromedp.Do(ctx,
		chromedp.EmulateViewport(1280, 900),
		chromedp.Navigate(srv.URL+"/"),
		chromedp.WaitVisible(chromedp.CSS("#partitions")),
	))
	if user := text("#user"); user != "victor · viewer" {
		t.Errorf("signed in as %q, want victor · viewer", user)
	}
	partitions, err := chromedp.Run(ctx, chromedp.Evaluate[int](fmt.Sprintf(
		`[...document.querySelectorAll("#partitions tbody tr")].filter(r => r.cells[0].textContent === %q).length`, h.Topic)))
	must(err)
	if partitions != 4 {
		t.Errorf("the overview lists %d partitions of %s, want 4", partitions, h.Topic)
	}
	if lag := text("#total-lag"); lag != "0" {
		t.Errorf("total lag %q after the processor drained the topic, want 0", lag)
	}
	shot("overview")

	// The dead letters, filtered: the count shown is the database's.
	var wantNew int
	must(h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.dead_letters
		WHERE consumer_group = $1 AND status = 'new' AND error_class = 'permanent'`, h.Group).Scan(&wantNew))
	if wantNew == 0 {
		t.Fatal("the workload dead-lettered nothing permanent: the test would prove nothing")
	}
	must(chromedp.Do(ctx,
		chromedp.Navigate(srv.URL+"/dead-letters"),
		chromedp.WaitVisible(chromedp.CSS("form.filter")),
		chromedp.SetValue(chromedp.CSS(`select[name="status"]`), "new"),
		chromedp.SetValue(chromedp.CSS(`input[name="class"]`), "permanent"),
		chromedp.Click(chromedp.CSS(`form.filter button`)),
	))
	waitFor(`location.search.includes("class=permanent") && document.readyState === "complete" && document.querySelector("#matched") !== null`)
	if matched := text("#matched"); !strings.HasPrefix(matched, fmt.Sprintf("%d dead letters match", wantNew)) {
		t.Errorf("the page says %q; the database has %d new permanent dead letters", matched, wantNew)
	}
	if rows := count("#dead-letters tbody tr a"); rows != min(wantNew, 50) {
		t.Errorf("the list shows %d dead letters, want %d", rows, min(wantNew, 50))
	}
	shot("dead-letters")

	// The newest of them: its record and value as the database has them.
	var topic string
	var partition int32
	var offset int64
	must(h.Pool.QueryRow(context.Background(), `SELECT topic, partition, "offset" FROM kafkapg.dead_letters
		WHERE consumer_group = $1 AND status = 'new' AND error_class = 'permanent' ORDER BY id DESC LIMIT 1`, h.Group).Scan(&topic, &partition, &offset))
	must(chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`#dead-letters tbody tr a`))))
	waitFor(`location.pathname.startsWith("/dead-letters/") && document.readyState === "complete" && document.querySelector("#value") !== null`)
	if origin, want := text("#origin"), fmt.Sprintf("%s / %d @ %d", topic, partition, offset); origin != want {
		t.Errorf("the first dead letter's page shows %q, want the newest, %q", origin, want)
	}
	if value := text("#value"); value == "" {
		t.Error("the dead letter's value is not shown")
	}
	shot("dead-letter")

	// A viewer sees no action, and may not act: 403, and no task.
	must(chromedp.Do(ctx, chromedp.Navigate(srv.URL+"/dead-letters")))
	waitFor(`document.readyState === "complete" && document.querySelector("#matched") !== null`)
	if n := count("#replay"); n != 0 {
		t.Error("a viewer is offered to replay")
	}
	form := "action=replay&class=retryable&status=new&reason=not+allowed"
	for _, path := range []string{"/dead-letters/confirm", "/dead-letters/act"} {
		if code := post(t, srv.URL+path, "victor", viewerPassword, form, nil); code != http.StatusForbidden {
			t.Errorf("a viewer's POST %s: %d, want 403", path, code)
		}
	}
	// A request from another site, with an operator's credentials: refused.
	if code := post(t, srv.URL+"/dead-letters/act", "alice", operatorPassword, form, map[string]string{"Sec-Fetch-Site": "cross-site"}); code != http.StatusForbidden {
		t.Errorf("a cross-site POST: %d, want 403", code)
	}
	var tasks int
	must(h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.tasks`).Scan(&tasks))
	if tasks != 0 {
		t.Fatalf("%d tasks exist after refused requests", tasks)
	}

	// An operator replays every new retryable dead letter, with the processor running: the dry
	// run's count is the database's, the task finishes, each record is applied once, and the
	// audit trail names the operator and the reason.
	var wantReplay int
	must(h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.dead_letters
		WHERE consumer_group = $1 AND status = 'new' AND error_class = 'retryable'`, h.Group).Scan(&wantReplay))
	if wantReplay == 0 {
		t.Fatal("the workload dead-lettered nothing retryable: the replay would prove nothing")
	}
	operator := "Basic " + base64.StdEncoding.EncodeToString([]byte("alice:"+operatorPassword))
	_, err = chromedp.Call(ctx, network.SetExtraHTTPHeaders, network.SetExtraHTTPHeadersParams{Headers: network.Headers{"Authorization": operator}})
	must(err)
	must(chromedp.Do(ctx, chromedp.Navigate(srv.URL+"/dead-letters?class=retryable&status=new")))
	waitFor(`document.readyState === "complete" && document.querySelector("#replay") !== null`)
	must(chromedp.Do(ctx, chromedp.Click(chromedp.CSS("#replay"))))
	waitFor(`location.pathname === "/dead-letters/confirm" && document.readyState === "complete" && document.querySelector("#would") !== null`)
	if would := text("#would"); would != fmt.Sprint(wantReplay) {
		t.Errorf("the dry run says %s dead letters would be replayed; the database has %d", would, wantReplay)
	}
	shot("replay-confirm")
	must(chromedp.Do(ctx,
		chromedp.SetValue(chromedp.CSS("#reason"), "downstream fixed, INC-42"),
		chromedp.Click(chromedp.CSS("#confirm")),
	))
	waitFor(`location.pathname.startsWith("/tasks/") && document.querySelector("#task-status") !== null && document.querySelector("#task-status").textContent === "done"`)
	waitFor(fmt.Sprintf(`document.querySelector("#task-outcome") !== null && document.querySelector("#task-outcome").textContent.startsWith("%d applied")`, wantReplay))
	shot("replay-task")
	var replayed, stillNew int
	must(h.Pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE status = 'replayed'), count(*) FILTER (WHERE status = 'new' AND error_class = 'retryable')
		FROM kafkapg.dead_letters WHERE consumer_group = $1`, h.Group).Scan(&replayed, &stillNew))
	if replayed != wantReplay || stillNew != 0 {
		t.Errorf("after the replay: %d replayed and %d new retryable dead letters, want %d and 0", replayed, stillNew, wantReplay)
	}
	var applied, distinct int
	must(h.Pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT e.event_id) FROM ledger_entries e
		JOIN kafkapg.dead_letters d ON d.consumer_group = $1 AND d.status = 'replayed' AND e.event_id = convert_from(d.value, 'UTF8')::jsonb->>'event_id'`, h.Group).Scan(&applied, &distinct))
	if applied != wantReplay || distinct != wantReplay {
		t.Errorf("the replayed events are in the ledger %d times (%d distinct), want each once (%d)", applied, distinct, wantReplay)
	}
	var actor, reason string
	must(h.Pool.QueryRow(context.Background(), `SELECT actor, reason FROM kafkapg.audit WHERE action = 'replay' ORDER BY id DESC LIMIT 1`).Scan(&actor, &reason))
	if actor != "console:alice" || reason != "downstream fixed, INC-42" {
		t.Errorf("audit: %q %q, want console:alice and the reason given", actor, reason)
	}
}

// post sends a form as user and returns the status.
func post(t *testing.T, url, user, password, form string, headers map[string]string) int {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(form))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.SetBasicAuth(user, password)
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// browser starts headless Chromium, or skips the test where there is none, unless
// KAFKAPG_REQUIRE_BROWSER is set (CI), where it fails.
func browser(t *testing.T) context.Context {
	path := os.Getenv("CHROMIUM")
	if path == "" {
		for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
			if p, err := exec.LookPath(name); err == nil {
				path = p
				break
			}
		}
	}
	if path == "" {
		if os.Getenv("KAFKAPG_REQUIRE_BROWSER") != "" {
			t.Fatal("no Chromium (install Debian's chromium, or set CHROMIUM); KAFKAPG_REQUIRE_BROWSER is set")
		}
		t.Skip("no Chromium here (apt-get install chromium); the browser tests need one")
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.NoSandbox, // CI runs as root
		chromedp.Flag("disable-dev-shm-usage", true),
	)
	actx, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancel)
	ctx, cancel2 := chromedp.NewContext(actx)
	t.Cleanup(cancel2)
	// The first call starts the browser, which lives as long as its context: no timeout on it.
	if err := chromedp.Do(ctx, chromedp.Navigate("about:blank")); err != nil {
		t.Fatalf("start %s: %v", path, err)
	}
	return ctx
}

// TestParseUsers: CONSOLE_USERS's entries, and errors that never echo a password.
func TestParseUsers(t *testing.T) {
	users, err := console.ParseUsers(" ann:operator:pass:with:colons , bob:viewer:another-password")
	if err != nil {
		t.Fatal(err)
	}
	if len(users) != 2 || users[0] != (console.User{Name: "ann", Role: console.Operator, Password: "pass:with:colons"}) || users[1].Role != console.Viewer {
		t.Errorf("users = %+v", users)
	}
	for _, tt := range []struct{ in, want, secret string }{
		{"", "no users", ""},
		{"ann:admin:a-long-password", `role "admin": want viewer or operator`, "a-long-password"},
		{"ann:viewer:short", "at least 12 characters", "short"},
		{"ann:viewer:a-long-password,a-secret-value", "entry 2: want name:role:password", "a-secret-value"},
		{"ann:viewer:a-long-password,ann:operator:b-long-password", `user "ann" is listed twice`, "long-password"},
	} {
		_, err := console.ParseUsers(tt.in)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParseUsers(%q) = %v, want an error saying %q", tt.in, err, tt.want)
			continue
		}
		if tt.secret != "" && strings.Contains(err.Error(), tt.secret) {
			t.Errorf("ParseUsers(%q) = %v: the error echoes a password", tt.in, err)
		}
	}
}
