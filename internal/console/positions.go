package console

import (
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/safetext"
)

type positionsData struct {
	Partitions []ops.PartitionStatus
	Topics     []string // the source topics listed, for the change form
	Notes      []string
	// CanAct: the signed-in user is an operator of a console that may act.
	CanAct bool
}

// positions lists the group's source partitions: the stored position, Kafka's committed offset,
// the end, the lag, the owner, and whether it is paused (since when, by whom, why); operators
// get the forms that pause, resume and set positions (each through a dry-run confirm page).
func (c *Console) positions(w http.ResponseWriter, r *http.Request) {
	list, notes, err := c.cfg.Ops.Partitions(r.Context(), c.cfg.Kafka)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	d := positionsData{Partitions: list, Notes: notes, CanAct: c.mayAct(r)}
	for _, p := range list {
		if !slices.Contains(d.Topics, p.Topic) {
			d.Topics = append(d.Topics, p.Topic)
		}
	}
	c.render(w, r, "positions", "Positions", d)
}

// positionForm is a pause, resume or set a posted form asks for.
type positionForm struct {
	Op        string // pause, resume or set
	Topic     string
	Partition int32 // ops.AllPartitions: every partition of the topic
	Target    string
	Value     string
	plan      ops.PositionPlan
}

// positionFormOf reads the change a posted form names: op, topic, partition ("" or "all": every
// one), and for set, target (offset, time, start, end) and value (an offset; a time, RFC 3339 or
// a duration ago).
func positionFormOf(r *http.Request) (positionForm, error) {
	if err := r.ParseForm(); err != nil {
		return positionForm{}, fmt.Errorf("%w: %v", ops.ErrUsage, err)
	}
	f := positionForm{Op: r.PostForm.Get("op"), Topic: r.PostForm.Get("topic"), Partition: ops.AllPartitions,
		Target: r.PostForm.Get("target"), Value: strings.TrimSpace(r.PostForm.Get("value"))}
	bad := func(format string, args ...any) (positionForm, error) {
		return positionForm{}, fmt.Errorf("%w: %s", ops.ErrUsage, fmt.Sprintf(format, args...))
	}
	if f.Op != "pause" && f.Op != "resume" && f.Op != "set" {
		return bad("op %q: want pause, resume or set", f.Op)
	}
	if f.Topic == "" {
		return bad("a topic is required")
	}
	if p := strings.TrimSpace(r.PostForm.Get("partition")); p != "" && p != "all" {
		n, err := strconv.ParseInt(p, 10, 32)
		if err != nil || n < 0 {
			return bad("partition %q: want a partition number, or nothing for every partition", p)
		}
		f.Partition = int32(n)
	}
	if f.Op != "set" {
		return f, nil
	}
	f.plan = ops.PositionPlan{Topic: f.Topic, Partition: f.Partition}
	switch f.Target {
	case "offset":
		n, err := strconv.ParseInt(f.Value, 10, 64)
		if err != nil || n < 0 {
			return bad("offset %q: want an offset (0 or more)", f.Value)
		}
		f.plan.Target.Offset = &n
	case "time":
		if t, err := time.Parse(time.RFC3339, f.Value); err == nil {
			f.plan.Target.Time = t
		} else if d, err := time.ParseDuration(f.Value); err == nil && d > 0 {
			f.plan.Target.Time = time.Now().Add(-d)
		} else {
			return bad("time %q: want an RFC 3339 time (2026-12-04T14:00:00Z) or a duration ago (90m)", f.Value)
		}
	case "start":
		f.plan.Target.Start = true
	case "end":
		f.plan.Target.End = true
	default:
		return bad("target %q: want offset, time, start or end", f.Target)
	}
	return f, nil
}

type positionChangeData struct {
	Form     positionForm
	Pause    ops.PauseChange
	Moves    []ops.PositionMove
	Executed bool
	// Changes: something would change (a pause or resume with nothing to do has no confirm).
	Changes bool
}

// confirmPosition shows the dry run of a pause, resume or set, and asks for the reason.
func (c *Console) confirmPosition(w http.ResponseWriter, r *http.Request) {
	c.changePosition(w, r, false)
}

// actPosition makes the change in the name of the signed-in operator and shows what it did.
func (c *Console) actPosition(w http.ResponseWriter, r *http.Request) { c.changePosition(w, r, true) }

func (c *Console) changePosition(w http.ResponseWriter, r *http.Request, execute bool) {
	f, err := positionFormOf(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	if f.Target == "time" {
		// The confirm page carries the time, not "90m", which would mean later when confirmed.
		f.Value = f.plan.Target.Time.UTC().Format(time.RFC3339Nano)
	}
	a := ops.Actor{Name: "console:" + userOf(r).name, Reason: strings.TrimSpace(r.PostForm.Get("reason"))}
	d := positionChangeData{Form: f, Executed: execute}
	switch f.Op {
	case "pause":
		d.Pause, err = c.cfg.Ops.Pause(r.Context(), c.cfg.Kafka, f.Topic, f.Partition, execute, a)
		d.Changes = d.Pause.Changed
	case "resume":
		d.Pause, err = c.cfg.Ops.Resume(r.Context(), c.cfg.Kafka, f.Topic, f.Partition, execute, a)
		d.Changes = d.Pause.Changed
	case "set":
		d.Moves, err = c.cfg.Ops.SetPositions(r.Context(), c.cfg.Kafka, f.plan, execute, a)
		d.Changes = len(d.Moves) > 0
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	title := map[string]string{"pause": "Pause", "resume": "Resume", "set": "Set the position"}[f.Op]
	if !execute {
		title += ": a dry run"
	}
	c.render(w, r, "position", title, d)
}

// partitionText is a partition for the pages: "every partition" for ops.AllPartitions.
func partitionText(p int32) string {
	if p == ops.AllPartitions {
		return "every partition"
	}
	return "partition " + strconv.Itoa(int(p))
}

// oneLineText is text from outside (an actor, a reason) for a table cell.
func oneLineText(s string, n int) string {
	return safetext.Truncate(strings.Join(strings.Fields(s), " "), n)
}
