package console_test

import (
	"context"
	"fmt"
	"html"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// boundedConsole serves a console of group g, whose source topic is orders, over a migrated
// database and a kfake cluster, with values hidden from viewers.
func boundedConsole(t *testing.T) (*pgxpool.Pool, *testenv.Kafka, *httptest.Server) {
	t.Helper()
	pool := testenv.Migrated(t)
	k := testenv.NewKfake(t)
	for _, topic := range []string{"orders", "hr.salaries"} {
		k.CreateTopicNamed(t, topic, 1)
	}
	if _, err := pool.Exec(context.Background(), `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ('g', 'orders', 0, 0)`); err != nil {
		t.Fatal(err)
	}
	users, err := console.ParseUsers("alice:operator:" + operatorPassword + ", victor:viewer:" + viewerPassword)
	if err != nil {
		t.Fatal(err)
	}
	c, err := console.New(console.Config{Ops: ops.New(pool, "kafkapg", "g").WithTopics("orders"), Kafka: k.Client(t), Users: users,
		HideValues: true, Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c.Handler())
	t.Cleanup(srv.Close)
	return pool, k, srv
}

func getAs(t *testing.T, url, user, password string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	req.SetBasicAuth(user, password)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, readAll(resp)
}

// TestConsoleTraceReadsOnlyTheGroupsTopics: a viewer (or an operator) who asks to trace a topic
// that is not the group's gets 400 and a page saying which topics may be traced, and none of the
// topic's keys (a viewer read hr.salaries's keys through /trace by walking its offsets).
func TestConsoleTraceReadsOnlyTheGroupsTopics(t *testing.T) {
	_, k, srv := boundedConsole(t)
	k.Produce(t, &kgo.Record{Topic: "hr.salaries", Key: []byte("ceo-salary"), Value: []byte("1")},
		&kgo.Record{Topic: "orders", Key: []byte("order-1"), Value: []byte("1")})
	for _, u := range [][2]string{{"victor", viewerPassword}, {"alice", operatorPassword}} {
		for _, q := range []string{"topic=hr.salaries&partition=0&offset=0", "topic=hr.salaries&key=ceo-salary"} {
			code, page := getAs(t, srv.URL+"/trace?"+q, u[0], u[1])
			if code != http.StatusBadRequest || strings.Contains(page, "ceo-salary") && !strings.Contains(page, `value="ceo-salary"`) ||
				!strings.Contains(html.UnescapeString(page), `topic "hr.salaries" is not one of group g's topics: only its source topics (orders)`) {
				t.Errorf("%s: /trace?%s: %d, want 400 saying the group's topics, and no key of the topic:\n%s", u[0], q, code, page)
			}
		}
	}
	if code, page := getAs(t, srv.URL+"/trace?topic=orders&partition=0&offset=0", "victor", viewerPassword); code != http.StatusOK || !strings.Contains(page, "order-1") {
		t.Errorf("/trace of the group's topic: %d, want 200 with its key:\n%s", code, page)
	}
}

// TestConsoleTracesAtOnceAreBounded: the console runs at most ops.MaxTraces traces at once
// (with the JSON API's, in the process); one more gets 429 at once, not a place in a queue.
func TestConsoleTracesAtOnceAreBounded(t *testing.T) {
	_, k, srv := boundedConsole(t)
	k.Produce(t, &kgo.Record{Topic: "orders", Key: []byte("k"), Value: []byte("v")})
	// Kafka answers no trace's offsets until released.
	release := make(chan struct{})
	k.Cluster.ControlKey(kmsg.ListOffsets.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster.KeepControl()
		k.Cluster.SleepControl(func() { <-release })
		return nil, nil, false
	})
	type answer struct {
		code int
		page string
	}
	n := ops.MaxTraces + 2
	answers := make(chan answer, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			code, page := getAs(t, srv.URL+"/trace?topic=orders&key=k", "victor", viewerPassword)
			answers <- answer{code, page}
		})
	}
	released := false
	for refused := 0; refused < n-ops.MaxTraces; refused++ {
		select {
		case a := <-answers:
			if a.code != http.StatusTooManyRequests || !strings.Contains(a.page, fmt.Sprintf("%d traces are running in this process", ops.MaxTraces)) {
				t.Errorf("a trace over the limit: %d, want 429 saying why:\n%s", a.code, a.page)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("%d traces at once: %d refused, want %d refused at once", n, refused, n-ops.MaxTraces)
			close(release)
			released = true
			refused = n
		}
	}
	if !released {
		close(release)
	}
	wg.Wait()
	close(answers)
	for a := range answers {
		if !released && a.code != http.StatusOK {
			t.Errorf("an admitted trace: %d, want 200:\n%s", a.code, a.page)
		}
	}
}

// TestConsoleDeadLetterReadsOnlyWhatItShows: a viewer's page of a 16 MB dead letter with values
// hidden reads none of its value (40 such requests took a processor to 786 MB); an operator's
// reads its first 64 KiB and says how much more there is. Measured in bytes allocated serving
// the page (the server is in this process).
func TestConsoleDeadLetterReadsOnlyWhatItShows(t *testing.T) {
	pool, _, srv := boundedConsole(t)
	const size = 16 << 20
	var id int64
	if err := pool.QueryRow(context.Background(), `INSERT INTO kafkapg.dead_letters
		(consumer_group, topic, partition, "offset", key, value, header_keys, header_values, "timestamp", error_class, error_message, attempts, first_failed_at)
		VALUES ('g', 'orders', 0, 7, 'k', convert_to(repeat('v', $1), 'UTF8'), ARRAY['big'::bytea], ARRAY[convert_to(repeat('h', $1), 'UTF8')], 0, 'permanent', 'bad', 1, now())
		RETURNING id`, size).Scan(&id); err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("%s/dead-letters/%d", srv.URL, id)
	for _, tc := range []struct {
		user, password string
		maxAlloc       uint64
		want           []string
	}{
		{"victor", viewerPassword, 2 << 20, []string{"value-hidden", fmt.Sprintf("%d bytes", size)}},
		{"alice", operatorPassword, 4 << 20, []string{strings.Repeat("v", 1000), fmt.Sprintf("… (%d bytes more)", size-64<<10)}},
	} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		code, page := getAs(t, url, tc.user, tc.password)
		runtime.ReadMemStats(&after)
		if code != http.StatusOK {
			t.Fatalf("%s: GET dead letter %d: %d %s", tc.user, id, code, page)
		}
		for _, w := range tc.want {
			if !strings.Contains(page, w) {
				t.Errorf("%s: the page of dead letter %d does not show %.40q", tc.user, id, w)
			}
		}
		if strings.Contains(page, strings.Repeat("v", 64<<10+1)) || tc.user == "victor" && strings.Contains(page, "hhhh") {
			t.Errorf("%s: the page of dead letter %d shows more of it than it should", tc.user, id)
		}
		alloc := after.TotalAlloc - before.TotalAlloc
		t.Logf("%s: the page of a %d-byte dead letter allocated %d bytes", tc.user, size, alloc)
		if alloc > tc.maxAlloc {
			t.Errorf("%s: the page of a %d-byte dead letter allocated %d bytes; want at most %d", tc.user, size, alloc, tc.maxAlloc)
		}
	}
}
