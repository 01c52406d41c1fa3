package processor_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"pgregory.net/rapid"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/sink"
)

var protocolHistories = flag.Int("protocol.histories", 8, "histories TestProtocolThroughTheProcessor runs through the real processor")

// TestProtocolThroughTheProcessor runs a few of the histories internal/streams' TestProtocol
// explores through the real processor, against Postgres and Kafka (kfake): an upstream database
// numbering the events it emits, restored from copies and restarted (each start a new identity:
// streams fork, or are created again), relays publishing in any order, twice, or late from a
// database that is gone; the consumer sends records round a retry tier and dead-letters others,
// which are replayed at the end. Every event published must be applied exactly once.
// -protocol.histories runs more.
func TestProtocolThroughTheProcessor(t *testing.T) {
	if f := flag.Lookup("rapid.checks"); f != nil && f.Value.String() == f.DefValue {
		f.Value.Set(strconv.Itoa(*protocolHistories))
		defer f.Value.Set(f.DefValue)
	}
	rapid.Check(t, func(rt *rapid.T) {
		log := upstreamHistory(rt)
		if len(log) == 0 {
			return
		}
		runThroughProcessor(t, rt, log)
	})
}

// upEvent is an event of the upstream's outbox: its stream header's fields and its message id.
type upEvent struct {
	stream, parent uuid.UUID
	seq, forkSeq   int64
	src            int64
	since          time.Time
	mid            string
	fate           string // at the consumer: ok, retry (fails on its first delivery), dead (permanently, until replayed)
}

type upRow struct {
	stream, parent uuid.UUID
	seq, forkSeq   int64
	ident          int
	updated, since time.Time
}

type upState struct {
	ident    int
	pos      int
	deferred []int
	row      *upRow
	outbox   []upEvent
}

func (s *upState) clone() *upState {
	c := &upState{ident: s.ident, pos: s.pos, deferred: slices.Clone(s.deferred), outbox: slices.Clone(s.outbox)}
	if s.row != nil {
		r := *s.row
		c.row = &r
	}
	return c
}

// upstreamHistory draws an upstream's history (one source partition into one partition of the
// consumer's topic) and returns what its relays published, in order.
func upstreamHistory(t *rapid.T) []upEvent {
	now := time.Now().Add(-time.Hour)
	idents := 1
	st := &upState{ident: 1}
	var snaps []*upState
	var late []upEvent
	var log []upEvent
	sources := rapid.IntRange(3, 12).Draw(t, "sources")
	apply := func(src int) {
		r := st.row
		switch {
		case r == nil:
			r = &upRow{stream: uuid.New()}
			st.row = r
		case r.ident != st.ident:
			*r = upRow{stream: uuid.New(), parent: r.stream, forkSeq: r.seq, since: r.updated}
		}
		r.ident, r.updated = st.ident, now
		n := 1 + src%2
		for i := range n {
			r.seq++
			st.outbox = append(st.outbox, upEvent{stream: r.stream, parent: r.parent, seq: r.seq, forkSeq: r.forkSeq, since: r.since,
				src: int64(src), mid: fmt.Sprintf("s%d-%d", src, i)})
		}
	}
	publish := func(e upEvent) {
		e.fate = rapid.SampledFrom([]string{"ok", "ok", "ok", "ok", "retry", "dead"}).Draw(t, "fate")
		log = append(log, e)
	}
	steps := rapid.IntRange(5, 40).Draw(t, "steps")
	for range steps {
		now = now.Add(time.Duration(rapid.IntRange(1, 30).Draw(t, "seconds")) * time.Second)
		switch rapid.IntRange(0, 9).Draw(t, "step") {
		case 0, 1, 2: // the source partition's worker applies its next record, or defers it
			if st.pos >= sources {
				continue
			}
			if rapid.IntRange(0, 4).Draw(t, "defer") == 0 {
				st.deferred = append(st.deferred, st.pos)
			} else {
				apply(st.pos)
			}
			st.pos++
		case 3: // a deferred record applied (a retry tier, held records, a replay)
			if len(st.deferred) == 0 {
				continue
			}
			i := rapid.IntRange(0, len(st.deferred)-1).Draw(t, "deferred")
			apply(st.deferred[i])
			st.deferred = slices.Delete(st.deferred, i, i+1)
		case 4, 5: // a relay publishes a row, deleting it or not
			if len(st.outbox) == 0 {
				continue
			}
			i := rapid.IntRange(0, len(st.outbox)-1).Draw(t, "row")
			publish(st.outbox[i])
			if rapid.IntRange(0, 5).Draw(t, "delete") > 0 {
				st.outbox = slices.Delete(st.outbox, i, i+1)
			}
		case 6: // a copy of the data directory
			snaps = append(snaps, st.clone())
		case 7, 8: // restored from a copy, or restarted: a new identity; rows read by the old relays may still be published
			for _, e := range st.outbox {
				if rapid.Bool().Draw(t, "in flight") {
					late = append(late, e)
				}
			}
			if len(snaps) > 0 && rapid.Bool().Draw(t, "restore") {
				st = snaps[rapid.IntRange(0, len(snaps)-1).Draw(t, "copy")].clone()
			}
			idents++
			st.ident = idents
		case 9: // a late publish from a database that is gone
			if len(late) == 0 {
				continue
			}
			publish(late[0])
			late = late[1:]
		}
	}
	// Everything finishes upstream: applied, published.
	for ; st.pos < sources; st.pos++ {
		apply(st.pos)
	}
	for _, src := range st.deferred {
		apply(src)
	}
	for _, e := range append(late, st.outbox...) {
		publish(e)
	}
	return log
}

