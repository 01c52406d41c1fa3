package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/otlprecv"
	"github.com/kafkapg/kafkapg/internal/topicread"
	"github.com/kafkapg/kafkapg/internal/tracing"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// traces is the -trace check. The suite's producer starts a trace of its own for every record it
// produces (a traceparent whose trace id encodes the record's index), the processors export their
// spans over OTLP/HTTP to a receiver of the suite's, and after the run:
//   - every process and send span kafkapg exported belongs to the trace of the record it handled
//     (a BatchHandler's call over several records links to theirs): through retry tiers, the
//     DLQ, replay, the outbox and a second stage, under kills and failovers, no hop lost or
//     replaced the record's context;
//   - every dead_letters row and DLQ record, and in a chain every posting, carries the trace of
//     its event (these are exact: they commit with the data, where a killed process's unexported
//     spans are lost);
//   - the receiver refused nothing.
type traces struct {
	prefix string // the high half of every trace id the producer starts, in hex
	recv   otlprecv.Receiver
	srv    *http.Server
	addr   string

	mu       sync.Mutex
	spans    int
	kinds    map[string]int // process, send, commit, and the rest (Postgres statements)
	traceIDs map[string]struct{}
	handled  map[int]bool // the records (by index) that have a process span on the source topic
	strays   []string     // process and send spans outside their record's trace
}

func newTraces(seed uint64, source string) (*traces, error) {
	t := &traces{prefix: fmt.Sprintf("%016x", seed|1<<63), kinds: map[string]int{}, traceIDs: map[string]struct{}{}, handled: map[int]bool{}}
	t.recv.OnSpan = func(sp otlprecv.Span) { t.add(sp, source) }
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("the OTLP receiver: %w", err)
	}
	t.addr = ln.Addr().String()
	t.srv = &http.Server{Handler: &t.recv}
	go t.srv.Serve(ln)
	return t, nil
}

func (t *traces) close() { t.srv.Close() }

// env is what the processors are given to export their spans here, each one sampled.
func (t *traces) env() []string {
	return []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + t.addr,
		"OTEL_TRACES_SAMPLER=parentbased_always_on",
		"OTEL_BSP_SCHEDULE_DELAY=500",
	}
}

// traceID is the trace id of the record produced at index i.
func (t *traces) traceID(i int) string { return fmt.Sprintf("%s%016x", t.prefix, i) }

// header is the traceparent the producer gives the record at index i.
func (t *traces) header(i int) kgo.RecordHeader {
	return kgo.RecordHeader{Key: "traceparent", Value: fmt.Appendf(nil, "00-%s-%016x-01", t.traceID(i), i+1)}
}

// index is the record index whose trace traceID is, or -1.
func (t *traces) index(traceID string) int {
	if len(traceID) != 32 {
		return -1
	}
	hi, lo := traceID[:16], traceID[16:]
	if hi != t.prefix {
		return -1
	}
	i, err := strconv.ParseInt(lo, 16, 64)
	if err != nil {
		return -1
	}
	return int(i)
}

func (t *traces) add(sp otlprecv.Span, source string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.spans++
	t.traceIDs[sp.TraceID] = struct{}{}
	kind, _, _ := strings.Cut(sp.Name, " ")
	if sp.Scope != tracing.Scope {
		kind = "postgres"
	}
	t.kinds[kind]++
	if sp.Scope != tracing.Scope || (kind != "process" && kind != "send") {
		return
	}
	i := t.index(sp.TraceID)
	if i >= 0 {
		if sp.Name == "process "+source {
			t.handled[i] = true
		}
		return
	}
	if kind == "process" && len(sp.Links) > 0 { // a BatchHandler's call over several records
		for _, l := range sp.Links {
			traceID, _, _ := strings.Cut(l, "-")
			i := t.index(traceID)
			if i < 0 {
				t.stray(sp, "links to trace "+traceID)
				return
			}
			if sp.Name == "process "+source {
				t.handled[i] = true
			}
		}
		return
	}
	t.stray(sp, "is in trace "+sp.TraceID)
}

func (t *traces) stray(sp otlprecv.Span, what string) {
	if len(t.strays) < 10 {
		t.strays = append(t.strays, fmt.Sprintf("%s span of %s (partition %s, offset %s) %s, no produced record's",
			sp.Name, sp.Service, sp.Attrs["messaging.destination.partition.id"], sp.Attrs["messaging.kafka.offset"], what))
	}
}

// traceReport is what the trace check found.
type traceReport struct {
	spans, traces, handled, produced int
	kinds                            map[string]int
	rows, dlq, postings              int // carrying their event's trace
}

