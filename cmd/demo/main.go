// Command demo shows kafkapg end to end on one machine: it starts the dev broker, produces a few
// thousand ledger events (some poison, some malformed, some that keep failing), runs the real
// processor binary against DATABASE_URL, waits until every event is applied or dead-lettered,
// checks the ledger, stops the processor with SIGTERM and prints a report. `make demo` runs it
// with a throwaway Postgres when DATABASE_URL is unset.
//
// The demo works in its own Postgres schema (kafkapg_demo) and drops it at the end unless -keep.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/localrun"
	"github.com/kafkapg/kafkapg/internal/promscrape"
	"github.com/kafkapg/kafkapg/internal/topicread"
	"github.com/kafkapg/kafkapg/retrytopics"
)

const (
	schema = "kafkapg_demo"
	topic  = "ledger"
	group  = "ledger-demo"
	// tiers are the demo's retry tiers; a record gets len(tiers)+1 delivery attempts.
	tiers = "200ms,500ms,1s"
)

// maxAttempt is the last delivery attempt with tiers.
var maxAttempt = func() int {
	ts, err := retrytopics.ParseTiers(tiers)
	if err != nil {
		panic(err)
	}
	return len(ts) + 1
}()

func main() {
	events := flag.Int("events", 5000, "ledger events to produce")
	partitions := flag.Int("partitions", 8, "partitions of the ledger topic")
	keep := flag.Bool("keep", false, "keep the demo schema (kafkapg_demo) and the logs afterwards")
	stay := flag.String("stay", "auto", "after the report, keep the processor and its console running on a trickle of new events until Ctrl-C: yes, no, or auto (yes when run in a terminal)")
	format := flag.String("format", "auto", "the events' format: json, avro (in the Schema Registry's wire format, against SCHEMA_REGISTRY_URL), or auto (avro when SCHEMA_REGISTRY_URL is set)")
	flag.Parse()
	registryURL := os.Getenv("SCHEMA_REGISTRY_URL")
	switch *format {
	case "auto":
		*format = "json"
		if registryURL != "" {
			*format = "avro"
		}
	case "json":
	case "avro":
		if registryURL == "" {
			fmt.Fprintln(os.Stderr, "-format=avro needs a Schema Registry at SCHEMA_REGISTRY_URL (`make demo` starts one when it can)")
			os.Exit(2)
		}
	default:
		fmt.Fprintf(os.Stderr, "-format=%q: want json, avro or auto\n", *format)
		os.Exit(2)
	}
	stayOn := *stay == "yes"
	switch *stay {
	case "auto":
		fi, _ := os.Stdout.Stat()
		stayOn = fi != nil && fi.Mode()&os.ModeCharDevice != 0
	case "yes", "no":
	default:
		fmt.Fprintf(os.Stderr, "-stay=%q: want yes, no or auto\n", *stay)
		os.Exit(2)
	}
	var avroURL string
	if *format == "avro" {
		avroURL = registryURL
	}
	if err := run(*events, int32(*partitions), *keep, stayOn, avroURL); err != nil {
		fmt.Fprintf(os.Stderr, "\ndemo failed: %v\n", err)
		os.Exit(1)
	}
}

