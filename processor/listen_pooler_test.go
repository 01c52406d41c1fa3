package processor

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/pgcluster"
)

// TestTheRelayPollsThroughAPooler: configuration.md and deploy/README.md say that the outbox
// relay LISTENs on a connection of its own, except through a pooler in transaction mode, which
// does not pass notifications on: there it polls. A processor that reaches Postgres directly
// gives the relay a connection to LISTEN on; one that reaches it through PgBouncer in transaction
// mode gives it none (a LISTEN there would run, and then hear nothing).
func TestTheRelayPollsThroughAPooler(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	if err := srv.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	b, err := pgcluster.StartBouncer(ctx, pgcluster.BouncerOptions{Backend: srv.Addr(), PoolMode: "transaction", DefaultPoolSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)

	for _, c := range []struct {
		name   string
		url    string
		listen bool
	}{
		{"direct", srv.URL("app"), true},
		{"through PgBouncer in transaction mode", b.URL("app") + "&default_query_exec_mode=cache_describe", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			pool, err := pgxpool.New(ctx, c.url)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			cfg := validConfig()
			cfg.Logger = slog.New(slog.DiscardHandler)
			p, err := New(pool, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if err := p.checkPooler(ctx); err != nil {
				t.Fatal(err)
			}
			if got := p.listenConfig() != nil; got != c.listen {
				t.Errorf("the relay LISTENs: %v, want %v", got, c.listen)
			}
		})
	}
}
