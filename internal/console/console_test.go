package console_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"html"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/loginlimit"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

const (
	operatorPassword = "operator-password-1"
	viewerPassword   = "viewer-password-12"
	viewerToken      = "token-of-a-viewer-0123"
	operatorToken    = "token-of-an-operator-4567"
)

// consoleOf starts a processor on a ledger workload with every kind of failure, its records
// prepared concurrently (a Prepare of up to 2 ms, Concurrency 8), waits until it settled (dead
// letters included), and serves the console over its database.
func consoleOf(t *testing.T, opts ...func(*console.Config)) (*testkit.Harness, *httptest.Server, []ledger.Item) {
	k := testenv.NewKfake(t)
	h := testkit.New(t, k, 4)
	if _, err := h.Pool.Exec(context.Background(), ledger.PreparedSchema); err != nil {
		t.Fatal(err)
	}
	// testkit.Mixed's mix, with more flaky events: 4 % of its events fail, about the 5 % the
	// failure-rate alert (which the browser test expects pending) fires above, so whether it
	// held depended on which records the console's first sample had already counted.
	items := ledger.Generate(ledger.GenConfig{Events: 600, Accounts: 40, Seed: 11, Prefix: "console",
		PoisonPerMille: 10, MalformedPerMille: 10, FlakyPerMille: 80})
	cfg := h.Config(ledger.NewPrepared(ledger.Handler{}, 2*time.Millisecond))
	cfg.Concurrency = 8
	r := h.Start(cfg)
	opts = append([]func(*console.Config){func(c *console.Config) { c.Concurrency = map[string]int{h.Topic: 8} }}, opts...)
	srv := serve(t, h, k, r.Reg, opts...) // as in the service: the console samples the processor from its start
	// Produced once the console has its first sample: a rate over the samples counts from the
	// first one (as Prometheus's increase does).
	h.Produce(items)
	h.WaitSettled(items, 1, 60*time.Second)
	return h, srv, items
}

// serve serves the console over h's database, as the service does: the overview samples reg
// (every 100 ms here), tasks run in the background. opts change the configuration.
func serve(t *testing.T, h *testkit.Harness, k *testenv.Kafka, reg prometheus.Gatherer, opts ...func(*console.Config)) *httptest.Server {
	users, err := console.ParseUsers("alice:operator:" + operatorPassword + ", victor:viewer:" + viewerPassword)
	if err != nil {
		t.Fatal(err)
	}
	tokens, err := console.ParseTokens("tina:viewer:" + viewerToken + ",otto:operator:" + operatorToken)
	if err != nil {
		t.Fatal(err)
	}
	o := ops.New(h.Pool, "kafkapg", h.Group)
	ctx, cancel := context.WithCancel(context.Background())
	var tasks sync.WaitGroup
	t.Cleanup(func() { cancel(); tasks.Wait() })
	kc := k.Client(t)
	samples := console.NewSampler(reg, 100*time.Millisecond, time.Hour)
	samples.Sample(time.Now()) // the first sample before serve returns (Run takes the next ones)
	go samples.Run(ctx)
	cfg := console.Config{
		Samples: samples,
		Ops:     o, Admin: kadm.NewClient(kc), Kafka: kc, Users: users, Tokens: tokens, Log: slog.New(slog.DiscardHandler),
		Stuck: retrytopics.StuckScope{Older: time.Hour, Tiers: map[string]int{h.Topic: 1}},
		Run: func(id int64) {
			tasks.Go(func() {
				if _, err := o.RunTask(ctx, id, "console-test", nil); err != nil && ctx.Err() == nil {
					t.Errorf("task %d: %v", id, err)
				}
			})
		},
	}
	for _, opt := range opts {
		opt(&cfg)
	}
	c, err := console.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c.Handler())
	t.Cleanup(srv.Close)
	return srv
}

