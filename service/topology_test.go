package service

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/pgcluster"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/topicread"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// topologyWorkload is the ledger workload the topology tests run: every kind of record, retried
// through two short tiers; its accounts' sequence numbers start after seqBase.
func topologyWorkload(prefix string, seqBase int64) []ledger.Item {
	items := ledger.Generate(ledger.GenConfig{
		Events: 400, Accounts: 20, Seed: 24, Prefix: prefix,
		PoisonPerMille: 20, MalformedPerMille: 10, FlakyPerMille: 100, MaxFailAttempts: 4,
	})
	for i := range items {
		if seqBase > 0 && items[i].Kind != ledger.KindMalformed {
			items[i].Event.Seq += seqBase
			items[i].Value, _ = json.Marshal(items[i].Event)
		}
	}
	return items
}

const topologyMaxAttempt = 3 // two tiers

// workload is the service running on a topic of its own, and the events produced to it.
type workload struct {
	t            *testing.T
	k            *testenv.Kafka
	svc          *service
	topic, group string
	items        []ledger.Item
	// dupsOK allows a dead letter in the dead-letter topic twice: a failover can lose the relay's
	// mark that it published one (its commits do not wait for the standby), which it publishes again.
	dupsOK bool
}

// startWorkload runs the service on dbURL (which may lead anywhere: a pooler, TLS, a multi-host
// URL) with the ledger handler, vars added to its environment.
func startWorkload(t *testing.T, k *testenv.Kafka, dbURL string, vars map[string]string) *workload {
	t.Helper()
	w := &workload{t: t, k: k, topic: k.CreateTopic(t, 3), group: "g-" + testenv.Name(t, 20)}
	all := map[string]string{
		"DATABASE_URL":   dbURL,
		"KAFKA_BROKERS":  strings.Join(k.Brokers, ","),
		"KAFKA_TOPICS":   w.topic,
		"KAFKA_GROUP_ID": w.group,
		"RETRY_TIERS":    "100ms,200ms",
		"DB_MAX_CONNS":   "8",
	}
	for k, v := range vars {
		all[k] = v
	}
	w.svc = startService(t, all)
	w.svc.waitReady()
	return w
}

// produce produces topologyWorkload(prefix) and checks, through direct (a pool on the same
// database), that every event produced so far was applied exactly once in per-account order and
// every dead letter is in the dead-letter topic and its table.
func (w *workload) produce(direct *pgxpool.Pool, prefix string) {
	t := w.t
	t.Helper()
	items := topologyWorkload(prefix, int64(len(w.items)))
	w.items = append(w.items, items...)
	recs := make([]*kgo.Record, 0, len(items))
	for _, it := range items {
		recs = append(recs, it.Record(w.topic))
	}
	w.k.Produce(t, recs...)
	ctx := context.Background()
	dlqTopic := retrytopics.DLQTopic(w.topic, w.group)
	testenv.Eventually(t, 90*time.Second, func() error {
		p, err := ledger.ReadProgress(ctx, direct, "kafkapg", w.group)
		if err != nil {
			return err
		}
		dlq, err := topicread.All(ctx, w.k.Brokers, dlqTopic)
		if err != nil {
			return err
		}
		return ledger.Settled(p, w.items, topologyMaxAttempt, len(dlq))
	})
	if _, err := ledger.Verify(ctx, direct, w.items, topologyMaxAttempt); err != nil {
		t.Errorf("ledger: %v", err)
	}
	dlq, err := topicread.All(ctx, w.k.Brokers, dlqTopic)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ledger.CheckDeadLetters(w.items, dlq, topologyMaxAttempt, w.dupsOK); err != nil {
		t.Errorf("dead-letter topic: %v", err)
	}
	if _, err := ledger.CheckDeadLetterRows(ctx, direct, "kafkapg", w.group, w.items, topologyMaxAttempt); err != nil {
		t.Errorf("dead_letters: %v", err)
	}
}

