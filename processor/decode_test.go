package processor_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hamba/avro/v2"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sr"

	"github.com/kafkapg/kafkapg/internal/rig/srproxy"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
)

const avroOrder = `{"type": "record", "name": "Order", "namespace": "shop", "fields": [
	{"name": "id", "type": "string"},
	{"name": "amount", "type": "long"}]}`

type avroOrderT struct {
	ID     string `avro:"id"`
	Amount int64  `avro:"amount"`
}

// alwaysRetryable is a handler whose ErrorClassifier calls every error retryable: it must not
// change a DecodeError's class.
type alwaysRetryable struct{ processor.Handler }

func (alwaysRetryable) ClassifyError(error) processor.ErrorClass { return processor.ClassRetryable }

// TestARegistryOutageWaitsAndBadBytesAreDeadLettered: a topic decoded with the Schema Registry
// (Avro) whose registry is down (503) when its records arrive: they wait in place — nothing
// applied, nothing dead-lettered, nothing sent to a tier, however long — and are applied once,
// in order, when it is back; a record whose bytes are not in the wire format is dead-lettered at
// once, saying so. The handler's ErrorClassifier calls everything retryable, and changes neither.
func TestARegistryOutageWaitsAndBadBytesAreDeadLettered(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		ctx := context.Background()
		h := testkit.New(t, k, 1)
		if _, err := h.Pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, amount bigint NOT NULL, "offset" bigint NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		p := srproxy.New(t, testenv.SchemaRegistry(t))
		reg, err := schemaregistry.New(schemaregistry.Config{URLs: []string{p.URL()}, Timeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(reg.Close)
		ss, err := reg.Client().CreateSchema(ctx, h.Topic+"-value", sr.Schema{Schema: avroOrder})
		if err != nil {
			t.Fatal(err)
		}
		dec, err := schemaregistry.Avro[avroOrderT](reg, avroOrder)
		if err != nil {
			t.Fatal(err)
		}
		p.Set(srproxy.Unavailable)

		cfg := h.Config(alwaysRetryable{processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			o, err := processor.DecodedAs[avroOrderT](rec)
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO orders (id, amount, "offset") VALUES ($1, $2, $3)`, o.ID, o.Amount, rec.Offset)
			return err
		})})
		cfg.RetryTiers = []time.Duration{100 * time.Millisecond}
		cfg.TopicPolicies = map[string]processor.TopicPolicy{h.Topic: {Values: dec}}
		r := h.Start(cfg)

		var recs []*kgo.Record
		for i := range 5 {
			b, err := avro.Marshal(avro.MustParse(avroOrder), avroOrderT{fmt.Sprintf("o-%d", i), int64(i * 10)})
			if err != nil {
				t.Fatal(err)
			}
			var hd sr.ConfluentHeader
			v, _ := hd.AppendEncode(nil, ss.ID, nil)
			recs = append(recs, &kgo.Record{Topic: h.Topic, Key: []byte(fmt.Sprint(i)), Value: append(v, b...)})
		}
		k.Produce(t, recs...)
		time.Sleep(3 * time.Second) // the outage lasts
		var applied, dead, tiers int
		count := func() {
			t.Helper()
			if err := h.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM kafkapg.dead_letters), (SELECT count(*) FROM kafkapg.retries)`).
				Scan(&applied, &dead, &tiers); err != nil {
				t.Fatal(err)
			}
		}
		count()
		if applied != 0 || dead != 0 || tiers != 0 {
			t.Fatalf("during the registry's outage: %d applied, %d dead-lettered, %d in tiers; want all waiting in place", applied, dead, tiers)
		}
		if n := r.Counter("kafkapg_infrastructure_retries_total"); n == 0 {
			t.Errorf("kafkapg_infrastructure_retries_total = 0 during the outage")
		}

		p.Set(srproxy.Forward)
		k.Produce(t, &kgo.Record{Topic: h.Topic, Key: []byte("bad"), Value: []byte(`{"id": "o-9", "amount": 1}`)})
		testenv.Eventually(t, 30*time.Second, func() error {
			count()
			if applied != 5 || dead != 1 {
				return fmt.Errorf("%d applied, %d dead-lettered; want 5 and the plain JSON one", applied, dead)
			}
			return nil
		})
		rows, _ := h.Pool.Query(ctx, `SELECT id FROM orders ORDER BY "offset"`)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(ids, []string{"o-0", "o-1", "o-2", "o-3", "o-4"}) {
			t.Errorf("applied %v", ids)
		}
		var class, msg string
		var attempts int
		if err := h.Pool.QueryRow(ctx, `SELECT error_class, error_message, attempts FROM kafkapg.dead_letters`).Scan(&class, &msg, &attempts); err != nil {
			t.Fatal(err)
		}
		if class != "permanent" || attempts != 1 || !strings.Contains(msg, "not in the Schema Registry's wire format: its first byte is 0x7b") {
			t.Errorf("the dead letter: %s after %d attempts: %s", class, attempts, msg)
		}
		count()
		if tiers != 0 {
			t.Errorf("%d records went to a retry tier", tiers)
		}
	})
}