// TestConsoleNeedsAUser: without credentials, or with wrong ones, every page answers 401 and
// nothing of the group's data.
func TestConsoleNeedsAUser(t *testing.T) {
	h, srv, _ := consoleOf(t)
	failed := 0 // wrong credentials sent: past loginlimit.Burst, the answer is 429 (TestConsoleLimitsFailedSignIns)
	for _, path := range []string{"/", "/dead-letters", "/dead-letters/1", "/retry-path", "/trace", "/static/console.css"} {
		for _, auth := range []struct{ name, user, password, header string }{
			{name: "none"},
			{name: "wrong password", user: "alice", password: viewerPassword},
			{name: "unknown user", user: "mallory", password: operatorPassword},
			{name: "wrong token", header: "Bearer token-of-nobody-000000"},
			{name: "a password as a token", header: "Bearer " + operatorPassword},
			{name: "a token as a password", user: "otto", password: operatorToken},
		} {
			req, _ := http.NewRequest("GET", srv.URL+path, nil)
			if auth.user != "" {
				req.SetBasicAuth(auth.user, auth.password)
			}
			if auth.header != "" {
				req.Header.Set("Authorization", auth.header)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body := readAll(resp)
			want := http.StatusUnauthorized
			if failed >= loginlimit.Burst {
				want = http.StatusTooManyRequests
			}
			if auth.name != "none" {
				failed++
			}
			if resp.StatusCode != want {
				t.Errorf("GET %s with %s: %d, want %d", path, auth.name, resp.StatusCode, want)
			}
			if strings.Contains(body, h.Topic) || strings.Contains(body, h.Group) {
				t.Errorf("GET %s with %s: the answer names the topic or group: %q", path, auth.name, body)
			}
		}
	}
}

// TestConsoleTokens: a token of CONSOLE_TOKENS signs its holder in with its role: a viewer's
// browses and may not act; an operator's acts, in its name.
func TestConsoleTokens(t *testing.T) {
	h, srv, _ := consoleOf(t)
	do := func(method, path, token, form string) (int, string) {
		t.Helper()
		return send(t, method, srv.URL+path, token, form)
	}
	if code, body := do("GET", "/", viewerToken, ""); code != http.StatusOK || !strings.Contains(body, "tina · viewer") {
		t.Errorf("GET / with a viewer's token: %d, signed in as tina? %v", code, strings.Contains(body, "tina · viewer"))
	}
	form := "action=discard&class=permanent&status=new&reason=by+token"
	if code, _ := do("POST", "/dead-letters/act", viewerToken, form); code != http.StatusForbidden {
		t.Errorf("a viewer's token discards: %d, want 403", code)
	}
	if code, _ := do("POST", "/dead-letters/act", operatorToken, form); code != http.StatusSeeOther && code != http.StatusOK {
		t.Errorf("an operator's token discards: %d, want a redirect to the task", code)
	}
	var actor string
	testenv.Eventually(t, 15*time.Second, func() error {
		return h.Pool.QueryRow(context.Background(), `SELECT actor FROM kafkapg.audit WHERE action = 'discard'`).Scan(&actor)
	})
	if actor != "console:otto" {
		t.Errorf("the discard is audited as %q, want console:otto", actor)
	}
}

// send sends a request with a bearer token, form as its body when not empty, and returns the
// status and the body.
func send(t *testing.T, method, url, token, form string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(form))
	req.Header.Set("Authorization", "Bearer "+token)
	if form != "" {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, readAll(resp)
}

// hiddenInputs returns the hidden inputs of the first form in page whose action is action.
func hiddenInputs(t *testing.T, page, action string) url.Values {
	t.Helper()
	i := strings.Index(page, `action="`+action+`"`)
	if i < 0 {
		t.Fatalf("no form to %s in the page", action)
	}
	form := page[i : i+strings.Index(page[i:], "</form>")]
	out := url.Values{}
	for _, m := range regexp.MustCompile(`<input type="hidden" name="([^"]+)" value="([^"]*)">`).FindAllStringSubmatch(form, -1) {
		out.Add(m[1], html.UnescapeString(m[2]))
	}
	return out
}

// TestConsoleCarriesTheFilterToTheAction: the replay and discard forms carry the filter the list
// showed: a time typed as a duration ago, made absolute; ids from the address, to the
// confirmation and on to the task, which acts on those dead letters and no others.
func TestConsoleCarriesTheFilterToTheAction(t *testing.T) {
	h, srv, _ := consoleOf(t)
	ctx := context.Background()

	// The list, as the filter form sends it: every input, most of them empty.
	code, page := send(t, "GET", srv.URL+"/dead-letters?topic=&key=&class=permanent&status=new&since=1h&until=&error=", operatorToken, "")
	if code != http.StatusOK {
		t.Fatalf("GET /dead-letters: %d", code)
	}
	carried := hiddenInputs(t, page, "/dead-letters/confirm")
	if carried.Has("key") || carried.Has("topic") {
		t.Errorf("empty inputs carried as a filter: %v (an empty key would choose the empty key)", carried)
	}
	since, err := time.Parse(time.RFC3339Nano, carried.Get("since"))
	if err != nil || time.Since(since) < time.Hour-time.Minute || time.Since(since) > time.Hour+time.Minute {
		t.Errorf("since=1h carried as %q (%v), want the time an hour before the page", carried.Get("since"), err)
	}
	if carried.Get("class") != "permanent" || carried.Get("status") != "new" {
		t.Errorf("the filter carried is %v", carried)
	}

	// Two dead letters by id: the confirmation's dry run counts two, and carries both ids on.
	rows, err := h.Pool.Query(ctx, `SELECT id FROM kafkapg.dead_letters WHERE consumer_group = $1 AND status = 'new' ORDER BY id LIMIT 2`, h.Group)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(ids) != 2 {
		t.Fatalf("two new dead letters: %v, %v", ids, err)
	}
	var others int
	if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.dead_letters WHERE consumer_group = $1 AND status = 'new'`, h.Group).Scan(&others); err != nil {
		t.Fatal(err)
	}
	others -= 2
	code, page = send(t, "POST", srv.URL+"/dead-letters/confirm", operatorToken, fmt.Sprintf("action=discard&id=%d&id=%d", ids[0], ids[1]))
	if code != http.StatusOK || !strings.Contains(page, `<strong id="would">2</strong>`) {
		t.Fatalf("the confirmation of two ids: %d, would discard two? %v", code, strings.Contains(page, `<strong id="would">2</strong>`))
	}
	carried = hiddenInputs(t, page, "/dead-letters/act")
	if got := carried["id"]; fmt.Sprint(got) != fmt.Sprint([]string{fmt.Sprint(ids[0]), fmt.Sprint(ids[1])}) {
		t.Errorf("the confirmation carries ids %v, want %v", got, ids)
	}
	carried.Set("reason", "two by id")
	if code, _ := send(t, "POST", srv.URL+"/dead-letters/act", operatorToken, carried.Encode()); code != http.StatusOK && code != http.StatusSeeOther {
		t.Fatalf("the discard: %d", code)
	}
	testenv.Eventually(t, 15*time.Second, func() error {
		var discarded, stillNew int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'discarded' AND id = ANY($2)), count(*) FILTER (WHERE status = 'new')
			FROM kafkapg.dead_letters WHERE consumer_group = $1`, h.Group, ids).Scan(&discarded, &stillNew); err != nil {
			return err
		}
		if discarded != 2 || stillNew != others {
			return fmt.Errorf("%d of the two discarded, %d others still new, want 2 and %d", discarded, stillNew, others)
		}
		return nil
	})
	// The same action again finds nothing new: said, and not an error; ids of no dead letter are.
	code, page = send(t, "POST", srv.URL+"/dead-letters/act", operatorToken, carried.Encode())
	if want := "None of the 2 dead letters the filter matches is new: all of them were already replayed or discarded. No task was started."; code != http.StatusOK || !strings.Contains(page, want) {
		t.Errorf("the same discard again: %d, says %q? %v", code, want, strings.Contains(page, want))
	}
	carried["id"] = []string{fmt.Sprint(ids[0])}
	code, page = send(t, "POST", srv.URL+"/dead-letters/act", operatorToken, carried.Encode())
	if want := "The dead letter the filter matches is not new: it was already replayed or discarded. No task was started."; code != http.StatusOK || !strings.Contains(page, want) {
		t.Errorf("the discard of one of them again: %d, says %q? %v", code, want, strings.Contains(page, want))
	}
	carried["id"] = []string{"999999"}
	if code, page = send(t, "POST", srv.URL+"/dead-letters/act", operatorToken, carried.Encode()); code != http.StatusBadRequest || !strings.Contains(page, "no dead letter matches the filter") {
		t.Errorf("a discard of no dead letter: %d; want 400 saying so", code)
	}
}

