package bench

import (
	"context"
	"fmt"
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/pgcluster"
)

// BenchmarkPgBouncer applies the same ledger events with the processor and the ledger handler
// three ways in one run and reports records/s:
//
//   - direct: to Postgres, with pgx's default query mode (named statements, prepared once per
//     connection);
//   - direct, cache_describe: to Postgres, in the mode kafkapg uses through a transaction pooler
//     (statements sent unnamed, their descriptions cached), to tell the mode's cost from the
//     pooler's;
//   - pgbouncer: through Debian's PgBouncer in transaction mode, with as many server sessions as
//     the pool has connections, in that mode.
//
// BENCH_EVENTS (default 300000) and BENCH_ROUNDS (default 3) as for BenchmarkLedgerEndToEnd.
func BenchmarkPgBouncer(b *testing.B) {
	events := envInt("BENCH_EVENTS", 300_000)
	rounds := envInt("BENCH_ROUNDS", 3)
	k := brokerFor(b)
	topic := ledgerTopic(b, k, events)

	var bouncer *pgcluster.Bouncer
	describe := func(raw string) string {
		u, err := url.Parse(raw)
		if err != nil {
			b.Fatal(err)
		}
		q := u.Query()
		q.Set("default_query_exec_mode", "cache_describe")
		u.RawQuery = q.Encode()
		return u.String()
	}
	through := func(raw string) string {
		u, err := url.Parse(describe(raw))
		if err != nil {
			b.Fatal(err)
		}
		if bouncer == nil {
			pw, _ := u.User.Password() // make bench's throwaway Postgres asks for one
			if bouncer, err = pgcluster.StartBouncer(context.Background(), pgcluster.BouncerOptions{
				Backend: u.Host, PoolMode: "transaction", DefaultPoolSize: poolConns + 2, Password: pw,
			}); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(bouncer.Close)
		}
		u.Host = bouncer.Addr()
		return u.String()
	}
	for b.Loop() {
		var direct, cached, pooled []float64
		runs := 0 // each run is a group of its own
		run := func(name string, via func(string) string) float64 {
			runs++
			return measureVia(b, name, topic, events, "ledger_entries", via, func(pool *pgxpool.Pool) func(context.Context) error {
				return kafkapg(b, k, topic, pool, runs)
			})
		}
		for range rounds {
			direct = append(direct, run("direct", nil))
			cached = append(cached, run("direct, cache_describe", describe))
			pooled = append(pooled, run("pgbouncer", through))
		}
		d, c, p := median(direct), median(cached), median(pooled)
		b.ReportMetric(d, "direct_rec/s")
		b.ReportMetric(c, "direct_cache_describe_rec/s")
		b.ReportMetric(p, "pgbouncer_rec/s")
		b.ReportMetric(p/d, "x_direct")
		fmt.Printf("\nledger handler through PgBouncer (transaction mode, %d server sessions), %s broker, %d events over %d partitions, median of %d rounds:\n",
			poolConns+2, k.Name, events, partitions, rounds)
		fmt.Printf("  direct, pgx's default mode        %9.0f records/s   rounds %v\n", d, rounded(direct))
		fmt.Printf("  direct, cache_describe            %9.0f records/s   rounds %v\n", c, rounded(cached))
		fmt.Printf("  through pgbouncer, cache_describe %9.0f records/s   rounds %v\n", p, rounded(pooled))
		fmt.Printf("  pgbouncer / direct = %.2f; cache_describe / default mode, both direct = %.2f\n\n", p/d, c/d)
	}
}
