package schema_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/schema"
)

// BenchmarkUpgradeStallsTheReleaseBefore measures what the upgrade from the release before's
// schema (5) costs its processors, which run on through it: the longest one of their hot
// statements (a batch's position update on offsets, a dead letter's insert: the two tables the
// migrations touch) waits while Migrate runs, with BENCH_DEAD_LETTERS rows in dead_letters (an
// index is built on it). Reported: stall-ms (the longest statement), migrate-ms, and the
// statements' count.
func BenchmarkUpgradeStallsTheReleaseBefore(b *testing.B) {
	deadLetters := 100_000
	if v, err := strconv.Atoi(os.Getenv("BENCH_DEAD_LETTERS")); err == nil && v > 0 {
		deadLetters = v
	}
	for range b.N {
		pool, _ := testenv.Postgres(b)
		ctx := context.Background()
		if _, err := schema.MigrateTo(ctx, pool, "kp", schema.PreviousSchema); err != nil {
			b.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `INSERT INTO kp.offsets (consumer_group, topic, partition, next_offset) SELECT 'g', 't', p, 0 FROM generate_series(0, 63) p`); err != nil {
			b.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `INSERT INTO kp.dead_letters (consumer_group, topic, partition, "offset", key, value, header_keys, header_values,
				"timestamp", error_class, error_message, attempts, first_failed_at)
			SELECT 'g', 't', i % 64, i, convert_to('k' || i, 'UTF8'), convert_to(repeat('v', 200), 'UTF8'), '{}', '{}', 0, 'permanent', 'm', 1, now()
			FROM generate_series(1, $1) i`, deadLetters); err != nil {
			b.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `ANALYZE`); err != nil {
			b.Fatal(err)
		}
		stop := make(chan struct{})
		var mu sync.Mutex
		var longest time.Duration
		var n int
		var wg sync.WaitGroup
		for w := range 4 { // four partitions' workers of the release before
			wg.Go(func() {
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					t0 := time.Now()
					var err error
					if i%10 == 9 {
						_, err = pool.Exec(ctx, `INSERT INTO kp.dead_letters (consumer_group, topic, partition, "offset", key, value, header_keys, header_values,
							"timestamp", error_class, error_message, attempts, first_failed_at) VALUES ('g', 't', $1, $2, 'k', 'v', '{}', '{}', 0, 'permanent', 'm', 1, now())`, w, -i)
					} else {
						_, err = pool.Exec(ctx, `UPDATE kp.offsets SET next_offset = next_offset + 1, updated_at = now() WHERE consumer_group = 'g' AND topic = 't' AND partition = $1`, (w*16+i)%64)
					}
					if err != nil {
						b.Error(err)
						return
					}
					d := time.Since(t0)
					mu.Lock()
					longest, n = max(longest, d), n+1
					mu.Unlock()
				}
			})
		}
		time.Sleep(200 * time.Millisecond) // the workers running
		t0 := time.Now()
		if _, err := schema.Migrate(ctx, pool, "kp"); err != nil {
			b.Fatal(err)
		}
		took := time.Since(t0)
		time.Sleep(200 * time.Millisecond)
		close(stop)
		wg.Wait()
		b.ReportMetric(float64(longest.Microseconds())/1000, "stall-ms")
		b.ReportMetric(float64(took.Microseconds())/1000, "migrate-ms")
		b.ReportMetric(float64(n), "statements")
		b.Log(fmt.Sprintf("%d dead letters: migrate %v, the release before's longest statement %v (%d statements)", deadLetters, took, longest, n))
	}
}