// protocolRecorder applies a record by inserting its message id into got (no unique constraint: an
// event applied twice is two rows); a record whose value is "retry" fails on its first delivery,
// one whose value is "dead" fails permanently (dead-lettered) on its first, and a replay brings it
// back as its second.
type protocolRecorder struct{}

func (protocolRecorder) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	switch v := string(rec.Value); {
	case v == "retry" && rec.Attempt == 1:
		return errors.New("fails once")
	case v == "dead" && rec.Attempt == 1:
		return processor.Permanent(errors.New("told to fail"))
	}
	return midRecorder{}.Handle(ctx, tx, rec)
}

func runThroughProcessor(t *testing.T, rt *rapid.T, log []upEvent) {
	k := testenv.NewKfake(t)
	h, cfg := midHarness(t, k, 1, protocolRecorder{})
	ctx := context.Background()
	cfg.LocalAttempts = 1
	cfg.RetryTiers = []time.Duration{50 * time.Millisecond}
	r := h.Start(cfg)
	defer r.Stop(t)
	th := sha256.Sum256([]byte(h.Topic))
	root := uuid.New()
	var recs []*kgo.Record
	want := map[string]bool{}
	for _, e := range log {
		hdr := fmt.Sprintf("%s %d %s %d 0@%x", e.stream, e.seq, root, e.src, th[:4])
		if e.forkSeq > 0 {
			hdr += fmt.Sprintf(" %s %d %d", e.parent, e.forkSeq, e.since.UnixMilli())
		}
		recs = append(recs, &kgo.Record{Topic: h.Topic, Partition: 0, Key: []byte(e.mid), Value: []byte(e.fate), Headers: []kgo.RecordHeader{
			{Key: sink.HeaderMessageID, Value: []byte(e.mid)},
			{Key: sink.HeaderStream, Value: []byte(hdr)},
		}})
		want[e.mid] = true
	}
	k.Produce(t, recs...)
	settled := func() error {
		var next int64
		var retrying, deadNew int
		if err := h.Pool.QueryRow(ctx, `SELECT coalesce((SELECT next_offset FROM kafkapg.offsets WHERE consumer_group = $1 AND topic = $2), 0),
				(SELECT count(*) FROM kafkapg.retries WHERE consumer_group = $1), (SELECT count(*) FROM kafkapg.held_records WHERE consumer_group = $1)`,
			h.Group, h.Topic).Scan(&next, &retrying, &deadNew); err != nil {
			return err
		}
		if next < int64(len(recs)) || retrying > 0 || deadNew > 0 {
			return fmt.Errorf("consumed %d of %d, %d in the retry path, %d held", next, len(recs), retrying, deadNew)
		}
		return nil
	}
	testenv.Eventually(t, 60*time.Second, settled)
	o := ops.New(h.Pool, "kafkapg", h.Group)
	if task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, ops.Actor{Name: "tester", Reason: "history"}, 0); err == nil {
		if _, err := o.RunTask(ctx, task.ID, "test", nil); err != nil {
			t.Fatal(err)
		}
	} else if !errors.Is(err, ops.ErrUsage) {
		t.Fatal(err)
	}
	testenv.Eventually(t, 60*time.Second, func() error {
		var pending int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.dead_letters WHERE consumer_group = $1 AND status IN ('new', 'replaying')`, h.Group).Scan(&pending); err != nil {
			return err
		}
		if pending > 0 {
			return fmt.Errorf("%d dead letters not replayed yet", pending)
		}
		return settled()
	})
	got := appliedMids(t, h)
	streams := map[uuid.UUID]bool{}
	for _, e := range log {
		streams[e.stream] = true
	}
	t.Logf("a history of %d records, %d events, %d streams", len(log), len(want), len(streams))
	var wrong []string
	for mid := range want {
		if got[mid] != 1 {
			wrong = append(wrong, mid+":"+strconv.Itoa(got[mid]))
		}
	}
	if len(wrong) > 0 || len(got) != len(want) {
		slices.Sort(wrong)
		var hist []string
		for i, e := range log {
			hist = append(hist, fmt.Sprintf("%d: %s seq %d src %d (fork of %s at %d) %s %s", i, e.stream.String()[:8], e.seq, e.src, e.parent.String()[:8], e.forkSeq, e.mid, e.fate))
		}
		rt.Fatalf("events applied other than once: %v (of %d events)\npublished:\n  %s", wrong, len(want), strings.Join(hist, "\n  "))
	}
}