// run runs the demo; with registryURL, on events in Avro in the Schema Registry's wire format.
func run(events int, partitions int32, keep, stay bool, registryURL string) error {
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		return errors.New("DATABASE_URL is not set: run `make demo`, which starts a throwaway Postgres, or point DATABASE_URL at a database")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bin, err := localrun.BinDir("demo")
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "kafkapg-demo-")
	if err != nil {
		return err
	}
	ok := false
	defer func() {
		if ok && !keep {
			os.RemoveAll(work)
		} else {
			fmt.Printf("logs       %s (devbroker.log, processor.log)\n", work)
		}
	}()

	// Postgres: a clean schema of our own; the processor finds its tables and the ledger's there.
	demoURL, err := localrun.PostgresURL(dbURL, "", schema)
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, demoURL)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+schema+` CASCADE; CREATE SCHEMA `+schema); err != nil {
		return fmt.Errorf("prepare schema %s: %w", schema, err)
	}
	if !keep {
		defer pool.Exec(context.WithoutCancel(ctx), `DROP SCHEMA IF EXISTS `+schema+` CASCADE`)
	}

	// The dev broker, as a separate process like a real one.
	brokerAddr, err := localrun.FreeAddr()
	if err != nil {
		return err
	}
	broker := exec.Command(filepath.Join(bin, "devbroker"), "-listen", brokerAddr)
	broker.Stdout, broker.Stderr = logFile(work, "devbroker.log")
	broker.SysProcAttr = ownGroup()
	if err := broker.Start(); err != nil {
		return fmt.Errorf("start devbroker: %w", err)
	}
	defer stop(broker, 5*time.Second)
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokerAddr))
	if err != nil {
		return err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	if err := localrun.WaitFor(ctx, 20*time.Second, func() error {
		_, err := adm.ListBrokers(ctx)
		return err
	}); err != nil {
		return fmt.Errorf("devbroker did not come up: %w", err)
	}
	if _, err := adm.CreateTopic(ctx, partitions, 1, nil, topic); err != nil {
		return fmt.Errorf("create topic: %w", err)
	}

	items := ledger.Generate(ledger.GenConfig{
		Events: events, Accounts: 50, Seed: uint64(time.Now().UnixNano()), Prefix: "demo",
		PoisonPerMille: 10, MalformedPerMille: 10, FlakyPerMille: 50, MaxFailAttempts: maxAttempt + 1,
	})
	kinds := map[ledger.Kind]int{}
	exhausted := 0
	recs := make([]*kgo.Record, len(items))
	for i, it := range items {
		kinds[it.Kind]++
		if it.Kind == ledger.KindFlaky && it.Dead(maxAttempt) {
			exhausted++
		}
		recs[i] = it.Record(topic)
	}
	handler, format := "ledger", "JSON (`make demo` runs them in Avro when it can start a Schema Registry: it needs java)"
	var enc *avroEvents
	if registryURL != "" {
		if enc, err = newAvroEvents(ctx, registryURL, topic+"-value"); err != nil {
			return err
		}
		for i, it := range items {
			if recs[i].Value, err = enc.encode(it); err != nil {
				return err
			}
			items[i].Value = recs[i].Value // what the dead letters' checks match the DLQ against
		}
		handler = "ledger-avro"
		format = fmt.Sprintf("Avro in the Schema Registry's wire format: schema id %d under subject %s at %s (HANDLER=ledger-avro decodes them before the handler; the malformed ones are not in the wire format)",
			enc.id, enc.subject, registryURL)
	}
	fmt.Printf("format     %s\n", format)
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		return fmt.Errorf("produce: %w", err)
	}
	fmt.Printf("produced   %d ledger events to %q (%d partitions): %d valid, %d flaky (%d recover in the retry tiers %s, %d outlast them), %d poison, %d malformed\n",
		len(items), topic, partitions, kinds[ledger.KindOK], kinds[ledger.KindFlaky], kinds[ledger.KindFlaky]-exhausted, tiers, exhausted,
		kinds[ledger.KindPoison], kinds[ledger.KindMalformed])

	// The processor, configured only by environment variables, as in production.
	httpAddr, err := addr("127.0.0.1:9090")
	if err != nil {
		return err
	}
	consoleAddr, err := addr("127.0.0.1:9091")
	if err != nil {
		return err
	}
	proc := exec.Command(filepath.Join(bin, "processor"))
	proc.Env = append(os.Environ(),
		"KAFKA_BROKERS="+brokerAddr,
		"KAFKA_GROUP_ID="+group,
		"KAFKA_TOPICS="+topic,
		"DATABASE_URL="+demoURL,
		"DB_SCHEMA="+schema,
		"HANDLER="+handler,
		"HTTP_ADDR="+httpAddr,
		"LOG_FORMAT=text",
		"RETRY_BACKOFF_BASE=20ms",
		"RETRY_BACKOFF_MAX=200ms",
		"RETRY_TIERS="+tiers,
		"CONSOLE_ADDR="+consoleAddr,
		"CONSOLE_USERS="+consoleUser+":operator:"+consolePassword,
		"CONSOLE_SAMPLE_INTERVAL=2s",
	)
	logOut, _ := logFile(work, "processor.log")
	proc.Stdout, proc.Stderr = logOut, logOut
	proc.SysProcAttr = ownGroup()
	started := time.Now()
	if err := proc.Start(); err != nil {
		return fmt.Errorf("start processor: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- proc.Wait() }()
	defer func() {
		if proc.ProcessState == nil {
			proc.Process.Kill()
		}
	}()

	var p ledger.Progress
	fi, _ := os.Stdout.Stat()
	tty := fi != nil && fi.Mode()&os.ModeCharDevice != 0
	err = localrun.WaitFor(ctx, 2*time.Minute, func() error {
		select {
		case err := <-exited:
			return fmt.Errorf("processor exited early (%v); see %s", err, filepath.Join(work, "processor.log"))
		default:
		}
		// From Postgres alone (dead_letters rows; the outbox is in flight): the DLQ topic itself
		// is read once, at the end.
		var err error
		if p, err = ledger.ReadProgress(ctx, pool, schema, group); err != nil {
			return err
		}
		if tty {
			fmt.Printf("\rprocessing %d applied, %d dead-lettered, %d in retry tiers, held behind their key or not yet published ...  ", p.Applied, p.DeadRows, p.Tiers+p.HeldRecords+p.Outbox)
		}
		return ledger.Settled(p, items, maxAttempt, -1)
	})
	if tty {
		fmt.Println()
	}
	if err != nil {
		return err
	}
	took := time.Since(started)
	// What /metrics says must match the database (group-wide gauges refresh every 5 s).
	var checks []metricCheck
	merr := localrun.WaitFor(ctx, 15*time.Second, func() error {
		var err error
		checks, err = compareMetrics(ctx, pool, kadm.NewClient(cl), "http://"+httpAddr+"/metrics")
		if err != nil {
			return err
		}
		for _, c := range checks {
			if c.metric != c.db {
				return fmt.Errorf("%s = %g on /metrics, %g in the database", c.name, c.metric, c.db)
			}
		}
		return nil
	})

	rep, verr := ledger.Verify(ctx, pool, items, maxAttempt)
	dlq, err := topicread.All(ctx, []string{brokerAddr}, retrytopics.DLQTopic(topic, group))
	if err != nil {
		return err
	}
	dups, derr := ledger.CheckDeadLetters(items, dlq, maxAttempt, false)
	deadRows, rerr := ledger.CheckDeadLetterRows(ctx, pool, schema, group, items, maxAttempt)
	derr = errors.Join(derr, rerr)

	// The operator's turn, the processor still running: list, trace, replay.
	recovered, oerr := operator(ctx, bin, proc.Env, pool, items)
	var replayed ledger.Report
	if oerr == nil {
		replayed, oerr = ledger.VerifyWith(ctx, pool, items, maxAttempt, ledger.VerifyOptions{Recovered: recovered})
	}

	fmt.Printf("applied    %d events exactly once into ledger_entries (%v from processor start)\n", rep.Applied, took.Round(time.Millisecond))
	fmt.Printf("dead       %d records in topic %s (%d outlasted the tiers, %d poison, %d malformed), %d duplicates; %d rows in %s.dead_letters\n",
		len(dlq), retrytopics.DLQTopic(topic, group), exhausted, kinds[ledger.KindPoison], kinds[ledger.KindMalformed], dups, deadRows, schema)
	if verr == nil {
		fmt.Printf("balances   consistent: %d accounts, each balance = sum of its entries = sum of its produced events; per-account order kept across retries\n", rep.Accounts)
	} else {
		fmt.Printf("balances   INCONSISTENT:\n%v\n", verr)
	}
	if derr != nil {
		fmt.Printf("dead letters WRONG:\n%v\n", derr)
	}
	fmt.Printf("metrics    served at http://%s/metrics (also /healthz, /readyz), compared with the database:\n", httpAddr)
	for _, c := range checks {
		mark := "="
		if c.metric != c.db {
			mark = "!= (WRONG)"
		}
		fmt.Printf("             %-44s %8g %s %-8g %s\n", c.name, c.metric, mark, c.db, c.query)
	}
	if merr != nil {
		fmt.Printf("metrics    do NOT match the database: %v\n", merr)
	}
	if oerr == nil {
		fmt.Printf("replayed   %d dead letters with the processor running: %d recovered and applied exactly once (%d events in the ledger now), the %d poison and malformed back in their own rows; replaying again applied nothing\n",
			deadRows, len(recovered), replayed.Applied, deadRows-len(recovered))
	} else {
		fmt.Printf("replay     WRONG: %v\n", oerr)
	}
	if !stay {
		fmt.Printf("console    served at http://%s while the demo ran (run `make demo` in a terminal, or bin/demo -stay=yes, to keep it open at the end)\n", consoleAddr)
	}
	if stay {
		if err := stayOpen(cl, enc, consoleAddr, exited); err != nil {
			return err
		}
	}

	sigAt := time.Now()
	proc.Process.Signal(syscall.SIGTERM)
	var exitErr error
	select {
	case exitErr = <-exited:
	case <-time.After(15 * time.Second):
		return errors.New("processor did not exit within 15s of SIGTERM")
	}
	shutdown := time.Since(sigAt)
	fmt.Printf("shutdown   SIGTERM -> exit %s in %v\n", exitStatus(exitErr), shutdown.Round(time.Millisecond))
	if verr != nil || derr != nil || merr != nil || oerr != nil || exitErr != nil {
		return errors.New("the demo found problems (above)")
	}
	ok = true
	fmt.Println("\nok: every event applied exactly once or dead-lettered; nothing lost.")
	return nil
}

// The demo console's user: an operator, on 127.0.0.1 only.
const (
	consoleUser     = "demo"
	consolePassword = "kafkapg-demo"
)

// addr returns preferred if it is free, else a free address.
func addr(preferred string) (string, error) {
	l, err := net.Listen("tcp", preferred)
	if err != nil {
		return localrun.FreeAddr()
	}
	l.Close()
	return preferred, nil
}

// stayOpen keeps the processor and its console running until Ctrl-C (or SIGTERM), producing a
// trickle of new ledger events (some of them failing) so that the console's chart, rates and
// retry path have something to show.
// With enc, the events are in Avro as the others were.
func stayOpen(cl *kgo.Client, enc *avroEvents, consoleAddr string, exited <-chan error) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fmt.Printf("\nThe processor keeps running, with its console at http://%s (user %s, password %s),\n", consoleAddr, consoleUser, consolePassword)
	fmt.Println("on a trickle of new events (about 50 a second, some failing). Ctrl-C ends the demo.")
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for round := 0; ; round++ {
		select {
		case <-ctx.Done():
			fmt.Println()
			return nil
		case err := <-exited:
			return fmt.Errorf("processor exited (%v)", err)
		case <-tick.C:
		}
		items := ledger.Generate(ledger.GenConfig{
			Events: 5, Accounts: 50, Seed: uint64(time.Now().UnixNano()), Prefix: fmt.Sprintf("live%d-", round),
			PoisonPerMille: 10, MalformedPerMille: 10, FlakyPerMille: 50, MaxFailAttempts: maxAttempt + 1,
		})
		for _, it := range items {
			r := it.Record(topic)
			if enc != nil {
				var err error
				if r.Value, err = enc.encode(it); err != nil {
					return err
				}
			}
			cl.Produce(ctx, r, nil)
		}
	}
}