// TestHeldRecordsAreDecodedToo: the records held behind a key whose first record went round the
// retry tiers reach the handler decoded, as the others (before, a held record prepared by a
// transaction that did not commit came back with its Prepare's result but without its decoded
// value: the ledger read the wire format's bytes as JSON and dead-lettered it).
func TestHeldRecordsAreDecodedToo(t *testing.T) {
	testenv.EachBroker(t, func(t *testing.T, k *testenv.Kafka) {
		t.Parallel()
		ctx := context.Background()
		h := testkit.New(t, k, 1)
		if _, err := h.Pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, amount bigint NOT NULL, "offset" bigint NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		reg, err := schemaregistry.New(schemaregistry.Config{URLs: []string{testenv.SchemaRegistry(t)}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(reg.Close)
		ss, err := reg.Client().CreateSchema(ctx, h.Topic+"-value", sr.Schema{Schema: avroOrder})
		if err != nil {
			t.Fatal(err)
		}
		dec, err := schemaregistry.Avro[avroOrderT](reg, avroOrder)
		if err != nil {
			t.Fatal(err)
		}
		cfg := h.Config(processor.HandlerFunc(func(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
			o, err := processor.DecodedAs[avroOrderT](rec)
			if err != nil {
				return processor.Permanent(err)
			}
			if o.ID == "o-0" && rec.Attempt == 1 {
				return fmt.Errorf("o-0 fails its first delivery")
			}
			if o.ID == "o-2" && rec.Attempt == 1 && !failedOnce(rec) {
				return fmt.Errorf("o-2 fails once, held: its batch's transaction does not commit")
			}
			_, err = tx.Exec(ctx, `INSERT INTO orders (id, amount, "offset") VALUES ($1, $2, $3)`, o.ID, o.Amount, rec.Offset)
			return err
		}))
		cfg.LocalAttempts = 2
		cfg.RetryTiers = []time.Duration{200 * time.Millisecond}
		cfg.TopicPolicies = map[string]processor.TopicPolicy{h.Topic: {Values: dec}}
		h.Start(cfg)
		var recs []*kgo.Record
		for i := range 4 {
			b, err := avro.Marshal(avro.MustParse(avroOrder), avroOrderT{fmt.Sprintf("o-%d", i), int64(i)})
			if err != nil {
				t.Fatal(err)
			}
			var hd sr.ConfluentHeader
			v, _ := hd.AppendEncode(nil, ss.ID, nil)
			recs = append(recs, &kgo.Record{Topic: h.Topic, Key: []byte("same key"), Value: append(v, b...)})
		}
		k.Produce(t, recs...)
		testenv.Eventually(t, 30*time.Second, func() error {
			var applied, dead int
			if err := h.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM kafkapg.dead_letters)`).Scan(&applied, &dead); err != nil {
				return err
			}
			if dead > 0 {
				var msg string
				_ = h.Pool.QueryRow(ctx, `SELECT error_message FROM kafkapg.dead_letters LIMIT 1`).Scan(&msg)
				t.Fatalf("%d dead-lettered: %s", dead, msg)
			}
			if applied != 4 {
				return fmt.Errorf("%d of 4 applied", applied)
			}
			return nil
		})
		rows, _ := h.Pool.Query(ctx, `SELECT id FROM orders ORDER BY "offset"`)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || !slices.Equal(ids, []string{"o-0", "o-1", "o-2", "o-3"}) {
			t.Errorf("applied %v (%v)", ids, err)
		}
	})
}

// failedOnce reports, the first time it is asked about a record, that it has not failed yet.
var failedOnceSeen sync.Map

func failedOnce(rec *processor.Record) bool {
	_, seen := failedOnceSeen.LoadOrStore(fmt.Sprint(rec.Topic, rec.Partition, rec.Offset), true)
	return seen
}
