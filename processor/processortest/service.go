package processortest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/handlertest"
	"github.com/kafkapg/kafkapg/internal/pgcluster"
	"github.com/kafkapg/kafkapg/internal/testdb"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/service"
	"github.com/kafkapg/kafkapg/sink"
)

// DB returns a pool on a new, empty database for the test, dropped when the test ends. The
// database is on the server at TEST_DATABASE_URL (a URL whose user may CREATE DATABASE) if that
// is set; otherwise on a throwaway server that the test binary starts once, from the PostgreSQL
// server binaries (initdb and postgres, found through pg_config, /usr/lib/postgresql/*/bin or
// PATH; nothing needs to be running), on a free port of 127.0.0.1 with a random password (no other
// local user may log in), and that stops, its files
// removed, when the test binary exits. So `go test ./...` runs handler tests with no setup on a
// machine that has the binaries (apt-get install postgresql, brew install postgresql@16).
func DB(t testing.TB) *pgxpool.Pool {
	t.Helper()
	base := os.Getenv("TEST_DATABASE_URL")
	if base == "" {
		var err error
		if base, err = throwaway(); err != nil {
			t.Fatal(err)
		}
	}
	pool, _ := testdb.New(t, base, "TEST_DATABASE_URL")
	return pool
}

// throwaway starts the test binary's own Postgres server, once, and returns its URL.
var throwaway = sync.OnceValues(func() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// A password of its own: without one, any local user would be its superuser while it runs.
	pw := make([]byte, 16)
	if _, err := rand.Read(pw); err != nil {
		return "", err
	}
	s, err := pgcluster.Start(ctx, pgcluster.Options{Password: hex.EncodeToString(pw)})
	if err == nil {
		err = s.CloseWhenProcessExits()
	}
	if err != nil {
		if s != nil {
			s.Close()
		}
		return "", fmt.Errorf("processortest: TEST_DATABASE_URL is not set, and a throwaway Postgres could not be started from the PostgreSQL server binaries: %v\n"+
			"Install them (apt-get install postgresql, brew install postgresql@16), or set TEST_DATABASE_URL to a server where this user may CREATE DATABASE", err)
	}
	return s.URL("postgres"), nil
})

// Service runs records through a service's handler the way the service runs a batch of one of
// its topics: the record bound, the handler's idempotency key (a duplicate of a record applied
// before is skipped, not handled), the handler, and, for a failure, the path the record would
// take under the topic's policy — the handler's Go settings (service.Handler) over the
// service's defaults. Records that succeed are committed, with their idempotency keys, as the
// service commits them; a failure is rolled back. The TOPIC_<topic>_* and service-wide
// environment variables are not read: set what a test needs on the Handler, or in Policy.
type Service struct {
	// Group is the consumer group, which names the retry and dead-letter topics; "test" unless
	// set.
	Group string
	// Policy, if it sets a field, overrides the handler's Go setting of it, as TOPIC_<topic>_*
	// does in the service.
	Policy processor.TopicPolicy

	t  testing.TB
	db *pgxpool.Pool
	h  service.Handler
}

