package console_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"

	"github.com/kafkapg/kafkapg/internal/ops"
)

// hostile is text from outside as an attacker writes it: a bidirectional override that shows
// "txt.exe" for "exe.txt", a terminal's escape sequence, a bell, a C1 CSI.
const hostile = "invoice\u202etxt.exe \x1b[31mred\x07 \u009b2J end\u2066"

// TestConsoleShowsControlsVisibly: the controls in an error message, an actor and a reason reach
// no page raw (html/template escapes markup, not these): each is shown as a visible escape.
func TestConsoleShowsControlsVisibly(t *testing.T) {
	h, srv, _ := consoleOf(t)
	ctx := context.Background()
	var id int64
	if err := h.Pool.QueryRow(ctx, `UPDATE kafkapg.dead_letters SET error_message = $2
		WHERE id = (SELECT min(id) FROM kafkapg.dead_letters WHERE consumer_group = $1) RETURNING id`, h.Group, "poison: "+hostile).Scan(&id); err != nil {
		t.Fatal(err)
	}
	o := ops.New(h.Pool, "kafkapg", h.Group)
	task, err := o.StartTask(ctx, ops.Discard, ops.Filter{Class: "permanent"}, ops.Actor{Name: "cli:" + hostile, Reason: "because " + hostile}, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{
		fmt.Sprintf("/dead-letters/%d", id),
		"/dead-letters?error=" + url.QueryEscape("invoice\u202etxt"),
		fmt.Sprintf("/tasks/%d", task.ID),
		"/",
	} {
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		req.SetBasicAuth("alice", operatorPassword)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body := readAll(resp)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d %s", path, resp.StatusCode, body)
		}
		for _, c := range []string{"\u202e", "\x1b", "\x07", "\u009b", "\u2066"} {
			if strings.Contains(body, c) {
				t.Errorf("GET %s: the page has %+q raw", path, c)
			}
		}
		if path != "/" && !strings.Contains(body, `invoice\u202etxt.exe \x1b[31mred\x07 \x9b2J end\u2066`) {
			t.Errorf("GET %s: the page does not show the controls as escapes", path)
		}
		// A filter's controls go back to the server as they came: as character references in
		// the form's fields, which the browser decodes.
		if strings.HasPrefix(path, "/dead-letters?") && !strings.Contains(body, `value="invoice&#x202e;txt"`) {
			t.Errorf("GET %s: the filter's field does not hold it as a character reference:\n%s", path, body)
		}
	}
}

// TestConsoleShowsControlsVisiblyInABrowser: in Chromium, the hostile error reads as its escapes
// (no override reorders it), and the filter's field holds the control itself, decoded from its
// character reference, so the form sends back what was asked for.
func TestConsoleShowsControlsVisiblyInABrowser(t *testing.T) {
	h, srv, _ := consoleOf(t)
	var id int64
	if err := h.Pool.QueryRow(context.Background(), `UPDATE kafkapg.dead_letters SET error_message = $2
		WHERE id = (SELECT min(id) FROM kafkapg.dead_letters WHERE consumer_group = $1) RETURNING id`, h.Group, "poison: "+hostile).Scan(&id); err != nil {
		t.Fatal(err)
	}
	b := newBrowser(t)
	b.as("alice", operatorPassword)
	b.open(fmt.Sprintf("%s/dead-letters/%d", srv.URL, id), `document.body.innerText.includes("poison")`)
	b.shot("hostile-text")
	text := b.text("body")
	if !strings.Contains(text, `invoice\u202etxt.exe \x1b[31mred\x07 \x9b2J end\u2066`) {
		t.Errorf("the page does not read as the escapes:\n%s", text)
	}
	for _, c := range []string{"\u202e", "\x1b", "\x07", "\u009b", "\u2066"} {
		if strings.Contains(text, c) {
			t.Errorf("the page shows %+q raw", c)
		}
	}
	b.open(srv.URL+"/dead-letters?error="+url.QueryEscape("invoice\u202etxt"), `document.querySelector('input[name="error"]') !== null`)
	v, err := chromedp.Run(b.ctx, chromedp.Evaluate[string](`document.querySelector('input[name="error"]').value`))
	if err != nil {
		t.Fatal(err)
	}
	if v != "invoice\u202etxt" {
		t.Errorf("the filter's field holds %+q, want the filter as asked, %+q", v, "invoice\u202etxt")
	}
}
