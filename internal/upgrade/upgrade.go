// Package upgrade reads and closes a schema's upgrade window (package schema): which migrations
// are pending, which members of the schema's groups run which release, and whether the window may
// be finalized — no member of the release before runs.
//
// A member of a group is a member of the release before when the broker describes it and
// group_members has no fresh row of it: processors of this release and later write one every 30
// seconds. A member that joined in the last 30 seconds reads as one of the release before too: a
// refusal that a minute's wait clears, never the other way round.
package upgrade

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/kafkapg/kafkapg/internal/schema"
)

// Member is a member of a group as the broker describes it, and the release it says it runs.
type Member struct {
	Group, MemberID, ClientID, Host string
	// Release is what the member wrote in group_members in the last two minutes; "" if nothing:
	// a process of the release before (or one that joined in the last 30 seconds).
	Release string
}

// Status is a schema's upgrade window and the members of its groups.
type Status struct {
	Finalized int      // the newest version finalized
	Pending   []int    // the versions pending: the window is open while there are any
	Groups    []string // the groups with positions in the schema, or members registered in it
	Members   []Member // nil if Kafka was not asked
}

// Open reports whether the window is open.
func (s Status) Open() bool { return len(s.Pending) > 0 }

// Before returns the members of the release before.
func (s Status) Before() []Member {
	var out []Member
	for _, m := range s.Members {
		if m.Release == "" {
			out = append(out, m)
		}
	}
	return out
}

// Read reads schemaName's window and, with adm (nil: not asked), the members of its groups.
func Read(ctx context.Context, pool *pgxpool.Pool, schemaName string, adm *kadm.Client) (Status, error) {
	var s Status
	var err error
	if s.Finalized, s.Pending, err = schema.Window(ctx, pool, schemaName); err != nil {
		return s, fmt.Errorf("read the upgrade window: %w", err)
	}
	id := func(t string) string { return pgx.Identifier{schemaName, t}.Sanitize() }
	rows, _ := pool.Query(ctx, `SELECT consumer_group FROM `+id("offsets")+`
		UNION SELECT consumer_group FROM `+id("group_members")+` WHERE seen_at > now() - interval '1 day' ORDER BY 1`)
	if s.Groups, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		return s, fmt.Errorf("read the schema's groups: %w", err)
	}
	if adm == nil || len(s.Groups) == 0 {
		return s, nil
	}
	type key struct{ group, member string }
	registered := map[key]string{}
	rows, err = pool.Query(ctx, `SELECT consumer_group, member_id, release FROM `+id("group_members")+` WHERE seen_at > now() - interval '2 minutes'`)
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var g, m, r string
		if err := rows.Scan(&g, &m, &r); err != nil {
			rows.Close()
			return s, err
		}
		registered[key{g, m}] = r
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return s, fmt.Errorf("read group_members: %w", err)
	}
	// A group is of the consumer protocol or the classic one; each describe answers for its own.
	consumer, err := adm.DescribeConsumerGroups(ctx, s.Groups...)
	if err != nil && consumer == nil {
		return s, fmt.Errorf("describe the groups %s (consumer protocol): %w", strings.Join(s.Groups, ", "), err)
	}
	var classic []string
	for _, g := range s.Groups {
		d, ok := consumer[g]
		if !ok || d.Err != nil {
			classic = append(classic, g)
			continue
		}
		for _, m := range d.Members {
			s.Members = append(s.Members, Member{Group: g, MemberID: m.MemberID, ClientID: m.ClientID, Host: m.ClientHost, Release: registered[key{g, m.MemberID}]})
		}
	}
	if len(classic) > 0 {
		described, err := adm.DescribeGroups(ctx, classic...)
		if err != nil && described == nil {
			return s, fmt.Errorf("describe the groups %s: %w", strings.Join(classic, ", "), err)
		}
		for _, g := range classic {
			d, ok := described[g]
			if !ok {
				return s, fmt.Errorf("the broker did not describe group %s", g)
			}
			if d.Err != nil {
				return s, fmt.Errorf("describe group %s: %w", g, d.Err)
			}
			for _, m := range d.Members {
				s.Members = append(s.Members, Member{Group: g, MemberID: m.MemberID, ClientID: m.ClientID, Host: m.ClientHost, Release: registered[key{g, m.MemberID}]})
			}
		}
	}
	slices.SortFunc(s.Members, func(a, b Member) int {
		return strings.Compare(a.Group+"\x00"+a.MemberID, b.Group+"\x00"+b.MemberID)
	})
	return s, nil
}

// ErrBeforeRuns is Finalize's refusal while a member of the release before runs.
var ErrBeforeRuns = errors.New("a process of the release before still runs")

// Finalize closes schemaName's window (schema.Finalize) if no member of the release before runs
// in any of its groups (asked of the broker through adm; nil skips the check: the caller vouches
// for it). It returns the versions finalized.
func Finalize(ctx context.Context, pool *pgxpool.Pool, schemaName string, adm *kadm.Client) ([]int, error) {
	if adm != nil {
		s, err := Read(ctx, pool, schemaName, adm)
		if err != nil {
			return nil, err
		}
		if before := s.Before(); len(before) > 0 {
			var names []string
			for _, m := range before {
				names = append(names, fmt.Sprintf("%s/%s (client %s, host %s)", m.Group, m.MemberID, m.ClientID, m.Host))
			}
			return nil, fmt.Errorf("%w: %d members say no release (the release before, or one that joined in the last 30 s): %s; finish the rollout, wait a minute and run again",
				ErrBeforeRuns, len(before), strings.Join(names, ", "))
		}
	}
	return schema.Finalize(ctx, pool, schemaName)
}
