package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/promscrape"
)

// A chain (-handler ledger-forward) runs two stages. Stage 1 is the suite's usual group on its
// usual topic with HANDLER=ledger-forward: the ledger, deduplicated on the event id, emitting a
// posting per applied event to ledger.PostingsTopic(topic) through the outbox. Stage 2 is a group
// of its own on the postings topic with HANDLER=ledger-post: it inserts them into a table without
// a unique constraint, deduplicated on the message id. The producer sends a share of the events
// twice; every fault hits both stages (a kill of stage 1 is also a kill of a relay), and one more
// fault (relayAckLost) makes stage 1's relays publish postings again.
const (
	chainHandler = "ledger-forward"
	postHandler  = "ledger-post"
	copyPerMille = 100
	// skippedMetric counts the records a processor skipped because their idempotency key was
	// applied before.
	skippedMetric = "kafkapg_duplicate_keys_skipped_total"
)

// chainReport is what the chain check found.
type chainReport struct {
	published, posted int
	// copiesSkipped are the records of stage 1's topic neither applied nor dead-lettered: the
	// copies it skipped (measured before the replay only).
	copiesSkipped int
	// republished are the postings stage 2 consumed but did not post: published twice.
	republished int
	// What the processes counted in their metrics (a lower bound: a process counts from its
	// start, and what it counts after its last scrape is lost when it is killed).
	copiesCounted, republishedCounted float64
	// streams is how many streams stage 2 keeps the state of (its deduplication state), and
	// forks how many of them forked upstream (a failover that lost commits).
	streams, forks int
}

