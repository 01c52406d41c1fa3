package console_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// BenchmarkPages times the console's pages, server side (the request to the last byte), with
// BENCH_DEAD_LETTERS (default 100000) dead letters in the table, one a second up to now: 10
// topics, three classes, most new, some replayed and discarded, each with a history row; and a
// key blocked behind every hundredth of them, ten records held behind each
// (ON_DEAD_LETTER=block). The bar: well under a second.
func BenchmarkPages(b *testing.B) {
	n := 100_000
	if v, err := strconv.Atoi(os.Getenv("BENCH_DEAD_LETTERS")); err == nil && v > 0 {
		n = v
	}
	pool, _ := testenv.Postgres(b)
	ctx := context.Background()
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.dead_letters (consumer_group, topic, partition, "offset", key, value,
			"timestamp", error_class, error_message, attempts, first_failed_at, dead_lettered_at, status, status_changed_at)
		SELECT 'g', 'topic-' || (i % 10), i % 16, i, ('acct-' || (i % 5000))::bytea, convert_to('{"event_id":"e-' || i || '","amount":5}', 'UTF8'),
			0, (ARRAY['retryable','permanent','permanent'])[1 + i % 3], 'ledger event e-' || i || ': ' || (ARRAY['simulated transient failure','poison event','has no account'])[1 + i % 3],
			3, now() - (($1 - i) || ' seconds')::interval, now() - (($1 - i) || ' seconds')::interval,
			CASE WHEN i % 10 = 0 THEN 'replayed' WHEN i % 17 = 0 THEN 'discarded' ELSE 'new' END, now()
		FROM generate_series(1, $1) i`, n); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.dead_letter_events (dead_letter_id, at, event, attempt, error_class, error_message)
		SELECT id, dead_lettered_at, 'dead_lettered', attempts, error_class, error_message FROM kafkapg.dead_letters;
		ANALYZE kafkapg.dead_letters; ANALYZE kafkapg.dead_letter_events`); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.held_keys (consumer_group, topic, partition, key, state, head_offset, held_since, updated_at)
			SELECT consumer_group, topic, partition, key || convert_to('-' || id, 'UTF8'), 'blocked', "offset", dead_lettered_at, dead_lettered_at
			FROM kafkapg.dead_letters WHERE id % 100 = 0;
		INSERT INTO kafkapg.held_records (consumer_group, topic, partition, "offset", key, value, "timestamp", held_at)
			SELECT h.consumer_group, h.topic, h.partition, h.head_offset * 100 + j, h.key, convert_to('{"amount":5}', 'UTF8'), 0, h.held_since
			FROM kafkapg.held_keys h, generate_series(1, 10) j;
		ANALYZE kafkapg.held_keys; ANALYZE kafkapg.held_records`); err != nil {
		b.Fatal(err)
	}
	users, _ := console.ParseUsers("ann:viewer:ann-password-1")
	c, err := console.New(console.Config{Ops: ops.New(pool, "kafkapg", "g"), Users: users, Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	srv := httptest.NewServer(c.Handler())
	defer srv.Close()
	var mid, midOffset int64
	var midTopic string
	var midPartition int32
	if err := pool.QueryRow(ctx, `SELECT id, topic, partition, "offset" FROM kafkapg.dead_letters ORDER BY id LIMIT 1 OFFSET $1`, n/2).
		Scan(&mid, &midTopic, &midPartition, &midOffset); err != nil {
		b.Fatal(err)
	}
	pages := []struct{ name, path string }{
		{"overview", "/"},
		{"dead letters, newest", "/dead-letters"},
		{"dead letters, new permanent of a topic", "/dead-letters?topic=topic-3&class=permanent&status=new"},
		{"dead letters, error text", "/dead-letters?error=poison"},
		{"dead letters, the last hour", "/dead-letters?since=1h"},
		{"dead letters, one key", "/dead-letters?key=acct-42"},
		{"dead letters, an older page", fmt.Sprintf("/dead-letters?before=%d", mid)},
		{"a dead letter", fmt.Sprintf("/dead-letters/%d", mid)},
		{"retry path", "/retry-path"},
		{"trace, a record", fmt.Sprintf("/trace?topic=%s&partition=%d&offset=%d", midTopic, midPartition, midOffset)},
		{"trace, a key", fmt.Sprintf("/trace?topic=%s&key=acct-42", midTopic)},
	}
	for b.Loop() {
		fmt.Printf("\nconsole pages with %d dead letters (server side, median of 5):\n", n)
		for _, p := range pages {
			var times []time.Duration
			for range 5 {
				req, _ := http.NewRequest("GET", srv.URL+p.path, nil)
				req.SetBasicAuth("ann", "ann-password-1")
				start := time.Now()
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				readAll(resp)
				if resp.StatusCode != http.StatusOK {
					b.Fatalf("GET %s: %d", p.path, resp.StatusCode)
				}
				times = append(times, time.Since(start))
			}
			med := median(times)
			b.ReportMetric(float64(med.Microseconds())/1000, "ms_"+strings.NewReplacer(", ", "_", " ", "_").Replace(p.name))
			fmt.Printf("  %-42s %7.1f ms\n", p.name, float64(med.Microseconds())/1000)
		}
	}
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}
