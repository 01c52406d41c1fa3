package processor_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
)

// roguePreparer's Prepare of the records at offset 0 ignores its context: it returns only when
// release is closed (at the end of the test), whatever happens to its partition meanwhile. Every
// other Prepare returns at once. Handle writes the record to rogue_applied, with the processor's
// name; lateReturns counts the rogue prepares that returned. A rogue's result reaches Handle only
// on a partition its worker kept (not on revoked, the partition that moved).
type roguePreparer struct {
	name        string
	rogue       bool
	release     <-chan struct{}
	blocked     *atomic.Int64
	lateReturns *atomic.Int64
	revoked     *atomic.Int32
}

func (h roguePreparer) Prepare(ctx context.Context, rec *processor.Record) error {
	if h.rogue && rec.Offset == 0 {
		h.blocked.Add(1)
		<-h.release // ignoring ctx
		h.lateReturns.Add(1)
		rec.Prepared = "late"
		return nil
	}
	rec.Prepared = "fresh"
	return nil
}

func (h roguePreparer) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	if rec.Prepared != "fresh" && rec.Partition == h.revoked.Load() {
		return processor.Permanent(fmt.Errorf("record %d of partition %d handled with %v, not its own Prepare's result", rec.Offset, rec.Partition, rec.Prepared))
	}
	_, err := tx.Exec(ctx, `INSERT INTO rogue_applied (partition, "offset", processor) VALUES ($1, $2, $3)`, rec.Partition, rec.Offset, h.name)
	return err
}

// rogueScene is the set-up of the rogue Prepare tests: a topic of two partitions, records of one
// key, k, and processors whose handler is a roguePreparer.
type rogueScene struct {
	t                    *testing.T
	h                    *testkit.Harness
	cl                   *kgo.Client
	release              chan struct{}
	releaseOnce          sync.Once
	blocked, lateReturns atomic.Int64
	revoked              atomic.Int32
}

func newRogueScene(t *testing.T) *rogueScene {
	k := testenv.NewKfake(t)
	sc := &rogueScene{t: t, h: testkit.New(t, k, 2), release: make(chan struct{}),
		cl: k.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))}
	sc.revoked.Store(-1)
	if _, err := sc.h.Pool.Exec(context.Background(), `CREATE TABLE rogue_applied (id bigserial, partition int, "offset" bigint, processor text,
		PRIMARY KEY (partition, "offset"))`); err != nil {
		t.Fatal(err)
	}
	return sc
}

// config returns a processor's config, preparing 4 records at once; rogue: its Prepare of the
// records at offset 0 ignores its context.
func (sc *rogueScene) config(name string, rogue bool) *processor.Config {
	cfg := sc.h.Config(roguePreparer{name: name, rogue: rogue, release: sc.release, blocked: &sc.blocked, lateReturns: &sc.lateReturns, revoked: &sc.revoked})
	cfg.Concurrency = 4
	return cfg
}

// start starts the processor; the rogue prepares are released before any processor stops.
func (sc *rogueScene) start(cfg *processor.Config) *running {
	r := sc.h.Start(cfg)
	sc.t.Cleanup(sc.releaseRogues)
	return r
}

func (sc *rogueScene) releaseRogues() { sc.releaseOnce.Do(func() { close(sc.release) }) }

// produce produces records of key k with the given values to partition.
func (sc *rogueScene) produce(partition int32, values ...string) {
	var recs []*kgo.Record
	for _, v := range values {
		recs = append(recs, &kgo.Record{Topic: sc.h.Topic, Partition: partition, Key: []byte("k"), Value: []byte(v)})
	}
	if err := sc.cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		sc.t.Fatal(err)
	}
}

// applied returns the offsets of partition's records applied, in the order they were, and how
// many each processor applied.
func (sc *rogueScene) applied(partition int32) (offs []int64, by map[string]int) {
	rows, err := sc.h.Pool.Query(context.Background(), `SELECT "offset", processor FROM rogue_applied WHERE partition = $1 ORDER BY id`, partition)
	if err != nil {
		sc.t.Fatal(err)
	}
	by = map[string]int{}
	var off int64
	var name string
	if _, err := pgx.ForEachRow(rows, []any{&off, &name}, func() error {
		offs = append(offs, off)
		by[name]++
		return nil
	}); err != nil {
		sc.t.Fatal(err)
	}
	return offs, by
}