// TestConsoleRefusesBadFilters: a filter Postgres could not compare (a NUL, invalid UTF-8) or a
// bad id is the user's mistake, answered with 400 naming it, not a server error.
func TestConsoleRefusesBadFilters(t *testing.T) {
	_, srv, _ := consoleOf(t)
	for path, want := range map[string]string{
		"/dead-letters?error=a%00b":     "error: not valid text",
		"/dead-letters?topic=%ff%fe":    "topic: not valid text",
		"/dead-letters?status=gone":     `status "gone"`,
		"/dead-letters/0":               "dead letter id: want a positive number",
		"/tasks/x":                      "task id: want a positive number",
		"/dead-letters?before=banana":   "before: want a dead letter id",
		"/dead-letters?since=yesterday": `since "yesterday": want an RFC 3339 time`,
		"/dead-letters?id=1,x":          `id: "x" is not an id`,
		"/dead-letters?key_hex=zz":      "key_hex: encoding/hex",
		// The trace page's topic too: not Postgres's error behind a 500.
		"/trace?topic=a%00b&partition=0&offset=1": "topic: not valid text",
		"/trace?topic=%ff&key=k":                  "topic: not valid text",
	} {
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		req.SetBasicAuth("victor", viewerPassword)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body := html.UnescapeString(readAll(resp))
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, want) {
			t.Errorf("GET %s: %d %q, want 400 saying %q", path, resp.StatusCode, body, want)
		}
		if strings.Contains(body, "usage: ") {
			t.Errorf("GET %s: the page says %q; a person needs the mistake, not the error's kind", path, body)
		}
	}
}

