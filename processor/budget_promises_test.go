package processor

import (
	"context"
	"fmt"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// These tests check the memory and concurrency rules docs/guarantees.md, docs/DESIGN.md and
// docs/retries.md state, on the values the code really uses: the Kafka client's options as
// newClient sets them, the heldApplier's goroutine count from its pool, and partitionShare.
// docs_test.go checks that the docs state the same numbers.

const (
	kib = 1 << 10
	mib = 1 << 20
	gib = 1 << 30
)

// newPromiseProcessor returns a Processor built by New with the given buffer budget and a pool
// of maxConns connections. The pool is never used: nothing here runs a statement, and a pgx pool
// connects only when asked for a connection.
func newPromiseProcessor(t *testing.T, budget int, maxConns int32, brokers ...string) *Processor {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig("postgres://kafkapg@127.0.0.1:1/kafkapg?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	c := validConfig()
	c.MaxBufferedBytes = budget
	c.Logger = slog.New(slog.DiscardHandler)
	if len(brokers) > 0 {
		c.Brokers = brokers
	}
	p, err := New(pool, c)
	if err != nil {
		t.Fatalf("New with MaxBufferedBytes %d: %v", budget, err)
	}
	return p
}

// promiseClient returns the Kafka client newClient makes for a processor with the given budget,
// connected to an in-process kfake broker (the group's topic does not exist there, so nothing is
// ever assigned). Its options are what the docs promise about fetching.
func promiseClient(t *testing.T, budget int) *kgo.Client {
	t.Helper()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	p := newPromiseProcessor(t, budget, 10, cluster.ListenAddrs()...)
	cl, err := p.newClient()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// fetchLimits are franz-go's fetch limits as the processor's client has them.
func fetchLimits(cl *kgo.Client) (fetch, partition int32) {
	return cl.OptValue(kgo.FetchMaxBytes).(int32), cl.OptValue(kgo.FetchMaxPartitionBytes).(int32)
}

// TestFetchSizesFollowTheBudget: franz-go's fetches, which come on top of the buffer budget, are
// max(budget/32, 1 MiB) and at most 50 MiB, and max(budget/128, 128 KiB) and at most 1 MiB a
// partition (docs/guarantees.md, "Memory"). Below 32 MiB the 1 MiB floor makes a fetch more than
// 1/32 of the budget: 1/16 of 16 MiB, 1/8 of 8 MiB.
func TestFetchSizesFollowTheBudget(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name          string
		budget        int
		wantFetch     int32
		wantPartition int32
	}{
		{name: "1 MiB, the least allowed", budget: 1 * mib, wantFetch: 1 * mib, wantPartition: 128 * kib},
		{name: "8 MiB", budget: 8 * mib, wantFetch: 1 * mib, wantPartition: 128 * kib},
		{name: "16 MiB", budget: 16 * mib, wantFetch: 1 * mib, wantPartition: 128 * kib},
		{name: "32 MiB", budget: 32 * mib, wantFetch: 1 * mib, wantPartition: 256 * kib},
		{name: "64 MiB, the default", budget: 64 * mib, wantFetch: 2 * mib, wantPartition: 512 * kib},
		{name: "1 GiB", budget: 1 * gib, wantFetch: 32 * mib, wantPartition: 1 * mib},
		{name: "4 GiB, past the caps", budget: 4 * gib, wantFetch: 50 * mib, wantPartition: 1 * mib},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			fetch, partition := fetchLimits(promiseClient(t, tt.budget))
			if fetch != tt.wantFetch || partition != tt.wantPartition {
				t.Errorf("budget %d: FetchMaxBytes %d, FetchMaxPartitionBytes %d; want %d and %d",
					tt.budget, fetch, partition, tt.wantFetch, tt.wantPartition)
			}
		})
	}
}

