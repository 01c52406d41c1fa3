package service

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// TestPositionsAPI: GET /api/v1/positions lists the partitions for any token; pause, resume and
// set are dry runs without execute, act with it (audited under the token's name), and are
// refused to a viewer's token.
func TestPositionsAPI(t *testing.T) {
	k := testenv.NewKfake(t)
	k.CreateTopicNamed(t, "orders", 2)
	k.Produce(t, &kgo.Record{Topic: "orders", Value: []byte("v")}, &kgo.Record{Topic: "orders", Value: []byte("v")})
	pool := testenv.Migrated(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tokens := []console.User{{Name: "bot", Role: console.Operator, Password: "operator-token-0123"}, {Name: "eye", Role: console.Viewer, Password: "viewer-token-01234"}}
	a := newAPI(ctx, ops.New(pool, "kafkapg", "pg"), "", tokens, slog.New(slog.NewTextHandler(io.Discard, nil)))
	a.keys = keysRoutes(a, &env{KafkaBrokers: k.Brokers, KafkaGroupID: "pg", KafkaTopics: []string{"orders"}, StallTimeout: time.Minute}, nil)
	srv := httptest.NewServer(a.handler())
	defer srv.Close()
	defer a.wait()
	call := func(method, path, tok, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	paused := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM kafkapg.pauses`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	code, body := call("GET", "/api/v1/positions", "viewer-token-01234", "")
	var listed struct{ Partitions []ops.PartitionStatus }
	if err := json.Unmarshal([]byte(body), &listed); code != 200 || err != nil || len(listed.Partitions) != 2 {
		t.Fatalf("GET positions as a viewer: %d %s", code, body)
	}
	if code, body = call("POST", "/api/v1/positions/pause", "viewer-token-01234", `{"topic": "orders", "execute": true, "reason": "x"}`); code != http.StatusForbidden || paused() != 0 {
		t.Errorf("pause as a viewer: %d %s", code, body)
	}
	if code, body = call("POST", "/api/v1/positions/pause", "operator-token-0123", `{"topic": "orders", "partition": 1}`); code != 200 || !strings.Contains(body, `"dry_run": true`) || paused() != 0 {
		t.Errorf("pause, dry run: %d %s", code, body)
	}
	if code, body = call("POST", "/api/v1/positions/pause", "operator-token-0123", `{"topic": "orders", "partition": 1, "execute": true, "reason": "downstream down"}`); code != 200 || paused() != 1 {
		t.Errorf("pause: %d %s", code, body)
	}
	var by string
	if err := pool.QueryRow(ctx, `SELECT paused_by FROM kafkapg.pauses`).Scan(&by); err != nil || by != "api:bot" {
		t.Errorf("paused by %q, %v; want api:bot", by, err)
	}
	if code, body = call("POST", "/api/v1/positions/set", "operator-token-0123", `{"topic": "orders", "end": true, "offset": 1}`); code != http.StatusBadRequest || !strings.Contains(body, "exactly one target") {
		t.Errorf("set with two targets: %d %s", code, body)
	}
	if code, body = call("POST", "/api/v1/positions/set", "operator-token-0123", `{"topic": "orders", "time": "1h", "execute": true, "reason": "reprocess"}`); code != 200 || strings.Count(body, `"executed": true`) != 2 {
		t.Errorf("set by time: %d %s", code, body)
	}
	if code, body = call("POST", "/api/v1/positions/resume", "operator-token-0123", `{"topic": "orders", "execute": true, "reason": "fixed"}`); code != 200 || paused() != 0 {
		t.Errorf("resume: %d %s", code, body)
	}
}