// operate checks that the console answers user:password with its dead letters, and that dlq
// list lists the poison events.
func (w *workload) operate(console, user, password string) {
	t := w.t
	t.Helper()
	req, _ := http.NewRequest("GET", "http://"+console+"/dead-letters", nil)
	req.SetBasicAuth(user, password)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("the console's dead letters: %d, want 200", resp.StatusCode)
	}
	var out, errOut strings.Builder
	if code := run([]string{"dlq", "list"}, &out, &errOut, builtinHandlers...); code != 0 || !strings.Contains(out.String(), "poison") {
		t.Errorf("dlq list exited %d (%s): %s; want the poison events listed", code, errOut.String(), out.String())
	}
}

// TestThroughPgBouncer runs everything kafkapg does through Debian's PgBouncer (1.18, which
// predates prepared statements in transaction mode) in transaction mode, with the defaults:
// migrations, the handlers' setup SQL, the processor and its relay, an operator command and the
// console. Before kafkapg chose a query mode for it, every claim failed with `prepared statement
// "stmtcache_…" already exists (SQLSTATE 42P05)` and nothing moved.
func TestThroughPgBouncer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	if err := srv.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	// A small pool of server sessions: the clients' transactions move between them.
	b, err := pgcluster.StartBouncer(ctx, pgcluster.BouncerOptions{Backend: srv.Addr(), PoolMode: "transaction", DefaultPoolSize: 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	direct, err := pgxpool.New(ctx, srv.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(direct.Close)

	// Asked for a mode that cannot work, it says which setting to change.
	setEnv(t, map[string]string{"DATABASE_URL": b.URL("app") + "&default_query_exec_mode=cache_statement"})
	var out strings.Builder
	if code := Run([]string{"migrate"}, &out, builtinHandlers...); code != 2 || !strings.Contains(out.String(), "default_query_exec_mode=cache_describe") {
		t.Errorf("migrate with default_query_exec_mode=cache_statement through PgBouncer exited %d: %s; want 2 and the setting to change", code, out.String())
	}
	out.Reset()
	setEnv(t, map[string]string{"DATABASE_URL": b.URL("app")})
	if code := Run([]string{"migrate"}, &out, builtinHandlers...); code != 0 {
		t.Fatalf("migrate through PgBouncer exited %d: %s", code, out.String())
	}

	k := testenv.NewKfake(t)
	console := testenv.FreeAddr(t)
	w := startWorkload(t, k, b.URL("app"), map[string]string{
		"CONSOLE_ADDR":  console,
		"CONSOLE_USERS": "ann:viewer:secret-password-1",
	})
	w.produce(direct, "pgb")
	if !strings.Contains(w.svc.logs.String(), "pooler=\"a pooler in transaction mode\"") {
		t.Errorf("the service did not say that it found a pooler in transaction mode; logs:\n%s", w.svc.logs.String())
	}
	for _, bad := range []string{"42P05", "stmtcache_", "26000"} {
		if strings.Contains(w.svc.logs.String(), bad) {
			t.Errorf("the logs mention %s: a prepared statement went through the pooler", bad)
		}
	}
	w.operate(console, "ann", "secret-password-1")
	w.svc.stop()
}

// TestServiceFollowsAFailover: the service reaches a primary with a synchronous standby through a
// multi-host DATABASE_URL with target_session_attrs=read-write. The primary dies and the standby
// is promoted between two workloads: the processor, its relay, the console and the operator
// commands all carry on against the new primary, and every event of both is applied exactly once.
func TestServiceFollowsAFailover(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	primary, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Close)
	if err := primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	standby, err := primary.Standby(ctx, pgcluster.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Close)
	if err := primary.SetSynchronous(ctx, standby.Name()); err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("postgres://postgres@%s,%s/app?sslmode=disable&target_session_attrs=read-write", primary.Addr(), standby.Addr())
	direct, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(direct.Close)

	k := testenv.NewKfake(t)
	console := testenv.FreeAddr(t)
	w := startWorkload(t, k, url, map[string]string{"CONSOLE_ADDR": console, "CONSOLE_USERS": "ann:viewer:secret-password-1"})
	w.produce(direct, "before")

	if err := primary.Kill(ctx); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	w.dupsOK = true
	direct.Reset()
	w.produce(direct, "after")
	w.operate(console, "ann", "secret-password-1")
	w.svc.stop()
}

// TestTLSVerifyFull: managed Postgres services require TLS. The processor and the operator
// commands connect with sslmode=verify-full to a server whose certificate a local CA signed; a
// client that does not trust that CA, or names the server by a name the certificate does not
// carry, is refused with an error that says why; a client without TLS is refused by the server.
func TestTLSVerifyFull(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("/tmp", "kafkapg-tls-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil { // the server's user reads its certificate there
		t.Fatal(err)
	}
	certs, err := pgcluster.NewTLS(dir+"/good", "localhost")
	if err != nil {
		t.Fatal(err)
	}
	other, err := pgcluster.NewTLS(dir+"/other", "localhost")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := pgcluster.Start(ctx, pgcluster.Options{TLS: certs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	if err := srv.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	url := func(host, mode, ca string) string {
		u := fmt.Sprintf("postgres://postgres@%s:%d/app?sslmode=%s", host, srv.Port(), mode)
		if ca != "" {
			u += "&sslrootcert=" + ca
		}
		return u
	}
	good := url("localhost", "verify-full", certs.CAFile)

	for _, tc := range []struct {
		name, url, want string
	}{
		{"a CA the client does not trust", url("localhost", "verify-full", other.CAFile), "certificate"},
		{"a name the certificate does not carry", url("127.0.0.1", "verify-full", certs.CAFile), "certificate"},
		{"no TLS", url("localhost", "disable", ""), "no encryption"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			setEnv(t, map[string]string{"DATABASE_URL": tc.url})
			var out strings.Builder
			code := Run([]string{"migrate"}, &out, builtinHandlers...)
			if code == 0 || !strings.Contains(out.String(), tc.want) {
				t.Errorf("migrate exited %d: %q; want a failure that mentions %q", code, out.String(), tc.want)
			}
			if strings.Contains(out.String(), "secret") {
				t.Errorf("the error shows a secret: %s", out.String())
			}
		})
	}

	setEnv(t, map[string]string{"DATABASE_URL": good})
	var out strings.Builder
	if code := Run([]string{"migrate"}, &out, builtinHandlers...); code != 0 {
		t.Fatalf("migrate with verify-full exited %d: %s", code, out.String())
	}
	direct, err := pgxpool.New(ctx, good)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(direct.Close)
	var ssl bool
	if err := direct.QueryRow(ctx, `SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()`).Scan(&ssl); err != nil || !ssl {
		t.Fatalf("the test's own connection is not encrypted (%v, %v)", ssl, err)
	}
	k := testenv.NewKfake(t)
	w := startWorkload(t, k, good, nil)
	w.produce(direct, "tls")
	var encrypted, plain int
	if err := direct.QueryRow(ctx, `SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) FROM pg_stat_ssl s
		JOIN pg_stat_activity a USING (pid) WHERE a.datname = 'app' AND a.backend_type = 'client backend'`).Scan(&encrypted, &plain); err != nil {
		t.Fatal(err)
	}
	if encrypted < 2 || plain != 0 {
		t.Errorf("%d encrypted and %d plain connections to the database while the service runs; want all encrypted", encrypted, plain)
	}
	var dlqOut, dlqErr strings.Builder
	if code := run([]string{"dlq", "list"}, &dlqOut, &dlqErr, builtinHandlers...); code != 0 || !strings.Contains(dlqOut.String(), "poison") {
		t.Errorf("dlq list with verify-full exited %d (%s): %s; want the poison events listed", code, dlqErr.String(), dlqOut.String())
	}
	w.svc.stop()
}
