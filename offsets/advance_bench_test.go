package offsets_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/offsets"
)

// BenchmarkAdvance is one batch transaction's advance (BEGIN, the advance, COMMIT) with the
// group's pauses: none, or 100 of other topics (the pause check is an index probe either way).
func BenchmarkAdvance(b *testing.B) {
	for _, tc := range []struct {
		name   string
		pauses int
	}{{"no pauses", 0}, {"100 pauses of other topics", 100}} {
		b.Run(tc.name, func(b *testing.B) {
			pool, s := setup(b)
			ctx := context.Background()
			if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.pauses (consumer_group, topic, partition, paused_by, reason)
				SELECT 'g1', 'other' || i, -1, 'bench', 'bench' FROM generate_series(1, $1::int) i`, tc.pauses); err != nil {
				b.Fatal(err)
			}
			pos, err := s.Claim(ctx, pool, "A", []offsets.Partition{{Topic: "a", Partition: 0}})
			if err != nil {
				b.Fatal(err)
			}
			p := pos[0]
			b.ResetTimer()
			for i := range b.N {
				if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return s.Advance(ctx, tx, p, int64(i+1)) }); err != nil {
					b.Fatal(err)
				}
				p = p.Advanced(int64(i + 1))
			}
		})
	}
}