// TestConsoleHidesValuesFromViewers: with HideValues a viewer sees a dead letter's size, not its
// value nor its headers' values; an operator sees them.
func TestConsoleHidesValuesFromViewers(t *testing.T) {
	h, srv, _ := consoleOf(t, func(c *console.Config) { c.HideValues = true })
	var id int64
	var value []byte
	if err := h.Pool.QueryRow(context.Background(), `SELECT id, value FROM kafkapg.dead_letters
		WHERE consumer_group = $1 AND error_message LIKE '%poison event%' ORDER BY id LIMIT 1`, h.Group).Scan(&id, &value); err != nil {
		t.Fatal(err)
	}
	var ev ledger.Event
	if err := json.Unmarshal(value, &ev); err != nil || ev.EventID == "" {
		t.Fatalf("dead letter %d: value %q is not a ledger event", id, value)
	}
	get := func(user, password string) string {
		req, _ := http.NewRequest("GET", fmt.Sprintf("%s/dead-letters/%d", srv.URL, id), nil)
		req.SetBasicAuth(user, password)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body := readAll(resp)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET dead letter %d as %s: %d %s", id, user, resp.StatusCode, body)
		}
		return body
	}
	// The value's fields (the error message names the event, not its fields).
	inValue := "&#34;amount&#34;: " + fmt.Sprint(ev.Amount)
	if body := get("victor", viewerPassword); strings.Contains(body, inValue) || !strings.Contains(body, "value-hidden") {
		t.Errorf("a viewer's page of dead letter %d shows its value (%s) or does not say it is hidden", id, inValue)
	}
	if body := get("alice", operatorPassword); !strings.Contains(body, inValue) {
		t.Errorf("an operator's page of dead letter %d does not show its value (%s)", id, inValue)
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
	b := newBrowser(t)
	ctx, must, text, count, waitFor, shot := b.ctx, b.must, b.text, b.count, b.waitFor, b.shot
	h, srv, _ := consoleOf(t)
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
	b.as("victor", viewerPassword)

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
	// The chart draws both series from the process's samples, and the alerts the rules would
	// raise: records were dead-lettered during the run (firing at once), and more than 5 % of
	// the tries failed (pending: it fires after 10 minutes).
	if n := count("svg#chart path.throughput"); n == 0 {
		t.Error("the chart draws no throughput")
	}
	alerts, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#alerts tbody tr")].map(r => r.cells[0].textContent + ":" + r.cells[1].textContent.split(" ")[0])`))
	must(err)
	got := strings.Join(alerts, " ")
	for _, want := range []string{"KafkapgDeadLettersGrowing:firing", "KafkapgFailureRateHigh:pending"} {
		if !strings.Contains(got, want) {
			t.Errorf("the alerts shown are %q, want %s among them", got, want)
		}
	}
	if breaker := text("#breaker"); breaker != "closed" {
		t.Errorf("the breaker reads %q, want closed", breaker)
	}
	// Concurrent prepares: none in flight once drained, and the topics that prepare concurrently.
	if n := text("#preparing"); n != "0" {
		t.Errorf("prepares in flight read %q after the processor drained the topic, want 0", n)
	}
	if c := text("#concurrency"); !strings.Contains(c, "CONCURRENCY: "+h.Topic+" 8") {
		t.Errorf("the prepares card says %q, want the topic's CONCURRENCY 8", c)
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
		chromedp.SetValue(chromedp.CSS(`input[name="since"]`), "1h"),
		chromedp.Click(chromedp.CSS(`form.filter button`)),
	))
	waitFor(`location.search.includes("class=permanent") && location.search.includes("since=1h") && document.readyState === "complete" && document.querySelector("#matched") !== null`)
	if matched := text("#matched"); !strings.HasPrefix(matched, fmt.Sprintf("%d dead letters match", wantNew)) {
		t.Errorf("the page says %q; the database has %d new permanent dead letters", matched, wantNew)
	}
	if rows := count("#dead-letters tbody tr a"); rows != min(wantNew, 50) {
		t.Errorf("the list shows %d dead letters, want %d", rows, min(wantNew, 50))
	}
	shot("dead-letters")
	filtered, err := chromedp.Run(ctx, chromedp.Evaluate[string](`location.href`))
	must(err)
	// A window in which nothing was dead-lettered shows nothing.
	b.open(srv.URL+"/dead-letters?status=new&since=2099-01-01T00:00:00Z", `document.querySelector("#matched") !== null`)
	if matched := text("#matched"); !strings.HasPrefix(matched, "0 dead letters match") {
		t.Errorf("dead letters since 2099: the page says %q", matched)
	}
	b.open(filtered, `document.querySelector("#dead-letters tbody tr a") !== null`)

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
	b.as("alice", operatorPassword)
	// The same confirmation, open in a second tab too: confirmed there after the first tab's
	// replay, it repeats the replay.
	again := b.tab()
	again.as("alice", operatorPassword)
	again.open(srv.URL+"/dead-letters?class=retryable&status=new", `document.querySelector("#replay") !== null`)
	again.must(chromedp.Do(again.ctx, chromedp.Click(chromedp.CSS("#replay"))))
	again.waitFor(`location.pathname === "/dead-letters/confirm" && document.readyState === "complete" && document.querySelector("#confirm") !== null`)
	b.open(srv.URL+"/dead-letters?class=retryable&status=new", `document.querySelector("#replay") !== null`)
	b.actOnAll("replay", wantReplay, "downstream fixed, INC-42")
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

	// The replay repeated from the second tab finds nothing new: no task, and a page that says
	// so, how many dead letters the filter matched, and what became of them.
	var tasksBefore int
	must(h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.tasks`).Scan(&tasksBefore))
	again.must(chromedp.Do(again.ctx,
		chromedp.SetValue(chromedp.CSS("#reason"), "downstream fixed, INC-42"),
		chromedp.Click(chromedp.CSS("#confirm")),
	))
	again.waitFor(`location.pathname === "/dead-letters/act" && document.readyState === "complete" && document.querySelector("#nothing") !== null`)
	if title := again.text("h1"); title != "Nothing to replay" {
		t.Errorf("the repeated replay's page is titled %q, want Nothing to replay", title)
	}
	if msg, want := again.text("#nothing"), fmt.Sprintf("None of the %d dead letters the filter matches is new: all of them were already replayed or discarded. No task was started.", wantReplay); !strings.Contains(msg, want) {
		t.Errorf("the repeated replay's page says %q, want %q", msg, want)
	}
	again.shot("replay-nothing-new")
	var tasksAfter int
	must(h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.tasks`).Scan(&tasksAfter))
	if tasksAfter != tasksBefore {
		t.Errorf("%d tasks after the repeated replay, were %d: it started one", tasksAfter, tasksBefore)
	}
	// Its link shows them: the filter's dead letters, whatever their status.
	if again.count("#matching") != 1 {
		t.Fatal("the repeated replay's page has no link to the dead letters the filter matched")
	}
	again.must(chromedp.Do(again.ctx, chromedp.Click(chromedp.CSS("#matching"))))
	again.waitFor(`location.pathname === "/dead-letters" && document.readyState === "complete" && document.querySelector("#matched") !== null`)
	if matched := again.text("#matched"); !strings.HasPrefix(matched, fmt.Sprintf("%d dead letters match", wantReplay)) {
		t.Errorf("the link from the repeated replay's page shows %q, want the %d dead letters replayed", matched, wantReplay)
	}
	if q, err := chromedp.Run(again.ctx, chromedp.Evaluate[string](`location.search`)); err != nil || strings.Contains(q, "status=") || !strings.Contains(q, "class=retryable") {
		t.Errorf("the link from the repeated replay's page goes to %q (%v), want the filter without its status", q, err)
	}

	// A replay started elsewhere (the CLI of a colleague, say), which the operator cancels from
	// its page: the task is cancelled, in the operator's name, and no dead letter moved.
	o := ops.New(h.Pool, "kafkapg", h.Group)
	started, err := o.StartTask(context.Background(), ops.Replay, ops.Filter{Class: "permanent"}, ops.Actor{Name: "cli:bob", Reason: "try again"}, 0)
	must(err)
	b.open(fmt.Sprintf("%s/tasks/%d", srv.URL, started.ID), `document.querySelector("#cancel") !== null`)
	if status := text("#task-status"); !strings.HasPrefix(status, "running") {
		t.Errorf("the started task's status reads %q, want running", status)
	}
	must(chromedp.Do(ctx, chromedp.Click(chromedp.CSS("#cancel"))))
	waitFor(`document.readyState === "complete" && document.querySelector("#task-status") !== null && document.querySelector("#task-status").textContent === "cancelled"`)
	shot("task-cancelled")
	var cancelledBy string
	var stillNewPermanent int
	must(h.Pool.QueryRow(context.Background(), `SELECT cancelled_by, (SELECT count(*) FROM kafkapg.dead_letters
		WHERE consumer_group = $1 AND status = 'new' AND error_class = 'permanent') FROM kafkapg.tasks WHERE id = $2`, h.Group, started.ID).Scan(&cancelledBy, &stillNewPermanent))
	if cancelledBy != "console:alice" || stillNewPermanent != wantNew {
		t.Errorf("after the cancel: cancelled by %q, %d new permanent dead letters; want console:alice and %d", cancelledBy, stillNewPermanent, wantNew)
	}

	// The operator discards every new permanent dead letter: the dry run counts them, the task
	// discards exactly those, and nothing of them reaches the ledger.
	b.open(srv.URL+"/dead-letters?class=permanent&status=new", `document.querySelector("#discard") !== null`)
	b.actOnAll("discard", wantNew, "poison from the old producer, INC-43")
	var discarded, newPermanent int
	must(h.Pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE status = 'discarded'), count(*) FILTER (WHERE status = 'new' AND error_class = 'permanent')
		FROM kafkapg.dead_letters WHERE consumer_group = $1`, h.Group).Scan(&discarded, &newPermanent))
	rows, err := h.Pool.Query(context.Background(), `SELECT value FROM kafkapg.dead_letters WHERE consumer_group = $1 AND status = 'discarded'`, h.Group)
	must(err)
	values, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	must(err)
	var ids []string
	for _, v := range values {
		var ev ledger.Event
		if json.Unmarshal(v, &ev) == nil && ev.EventID != "" {
			ids = append(ids, ev.EventID)
		}
	}
	var ledgerRows int
	must(h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger_entries WHERE event_id = ANY($1)`, ids).Scan(&ledgerRows))
	if discarded != wantNew || newPermanent != 0 || ledgerRows != 0 || len(ids) == 0 {
		t.Errorf("after the discard: %d discarded, %d new permanent, %d of %d events in the ledger; want %d, 0, 0 of some", discarded, newPermanent, ledgerRows, len(ids), wantNew)
	}
	must(h.Pool.QueryRow(context.Background(), `SELECT actor, reason FROM kafkapg.audit WHERE action = 'discard' ORDER BY id DESC LIMIT 1`).Scan(&actor, &reason))
	if actor != "console:alice" || reason != "poison from the old producer, INC-43" {
		t.Errorf("audit of the discard: %q %q, want console:alice and the reason given", actor, reason)
	}
}

