package ops_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

const group = "g"

// deadLetters makes a database with n new dead letters of topic t (partition 0, offsets 0..n-1,
// keys k0..k9, classes alternating retryable and permanent) and the partition's offsets row.
func deadLetters(t *testing.T, n int) (*pgxpool.Pool, *ops.Ops) {
	t.Helper()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	_, err := pool.Exec(ctx, `INSERT INTO kafkapg.offsets (consumer_group, topic, partition, next_offset) VALUES ($1, 't', 0, $2)`, group, n)
	if err != nil {
		t.Fatal(err)
	}
	_, err = pool.Exec(ctx, `WITH d AS (
			INSERT INTO kafkapg.dead_letters (consumer_group, topic, partition, "offset", key, value, "timestamp", error_class, error_message, attempts, first_failed_at)
			SELECT $1, 't', 0, i, convert_to('k' || (i % 10), 'UTF8'), convert_to('v' || i, 'UTF8'), 0,
				CASE WHEN i % 2 = 0 THEN 'retryable' ELSE 'permanent' END, 'boom ' || i, 2, now()
			FROM generate_series(0, $2 - 1) AS i
			RETURNING id, attempts, error_class, error_message)
		INSERT INTO kafkapg.dead_letter_events (dead_letter_id, event, attempt, error_class, error_message)
			SELECT id, 'dead_lettered', attempts, error_class, error_message FROM d`, group, n)
	if err != nil {
		t.Fatal(err)
	}
	return pool, ops.New(pool, "kafkapg", group)
}

func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

var tester = ops.Actor{Name: "tester", Reason: "testing"}

// TestReplayTaskResumesWhereItsRunnerStopped: a task whose runner stops after its first chunk
// is interrupted once its heartbeat is old, is resumed by another runner from its cursor, and
// queues every dead letter exactly once; running it again changes nothing; a task another
// runner heart-beats is refused.
func TestReplayTaskResumesWhereItsRunnerStopped(t *testing.T) {
	pool, o := deadLetters(t, 450)
	ctx := context.Background()
	task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, tester, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task.Matched != 450 || task.Status != "running" {
		t.Fatalf("task %+v; want 450 matched, running", task)
	}
	cctx, cancel := context.WithCancel(ctx)
	_, err = o.RunTask(cctx, task.ID, "first", func(ops.Task) { cancel() }) // dies after its first chunk
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("RunTask after a cancel = %v; want context.Canceled", err)
	}
	task, _ = o.Task(ctx, task.ID)
	if task.Done != 200 || task.Status != "running" || task.Interrupted {
		t.Fatalf("after one chunk: %+v; want 200 done, running, not interrupted yet (heartbeat fresh)", task)
	}
	if _, err := o.RunTask(ctx, task.ID, "second", nil); !errors.Is(err, ops.ErrTaskBusy) {
		t.Fatalf("RunTask while the first runner's lease holds = %v; want ErrTaskBusy", err)
	}
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.tasks SET heartbeat_at = now() - interval '1 minute'`); err != nil {
		t.Fatal(err)
	}
	if task, _ = o.Task(ctx, task.ID); !task.Interrupted {
		t.Fatalf("task %+v; want interrupted once its heartbeat is old", task)
	}
	task, err = o.RunTask(ctx, task.ID, "second", nil)
	if err != nil || task.Status != "done" || task.Done != 450 || task.Skipped != 0 {
		t.Fatalf("resumed: %+v, %v; want done, 450 done, none skipped", task, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.held_records`); n != 450 {
		t.Errorf("%d records waiting to be applied; want 450", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM (SELECT dead_letter_id FROM kafkapg.dead_letter_events WHERE event = 'replay_queued' GROUP BY 1 HAVING count(*) = 1) x`); n != 450 {
		t.Errorf("%d dead letters queued exactly once; want 450", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.dead_letters WHERE status = 'replaying' AND replays = 1`); n != 450 {
		t.Errorf("%d rows replaying; want 450", n)
	}
	// The task analyzed the tables its chunks and the held-record appliers read (a burst of dead
	// letters has no statistics yet: see Ops.analyze). last_analyze is set by ANALYZE only, not by
	// autovacuum.
	if n := count(t, pool, `SELECT count(*) FROM pg_stat_user_tables WHERE schemaname = 'kafkapg'
		AND relname IN ('dead_letters', 'dead_letter_events', 'held_records', 'held_keys') AND last_analyze IS NOT NULL`); n != 4 {
		t.Errorf("%d of the 4 tables analyzed by the task; want all", n)
	}
	if n := count(t, pool, `SELECT keys_epoch FROM kafkapg.offsets`); n < 1 {
		t.Errorf("keys_epoch %d; want it bumped", n)
	}
	// Held keys: one per distinct key, ready.
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.held_keys WHERE state = 'ready'`); n != 10 {
		t.Errorf("%d ready keys; want 10", n)
	}
	again, err := o.RunTask(ctx, task.ID, "third", nil)
	if err != nil || again.Done != 450 || again.Status != "done" {
		t.Errorf("running a finished task: %+v, %v; want it unchanged", again, err)
	}
	// The same replay again is safe, and finding nothing new is not a mistake; a filter that
	// matches nothing at all is (a typo).
	var nothing *ops.NothingNewError
	if _, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, tester, 0); !errors.As(err, &nothing) || errors.Is(err, ops.ErrUsage) ||
		nothing.NotNew != 450 || nothing.Replaying != 450 {
		t.Errorf("a second replay of the same rows: %v (%+v); want a *NothingNewError of 450, 450 of them replaying, not bad usage", err, nothing)
	} else if want := "nothing to replay: 450 matching dead letters were already replayed or discarded (450 of them still being replayed)"; err.Error() != want {
		t.Errorf("a second replay of the same rows says %q; want %q", err, want)
	}
	if _, err := o.StartTask(ctx, ops.Replay, ops.Filter{Topic: "no-such-topic"}, tester, 0); !errors.Is(err, ops.ErrUsage) || errors.As(err, &nothing) {
		t.Errorf("a replay whose filter matches no dead letter: %v; want bad usage", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.tasks`); n != 1 {
		t.Errorf("%d tasks; want the first only", n)
	}
}

