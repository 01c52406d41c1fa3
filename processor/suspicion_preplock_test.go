package processor

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

// blockingPreparer's Prepare of a record whose value is "rogue" ignores its context: it returns
// when the channel in rec.Prepared's place (rogues[offset]) is closed. Every other Prepare returns
// at once.
type blockingPreparer struct {
	rogues  map[int64]chan struct{}
	started chan int64
}

func (h blockingPreparer) Prepare(_ context.Context, rec *Record) error {
	if string(rec.Value) == "rogue" {
		h.started <- rec.Offset
		<-h.rogues[rec.Offset] // ignoring its context
	}
	rec.Prepared = rec.Offset
	return nil
}

func (blockingPreparer) Handle(context.Context, pgx.Tx, *Record) error { return nil }

// TestHeldApplierIsNotBlockedByAStoppedWorkersPrepare (issue 39, S3): the key's lock, the path
// the held records' applier (and a retry tier's worker, and a record tried again alone) takes
// inside its transaction: prepareInline, under its own, long-lived context. A worker's Prepare
// that ignores its context keeps its key's lock while its worker runs, so that the key's Prepare
// calls never overlap within a live worker; once the worker has stopped (its context ended: the
// partition revoked), the lock is given back, the applier prepares the key's held record at once,
// and the late Prepare's result is discarded. Before the fix the applier waited, in its
// transaction, for as long as the rogue Prepare ran.
func TestHeldApplierIsNotBlockedByAStoppedWorkersPrepare(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none") // never connected
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	h := blockingPreparer{rogues: map[int64]chan struct{}{0: make(chan struct{}), 1: make(chan struct{})}, started: make(chan int64, 2)}
	p, err := New(pool, &Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}, Handler: h, Concurrency: 4,
		Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { // no goroutine left behind, whatever failed
		for _, ch := range h.rogues {
			select {
			case <-ch:
			default:
				close(ch)
			}
		}
	}()
	pol := p.policy("t")
	rec := func(off int64, value string) *Record {
		return &Record{Topic: "t", Partition: 0, Offset: off, Key: []byte("k"), Value: []byte(value), Attempt: 1, consumed: off, ordered: true}
	}
	applier := context.Background() // the held records' applier's: the process's lifetime

	// A live worker's rogue Prepare keeps the key: the applier waits for it.
	live, stopLive := context.WithCancel(context.Background())
	defer stopLive()
	liveDone := make(chan error, 1)
	go func() { liveDone <- p.prepareOne(live, pol, rec(0, "rogue")) }()
	<-h.started
	held := rec(5, "v")
	applied := make(chan error, 1)
	go func() {
		_, err := p.prepareInline(applier, pol, []*Record{held})
		applied <- err
	}()
	select {
	case err := <-applied:
		t.Fatalf("the applier prepared the key's record (err %v) while a live worker's Prepare of the key ran", err)
	case <-time.After(300 * time.Millisecond):
	}
	close(h.rogues[0])
	if err := <-liveDone; err != nil {
		t.Fatalf("the live worker's Prepare: %v", err)
	}
	select {
	case err := <-applied:
		if err != nil || !held.prepared || held.Prepared != int64(5) {
			t.Fatalf("the applier's Prepare: err %v, prepared %v (%v)", err, held.prepared, held.Prepared)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the applier did not prepare the key's record once the live worker's Prepare returned")
	}

	// A stopped worker's rogue Prepare loses the key: the applier goes on at once.
	gone, stopGone := context.WithCancel(context.Background())
	rogue := rec(1, "rogue")
	goneDone := make(chan error, 1)
	go func() { goneDone <- p.prepareOne(gone, pol, rogue) }()
	<-h.started
	stopGone() // its worker stopped: the partition was revoked
	held = rec(6, "v")
	go func() {
		_, err := p.prepareInline(applier, pol, []*Record{held})
		applied <- err
	}()
	select {
	case err := <-applied:
		if err != nil || !held.prepared {
			t.Fatalf("the applier's Prepare: err %v, prepared %v", err, held.prepared)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the held records' applier waited for the key's lock, held by the Prepare of a worker that has stopped (it ignores its context)")
	}
	close(h.rogues[1])
	if err := <-goneDone; !errors.Is(err, context.Canceled) || rogue.Prepared != nil {
		t.Errorf("the late Prepare of the stopped worker: err %v, rec.Prepared %v; want its result discarded (context.Canceled, nil)", err, rogue.Prepared)
	}
	if len(p.prepLocks.busy) != 0 {
		t.Errorf("locks left taken: %v", p.prepLocks.busy)
	}
}