// TestConsoleReplayCountsDuplicatesApart: a replay from the console whose records were applied
// for one and skipped as a duplicate for the other (a copy with its idempotency key was applied
// while it was dead) says so on its task's page: "1 applied · 1 duplicate skipped", not
// 2 applied.
func TestConsoleReplayCountsDuplicatesApart(t *testing.T) {
	b := newBrowser(t)
	k := testenv.NewKfake(t)
	h := testkit.New(t, k, 1)
	cfg := h.Config(ledger.Handler{})
	cfg.TopicPolicies = map[string]processor.TopicPolicy{h.Topic: {IdempotencyKey: processor.KeyFromHeader("idem")}}
	cfg.RetryTiers = []time.Duration{} // dead at the first failure
	cfg.LocalAttempts = 1
	r := h.Start(cfg)
	srv := serve(t, h, k, r.Reg)
	rec := func(id, idem string, fail int) *kgo.Record {
		return &kgo.Record{Topic: h.Topic, Key: []byte("a"), Headers: []kgo.RecordHeader{{Key: "idem", Value: []byte(idem)}},
			Value: fmt.Appendf(nil, `{"event_id":%q,"account":"a","amount":1,"seq":1,"fail_attempts":%d}`, id, fail)}
	}
	// f1 and g1 fail their first delivery and are dead; g1's fixed copy (its idempotency key) is
	// applied meanwhile.
	k.Produce(t, rec("f1", "KF", 1), rec("g1", "KG", 1), rec("g1-fixed", "KG", 0))
	h.WaitApplied(1, 20*time.Second)
	testenv.Eventually(t, 20*time.Second, func() error {
		var dead int
		if err := h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.dead_letters WHERE consumer_group = $1 AND status = 'new'`, h.Group).Scan(&dead); err != nil {
			return err
		}
		if dead != 2 {
			return fmt.Errorf("%d dead letters, want f1 and g1", dead)
		}
		return nil
	})
	b.as("alice", operatorPassword)
	b.open(srv.URL+"/dead-letters?status=new", `document.querySelector("#replay") !== null`)
	b.actOnAll("replay", 2, "dependency fixed")
	b.waitFor(`document.querySelector("#task-outcome") !== null && document.querySelector("#task-outcome").textContent.endsWith(" 0 on their way")`)
	if got, want := b.text("#task-outcome"), "1 applied · 1 duplicate skipped · 0 dead again · 0 on their way"; got != want {
		t.Errorf("the replay's outcome reads %q, want %q", got, want)
	}
	b.shot("replay-task-duplicates")
	rows, err := h.Pool.Query(context.Background(), `SELECT event_id FROM ledger_entries ORDER BY applied_order`)
	b.must(err)
	entries, err := pgx.CollectRows(rows, pgx.RowTo[string])
	b.must(err)
	if fmt.Sprint(entries) != "[g1-fixed f1]" {
		t.Errorf("applied %q, want g1-fixed, then the replayed f1 (g1 skipped)", entries)
	}
}

// browserT is a Chromium tab and the checks the browser tests make with it.
type browserT struct {
	t   *testing.T
	ctx context.Context
	dir string // where screenshots go
}

// newBrowser starts Chromium (see browser) with a tab 1280 pixels wide.
func newBrowser(t *testing.T) *browserT {
	b := &browserT{t: t, ctx: browser(t), dir: os.Getenv("KAFKAPG_SCREENSHOTS")}
	if b.dir == "" {
		b.dir = t.TempDir()
	}
	b.must(os.MkdirAll(b.dir, 0o755))
	_, err := chromedp.Call(b.ctx, network.Enable, network.EnableParams{})
	b.must(err)
	b.must(chromedp.Do(b.ctx, chromedp.EmulateViewport(1280, 900)))
	return b
}

// tab opens another tab of b's browser, signed in as no one.
func (b *browserT) tab() *browserT {
	ctx, cancel := chromedp.NewContext(b.ctx)
	b.t.Cleanup(cancel)
	t := &browserT{t: b.t, ctx: ctx, dir: b.dir}
	_, err := chromedp.Call(ctx, network.Enable, network.EnableParams{})
	t.must(err)
	t.must(chromedp.Do(ctx, chromedp.EmulateViewport(1280, 900)))
	return t
}

func (b *browserT) must(err error) {
	b.t.Helper()
	if err != nil {
		b.t.Fatal(err)
	}
}

// as signs the tab in as a user (every request carries the user's basic credentials).
func (b *browserT) as(user, password string) {
	b.t.Helper()
	auth := "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
	_, err := chromedp.Call(b.ctx, network.SetExtraHTTPHeaders, network.SetExtraHTTPHeadersParams{Headers: network.Headers{"Authorization": auth}})
	b.must(err)
}

// open navigates to url and waits until the page has loaded and cond (JavaScript) holds.
func (b *browserT) open(url, cond string) {
	b.t.Helper()
	b.must(chromedp.Do(b.ctx, chromedp.Navigate(url)))
	b.waitFor(`document.readyState === "complete" && (` + cond + `)`)
}

// text returns the text of the first element sel matches.
func (b *browserT) text(sel string) string {
	b.t.Helper()
	v, err := chromedp.Run(b.ctx, chromedp.Text(chromedp.CSS(sel)))
	b.must(err)
	return v
}

// count returns how many elements sel matches.
func (b *browserT) count(sel string) int {
	b.t.Helper()
	n, err := chromedp.Run(b.ctx, chromedp.Evaluate[int](fmt.Sprintf(`document.querySelectorAll(%q).length`, sel)))
	b.must(err)
	return n
}

// waitFor waits until a JavaScript condition holds: after a click, until the next page is the
// one shown.
func (b *browserT) waitFor(cond string) {
	b.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		ok, err := chromedp.Run(b.ctx, chromedp.Evaluate[bool](cond))
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("waited 15s for %s (last error: %v)", cond, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// shot saves a screenshot of the whole page as name.png.
func (b *browserT) shot(name string) {
	b.t.Helper()
	png, err := chromedp.Run(b.ctx, chromedp.FullScreenshot(100))
	b.must(err)
	b.must(os.WriteFile(filepath.Join(b.dir, name+".png"), png, 0o644))
}

// actOnAll replays or discards (action) all the dead letters the filter shown matches: it
// checks that the dry run counts want of them, gives the reason, confirms, and waits until the
// task is done. It saves screenshots of the confirmation and of the task.
func (b *browserT) actOnAll(action string, want int, reason string) {
	b.t.Helper()
	b.must(chromedp.Do(b.ctx, chromedp.Click(chromedp.CSS("#"+action))))
	b.waitFor(`location.pathname === "/dead-letters/confirm" && document.readyState === "complete" && document.querySelector("#would") !== null`)
	if would := b.text("#would"); would != fmt.Sprint(want) {
		b.t.Errorf("the dry run says %s dead letters would be %sed; the database has %d", would, strings.TrimSuffix(action, "e"), want)
	}
	b.shot(action + "-confirm")
	b.must(chromedp.Do(b.ctx,
		chromedp.SetValue(chromedp.CSS("#reason"), reason),
		chromedp.Click(chromedp.CSS("#confirm")),
	))
	b.waitFor(`location.pathname.startsWith("/tasks/") && document.querySelector("#task-status") !== null && document.querySelector("#task-status").textContent === "done"`)
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
	if _, err := console.ParseTokens("bot:viewer:fifteen-chars-n"); err == nil || !strings.Contains(err.Error(), `token "bot": the token must be at least 16 characters`) || strings.Contains(err.Error(), "fifteen") {
		t.Errorf("a short token: %v", err)
	}
	users, err := console.ParseUsers(" ann:operator:pass:with:colons , bob:viewer:another-password")
	if err != nil {
		t.Fatal(err)
	}
	if len(users) != 2 || users[0] != (console.User{Name: "ann", Role: console.Operator, Password: "pass:with:colons"}) || users[1].Role != console.Viewer {
		t.Errorf("users = %+v", users)
	}
	for _, tt := range []struct{ in, want, secret string }{
		{"", "no users", ""},
		{"ann:admin:a-long-password", `entry 1: its second field, the role, must be viewer or operator`, "a-long-password"},
		// In the wrong order, the secret is where the role should be.
		{"bob:viewer:a-long-password, ann:MySecretPassw0rd!:viewer", `entry 2: its second field, the role, must be viewer or operator`, "MySecretPassw0rd"},
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

// TestConsoleRetryPathInABrowser: with ON_DEAD_LETTER=block and an hour-long retry tier, the
// retry path page shows the tier's backlog and the held keys with the record each waits behind;
// an operator releases the blocked key, after a dry run, and its held records are applied once
// each, in order; a key whose record is in a tier is refused; the trace page draws a record's
// way. Each step is checked in the database.
func TestConsoleRetryPathInABrowser(t *testing.T) {
	b := newBrowser(t)
	k := testenv.NewKfake(t)
	h := testkit.New(t, k, 1)
	cfg := h.Config(ledger.Handler{})
	cfg.RetryTiers = []time.Duration{time.Hour}
	cfg.LocalAttempts = 1
	cfg.OnDeadLetter = processor.OnDeadLetterBlock
	k.CreateTopicNamed(t, h.DLQ(), 1)
	h.Produce([]ledger.Item{
		testkit.Event("a1", "A", 1, 0, false),
		testkit.Event("a2", "A", 2, 0, true),  // poison: dead-lettered, blocks A
		testkit.Event("b1", "B", 1, 9, false), // fails: to the hour-long tier, B held behind it
		testkit.Event("a3", "A", 3, 0, false),
		testkit.Event("b2", "B", 2, 0, false),
		testkit.Event("a4", "A", 4, 0, false),
		testkit.Event("c1", "C", 1, 0, false),
	})
	r := h.Start(cfg)
	applied := func() string {
		t.Helper()
		rows, err := h.Pool.Query(context.Background(), `SELECT event_id FROM ledger_entries ORDER BY applied_order`)
		b.must(err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		b.must(err)
		return strings.Join(ids, " ")
	}
	held := func() string {
		t.Helper()
		var s string
		b.must(h.Pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(convert_from(key, 'UTF8') || ':' || state, ' ' ORDER BY key), '')
			FROM kafkapg.held_keys WHERE consumer_group = $1`, h.Group).Scan(&s))
		return s
	}
	testenv.Eventually(t, 30*time.Second, func() error {
		if got, want := applied()+" | "+held(), "a1 c1 | A:blocked B:retrying"; got != want {
			return fmt.Errorf("applied | held keys: %q, want %q", got, want)
		}
		var outbox int
		b.must(h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM kafkapg.outbox`).Scan(&outbox))
		if outbox != 0 {
			return fmt.Errorf("%d records wait in the outbox", outbox)
		}
		return nil
	})
	srv := serve(t, h, k, r.Reg)

	// A viewer sees the tier's backlog and both keys, the longest held first, and cannot release.
	b.as("victor", viewerPassword)
	b.open(srv.URL+"/retry-path", `document.querySelector("#keys") !== null`)
	if n := b.text("#tiers tbody tr td:nth-child(2)"); n != "1" {
		t.Errorf("tier 1 shows %q records waiting, want 1", n)
	}
	keys, err := chromedp.Run(b.ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#keys tbody tr")].map(r => r.dataset.key + ":" + r.cells[2].textContent + ":" + r.cells[3].textContent)`))
	b.must(err)
	if got := strings.Join(keys, " "); got != "A:blocked:2 B:retrying:1" {
		t.Errorf("held keys on the page: %q, want A:blocked:2 B:retrying:1", got)
	}
	if n := b.count("button.release"); n != 0 {
		t.Errorf("a viewer is offered %d releases", n)
	}
	form := fmt.Sprintf("topic=%s&partition=0&key_hex=%x&reason=not+allowed", h.Topic, "A")
	if code := post(t, srv.URL+"/keys/release", "victor", viewerPassword, form, nil); code != http.StatusForbidden {
		t.Errorf("a viewer's release: %d, want 403", code)
	}
	if code := post(t, srv.URL+"/keys/release", "alice", operatorPassword, fmt.Sprintf("topic=%s&partition=0&key_hex=%x&reason=too+early", h.Topic, "B"), nil); code != http.StatusBadRequest {
		t.Errorf("releasing a key whose record is in a tier (not stuck): %d, want 400", code)
	}
	if got := held(); got != "A:blocked B:retrying" {
		t.Fatalf("after refused releases the held keys are %q", got)
	}

	// The operator releases A: the dry run says what it will do, then A's held records are
	// applied, in order, once each; the audit trail names the operator.
	b.as("alice", operatorPassword)
	b.open(srv.URL+"/retry-path", `document.querySelector("button.release") !== null`)
	b.shot("retry-path")
	if n := b.count(`#keys tr[data-key="B"] button.release`); n != 0 {
		t.Error("the operator is offered to release B, whose record is in a tier and comes back by itself")
	}
	b.must(chromedp.Do(b.ctx, chromedp.Click(chromedp.CSS(`#keys tr[data-key="A"] button.release`))))
	b.waitFor(`location.pathname === "/keys/confirm" && document.readyState === "complete" && document.querySelector("#would-release") !== null`)
	if n := b.text("#release-held"); n != "2" {
		t.Errorf("the dry run says %s held records, want 2", n)
	}
	if got := held(); got != "A:blocked B:retrying" {
		t.Fatalf("the dry run changed the held keys: %q", got)
	}
	b.shot("release-confirm")
	b.must(chromedp.Do(b.ctx,
		chromedp.SetValue(chromedp.CSS("#reason"), "a2 was a test event, INC-44"),
		chromedp.Click(chromedp.CSS("#confirm")),
	))
	b.waitFor(`location.pathname === "/keys/release" && document.readyState === "complete" && document.querySelector("#released") !== null`)
	testenv.Eventually(t, 30*time.Second, func() error {
		if got, want := applied()+" | "+held(), "a1 c1 a3 a4 | B:retrying"; got != want {
			return fmt.Errorf("applied | held keys: %q, want %q", got, want)
		}
		return nil
	})
	var actor, reason string
	b.must(h.Pool.QueryRow(context.Background(), `SELECT actor, reason FROM kafkapg.audit WHERE action = 'release_key' ORDER BY id DESC LIMIT 1`).Scan(&actor, &reason))
	if actor != "console:alice" || reason != "a2 was a test event, INC-44" {
		t.Errorf("audit of the release: %q %q, want console:alice and the reason given", actor, reason)
	}

	// The trace of key A: its four records, newest first; a2's path ends dead, a3's applied
	// after its key's release; b1 (by offset) waits in tier 1.
	b.open(srv.URL+"/trace", `document.querySelector("#trace-form") !== null`)
	b.must(chromedp.Do(b.ctx,
		chromedp.SetValue(chromedp.CSS(`#trace-form input[name="topic"]`), h.Topic),
		chromedp.SetValue(chromedp.CSS(`#trace-form input[name="key"]`), "A"),
		chromedp.Click(chromedp.CSS(`#trace-form button`)),
	))
	b.waitFor(`location.search.includes("key=A") && document.readyState === "complete" && document.querySelectorAll("section.trace").length > 0`)
	paths, err := chromedp.Run(b.ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("section.trace")].map(s => s.dataset.offset + ":" + [...s.querySelectorAll("ol.path li")].map(l => l.textContent).join(">"))`))
	b.must(err)
	// a3 and a4 waited behind a2 until its release: their paths keep the wait, with how long it
	// lasted ("held 1.2s"), and their timelines behind which record.
	want := "5:produced>held …>applied 3:produced>held …>applied 1:produced>failed>dead>released>dead 0:produced>applied"
	if got := regexp.MustCompile(`held [0-9.]+(ms|s)`).ReplaceAllString(strings.Join(paths, " "), "held …"); got != want {
		t.Errorf("the trace of key A draws %q, want %q", got, want)
	}
	if got := b.text(`section.trace[data-offset="3"] ol.timeline`); !strings.Contains(got, "held behind the record at offset 1 of its key for ") {
		t.Errorf("a3's timeline says %q, want its wait behind a2 (offset 1)", got)
	}
	b.shot("trace-key")
	b.open(fmt.Sprintf("%s/trace?topic=%s&partition=0&offset=2", srv.URL, h.Topic), `document.querySelectorAll("section.trace").length === 1`)
	if got := b.text("section.trace ol.path"); !strings.Contains(got, "tier 1") || !strings.Contains(got, "in a tier") {
		t.Errorf("the trace of b1 draws %q, want it sent to tier 1 and waiting there", got)
	}
	b.shot("trace")

	// A copy skipped by its idempotency key, as the processor keeps it (a1's row, as if a1 had
	// been a copy of an earlier record at offset 4 of partition 3): its path ends skipped, not
	// applied, and its timeline names the key and the copy applied before (issue 42).
	if _, err := h.Pool.Exec(context.Background(), `INSERT INTO kafkapg.skipped_duplicates
		(consumer_group, topic, partition, "offset", skipped_at, idempotency_key, key_hash, first_partition, first_offset)
		VALUES ($1, $2, 0, 0, now(), 'pay-17', '\x0123456789abcdef01', 3, 4)`, h.Group, h.Topic); err != nil {
		t.Fatal(err)
	}
	b.open(fmt.Sprintf("%s/trace?topic=%s&partition=0&offset=0", srv.URL, h.Topic), `document.querySelectorAll("section.trace").length === 1`)
	path, err := chromedp.Run(b.ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("section.trace ol.path li")].map(l => l.className + ":" + l.textContent)`))
	b.must(err)
	if got, want := strings.Join(path, " > "), "kind-produced:produced > now state-skipped_duplicate:skipped (duplicate)"; got != want {
		t.Errorf("the path of a skipped copy is %q, want %q", got, want)
	}
	if got := b.text("section.trace ol.timeline"); !strings.Contains(got, `skipped as a duplicate by its idempotency key "pay-17"`) ||
		!strings.Contains(got, fmt.Sprintf("the copy at %s[3]@4 was applied before it", h.Topic)) {
		t.Errorf("the timeline of a skipped copy says %q, want its key and the copy applied before", got)
	}
	b.shot("trace-skipped")
}

