package processor

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/internal/schema"
)

// The upgrade window (package schema): while the schema has migrations the release before does
// not know pending, its processors may run beside this release's in a group, or again after a
// rollback. They look idempotency keys up in idempotency_keys only and know nothing of streams.
// So while the window is open this release's processors record every key in that table as well
// (keyring.Ring.SetWindow) and decide every numbered record by key as well (keyAll); once it is
// finalized, numbered records stay decided by key for a retention more (schema.Finalize extends
// the groups' windows of keys), as the release before's copies may still come.

// Release is this release's name, as group_members and the changelog (CHANGELOG.md) say it.
const Release = "v0.2.0"

// windowEvery is how often a processor reads the window again: how long, at most, it writes
// for the release before after the window closed.
var windowEvery = 30 * time.Second

// readWindow reads the upgrade window and, with streams, the group's window of keys, and sets
// what they decide.
func (p *Processor) readWindow(ctx context.Context) error {
	_, pending, err := schema.Window(ctx, p.pool, p.cfg.Schema)
	if err != nil {
		return err
	}
	open := len(pending) > 0
	if was := p.window.Swap(open); was != open || !p.windowRead.Swap(true) {
		p.keys.SetWindow(p.cfg.Group, open)
		p.metrics.windowOpen.Set(b2f(open))
		if open {
			p.log.Info("the upgrade window is open: keys are recorded for the release before as well, and numbered events decided by key as well, until it is finalized (docs/upgrading.md)",
				"pending_migrations", pending)
		} else if was {
			p.log.Info("the upgrade window was finalized: keys are recorded in the key ring only")
		}
	}
	if p.streamsOn() {
		var until time.Time
		if err := p.pool.QueryRow(ctx, p.streamSQL.groupWindow, p.cfg.Group, p.cfg.IdempotencyRetention).Scan(&until); err != nil {
			return err
		}
		p.keysAllUntil.Store(until.UnixMilli())
	}
	return nil
}

// watchWindow reads the upgrade window every every (windowEvery) until ctx is done, and says which
// release this member runs as soon as it is in the group (then every windowEvery: a member id
// changes when it joins again).
func (p *Processor) watchWindow(ctx context.Context, every time.Duration) {
	t := time.NewTicker(min(every, 2*time.Second))
	defer t.Stop()
	var read, registered, failed time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if time.Since(read) >= every {
			read = time.Now()
			if err := p.readWindow(ctx); err != nil && ctx.Err() == nil {
				p.log.Warn("cannot read the upgrade window; will try again", "err", err, "every", every.String())
			}
		}
		if (time.Since(registered) >= every || p.member() != p.registered()) && time.Since(failed) >= every {
			switch err := p.registerMember(ctx); {
			case err != nil && ctx.Err() == nil:
				failed = time.Now() // tried again after every, not at each tick: one warning per try
				p.log.Warn("cannot say which release this member runs (group_members); will try again", "err", err, "every", every.String())
			case err == nil && p.registered() != "":
				registered = time.Now()
			}
		}
	}
}

// registered is the member id group_members has for this process ("" none).
func (p *Processor) registered() string {
	s, _ := p.registeredAs.Load().(string)
	return s
}

// member is this process's member id in the group ("" out of it).
func (p *Processor) member() string {
	if cl := p.client.Load(); cl != nil {
		m, _ := cl.GroupMetadata()
		return m
	}
	return ""
}

// registerMember says, in group_members, that this process's member of the group runs this
// release: `upgrade finalize` takes a member the broker knows and this table does not for one of
// the release before. Rows not seen for a day go.
func (p *Processor) registerMember(ctx context.Context) error {
	member := p.member()
	if member == "" {
		p.registeredAs.Store("")
		return nil // not in the group (yet)
	}
	t := pgx.Identifier{p.cfg.Schema, "group_members"}.Sanitize()
	_, err := p.pool.Exec(ctx, `WITH gone AS (DELETE FROM `+t+` WHERE seen_at < now() - interval '1 day')
		INSERT INTO `+t+` (consumer_group, member_id, release, schema_version, instance, seen_at) VALUES ($1, $2, $3, $4, $5, now())
		ON CONFLICT (consumer_group, member_id) DO UPDATE SET release = excluded.release, schema_version = excluded.schema_version,
			instance = excluded.instance, seen_at = excluded.seen_at`,
		p.cfg.Group, member, Release, schema.Version(), p.cfg.InstanceName)
	if err == nil {
		p.registeredAs.Store(member)
	}
	return err
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
