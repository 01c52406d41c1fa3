package service

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/sr"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
)

// TestDlqShowDecodesWithTheRegistry: with SCHEMA_REGISTRY_URL, `dlq show` shows a dead letter
// whose value is in the Schema Registry's wire format decoded (what it is, then the value as
// JSON), in text and in JSON; one whose schema the registry does not have as bytes, saying why;
// without SCHEMA_REGISTRY_URL as bytes, as before.
func TestDlqShowDecodesWithTheRegistry(t *testing.T) {
	pool := dlqDB(t)
	ctx := context.Background()
	url := testenv.SchemaRegistry(t)
	reg, err := schemaregistry.New(schemaregistry.Config{URLs: []string{url}})
	if err != nil {
		t.Fatal(err)
	}
	schema := `{"type": "record", "name": "DlqOrder", "namespace": "dlqshow", "fields": [{"name": "id", "type": "string"}, {"name": "amount", "type": "long"}]}`
	subject := testenv.Name(t, 50) + "-value"
	ss, err := reg.Client().CreateSchema(ctx, subject, sr.Schema{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	payload, err := avro.Marshal(avro.MustParse(schema), map[string]any{"id": "o-7", "amount": int64(70)})
	if err != nil {
		t.Fatal(err)
	}
	var h sr.ConfluentHeader
	good, _ := h.AppendEncode(nil, ss.ID, nil)
	unknown, _ := h.AppendEncode(nil, 2000000000, nil)
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.dead_letters SET value = CASE id WHEN 1 THEN $1::bytea ELSE $2::bytea END WHERE id IN (1, 2)`,
		append(good, payload...), append(unknown, 1, 2, 3)); err != nil {
		t.Fatal(err)
	}

	t.Setenv("SCHEMA_REGISTRY_URL", url)
	code, out, errOut := cli("dlq", "show", "1")
	wantHead := "value:      AVRO, schema id " + strconv.Itoa(ss.ID) + " (" + subject + " v1), decoded:"
	if code != 0 || !strings.Contains(out, wantHead) || !strings.Contains(out, `"id": "o-7"`) || !strings.Contains(out, `"amount": 70`) {
		t.Errorf("dlq show 1: exit %d\n%s%s\nwant %q and the value as JSON", code, out, errOut, wantHead)
	}
	code, out, _ = cli("dlq", "show", "1", "--json")
	var shown struct {
		Decoded struct {
			Schema   string          `json:"schema"`
			SchemaID int             `json:"schema_id"`
			Value    json.RawMessage `json:"value"`
		} `json:"decoded_value"`
	}
	if err := json.Unmarshal([]byte(out), &shown); code != 0 || err != nil || shown.Decoded.SchemaID != ss.ID {
		t.Errorf("dlq show 1 --json: exit %d, %v\n%s", code, err, out)
	}
	var v map[string]any
	if err := json.Unmarshal(shown.Decoded.Value, &v); err != nil || v["id"] != "o-7" {
		t.Errorf("dlq show 1 --json: decoded_value.value %s (%v)", shown.Decoded.Value, err)
	}
	code, out, _ = cli("dlq", "show", "2")
	if code != 0 || !strings.Contains(out, "(in the Schema Registry's wire format, not decoded: decode the record's value (schema id 2000000000): schema id 2000000000 is not in the registry (404") {
		t.Errorf("dlq show 2 (an unknown schema id): exit %d\n%s", code, out)
	}

	t.Setenv("SCHEMA_REGISTRY_URL", "")
	code, out, _ = cli("dlq", "show", "1")
	if code != 0 || strings.Contains(out, "decoded") || !strings.Contains(out, "not text") {
		t.Errorf("dlq show 1 without a registry: exit %d\n%s\nwant the bytes", code, out)
	}
}