// TestConsoleLinksKeepTheFilter: the dead letters' "Older →" link and the confirmation's Cancel
// link carry the filter (they rendered it with its '=' and '&' escaped, and led to page 1 of
// everything).
func TestConsoleLinksKeepTheFilter(t *testing.T) {
	h, srv, _ := consoleOf(t)
	if _, err := h.Pool.Exec(context.Background(), `INSERT INTO kafkapg.dead_letters
		(consumer_group, topic, partition, "offset", key, value, "timestamp", error_class, error_message, attempts, first_failed_at)
		SELECT $1, $2, 0, 100000 + i, convert_to('m' || i, 'UTF8'), 'v', 0, 'manual', 'by hand', 1, now() FROM generate_series(1, 60) AS i`,
		h.Group, h.Topic); err != nil {
		t.Fatal(err)
	}
	get := func(path string) string {
		t.Helper()
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		req.SetBasicAuth("alice", operatorPassword)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d", path, resp.StatusCode)
		}
		return readAll(resp)
	}
	href := func(page, id string) string {
		t.Helper()
		m := regexp.MustCompile(`id="` + id + `" href="([^"]*)"`).FindStringSubmatch(page)
		if m == nil {
			t.Fatalf("no link #%s on the page", id)
		}
		return html.UnescapeString(m[1])
	}
	older := href(get("/dead-letters?class=manual"), "older")
	if !strings.Contains(older, "class=manual") || !strings.Contains(older, "before=") {
		t.Errorf("Older → links to %s; want the filter (class=manual) and the page (before=)", older)
	}
	if page := get(older); strings.Count(page, ">by hand<") != 10 || strings.Contains(page, "poison") {
		t.Errorf("the older page shows %d of the 10 remaining manual dead letters (or others)", strings.Count(page, ">by hand<"))
	}
	req, _ := http.NewRequest("POST", srv.URL+"/dead-letters/confirm", strings.NewReader("action=discard&class=manual"))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.SetBasicAuth("alice", operatorPassword)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if back := href(readAll(resp), "back"); !strings.Contains(back, "class=manual") {
		t.Errorf("Cancel links to %s; want the filter (class=manual)", back)
	}
}

