package console_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
)

// TestConsolePositionsInABrowser: the Positions page lists each source partition with its
// position, end, lag, owner and pause; a viewer is offered no change and is refused one; an
// operator pauses a partition and sets a position back, each through a dry run that changes
// nothing, then in the operator's name.
func TestConsolePositionsInABrowser(t *testing.T) {
	b := newBrowser(t)
	k := testenv.NewKfake(t)
	h := testkit.New(t, k, 2)
	ctx := context.Background()
	var recs []*kgo.Record
	for i := range 10 {
		recs = append(recs, &kgo.Record{Topic: h.Topic, Partition: int32(i % 2), Value: []byte("v")})
	}
	b.must(k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner())).ProduceSync(ctx, recs...).FirstErr())
	_, err := h.Pool.Exec(ctx, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset, owner) VALUES ($1, $2, 0, 3, 'pod-a/1'), ($1, $2, 1, 5, 'pod-b/1')`, h.Group, h.Topic)
	b.must(err)
	srv := serve(t, h, k, prometheus.NewRegistry())
	scalar := func(sql string) string {
		t.Helper()
		var s string
		b.must(h.Pool.QueryRow(ctx, sql, h.Group).Scan(&s))
		return s
	}
	rows := func() string {
		t.Helper()
		v, err := chromedp.Run(b.ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#positions tbody tr")].map(r => [...r.cells].slice(1, 6).map(c => c.textContent.trim()).join(" "))`))
		b.must(err)
		return strings.Join(v, " | ")
	}

	b.as("victor", viewerPassword)
	b.open(srv.URL+"/positions", `document.querySelector("#positions") !== null`)
	if got, want := rows(), "0 3 — 5 2 | 1 5 — 5 0"; got != want {
		t.Errorf("positions as a viewer: %q, want %q", got, want)
	}
	if n := b.count("p.note"); n != 0 {
		t.Errorf("notes on the page: %d (a group that never committed to Kafka has nothing to note)", n)
	}
	if n := b.count("button.pause") + b.count("#position-form"); n != 0 {
		t.Errorf("a viewer is offered %d changes", n)
	}
	if code := post(t, srv.URL+"/positions/act", "victor", viewerPassword, "op=pause&topic="+h.Topic+"&partition=0&reason=not+allowed", nil); code != http.StatusForbidden {
		t.Errorf("a viewer's pause: %d, want 403", code)
	}

	b.as("alice", operatorPassword)
	b.open(srv.URL+"/positions", `document.querySelector("button.pause") !== null`)
	b.shot("positions")
	b.must(chromedp.Do(b.ctx, chromedp.Click(chromedp.CSS(`#positions tr[data-partition="0"] button.pause`))))
	b.waitFor(`location.pathname === "/positions/confirm" && document.readyState === "complete" && document.querySelector("#would") !== null`)
	if got := scalar(`SELECT count(*)::text FROM kafkapg.pauses WHERE consumer_group = $1`); got != "0" {
		t.Fatalf("the dry run paused: %s pauses", got)
	}
	b.shot("position-pause-confirm")
	b.must(chromedp.Do(b.ctx, chromedp.SetValue(chromedp.CSS("#reason"), "ledger down, INC-51"), chromedp.Click(chromedp.CSS("#confirm"))))
	b.waitFor(`location.pathname === "/positions/act" && document.readyState === "complete" && document.querySelector("#done") !== null`)
	if got := scalar(`SELECT paused_by || ' ' || partition || ' ' || reason FROM kafkapg.pauses WHERE consumer_group = $1`); got != "console:alice 0 ledger down, INC-51" {
		t.Errorf("the pause: %q", got)
	}
	b.open(srv.URL+"/positions", `document.querySelector("#positions") !== null`)
	if n := b.count(`#positions tr.paused[data-partition="0"] button.resume`); n != 1 {
		t.Errorf("partition 0 is not shown paused with a resume")
	}
	if got := b.text(`#positions tr[data-partition="0"] td.why`); !strings.Contains(got, "by console:alice: ledger down, INC-51") {
		t.Errorf("the pause shown: %q", got)
	}
	b.shot("positions-paused")
	b.open(srv.URL+"/", `document.querySelector("#partitions") !== null`)
	if n := b.count("#partitions a.state-paused"); n != 1 {
		t.Errorf("the overview shows %d paused partitions, want 1", n)
	}
	b.shot("overview-paused")
	b.open(srv.URL+"/positions", `document.querySelector("#position-form") !== null`)

	// Set partition 0 back to offset 1: the dry run says 2 records are applied again.
	b.must(chromedp.Do(b.ctx,
		chromedp.SetValue(chromedp.CSS(`#position-form input[name="partition"]`), "0"),
		chromedp.SetValue(chromedp.CSS(`#position-form input[name="value"]`), "1"),
		chromedp.Click(chromedp.CSS("#position-dry-run")),
	))
	b.waitFor(`location.pathname === "/positions/confirm" && document.readyState === "complete" && document.querySelector("#moves") !== null`)
	if got := b.text(`#moves tr[data-partition="0"] td.reapplied`); got != "2" {
		t.Errorf("the dry run applies %s again, want 2", got)
	}
	if got := b.text(`#moves tr[data-partition="0"] td.paused`); !strings.HasPrefix(got, "paused since ") || !strings.HasSuffix(got, " by console:alice") {
		t.Errorf("the dry run says of partition 0's pause: %q", got)
	}
	b.shot("position-set-confirm")
	if got := scalar(`SELECT next_offset::text FROM kafkapg.offsets WHERE consumer_group = $1 AND partition = 0`); got != "3" {
		t.Fatalf("the dry run moved the position to %s", got)
	}
	b.must(chromedp.Do(b.ctx, chromedp.SetValue(chromedp.CSS("#reason"), "reprocess after the fix of INC-51"), chromedp.Click(chromedp.CSS("#confirm"))))
	b.waitFor(`location.pathname === "/positions/act" && document.readyState === "complete" && document.querySelector("#done") !== null`)
	b.shot("position-set-done")
	if got := scalar(`SELECT next_offset || ' ' || (SELECT actor FROM kafkapg.position_changes WHERE id = o.position_change) FROM kafkapg.offsets o WHERE consumer_group = $1 AND partition = 0`); got != "1 console:alice" {
		t.Errorf("after the change: %q, want position 1 changed by console:alice", got)
	}

	// The whole topic paused (no partition given) shows on each partition, and a row's resume
	// resumes the topic.
	b.open(srv.URL+"/positions", `document.querySelector("#position-form") !== null`)
	b.must(chromedp.Do(b.ctx,
		chromedp.SetValue(chromedp.CSS(`#position-form select[name="op"]`), "pause"),
		chromedp.Click(chromedp.CSS("#position-dry-run")),
	))
	b.waitFor(`location.pathname === "/positions/confirm" && document.readyState === "complete" && document.querySelector("#would") !== null`)
	if got := b.text("#would"); !strings.Contains(got, "every partition: this would pause it") {
		t.Errorf("the topic's pause, dry run: %q", got)
	}
	b.must(chromedp.Do(b.ctx, chromedp.SetValue(chromedp.CSS("#reason"), "all of it, INC-52"), chromedp.Click(chromedp.CSS("#confirm"))))
	b.waitFor(`location.pathname === "/positions/act" && document.readyState === "complete" && document.querySelector("#done") !== null`)
	b.open(srv.URL+"/positions", `document.querySelector("#positions") !== null`)
	if got := b.text(`#positions tr[data-partition="1"] td.why`); !strings.Contains(got, "(the topic)") {
		t.Errorf("partition 1 under the topic's pause: %q", got)
	}
	b.must(chromedp.Do(b.ctx, chromedp.Click(chromedp.CSS(`#positions tr[data-partition="1"] button.resume`))))
	b.waitFor(`location.pathname === "/positions/confirm" && document.readyState === "complete" && document.querySelector("#would") !== null`)
	b.must(chromedp.Do(b.ctx, chromedp.SetValue(chromedp.CSS("#reason"), "back, INC-52"), chromedp.Click(chromedp.CSS("#confirm"))))
	b.waitFor(`location.pathname === "/positions/act" && document.readyState === "complete" && document.querySelector("#done") !== null`)
	if got := scalar(`SELECT count(*)::text FROM kafkapg.pauses WHERE consumer_group = $1`); got != "0" {
		t.Errorf("after resuming the topic from a row: %s pauses left", got)
	}

	// A set of a partition that is not paused says its owner goes on at once.
	b.open(srv.URL+"/positions", `document.querySelector("#position-form") !== null`)
	b.must(chromedp.Do(b.ctx,
		chromedp.SetValue(chromedp.CSS(`#position-form input[name="partition"]`), "1"),
		chromedp.SetValue(chromedp.CSS(`#position-form input[name="value"]`), "2"),
		chromedp.Click(chromedp.CSS("#position-dry-run")),
	))
	b.waitFor(`location.pathname === "/positions/confirm" && document.readyState === "complete" && document.querySelector("#moves") !== null`)
	if got := b.text(`#moves tr[data-partition="1"] td.paused`); got != "no: its owner goes on from the new position at once" {
		t.Errorf("the dry run says of unpaused partition 1: %q", got)
	}
	b.shot("position-set-unpaused-confirm")
}