// TestHeldApplierGoroutines: a processor applies held records in min(max(pool size, 4), 16)
// goroutines (DB_MAX_CONNS is the pool size), and all of them together take at most a quarter of
// the buffer budget's worth of held records at once.
func TestHeldApplierGoroutines(t *testing.T) {
	t.Parallel()
	tests := []struct {
		maxConns int32
		want     int
	}{
		{maxConns: 1, want: 4},
		{maxConns: 4, want: 4},
		{maxConns: 10, want: 10}, // DB_MAX_CONNS's default
		{maxConns: 16, want: 16},
		{maxConns: 100, want: 16},
	}
	const budget = 64 * mib
	for _, tt := range tests {
		t.Run(fmt.Sprintf("DB_MAX_CONNS=%d", tt.maxConns), func(t *testing.T) {
			t.Parallel()
			d := newPromiseProcessor(t, budget, tt.maxConns).heldApplier
			if got := d.workers(); got != tt.want {
				t.Errorf("pool of %d connections: %d held-record goroutines, want %d", tt.maxConns, got, tt.want)
			}
			if all := d.pageBytes() * d.workers(); all > budget/4 || all < budget/4-d.workers() {
				t.Errorf("pool of %d connections: the goroutines' pages hold %d bytes together, want a quarter of the budget, %d",
					tt.maxConns, all, budget/4)
			}
		})
	}
}

// TestPartitionShare: a partition pauses at budget / max(partitions holding records,
// min(partitions assigned, 4)), and at least 64 KiB. So a quarter at most from 4 assigned
// partitions on (a source partition with 3 retry tiers is 4), but a half, a third or all of the
// budget for a processor assigned 2, 3 or 1 partitions, however few of them hold records.
func TestPartitionShare(t *testing.T) {
	t.Parallel()
	const budget = 64 * mib
	tests := []struct {
		name     string
		sources  int
		tiers    int // retry tiers per source partition, all assigned to this processor
		busy     int // partitions holding records
		budget   int64
		want     int64
		wantPart string // the share as a part of the budget, for the message
	}{
		{name: "1 source, no tiers", sources: 1, busy: 1, want: budget, wantPart: "all"},
		{name: "2 sources, no tiers, one busy", sources: 2, busy: 1, want: budget / 2, wantPart: "a half"},
		{name: "3 sources, no tiers, one busy", sources: 3, busy: 1, want: budget / 3, wantPart: "a third"},
		{name: "4 sources, no tiers, one busy", sources: 4, busy: 1, want: budget / 4, wantPart: "a quarter"},
		{name: "8 sources, no tiers, one busy", sources: 8, busy: 1, want: budget / 4, wantPart: "a quarter"},
		{name: "8 sources, no tiers, all busy", sources: 8, busy: 8, want: budget / 8, wantPart: "an eighth"},
		{name: "1 source, 3 tiers, source busy", sources: 1, tiers: 3, busy: 1, want: budget / 4, wantPart: "a quarter"},
		{name: "2 sources, 3 tiers, sources busy", sources: 2, tiers: 3, busy: 2, want: budget / 4, wantPart: "a quarter"},
		{name: "3 sources, 3 tiers, sources busy", sources: 3, tiers: 3, busy: 3, want: budget / 4, wantPart: "a quarter"},
		{name: "4 sources, 3 tiers, all busy", sources: 4, tiers: 3, busy: 16, want: budget / 16, wantPart: "a sixteenth"},
		{name: "8 sources, 3 tiers, sources busy", sources: 8, tiers: 3, busy: 8, want: budget / 8, wantPart: "an eighth"},
		{name: "1 MiB budget, 64 busy: the floor", sources: 64, busy: 64, budget: 1 * mib, want: 64 * kib, wantPart: "64 KiB"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := int64(budget)
			if tt.budget != 0 {
				b = tt.budget
			}
			p := &Processor{buf: newBuffer(int(b))}
			p.nWorkers.Store(int32(tt.sources * (1 + tt.tiers)))
			p.busy.Store(int32(tt.busy))
			if got := p.partitionShare(); got != tt.want {
				t.Errorf("%d assigned partitions, %d holding records: a partition's share is %d of %d, want %d (%s)",
					tt.sources*(1+tt.tiers), tt.busy, got, b, tt.want, tt.wantPart)
			}
		})
	}
}
