package sink_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/sink"
)

func TestRelayPublishesAndDeletes(t *testing.T) {
	t.Parallel()
	pool, s, pos := setup(t)
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 1)
	ctx := context.Background()
	msgs := []sink.Message{
		{Topic: topic, Key: []byte("a"), Value: []byte("1")},
		{Topic: topic, Key: nil, Value: []byte("2")},
		{Topic: topic, Key: []byte("c"), Value: []byte("3")},
	}
	if err := s.Apply(ctx, pos, 1, nil, msgs); err != nil {
		t.Fatal(err)
	}
	published := 0
	relay := sink.NewRelay(pool, k.Client(t), sink.RelayConfig{Schema: "kafkapg", Group: "g", BatchSize: 2,
		Published: func(sink.Message, time.Duration) { published++ }})
	n, err := relay.Flush(ctx)
	if err != nil || n != 3 || published != 3 {
		t.Fatalf("Flush = %d, %v (published %d); want 3", n, err, published)
	}
	if got := count(t, pool, "kafkapg.outbox"); got != 0 {
		t.Fatalf("%d outbox rows left after publishing", got)
	}
	recs := k.ReadAll(t, topic)
	if len(recs) != 3 {
		t.Fatalf("%d records on the topic, want 3", len(recs))
	}
	for i, r := range recs {
		if string(r.Value) != string(msgs[i].Value) || string(r.Key) != string(msgs[i].Key) {
			t.Errorf("record %d = %q/%q, want %q/%q (in order)", i, r.Key, r.Value, msgs[i].Key, msgs[i].Value)
		}
	}

	// Another group's rows are not this relay's.
	other := sink.NewRelay(pool, k.Client(t), sink.RelayConfig{Schema: "kafkapg", Group: "other"})
	if err := s.Apply(ctx, pos.Advanced(1), 2, nil, msgs[:1]); err != nil {
		t.Fatal(err)
	}
	if n, err := other.Flush(ctx); n != 0 || err != nil {
		t.Fatalf("relay of another group published %d rows (%v)", n, err)
	}

}