// verifyChain waits for stage 2 to have consumed every posting published and checks, from
// Postgres, that every event stage 1 applied (and the replay recovered) was posted exactly once,
// each account's postings in order; that stage 2 dead-lettered nothing; and that each stage
// recorded an idempotency key for every record it applied and for no other.
func (s *suite) verifyChain(ctx context.Context, items []ledger.Item, recovered map[string]bool) (chainReport, error) {
	var rep chainReport
	one, two := s.stages[0], s.stages[1]
	published, err := s.waitPosted(ctx)
	if err != nil {
		return rep, err
	}
	rep.published = published
	var errs []error
	rep.posted, err = ledger.VerifyChainWith(ctx, s.pool, items, maxAttempt, ledger.VerifyOptions{Recovered: recovered, Unordered: s.unordered})
	if err != nil {
		errs = append(errs, fmt.Errorf("ledger_postings (stage 2):\n%w", err))
	}
	var entries, deadOne, deadTwo, keys int
	if err := s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM ledger_entries),
			(SELECT count(*) FROM dead_letters WHERE consumer_group = $1), (SELECT count(*) FROM dead_letters WHERE consumer_group = $2),
			(SELECT count(*) FROM idempotency_keys_0) + (SELECT count(*) FROM idempotency_keys_1) + (SELECT count(*) FROM idempotency_keys_2)
				+ (SELECT count(*) FROM idempotency_keys_3) + (SELECT count(*) FROM idempotency_keys)
				+ (SELECT coalesce(sum(cardinality(keys)), 0) FROM (SELECT keys FROM idempotency_runs_0 UNION ALL SELECT keys FROM idempotency_runs_1
					UNION ALL SELECT keys FROM idempotency_runs_2 UNION ALL SELECT keys FROM idempotency_runs_3) r)`,
		one.group, two.group).Scan(&entries, &deadOne, &deadTwo, &keys); err != nil {
		return rep, err
	}
	if deadTwo > 0 {
		errs = append(errs, fmt.Errorf("stage 2 dead-lettered %d postings (see its dead_letters rows, group %s)", deadTwo, two.group))
	}
	s.mu.Lock()
	forced := s.stats.republished
	s.mu.Unlock()
	if republished := published - rep.posted - deadTwo; republished < forced {
		errs = append(errs, fmt.Errorf("stage 2 consumed %d postings over the ones it posted, but relay-ack-lost made the relays publish %d again", republished, forced))
	}
	// Stage 1 records a key per event it applied. Stage 2 few: the postings are numbered in
	// streams, and decided by key as well only below the first number it observed of a stream and
	// where another stream's event may share their key (after a fork upstream: every restart,
	// failover or restore of its database). Its streams' numbers done are postings applied, or
	// copies and repeats skipped, or dead letters discarded: never more than it consumed.
	var streams, numbered, forks int
	if err := s.pool.QueryRow(ctx, `SELECT count(*), coalesce(sum((x.s->>'high')::int8 - (x.s->>'floor')::int8 + 1
			- (SELECT coalesce(sum(upper(r) - lower(r)), 0) FROM unnest((x.s->>'missing')::int8multirange) AS r)), 0),
			count(*) FILTER (WHERE (x.s->>'fork_seq')::int8 > 0 OR x.ord > 1)
		FROM idempotency_lineages l, jsonb_array_elements(l.state->'streams') WITH ORDINALITY AS x(s, ord)
		WHERE l.consumer_group = $1`, two.group).Scan(&streams, &numbered, &forks); err != nil {
		return rep, err
	}
	if keys < entries {
		errs = append(errs, fmt.Errorf("%d idempotency keys recorded for the %d events stage 1 applied: a key must commit with its event", keys, entries))
	}
	if numbered > published {
		errs = append(errs, fmt.Errorf("stage 2's %d streams (%d forked upstream) say %d postings done with, but it consumed %d", streams, forks, numbered, published))
	}
	rep.streams, rep.forks = streams, forks
	// Every record of a stage's topic was applied, dead-lettered or skipped as a duplicate.
	rep.republished = published - rep.posted - deadTwo
	if recovered == nil { // the replay adds records to stage 1's topics
		rep.copiesSkipped = len(items) - entries - deadOne
	}
	rep.copiesCounted, rep.republishedCounted = s.counted(ctx, one), s.counted(ctx, two)
	return rep, errors.Join(errs...)
}

// waitPosted waits until stage 1 has published every posting it emitted and stage 2 has
// consumed them all (its committed offsets in Postgres reach the end of the postings topic) and
// has nothing in flight; it returns how many postings were published.
func (s *suite) waitPosted(ctx context.Context) (published int, err error) {
	one, two := s.stages[0], s.stages[1]
	cl, err := kgo.NewClient(kgo.SeedBrokers(s.clientSeeds...))
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	var last string
	err = localrun.WaitFor(ctx, s.cfg.settle, func() error {
		ends, err := adm.ListEndOffsets(ctx, two.topic)
		if err == nil {
			err = ends.Error()
		}
		if err != nil {
			return err
		}
		published = 0
		ends.Each(func(o kadm.ListedOffset) { published += int(o.Offset) })
		var consumed int
		if err := s.pool.QueryRow(ctx, `SELECT coalesce(sum(next_offset), 0) FROM offsets WHERE consumer_group = $1 AND topic = $2`,
			two.group, two.topic).Scan(&consumed); err != nil {
			return err
		}
		p1, err := ledger.ReadProgress(ctx, s.pool, schema, one.group)
		if err != nil {
			return err
		}
		p2, err := ledger.ReadProgress(ctx, s.pool, schema, two.group)
		if err != nil {
			return err
		}
		if consumed < published || p1.Outbox > 0 || p2.InFlight() > 0 {
			last = fmt.Sprintf("stage 2 consumed %d of %d postings published; stage 1 has %d outbox rows not yet published; stage 2 has %d outbox rows, %d records in tiers, %d held keys, %d held records",
				consumed, published, p1.Outbox, p2.Outbox, p2.Tiers, p2.HeldKeys, p2.HeldRecords)
			return errors.New(last)
		}
		return nil
	})
	if err != nil {
		if last == "" {
			last = err.Error()
		}
		return published, fmt.Errorf("stage 2 did not settle within %v: %s", s.cfg.settle, last)
	}
	return published, nil
}

// relayAckLost makes stage 1's relays publish again a few of the postings they published last,
// as they do when they die between Kafka's acknowledgement and their commit (a window a SIGKILL
// seldom hits): stage 2 must skip them. Stage 1 keeps its published rows for this
// (OUTBOX_RETENTION): the fault marks them not published.
func (s *suite) relayAckLost(ctx context.Context) error {
	tag, err := s.pool.Exec(ctx, `UPDATE outbox SET published_at = NULL WHERE id IN (SELECT id FROM outbox
		WHERE consumer_group = $1 AND topic = $2 AND published_at IS NOT NULL ORDER BY id DESC LIMIT $3)`,
		s.stages[0].group, s.stages[1].topic, 5+s.rng.IntN(50))
	if err != nil {
		return err
	}
	s.count(func(st *stats) {
		st.acksLost++
		st.republished += int(tag.RowsAffected())
	})
	return nil
}

// tally adds what p counted in skippedMetric to its stage's total, before p ends and its count
// with it.
func (s *suite) tally(p *proc) {
	n, _ := scrapeSkipped(context.Background(), p) // not measured: counted as none
	s.count(func(st *stats) { st.skipped[p.stage.n] += n })
}

// counted returns what st's processes counted in skippedMetric: those that ended and those that
// run.
func (s *suite) counted(ctx context.Context, st *stage) float64 {
	s.mu.Lock()
	n := s.stats.skipped[st.n]
	s.mu.Unlock()
	for _, p := range s.procs {
		if p.stage == st {
			c, _ := scrapeSkipped(ctx, p)
			n += c
		}
	}
	return n
}

// scrapeSkipped reads skippedMetric from p's /metrics.
func scrapeSkipped(ctx context.Context, p *proc) (float64, error) {
	select {
	case <-p.done:
		return 0, errors.New("exited")
	default:
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	sums, err := promscrape.Sums(ctx, "http://"+p.http+"/metrics")
	return sums[skippedMetric], err
}