// TestCancelledTaskStops: a cancelled task acts on nothing more; cancelling it again is refused.
func TestCancelledTaskStops(t *testing.T) {
	pool, o := deadLetters(t, 10)
	ctx := context.Background()
	task, err := o.StartTask(ctx, ops.Discard, ops.Filter{Class: "permanent"}, tester, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task.Matched != 5 {
		t.Fatalf("matched %d permanent dead letters; want 5", task.Matched)
	}
	if task, err = o.Cancel(ctx, task.ID, ops.Actor{Name: "boss"}); err != nil || task.Status != "cancelled" || task.CancelledBy != "boss" {
		t.Fatalf("Cancel = %+v, %v", task, err)
	}
	if task, err = o.RunTask(ctx, task.ID, "r", nil); err != nil || task.Done != 0 {
		t.Fatalf("RunTask of a cancelled task = %+v, %v; want nothing done", task, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.dead_letters WHERE status <> 'new'`); n != 0 {
		t.Errorf("%d rows changed by a cancelled task", n)
	}
	if _, err := o.Cancel(ctx, task.ID, tester); !errors.Is(err, ops.ErrUsage) {
		t.Errorf("cancelling twice: %v; want a usage error", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.audit WHERE action = 'cancel' AND actor = 'boss'`); n != 1 {
		t.Errorf("%d audit rows for the cancel; want 1", n)
	}
}

// TestDiscardThenPurge: discarding marks rows (kept, with their history); purging deletes only
// replayed and discarded rows older than asked, and only with execute.
func TestDiscardThenPurge(t *testing.T) {
	pool, o := deadLetters(t, 6)
	ctx := context.Background()
	p, err := o.Preview(ctx, ops.Discard, ops.Filter{Error: "BOOM 3"}, 5)
	if err != nil || p.Matched != 1 || len(p.Sample) != 1 || p.Sample[0].Offset != 3 {
		t.Fatalf("Preview(error contains 'BOOM 3') = %+v, %v; want offset 3 only (case-insensitive)", p, err)
	}
	task, err := o.StartTask(ctx, ops.Discard, ops.Filter{Class: "retryable"}, tester, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task, err = o.RunTask(ctx, task.ID, "r", nil); err != nil || task.Done != 3 {
		t.Fatalf("discard: %+v, %v; want 3 done", task, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.dead_letters d WHERE status = 'discarded' AND value IS NOT NULL
		AND EXISTS (SELECT 1 FROM kafkapg.dead_letter_events e WHERE e.dead_letter_id = d.id AND e.event = 'discarded' AND e.task_id = $1)`, task.ID); n != 3 {
		t.Errorf("%d rows discarded with their value and a history event; want 3", n)
	}
	if n, err := o.Purge(ctx, time.Hour, true, tester); err != nil || n != 0 {
		t.Errorf("Purge(1h) = %d, %v; want nothing that recent", n, err)
	}
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.dead_letters SET status_changed_at = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	if n, err := o.Purge(ctx, time.Hour, false, ops.Actor{}); err != nil || n != 3 {
		t.Errorf("Purge dry run = %d, %v; want 3 counted", n, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.dead_letters`); n != 6 {
		t.Errorf("%d rows after a dry run; want 6", n)
	}
	if n, err := o.Purge(ctx, time.Hour, true, tester); err != nil || n != 3 {
		t.Errorf("Purge = %d, %v; want the 3 discarded rows", n, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.dead_letters WHERE status = 'new'`); n != 3 {
		t.Errorf("%d new rows left; want 3 (new rows are never purged)", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.dead_letter_events e WHERE NOT EXISTS (SELECT 1 FROM kafkapg.dead_letters d WHERE d.id = e.dead_letter_id)`); n != 0 {
		t.Errorf("%d history rows of purged dead letters left", n)
	}
}

// TestFiltersChooseTheirRows: each filter of List narrows to what it names.
func TestFiltersChooseTheirRows(t *testing.T) {
	_, o := deadLetters(t, 20)
	ctx := context.Background()
	for _, c := range []struct {
		f    ops.Filter
		want int
	}{
		{ops.Filter{}, 20},
		{ops.Filter{Topic: "t"}, 20},
		{ops.Filter{Topic: "other"}, 0},
		{ops.Filter{Key: []byte("k3"), HasKey: true}, 2},
		{ops.Filter{Class: "permanent"}, 10},
		{ops.Filter{Status: "new"}, 20},
		{ops.Filter{Status: "replayed"}, 0},
		{ops.Filter{Status: "replayed,new"}, 20},
		{ops.Filter{Status: "replayed, discarded"}, 0},
		{ops.Filter{Since: time.Now().Add(-time.Hour)}, 20},
		{ops.Filter{Until: time.Now().Add(-time.Hour)}, 0},
		{ops.Filter{Error: "boom 1"}, 11}, // 1, 10..19
		{ops.Filter{IDs: []int64{1, 2, 999}}, 2},
		{ops.Filter{Class: "permanent", Key: []byte("k3"), HasKey: true}, 2},
	} {
		got, err := o.List(ctx, c.f, 100)
		if err != nil || len(got) != c.want {
			t.Errorf("List(%+v) = %d rows, %v; want %d", c.f, len(got), err, c.want)
		}
	}
	if _, err := o.List(ctx, ops.Filter{Status: "bogus"}, 10); !errors.Is(err, ops.ErrUsage) {
		t.Errorf("List(status bogus) = %v; want a usage error", err)
	}
	sum, err := o.Summary(ctx, ops.Filter{})
	if err != nil || fmt.Sprint(len(sum)) != "2" || sum[0].N+sum[1].N != 20 {
		t.Errorf("Summary = %+v, %v; want 2 groups (permanent, retryable) of 20 in all", sum, err)
	}
}

// TestReplayRateIsCapped: a task with a rate takes at least as long as its rate allows.
func TestReplayRateIsCapped(t *testing.T) {
	_, o := deadLetters(t, 30)
	ctx := context.Background()
	task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, tester, 20)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if task, err = o.RunTask(ctx, task.ID, "r", nil); err != nil || task.Done != 30 {
		t.Fatalf("RunTask = %+v, %v", task, err)
	}
	// 30 records at 20 per second: the last chunk may not start before 25 of them took 1.25 s.
	if took := time.Since(start); took < time.Second {
		t.Errorf("30 records at --rate 20 took %v; want at least 1 s", took)
	}
}

// TestTaskFilterOnTheEmptyKey: the empty key is a key (Kafka's records may carry one). A discard
// of the dead letters whose key is empty matched them in its dry run and then, its filter stored
// as JSON and read back as "no key", matched nothing: the task ended done with 0 done.
func TestTaskFilterOnTheEmptyKey(t *testing.T) {
	pool, o := deadLetters(t, 6)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `UPDATE kafkapg.dead_letters SET key = '' WHERE "offset" < 2`); err != nil {
		t.Fatal(err)
	}
	f := ops.Filter{Key: []byte{}, HasKey: true}
	p, err := o.Preview(ctx, ops.Discard, f, 5)
	if err != nil || p.Matched != 2 {
		t.Fatalf("Preview(key '') = %+v, %v; want the 2 dead letters with the empty key", p, err)
	}
	task, err := o.StartTask(ctx, ops.Discard, f, tester, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task, err = o.RunTask(ctx, task.ID, "r", nil); err != nil || task.Done != 2 {
		t.Fatalf("discard of key '': %+v, %v; want 2 done", task, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.dead_letters WHERE status = 'discarded' AND key = ''`); n != 2 {
		t.Errorf("%d dead letters with the empty key discarded; want 2", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.dead_letters WHERE status = 'discarded'`); n != 2 {
		t.Errorf("%d dead letters discarded in all; want 2", n)
	}
}

// TestReplayLeavesTierRecordsAlone: a record of a retry tier's topic without kafkapg's headers
// (produced there by hand) is handled as one of its own and dead-lettered under the tier's topic;
// a replay put it in held_records under that topic, which no processor applies: it stayed
// replaying for ever. The dry run now says so, and the task leaves it alone.
func TestReplayLeavesTierRecordsAlone(t *testing.T) {
	pool, o := deadLetters(t, 3)
	ctx := context.Background()
	var id int64
	if err := pool.QueryRow(ctx, `INSERT INTO kafkapg.dead_letters (consumer_group, topic, partition, "offset", key, value, "timestamp", error_class, error_message, attempts, first_failed_at)
		VALUES ($1, 't.g.retry.1', 0, 7, 'k', 'v', 0, 'permanent', 'not ours', 1, now()) RETURNING id`, group).Scan(&id); err != nil {
		t.Fatal(err)
	}
	p, err := o.Preview(ctx, ops.Replay, ops.Filter{}, 10)
	if err != nil || p.OfTiers != 1 || !strings.Contains(strings.Join(p.Notes, "\n"), "records of a retry tier's topic itself") {
		t.Fatalf("Preview = %+v, %v; want the tier's record named as left alone", p, err)
	}
	task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, tester, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task, err = o.RunTask(ctx, task.ID, "r", nil); err != nil || task.Done != 3 || task.Skipped != 1 {
		t.Fatalf("replay: %+v, %v; want 3 done and the tier's record skipped", task, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.dead_letters WHERE id = $1 AND status = 'new'`, id); n != 1 {
		t.Errorf("the tier's record is no longer new: a replay took it")
	}
	if n := count(t, pool, `SELECT count(*) FROM kafkapg.held_records WHERE topic = 't.g.retry.1'`); n != 0 {
		t.Errorf("%d held records under the tier's topic; no processor would apply them", n)
	}
}

// TestTaskActsOn200DeadLettersPerTransaction: a task works through its dead letters 200 to a
// transaction (the runbook says so): a failure or a cancel loses at most one chunk's work, and a
// chunk's locks stay few. Told by the rows themselves: the rows one transaction wrote carry its
// id (xmin), so 450 replayed dead letters carry three, of 200, 200 and 50 rows.
func TestTaskActsOn200DeadLettersPerTransaction(t *testing.T) {
	pool, o := deadLetters(t, 450)
	ctx := context.Background()
	task, err := o.StartTask(ctx, ops.Replay, ops.Filter{}, tester, 0)
	if err != nil {
		t.Fatal(err)
	}
	if task, err = o.RunTask(ctx, task.ID, "r", nil); err != nil || task.Done != 450 {
		t.Fatalf("RunTask = %+v, %v; want 450 done", task, err)
	}
	rows, err := pool.Query(ctx, `SELECT count(*) FROM kafkapg.dead_letters GROUP BY xmin::text ORDER BY 1 DESC`)
	if err != nil {
		t.Fatal(err)
	}
	perTx, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(perTx, []int{200, 200, 50}) {
		t.Errorf("the task changed its 450 dead letters in transactions of %v rows; want 200, 200, 50", perTx)
	}
}