// moveOnePartition waits for the two rogue prepares of processor A (started), then has B join, and
// returns B and the partition it was given once B has applied n of its records (the rogue's
// record among them: B's Prepare returns at once).
func (sc *rogueScene) moveOnePartition(n int) (*running, int32) {
	testenv.Eventually(sc.t, 30*time.Second, func() error {
		if n := sc.blocked.Load(); n != 2 {
			return fmt.Errorf("%d of 2 rogue prepares started", n)
		}
		return nil
	})
	b := sc.start(sc.config("B", false))
	moved := int32(-1)
	testenv.Eventually(sc.t, 30*time.Second, func() error {
		for p := range int32(2) {
			if offs, by := sc.applied(p); len(offs) == n && by["B"] == n {
				moved = p
				return nil
			}
		}
		return fmt.Errorf("B has not applied %d records of a partition it was given", n)
	})
	sc.revoked.Store(moved)
	return b, moved
}

// checkRogueLogged checks that A logged its rogue Prepare of the moved partition.
func (sc *rogueScene) checkRogueLogged(logs *syncBuffer, moved int32) {
	testenv.Eventually(sc.t, 10*time.Second, func() error {
		for _, l := range logs.lines(sc.t) {
			if l["level"] == "WARN" && strings.HasPrefix(fmt.Sprint(l["msg"]), "a Prepare ignores its context") && l["partition"] == float64(moved) {
				return nil
			}
		}
		return fmt.Errorf("no warning of the rogue Prepare of partition %d", moved)
	})
}

// finish releases the rogue prepares and checks that every record of each partition p (offsets 0
// to want[p]-1) is applied once, in offset order, and that no late result reached Handle.
func (sc *rogueScene) finish(a *running, want map[int32]int) {
	sc.releaseRogues()
	testenv.Eventually(sc.t, 30*time.Second, func() error {
		if n := sc.lateReturns.Load(); n != 2 {
			return fmt.Errorf("%d of 2 rogue prepares returned", n)
		}
		return nil
	})
	for p, n := range want {
		testenv.Eventually(sc.t, 30*time.Second, func() error {
			if offs, _ := sc.applied(p); len(offs) != n {
				return fmt.Errorf("partition %d: applied %v, want offsets 0 to %d", p, offs, n-1)
			}
			return nil
		})
		if offs, _ := sc.applied(p); !slices.IsSorted(offs) {
			sc.t.Errorf("partition %d: records of key k applied in the order %v", p, offs)
		}
	}
	if dead := a.Counter("kafkapg_records_dead_lettered_total"); dead != 0 {
		sc.t.Errorf("%v records dead-lettered: a late Prepare's result reached Handle", dead)
	}
}

// TestRoguePrepareLosesItsKeyAtRevoke (issue 39, S3): a Prepare that ignores its context must not
// keep its key from the partition's next worker in the same process.
//
// Processor A prepares concurrently (Concurrency 4); the first record of each of its two
// partitions, of key k, is prepared by a Prepare that ignores its context and does not return
// until the end of the test. B joins: one partition moves to B, which applies its records (B's
// Prepare returns at once). B leaves: the partition comes back to A, whose new worker of it must
// apply the key's next record. Before the fix the process-wide lock of (partition, k) stayed with
// the revoked worker's rogue Prepare, and the new worker waited on it for as long as the rogue
// ran; nothing bounded it. Now the lock belongs to the worker that took it and is given back when
// that worker stops; the rogue is logged, and its result, when it comes, discarded.
//
// The held records' applier prepares under the same lock, inside its transaction:
// TestHeldApplierIsNotBlockedByAStoppedWorkersPrepare tests that path (in a processor with retry
// tiers, a member that joins is given the tiers' partitions first, so no source partition can be
// made to move to it and back as here).
func TestRoguePrepareLosesItsKeyAtRevoke(t *testing.T) {
	sc := newRogueScene(t)
	sc.produce(0, "v", "v")
	sc.produce(1, "v", "v")
	acfg := sc.config("A", true)
	logs := captureLogs(t, acfg)
	a := sc.start(acfg)
	b, moved := sc.moveOnePartition(2)
	b.Stop(t) // the partition goes back to A
	sc.produce(moved, "v")
	start := time.Now()
	testenv.Eventually(t, 20*time.Second, func() error {
		if offs, _ := sc.applied(moved); len(offs) != 3 {
			return fmt.Errorf("partition %d: %d of 3 records applied; its key's lock is still held by the Prepare of A's revoked worker, which ignores its context", moved, len(offs))
		}
		return nil
	})
	t.Logf("partition %d came back to A, whose new worker applied the key's next record %v after B left", moved, time.Since(start).Round(time.Millisecond))
	sc.checkRogueLogged(logs, moved)
	sc.finish(a, map[int32]int{moved: 3, 1 - moved: 2})
}