// NewService prepares db as the service's startup does — kafkapg's tables, then h.Setup — and
// returns a Service that runs records through h.
func NewService(t testing.TB, db *pgxpool.Pool, h service.Handler) *Service {
	t.Helper()
	ctx := t.Context()
	if err := processor.Migrate(ctx, db, "kafkapg"); err != nil {
		t.Fatalf("processortest: kafkapg's tables: %v", err)
	}
	if h.Setup != nil {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatalf("processortest: begin: %v", err)
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		if err := h.Setup(ctx, tx); err != nil {
			t.Fatalf("processortest: handler %q's Setup: %v", h.Name, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("processortest: handler %q's Setup: %v", h.Name, err)
		}
	}
	return &Service{Group: "test", t: t, db: db, h: h}
}

// Run runs recs, records of one topic, as one batch of a partition (give them the partition
// and offsets you want the processor's; NewRecord's are partition 0, offset 0), commits what they
// did if they succeed, and reports the outcome.
func (s *Service) Run(recs ...*processor.Record) Result {
	s.t.Helper()
	if len(recs) == 0 {
		return Result{Index: -1}
	}
	topic := recs[0].Topic
	for _, r := range recs[1:] {
		if r.Topic != topic {
			s.t.Fatalf("processortest: Service.Run takes the records of one topic, got %q and %q", topic, r.Topic)
		}
	}
	ctx := s.t.Context()
	tx, err := s.db.Begin(ctx)
	if err != nil {
		s.t.Fatalf("processortest: begin: %v", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	out := handlertest.TryTopic(ctx, tx, s.config(topic), topic, recs)
	res := Result{Err: out.Err, Class: processor.ErrorClass(out.Class), Index: out.Index, Duplicates: out.Duplicates}
	if out.Err != nil {
		res.Next = pathOf(res.Class, out)
		return res
	}
	res.Emitted = out.Emitted.([]sink.Event)
	if err := tx.Commit(ctx); err != nil {
		s.t.Fatalf("processortest: commit: %v", err)
	}
	return res
}

// config is the processor configuration the service would have for topic.
func (s *Service) config(topic string) *processor.Config {
	tp := processor.TopicPolicy{
		Handler:        s.h.Handler,
		IdempotencyKey: s.h.IdempotencyKey,
		RetryTiers:     s.h.RetryTiers,
		LocalAttempts:  s.h.LocalAttempts,
		OnDeadLetter:   s.h.OnDeadLetter,
		MaxRecordBytes: s.h.MaxRecordBytes,
		Concurrency:    s.h.Concurrency,
	}
	p := s.Policy
	if p.Handler != nil {
		tp.Handler = p.Handler
	}
	if p.IdempotencyKey != nil {
		tp.IdempotencyKey = p.IdempotencyKey
	}
	if p.RetryTiers != nil {
		tp.RetryTiers = p.RetryTiers
	}
	if p.LocalAttempts != 0 {
		tp.LocalAttempts = p.LocalAttempts
	}
	if p.OnDeadLetter != "" {
		tp.OnDeadLetter = p.OnDeadLetter
	}
	if p.MaxRecordBytes != 0 {
		tp.MaxRecordBytes = p.MaxRecordBytes
	}
	if p.Concurrency != 0 {
		tp.Concurrency = p.Concurrency
	}
	return &processor.Config{Group: s.Group, Topics: []string{topic}, Schema: "kafkapg",
		TopicPolicies: map[string]processor.TopicPolicy{topic: tp}}
}

// Path is where a record that failed goes, under its topic's policy, as first delivered.
type Path struct {
	// InPlace: the failure is an outage (processor.ClassInfrastructure): the batch is retried
	// where it is, without counting an attempt, until it passes; it goes nowhere.
	InPlace bool
	// LocalAttempts is how many times in all a retryable failure is tried in process before it
	// leaves for the first tier (and again at each tier).
	LocalAttempts int
	// Tiers are the retry tiers a retryable failure then goes through, in order.
	Tiers []Tier
	// DeadLetterTopic is where it ends: a permanent failure at once, a retryable one after the
	// tiers; a row of the dead_letters table too.
	DeadLetterTopic string
	// BlocksKey: once it is dead-lettered, the later records of its key wait for an operator
	// (OnDeadLetterBlock), instead of going on.
	BlocksKey bool
}

// Tier is a retry tier: its topic, and how long after a failure a record in it is due.
type Tier struct {
	Topic string
	Delay time.Duration
}

// String describes the path: "retried in place", or "tried 3 times, then orders.test.retry.1
// (after 1s), …, then dead-lettered to orders.test.dlq".
func (p Path) String() string {
	if p.InPlace {
		return "retried in place until it passes (an outage: no attempt counted)"
	}
	if p.DeadLetterTopic == "" {
		return "nowhere"
	}
	var b strings.Builder
	if p.LocalAttempts > 0 {
		fmt.Fprintf(&b, "tried %d times, then ", p.LocalAttempts)
		for _, t := range p.Tiers {
			fmt.Fprintf(&b, "%s (after %s, tried %d times), then ", t.Topic, t.Delay, p.LocalAttempts)
		}
		fmt.Fprintf(&b, "dead-lettered to %s", p.DeadLetterTopic)
	} else {
		fmt.Fprintf(&b, "dead-lettered at once to %s", p.DeadLetterTopic)
	}
	if p.BlocksKey {
		b.WriteString("; later records of its key wait for an operator")
	}
	return b.String()
}

// pathOf is the path of a record that failed with class.
func pathOf(class processor.ErrorClass, out handlertest.Outcome) Path {
	switch class {
	case processor.ClassInfrastructure:
		return Path{InPlace: true}
	case processor.ClassPermanent:
		return Path{DeadLetterTopic: out.DLQTopic, BlocksKey: out.Block}
	}
	p := Path{LocalAttempts: out.LocalAttempts, DeadLetterTopic: out.DLQTopic, BlocksKey: out.Block}
	for i, t := range out.TierTopics {
		p.Tiers = append(p.Tiers, Tier{Topic: t, Delay: out.TierDelays[i]})
	}
	return p
}