// metricCheck is one metric read from /metrics and the same figure computed from the database.
type metricCheck struct {
	name       string
	metric, db float64
	query      string
}

// compareMetrics scrapes url and computes, from Postgres and the broker's end offsets, what each
// metric should say after a run of one processor that never restarted.
func compareMetrics(ctx context.Context, pool *pgxpool.Pool, adm *kadm.Client, url string) ([]metricCheck, error) {
	sums, err := promscrape.Sums(ctx, url)
	if err != nil {
		return nil, err
	}
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return nil, err
	}
	var lag int64
	var stored = map[int32]int64{}
	rows, err := pool.Query(ctx, `SELECT partition, next_offset FROM offsets WHERE consumer_group = $1 AND topic = $2 AND next_offset IS NOT NULL`, group, topic)
	if err != nil {
		return nil, err
	}
	var part int32
	var next int64
	if _, err := pgx.ForEachRow(rows, []any{&part, &next}, func() error { stored[part] = next; return nil }); err != nil {
		return nil, err
	}
	ends.Each(func(o kadm.ListedOffset) { lag += o.Offset - stored[o.Partition] })

	checks := []metricCheck{
		{name: "kafkapg_consumer_lag_records", db: float64(lag), query: "broker end offsets - offsets.next_offset"},
		{name: "kafkapg_records_applied_total", query: "SELECT count(*) FROM ledger_entries"},
		{name: "kafkapg_records_retried_total", query: "sum(attempt - 1) over ledger_entries and dead_letters"},
		{name: "kafkapg_retry_tier_records", query: "SELECT count(*) FROM retries"},
		{name: "kafkapg_held_records", query: "SELECT count(*) FROM held_records"},
		{name: "kafkapg_records_dead_lettered_total", query: "SELECT count(*) FROM dead_letters"},
		{name: "kafkapg_dead_letters_new", query: "... WHERE status = 'new'"},
	}
	err = pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM ledger_entries),
		(SELECT coalesce(sum(attempt - 1), 0) FROM ledger_entries) + (SELECT coalesce(sum(attempts - 1), 0) FROM dead_letters WHERE consumer_group = $1),
		(SELECT count(*) FROM retries WHERE consumer_group = $1),
		(SELECT count(*) FROM held_records WHERE consumer_group = $1),
		(SELECT count(*) FROM dead_letters WHERE consumer_group = $1),
		(SELECT count(*) FROM dead_letters WHERE consumer_group = $1 AND status = 'new')`, group).
		Scan(&checks[1].db, &checks[2].db, &checks[3].db, &checks[4].db, &checks[5].db, &checks[6].db)
	if err != nil {
		return nil, err
	}
	for i := range checks {
		checks[i].metric = sums[checks[i].name]
	}
	return checks, nil
}

func logFile(dir, name string) (*os.File, *os.File) {
	f, err := os.Create(filepath.Join(dir, name))
	if err != nil {
		panic(err)
	}
	return f, f
}

// ownGroup puts a child in a process group of its own: Ctrl-C in the terminal reaches the demo
// alone, which stops its children in order.
func ownGroup() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }

func stop(cmd *exec.Cmd, grace time.Duration) {
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(grace):
		cmd.Process.Kill()
	}
}

func exitStatus(err error) string {
	var ee *exec.ExitError
	switch {
	case err == nil:
		return "0"
	case errors.As(err, &ee):
		return fmt.Sprint(ee.ExitCode())
	}
	return err.Error()
}
