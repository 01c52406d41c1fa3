package processortest_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/processortest"
	"github.com/kafkapg/kafkapg/service"
)

// priced is a processor.Preparer: Prepare quotes a price (the wait on another system), Handle
// needs the quote. started, if set, is called as each Prepare starts.
type priced struct {
	mu       sync.Mutex
	prepared []string // keys, in the order their Prepare started
	handled  []string
	started  func(ctx context.Context, key string) error
}

func (h *priced) Prepare(ctx context.Context, rec *processor.Record) error {
	h.mu.Lock()
	h.prepared = append(h.prepared, string(rec.Key))
	h.mu.Unlock()
	if string(rec.Value) == "unpriceable" {
		return processor.Permanent(errors.New("no price for it"))
	}
	if h.started != nil {
		if err := h.started(ctx, string(rec.Key)); err != nil {
			return err
		}
	}
	rec.Prepared = int64(len(rec.Value))
	return nil
}

func (h *priced) Handle(_ context.Context, _ pgx.Tx, rec *processor.Record) error {
	if _, ok := rec.Prepared.(int64); !ok {
		return fmt.Errorf("record %s handled without its Prepare's quote (Prepared = %v)", rec.Key, rec.Prepared)
	}
	h.mu.Lock()
	h.handled = append(h.handled, string(rec.Key))
	h.mu.Unlock()
	return nil
}

// TestRunCallsPrepare: Run and Service.Run call a Preparer's Prepare before its Handle, once per
// record, as the processor does; a Prepare error fails its record as Handle's would, and the
// records after it are not handled.
func TestRunCallsPrepare(t *testing.T) {
	db := processortest.DB(t)
	recs := func(values ...string) []*processor.Record {
		var out []*processor.Record
		for i, v := range values {
			r := processortest.NewRecord("orders", fmt.Sprintf("k%d", i), v)
			r.Offset = int64(i)
			out = append(out, r)
		}
		return out
	}

	h := &priced{}
	if res := processortest.Run(t, db, h, recs("a", "bb", "ccc")...); !res.Applied() {
		t.Fatalf("Run: %v", res)
	}
	if want := []string{"k0", "k1", "k2"}; !slices.Equal(h.prepared, want) || !slices.Equal(h.handled, want) {
		t.Fatalf("Run prepared %v and handled %v, want each of %v once", h.prepared, h.handled, want)
	}

	h = &priced{}
	res := processortest.Run(t, db, h, recs("a", "unpriceable", "ccc")...)
	if res.Applied() || res.Class != processor.ClassPermanent || res.Index != 1 {
		t.Fatalf("a Prepare's Permanent error: %v, want record 1 failed, permanent", res)
	}
	if slices.Contains(h.handled, "k1") || slices.Contains(h.handled, "k2") {
		t.Fatalf("handled %v: a record whose Prepare failed, or one after it", h.handled)
	}

	h = &priced{}
	svc := processortest.NewService(t, db, service.Handler{Name: "priced", Handler: h})
	if res := svc.Run(recs("a", "bb")...); !res.Applied() || !slices.Equal(h.prepared, []string{"k0", "k1"}) {
		t.Fatalf("Service.Run: %v, prepared %v", res, h.prepared)
	}
}

// TestServicePreparesConcurrently: with the handler's Concurrency, Service.Run prepares the
// records of different keys side by side, as the service does; each of the four Prepares here
// waits until all four have started.
func TestServicePreparesConcurrently(t *testing.T) {
	db := processortest.DB(t)
	const n = 4
	var wg sync.WaitGroup
	wg.Add(n)
	all := make(chan struct{})
	go func() { wg.Wait(); close(all) }()
	h := &priced{started: func(ctx context.Context, key string) error {
		wg.Done()
		select {
		case <-all:
			return nil
		case <-time.After(10 * time.Second):
			return processor.Permanent(fmt.Errorf("%s's Prepare waited 10 s for the other keys' to start: Prepares ran one at a time", key))
		}
	}}
	svc := processortest.NewService(t, db, service.Handler{Name: "priced", Handler: h, Concurrency: n})
	var recs []*processor.Record
	for i := range n {
		r := processortest.NewRecord("orders", fmt.Sprintf("k%d", i), "v")
		r.Offset = int64(i)
		recs = append(recs, r)
	}
	if res := svc.Run(recs...); !res.Applied() {
		t.Fatalf("Concurrency %d: %v", n, res)
	}
}