// check checks what arrived and the trace context the database and the topics kept.
func (t *traces) check(ctx context.Context, s *suite, items []ledger.Item) (traceReport, error) {
	var errs []error
	// Each event's trace ids: the producer sent some events twice (a chain), each copy with a
	// trace of its own, and the first delivery of either applies it.
	byValue, byEvent := map[string][]string{}, map[string][]string{}
	for i, it := range items {
		byValue[string(it.Value)] = append(byValue[string(it.Value)], t.traceID(i))
		byEvent[it.Event.EventID] = append(byEvent[it.Event.EventID], t.traceID(i))
	}
	t.mu.Lock()
	rep := traceReport{spans: t.spans, traces: len(t.traceIDs), handled: len(t.handled), produced: len(items), kinds: maps.Clone(t.kinds)}
	for _, st := range t.strays {
		errs = append(errs, errors.New("tracing: "+st))
	}
	t.mu.Unlock()
	if rep.kinds["process"] == 0 || rep.kinds["send"] == 0 {
		errs = append(errs, fmt.Errorf("tracing: the processors exported %d process and %d send spans", rep.kinds["process"], rep.kinds["send"]))
	}
	if r := t.recv.Refused(); len(r) > 0 {
		errs = append(errs, fmt.Errorf("tracing: the OTLP receiver refused %d exports, the first: %s", len(r), r[0]))
	}
	own := func(what string, hs []kgo.RecordHeader, want []string) bool {
		got := tracing.TraceID(hs)
		if slices.Contains(want, got) {
			return true
		}
		// An oversized record's DLQ copy has no value (the dead_letters row keeps it).
		if i := t.index(got); len(want) == 0 && i >= 0 && i < len(items) && slices.ContainsFunc(hs, func(h kgo.RecordHeader) bool {
			return h.Key == retrytopics.HeaderValueOmitted && string(h.Value) == strconv.Itoa(len(items[i].Value))
		}) {
			return true
		}
		if len(errs) < 20 {
			errs = append(errs, fmt.Errorf("tracing: %s is in trace %q, its record's are %v", what, got, want))
		}
		return false
	}

	rows, err := s.pool.Query(ctx, `SELECT id, value, header_keys, header_values FROM `+pgx.Identifier{schema, "dead_letters"}.Sanitize()+
		` WHERE consumer_group = $1`, s.group)
	if err != nil {
		return rep, err
	}
	var id int64
	var value []byte
	var keys, values [][]byte
	if _, err := pgx.ForEachRow(rows, []any{&id, &value, &keys, &values}, func() error {
		hs := make([]kgo.RecordHeader, len(keys))
		for i := range keys {
			hs[i] = kgo.RecordHeader{Key: string(keys[i]), Value: values[i]}
		}
		if own(fmt.Sprintf("dead_letters row %d", id), hs, byValue[string(value)]) {
			rep.rows++
		}
		return nil
	}); err != nil {
		return rep, fmt.Errorf("read dead_letters: %w", err)
	}

	dlq, err := topicread.All(ctx, s.clientSeeds, retrytopics.DLQTopic(s.topic, s.group))
	if err != nil {
		return rep, err
	}
	for _, r := range dlq {
		if own(fmt.Sprintf("DLQ record %d/%d", r.Partition, r.Offset), r.Headers, byValue[string(r.Value)]) {
			rep.dlq++
		}
	}

	if s.cfg.chain() {
		postings, err := topicread.All(ctx, s.clientSeeds, s.stages[1].topic)
		if err != nil {
			return rep, err
		}
		for _, r := range postings {
			var p ledger.Posting
			if err := json.Unmarshal(r.Value, &p); err != nil {
				errs = append(errs, fmt.Errorf("tracing: posting %d/%d: %v", r.Partition, r.Offset, err))
				continue
			}
			if own(fmt.Sprintf("posting %d/%d of %s", r.Partition, r.Offset, p.EventID), r.Headers, byEvent[p.EventID]) {
				rep.postings++
			}
		}
	}
	return rep, errors.Join(errs...)
}

// describe is the summary's segment.
func (r traceReport) describe(chain bool) string {
	out := fmt.Sprintf("tracing: %d spans exported (%d process, %d send, %d commit, %d Postgres) in %d traces; %d of %d produced records were handled in a process span of their trace or linked from one (copies skipped as duplicates before the handler have none, and a killed process's unexported spans are lost);"+
		" every process and send span in its record's trace, and so are %d dead_letters rows and %d DLQ records",
		r.spans, r.kinds["process"], r.kinds["send"], r.kinds["commit"], r.kinds["postgres"], r.traces, r.handled, r.produced, r.rows, r.dlq)
	if chain {
		out += fmt.Sprintf(" and %d postings", r.postings)
	}
	return out
}
