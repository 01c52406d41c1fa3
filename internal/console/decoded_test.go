package console_test

import (
	"context"
	"strings"
	"testing"

	"github.com/hamba/avro/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/sr"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
)

// TestConsoleShowsValuesDecoded: a dead letter whose value is in the Schema Registry's wire format
// is shown decoded (what it is, the value as JSON) to an operator, in a real browser; one whose
// schema the registry does not have is shown as bytes, saying why; a viewer under
// CONSOLE_HIDE_VALUES sees neither.
func TestConsoleShowsValuesDecoded(t *testing.T) {
	b := newBrowser(t)
	k := testenv.NewKfake(t)
	h := testkit.New(t, k, 1)
	ctx := context.Background()
	reg, err := schemaregistry.New(schemaregistry.Config{URLs: []string{testenv.SchemaRegistry(t)}})
	b.must(err)
	schema := `{"type": "record", "name": "Payment", "namespace": "console", "fields": [{"name": "payment_id", "type": "string"},
		{"name": "amount_cents", "type": "long"}, {"name": "card", "type": {"type": "record", "name": "Card", "fields": [{"name": "last4", "type": "string"}]}}]}`
	subject := testenv.Name(t, 50) + "-value"
	ss, err := reg.Client().CreateSchema(ctx, subject, sr.Schema{Schema: schema})
	b.must(err)
	payload, err := avro.Marshal(avro.MustParse(schema), map[string]any{"payment_id": "pay-81", "amount_cents": int64(1999), "card": map[string]any{"last4": "4242"}})
	b.must(err)
	var hd sr.ConfluentHeader
	good, _ := hd.AppendEncode(nil, ss.ID, nil)
	unknown, _ := hd.AppendEncode(nil, 2000000000, nil)
	_, err = h.Pool.Exec(ctx, `INSERT INTO kafkapg.dead_letters (consumer_group, topic, partition, "offset", key, value, "timestamp", error_class, error_message, attempts, first_failed_at)
		VALUES ($1, $2, 0, 4, 'k', $3, 0, 'permanent', 'card declined', 1, now()), ($1, $2, 0, 5, 'k', $4, 0, 'permanent', 'unknown schema', 1, now())`,
		h.Group, h.Topic, append(good, payload...), append(unknown, 1, 2, 3))
	b.must(err)
	srv := serve(t, h, k, prometheus.NewRegistry(), func(c *console.Config) { c.Registry = reg; c.HideValues = true })

	b.as("alice", operatorPassword)
	b.open(srv.URL+"/dead-letters/1", `document.querySelector("#value") !== null`)
	if got, want := b.text("#encoding"), "decoded: AVRO, schema id "; !strings.Contains(got, want) || !strings.Contains(got, subject+" v1") {
		t.Errorf("the value's encoding: %q, want %q… (%s v1)", got, want, subject)
	}
	if got := b.text("#value"); !strings.Contains(got, `"payment_id": "pay-81"`) || !strings.Contains(got, `"last4": "4242"`) {
		t.Errorf("the value shown: %q", got)
	}
	b.shot("deadletter-decoded")
	b.open(srv.URL+"/dead-letters/2", `document.querySelector("#value") !== null`)
	if got := b.text("#not-decoded"); !strings.Contains(got, "not decoded with its schema") || !strings.Contains(got, "schema id 2000000000 is not in the registry") {
		t.Errorf("an unknown schema id: %q", got)
	}
	if got := b.text("#encoding"); !strings.Contains(got, "hex") {
		t.Errorf("an unknown schema id's value: shown as %q, want hex", got)
	}
	b.shot("deadletter-not-decoded")

	b.as("victor", viewerPassword)
	b.open(srv.URL+"/dead-letters/1", `document.querySelector("#value-hidden") !== null`)
	if n := b.count("#value") + b.count("#encoding"); n != 0 {
		t.Errorf("a viewer under CONSOLE_HIDE_VALUES is shown the value")
	}
}