// TestRetryPathPageIsBoundedInBytes: the retry path page put each held key whole into its release
// form (100 keys of 900 KB: 180 MB of hex in one page); it shows a key's first bytes and names it
// by its SHA-256, which the release's confirmation takes.
func TestRetryPathPageIsBoundedInBytes(t *testing.T) {
	h, srv, _ := consoleOf(t)
	ctx := context.Background()
	if _, err := h.Pool.Exec(ctx, `INSERT INTO kafkapg.held_keys (consumer_group, topic, partition, key, state, head_offset, held_since, updated_at)
		SELECT $1, $2, 0, convert_to(i || repeat('k', 900000), 'UTF8'), 'retrying', 100000 + i, now() - interval '2 hours', now() - interval '2 hours'
		FROM generate_series(1, 5) AS i`, h.Group, h.Topic); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest("GET", srv.URL+"/retry-path", nil)
	req.SetBasicAuth("alice", operatorPassword)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	page := readAll(resp)
	if resp.StatusCode != http.StatusOK || len(page) > 200_000 {
		t.Fatalf("GET /retry-path: %d, %d bytes with five 900 KB keys; want 200 and well under 200 KB", resp.StatusCode, len(page))
	}
	m := regexp.MustCompile(`name="key_sha256" value="([0-9a-f]{64})"`).FindStringSubmatch(page)
	if m == nil || strings.Contains(page, `name="key_hex"`) {
		t.Fatalf("the release forms do not name keys by their SHA-256")
	}
	form := url.Values{"topic": {h.Topic}, "partition": {"0"}, "key_sha256": {m[1]}}
	req, _ = http.NewRequest("POST", srv.URL+"/keys/confirm", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.SetBasicAuth("alice", operatorPassword)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(resp)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `name="key_sha256" value="`+m[1]+`"`) || len(body) > 200_000 {
		t.Errorf("POST /keys/confirm by SHA-256: %d, %d bytes; want the confirmation, carrying the SHA-256", resp.StatusCode, len(body))
	}

	// Another site's page cannot make a signed-in browser load the console's pages (an image,
	// a fetch); a link followed to them opens them.
	for _, c := range []struct {
		site, mode string
		want       int
	}{{"cross-site", "no-cors", http.StatusForbidden}, {"cross-site", "cors", http.StatusForbidden}, {"cross-site", "navigate", http.StatusOK}, {"same-origin", "cors", http.StatusOK}} {
		req, _ := http.NewRequest("GET", srv.URL+"/dead-letters", nil)
		req.SetBasicAuth("alice", operatorPassword)
		req.Header.Set("Sec-Fetch-Site", c.site)
		req.Header.Set("Sec-Fetch-Mode", c.mode)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("GET /dead-letters, Sec-Fetch-Site %s, Sec-Fetch-Mode %s: %d, want %d", c.site, c.mode, resp.StatusCode, c.want)
		}
	}
}