// TestRelayRefusalHoldsUpNothing: a record Kafka refuses for good (here: larger than the
// producer's batch limit, and larger than the topic's max.message.bytes) must not hold up the
// records published with it, nor be published again and again. Without a Refused hook it is set
// aside in the outbox with Kafka's answer; with one, its replacement is published.
func TestRelayRefusalHoldsUpNothing(t *testing.T) {
	t.Parallel()
	pool, s, pos := setup(t)
	k := testenv.NewKfake(t)
	ctx := context.Background()
	small := k.CreateTopic(t, 1)
	// A topic whose limit the broker enforces: the producer accepts the record, the broker
	// refuses the whole batch it travels in.
	strict := k.TopicName(t) + "_strict"
	if _, err := kadm.NewClient(k.Client(t)).CreateTopic(ctx, 1, 1, map[string]*string{"max.message.bytes": kadm.StringPtr("4000")}, strict); err != nil {
		t.Fatal(err)
	}
	msgs := []sink.Message{
		{Topic: small, Key: []byte("a"), Value: []byte("1")},
		{Topic: small, Key: []byte("huge"), Value: random(1_100_000)}, // over the producer's limit
		{Topic: strict, Key: []byte("b"), Value: []byte("2")},
		{Topic: strict, Key: []byte("mid"), Value: random(6000)}, // over the topic's limit (compressed too)
		{Topic: strict, Key: []byte("c"), Value: []byte("3")},
		{Topic: small, Key: []byte("d"), Value: []byte("4")},
	}
	if err := s.Apply(ctx, pos, 1, nil, msgs); err != nil {
		t.Fatal(err)
	}
	relay := sink.NewRelay(pool, k.Client(t), sink.RelayConfig{Schema: "kafkapg", Group: "g"})
	n, err := relay.Flush(ctx)
	if err != nil || n != 4 {
		t.Fatalf("Flush = %d, %v; want the 4 records Kafka takes published, without error", n, err)
	}
	var got []string
	for _, topic := range []string{small, strict} {
		for _, r := range k.ReadAll(t, topic) {
			got = append(got, string(r.Key))
		}
	}
	if fmt.Sprint(got) != "[a d b c]" {
		t.Errorf("published %v, want [a d b c], each once", got)
	}
	rows, err := pool.Query(ctx, `SELECT key, refused_error FROM kafkapg.outbox WHERE refused_at IS NOT NULL ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	var aside []string
	var key []byte
	var why string
	if _, err := pgx.ForEachRow(rows, []any{&key, &why}, func() error {
		if !strings.Contains(why, "MESSAGE_TOO_LARGE") {
			t.Errorf("row %q set aside with %q; want Kafka's answer", key, why)
		}
		aside = append(aside, string(key))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(aside) != "[huge mid]" || count(t, pool, "kafkapg.outbox") != 2 {
		t.Errorf("set aside %v (%d rows left); want [huge mid] and nothing else", aside, count(t, pool, "kafkapg.outbox"))
	}
	if n, err := relay.Flush(ctx); n != 0 || err != nil {
		t.Errorf("a second Flush published %d (%v): set-aside rows must not be tried again", n, err)
	}
	if b, err := relay.Backlog(ctx); err != nil || b.Waiting != 0 || b.SetAside != 2 || b.Oldest != 0 {
		t.Errorf("Backlog = %+v, %v; want nothing waiting and 2 set aside", b, err)
	}

	// A row edited by hand so that it no longer reads back into a record (two header keys, one
	// value) is set aside too, without holding up the row after it.
	if _, err := pool.Exec(ctx, `INSERT INTO kafkapg.outbox (consumer_group, topic, key, value, header_keys, header_values)
		VALUES ('g', $1, 'bad', 'x', '{a,b}', '{1}'), ('g', $1, 'e', '5', '{}', '{}')`, small); err != nil {
		t.Fatal(err)
	}
	if n, err := relay.Flush(ctx); n != 1 || err != nil {
		t.Errorf("Flush with an unreadable row = %d, %v; want the good row published", n, err)
	}
	var bad string
	if err := pool.QueryRow(ctx, `SELECT refused_error FROM kafkapg.outbox WHERE key = 'bad' AND refused_at IS NOT NULL`).Scan(&bad); err != nil || !strings.Contains(bad, "header") {
		t.Errorf("the unreadable row: %q, %v; want it set aside saying why", bad, err)
	}

	// With a hook, the writer takes the refused record back and says what replaces it.
	if err := s.Apply(ctx, pos.Advanced(1), 2, nil, msgs[1:2]); err != nil {
		t.Fatal(err)
	}
	var refusals []error
	hooked := sink.NewRelay(pool, k.Client(t), sink.RelayConfig{Schema: "kafkapg", Group: "g",
		Refused: func(_ context.Context, _ pgx.Tx, m sink.Message, refusal error) (*sink.Message, error) {
			refusals = append(refusals, refusal)
			m.Value = []byte("smaller")
			return &m, nil
		}})
	if n, err := hooked.Flush(ctx); n != 0 || err != nil {
		t.Fatalf("Flush = %d, %v", n, err)
	}
	if n, err := hooked.Flush(ctx); n != 1 || err != nil {
		t.Fatalf("Flush of the replacement = %d, %v", n, err)
	}
	if len(refusals) != 1 || !sink.IsRefusal(refusals[0]) {
		t.Errorf("hook called with %v, want one refusal", refusals)
	}
	recs := k.ReadAll(t, small)
	if last := recs[len(recs)-1]; string(last.Key) != "huge" || string(last.Value) != "smaller" {
		t.Errorf("last record %q=%q, want the replacement", last.Key, last.Value)
	}
}

// TestRelayTransactionIsIdleBounded: a relay that stops answering while it holds outbox rows (a
// frozen process; here, its produce hangs on a cut network) holds them from the other relays for
// at most its TxIdleTimeout: Postgres ends its transaction.
func TestRelayTransactionIsIdleBounded(t *testing.T) {
	t.Parallel()
	pool, s, pos := setup(t)
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 1)
	ctx := context.Background()
	cutOff := testenv.NewNetFault()
	frozenClient := k.Client(t, kgo.Dialer(cutOff.Dial))
	frozen := sink.NewRelay(pool, frozenClient, sink.RelayConfig{Schema: "kafkapg", Group: "g",
		TxIdleTimeout: time.Second, PublishTimeout: time.Minute})
	// A first record, published while the network is up: the relay knows the topic exists.
	if err := s.Apply(ctx, pos, 1, nil, []sink.Message{{Topic: topic, Key: []byte("k"), Value: []byte("v0")}}); err != nil {
		t.Fatal(err)
	}
	if n, err := frozen.Flush(ctx); n != 1 || err != nil {
		t.Fatalf("Flush = %d, %v", n, err)
	}
	if err := s.Apply(ctx, pos.Advanced(1), 2, nil, []sink.Message{{Topic: topic, Key: []byte("k"), Value: []byte("v")}}); err != nil {
		t.Fatal(err)
	}
	cutOff.Cut()
	frozenDone := make(chan struct{})
	go func() {
		defer close(frozenDone)
		frozen.Flush(ctx)
	}()
	t.Cleanup(func() { cutOff.Restore(); <-frozenDone })
	testenv.Eventually(t, 10*time.Second, func() error { // the frozen relay holds the row's lane
		var locked int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&locked); err != nil {
			return err
		}
		if locked == 0 {
			return errors.New("the lane is not locked yet")
		}
		return nil
	})
	began := time.Now()
	other := sink.NewRelay(pool, k.Client(t), sink.RelayConfig{Schema: "kafkapg", Group: "g"})
	testenv.Eventually(t, 20*time.Second, func() error {
		n, err := other.Flush(ctx)
		if err != nil || n != 1 {
			return fmt.Errorf("the other relay published %d rows (%v)", n, err)
		}
		return nil
	})
	t.Logf("the other relay published the frozen relay's row %v after it was locked (idle timeout 1s)", time.Since(began).Round(time.Millisecond))
}

// random returns n random bytes: a value no compression makes smaller.
func random(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}
