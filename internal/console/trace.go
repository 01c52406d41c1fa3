package console

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/internal/tracing"
)

type traceData struct {
	Form    map[string]string
	Asked   bool // a search was made
	Records []traced
	Notes   []string
	Error   string
}

// traced is a record's trace and its path: the kinds of its steps, then where it is now.
type traced struct {
	ops.RecordTrace
	Path     []pathStep
	TraceURL string // its trace in the trace viewer (Config.TraceURL); "" if none
}

type pathStep struct {
	Label string
	Class string // kind-<step kind>, or now state-<state> for the last
}

// pathOf draws a record's path: a label per step, then where it is now (unless its last step
// says so already).
func pathOf(rt ops.RecordTrace) []pathStep {
	var path []pathStep
	for _, s := range rt.Steps {
		path = append(path, pathStep{Label: stepLabel(s), Class: "kind-" + s.Kind})
	}
	now := pathStep{Label: stateLabel[rt.State], Class: "now state-" + rt.State}
	if n := len(path); n > 0 && path[n-1].Label == now.Label {
		path[n-1] = now
	} else {
		path = append(path, now)
	}
	return path
}

// trace finds records by topic, partition and offset, or by key, and draws each one's way
// through kafkapg as a timeline (ops.Trace: Postgres, and Kafka for the records Postgres does
// not keep).
func (c *Console) trace(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	d := traceData{Form: map[string]string{"topic": q.Get("topic"), "partition": q.Get("partition"), "offset": q.Get("offset"), "key": q.Get("key")}}
	if q.Get("topic") == "" {
		c.render(w, r, "trace", "Trace a record", d)
		return
	}
	d.Asked = true
	tq, err := traceQueryOf(d.Form)
	tq.Concurrency = c.cfg.Concurrency[tq.Topic]
	var res ops.TraceResult
	if err == nil {
		res, err = c.cfg.Ops.Trace(r.Context(), tq, c.cfg.Kafka)
	}
	if errors.Is(err, ops.ErrBusy) {
		// As many traces as the process runs at once are running (ops.MaxTraces): refused, not
		// queued; said on the page, with the form to try again.
		d.Error = strings.TrimPrefix(err.Error(), ops.ErrBusy.Error()+": ")
		for k, v := range d.Form {
			d.Form[k] = safetext.Text(v, 1024)
		}
		w.Header().Set("Retry-After", "5")
		c.renderStatus(w, r, http.StatusTooManyRequests, "trace", "Trace a record", d)
		return
	}
	if errors.Is(err, ops.ErrUsage) {
		// The person's mistake (a topic not the group's among them): said on the page, with the
		// form to correct it.
		d.Error = strings.TrimPrefix(err.Error(), ops.ErrUsage.Error()+": ")
		// The form shows what was asked, as text (a NUL or a byte that is not UTF-8 escaped).
		for k, v := range d.Form {
			d.Form[k] = safetext.Text(v, 1024)
		}
		c.renderStatus(w, r, http.StatusBadRequest, "trace", "Trace a record", d)
		return
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	for _, rt := range res.Records {
		d.Records = append(d.Records, traced{RecordTrace: rt, Path: pathOf(rt), TraceURL: tracing.ViewerURL(c.cfg.TraceURL, rt.TraceID)})
	}
	d.Notes = res.Notes
	if c.cfg.Kafka == nil {
		d.Notes = append(d.Notes, "This console does not read Kafka: records that Postgres does not keep are not found by key, and the broker's retention is not checked.")
	}
	c.render(w, r, "trace", "Trace a record", d)
}

// traceQueryOf reads a trace search: a key, or a partition and an offset.
func traceQueryOf(f map[string]string) (ops.TraceQuery, error) {
	tq := ops.TraceQuery{Topic: f["topic"]}
	if f["offset"] == "" && f["key"] != "" {
		tq.Key = []byte(f["key"])
		return tq, nil
	}
	p, err := strconv.ParseInt(f["partition"], 10, 32)
	if err != nil {
		return tq, fmt.Errorf("%w: partition %q: want a partition number (or search by key)", ops.ErrUsage, f["partition"])
	}
	o, err := strconv.ParseInt(f["offset"], 10, 64)
	if err != nil {
		return tq, fmt.Errorf("%w: offset %q: want an offset (or search by key)", ops.ErrUsage, f["offset"])
	}
	tq.Partition, tq.Offset = int32(p), o
	return tq, nil
}

// stepLabel is a step's name on a record's path.
func stepLabel(s ops.TraceStep) string {
	switch s.Kind {
	case ops.StepTier:
		return fmt.Sprintf("tier %d", s.Tier)
	case ops.StepDeadLettered:
		return "dead"
	case ops.StepReplayQueued:
		return "replay"
	case ops.StepOutbox:
		return "outbox"
	case ops.StepSkippedDuplicate:
		return stateLabel[ops.TraceSkippedDuplicate]
	case ops.StepHeld:
		if s.Until != nil {
			// How long it waited behind its key, once it moved on (the timeline says behind which
			// record).
			return "held " + waitLabel(s.Until.Sub(s.At))
		}
	}
	return s.Kind
}

// waitLabel says how long a wait lasted, shortly: to the millisecond under a second, to the
// tenth of a second under a minute, to the second above.
func waitLabel(d time.Duration) string {
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}

// stateLabel is where a record is now, on its path.
var stateLabel = map[string]string{
	ops.TraceNotConsumed:      "not consumed",
	ops.TraceApplied:          "applied",
	ops.TraceSkippedDuplicate: "skipped (duplicate)",
	ops.TraceInTier:           "in a tier",
	ops.TraceOutbox:           "in the outbox",
	ops.TraceHeld:             "held",
	ops.TraceDeadLettered:     "dead",
	ops.TraceBeyondRetention:  "beyond retention",
}