// TestConsoleTraceShowsTheTraceID: a dead letter whose record carried a trace context shows its
// trace id on the trace page, linked to the trace viewer of TRACE_URL.
func TestConsoleTraceShowsTheTraceID(t *testing.T) {
	h, srv, _ := consoleOf(t, func(c *console.Config) { c.TraceURL = "https://traces.example/trace/{trace_id}?from=kafkapg" })
	const id = "4bf92f3577b34da6a3ce929d0e0e4736"
	if _, err := h.Pool.Exec(context.Background(), `INSERT INTO kafkapg.dead_letters
		(consumer_group, topic, partition, "offset", key, value, header_keys, header_values, "timestamp", error_class, error_message, attempts, first_failed_at)
		VALUES ($1, $2, 0, 100000, 'k', 'v', ARRAY['traceparent'::bytea], ARRAY[$3::bytea], 0, 'permanent', 'by hand', 1, now())`,
		h.Group, h.Topic, []byte("00-"+id+"-00f067aa0ba902b7-01")); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest("GET", fmt.Sprintf("%s/trace?topic=%s&partition=0&offset=100000", srv.URL, h.Topic), nil)
	req.SetBasicAuth("victor", viewerPassword)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	page := readAll(resp)
	if !strings.Contains(page, `id="trace-id">`+id+`<`) || !strings.Contains(page, `href="https://traces.example/trace/`+id+`?from=kafkapg"`) {
		t.Errorf("the trace page does not show trace %s with its link:\n%s", id, page)
	}
}
