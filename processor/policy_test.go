package processor_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// TestTopicPoliciesApplyPerTopic consumes two topics in one processor with different policies:
// "orders" has the default handler, two retry tiers and blocks a key after a dead letter;
// "payments" has its own handler, no retry tiers, one local attempt and a small record bound.
// A record that always fails must take each topic's own path, and only the topics' own tier
// topics may exist.
func TestTopicPoliciesApplyPerTopic(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		h := newHarness(t, k, 1)
		payments := k.CreateTopic(t, 1)
		ctx := context.Background()
		if _, err := h.Pool.Exec(ctx, `CREATE TABLE seen (topic text, key text, handler text, tries int, PRIMARY KEY (topic, key, handler))`); err != nil {
			t.Fatal(err)
		}
		// Each handler counts its calls per key (in its own connection, so that failed tries
		// count too) and fails the key "bad" with a retryable error.
		handler := func(name string) processor.Handler {
			return processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, r *processor.Record) error {
				if _, err := h.Pool.Exec(ctx, `INSERT INTO seen VALUES ($1, $2, $3, 1)
					ON CONFLICT (topic, key, handler) DO UPDATE SET tries = seen.tries + 1`, r.Topic, string(r.Key), name); err != nil {
					return processor.Infrastructure(err)
				}
				if string(r.Key) == "bad" {
					return errors.New("downstream says no")
				}
				return nil
			})
		}
		cfg := h.Config(handler("default"))
		cfg.Topics = []string{h.Topic, payments}
		cfg.RetryTiers = []time.Duration{50 * time.Millisecond, 50 * time.Millisecond}
		cfg.LocalAttempts = 2
		cfg.OnDeadLetter = processor.OnDeadLetterBlock
		cfg.TopicPolicies = map[string]processor.TopicPolicy{
			payments: {
				Handler:        handler("payments"),
				RetryTiers:     []time.Duration{},
				LocalAttempts:  1,
				OnDeadLetter:   processor.OnDeadLetterSkip,
				MaxRecordBytes: 100,
			},
		}
		var logs syncBuffer
		cfg.Logger = slog.New(slog.NewJSONHandler(&logs, nil))
		r := h.Start(cfg)
		// Each topic's settings in force are logged at startup, the policy's and the defaults.
		testenv.Eventually(t, 30*time.Second, func() error {
			want := []string{
				`"topic":"` + payments + `","handler":"processor.HandlerFunc","retry_tiers":"[]","tier_topics":[],"dlq_topic":"` + retrytopics.DLQTopic(payments, h.Group) + `","local_attempts":1,"on_dead_letter":"skip","max_record_bytes":100,"idempotency_key":"none"`,
				`"topic":"` + h.Topic + `","handler":"processor.HandlerFunc","retry_tiers":"[50ms 50ms]","tier_topics":["` + retrytopics.TierTopic(h.Topic, h.Group, 1) + ` after 50ms","` + retrytopics.TierTopic(h.Topic, h.Group, 2) + ` after 50ms"]`,
				`"local_attempts":2,"on_dead_letter":"block","max_record_bytes":1048576`, `"msg":"topic settings"`,
			}
			for _, w := range want {
				if !strings.Contains(logs.String(), w) {
					return fmt.Errorf("the logs do not say %s:\n%s", w, logs.String())
				}
			}
			return nil
		})
		for _, topic := range []string{h.Topic, payments} {
			k.Produce(t,
				&kgo.Record{Topic: topic, Key: []byte("bad"), Value: []byte("1")},
				&kgo.Record{Topic: topic, Key: []byte("bad"), Value: []byte("2")},
				&kgo.Record{Topic: topic, Key: []byte("big"), Value: make([]byte, 200)},
			)
		}
		want := map[string]int{
			// orders: 2 local tries on each of 3 deliveries (source, tier 1, tier 2); the key's
			// second record stays held behind the dead letter (block); 200 bytes fit 1 MiB.
			h.Topic + "/bad/default": 6, h.Topic + "/big/default": 1,
			// payments: 1 try, then the DLQ; the key's second record is applied (skip) and fails
			// alike; the big record never reaches the handler.
			payments + "/bad/payments": 2,
		}
		testenv.Eventually(t, 60*time.Second, func() error {
			got := map[string]int{}
			rows, err := h.Pool.Query(ctx, `SELECT topic || '/' || key || '/' || handler, tries FROM seen`)
			if err != nil {
				return err
			}
			var name string
			var n int
			if _, err := pgx.ForEachRow(rows, []any{&name, &n}, func() error { got[name] = n; return nil }); err != nil {
				return err
			}
			var dead []string
			rows, err = h.Pool.Query(ctx, `SELECT d FROM (SELECT topic || '/' || encode(key, 'escape') || '/' || error_class || '/' || attempts AS d
				FROM kafkapg.dead_letters) AS dl ORDER BY d COLLATE "C"`)
			if err != nil {
				return err
			}
			if _, err := pgx.ForEachRow(rows, []any{&name}, func() error { dead = append(dead, name); return nil }); err != nil {
				return err
			}
			wantDead := fmt.Sprint(slices.Sorted(slices.Values([]string{h.Topic + "/bad/retryable/3", payments + "/bad/retryable/1", payments + "/bad/retryable/1", payments + "/big/permanent/1"})))
			if fmt.Sprint(got) != fmt.Sprint(want) || fmt.Sprint(dead) != wantDead {
				return fmt.Errorf("handler calls %v, want %v; dead letters %v, want %v", got, want, dead, wantDead)
			}
			return nil
		})
		var held int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.held_records WHERE topic = $1`, h.Topic).Scan(&held); err != nil || held != 1 {
			t.Errorf("held records of %s = %d (%v), want 1 (behind the blocked key)", h.Topic, held, err)
		}
		if got := r.Counter("kafkapg_records_retried_total"); got != 2 {
			t.Errorf("kafkapg_records_retried_total = %v, want 2 (orders' tiers 1 and 2)", got)
		}
		topics, err := kadm.NewClient(k.Client(t)).ListTopics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, tt := range []struct {
			topic string
			want  bool
		}{
			{retrytopics.TierTopic(h.Topic, h.Group, 2), true},
			{retrytopics.TierTopic(h.Topic, h.Group, 3), false},
			{retrytopics.TierTopic(payments, h.Group, 1), false},
			{retrytopics.DLQTopic(payments, h.Group), true},
		} {
			if topics.Has(tt.topic) != tt.want {
				t.Errorf("topic %s exists: %v, want %v", tt.topic, topics.Has(tt.topic), tt.want)
			}
		}
	})
}

// syncBuffer is a bytes.Buffer for a logger that goroutines write to while a test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
