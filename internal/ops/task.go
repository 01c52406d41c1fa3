package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kafkapg/kafkapg/internal/backoff"
)

// Task is a replay or discard of the new dead letters a filter matched when it started (ids up to
// MaxID), stored in the tasks table and worked through in id order, a chunk per transaction. It
// survives its runner: a task whose runner stopped (killed, Ctrl-C) is Interrupted and can be
// resumed where it stopped; a cancelled one stops after its chunk in flight.
type Task struct {
	ID          int64      `json:"id"`
	Action      Action     `json:"action"`
	Filter      Filter     `json:"filter"`
	Reason      string     `json:"reason"`
	Actor       string     `json:"actor"`
	Rate        float64    `json:"rate,omitempty"` // records per second; 0: as fast as it goes
	MaxID       int64      `json:"max_id"`
	Matched     int64      `json:"matched"` // new dead letters the filter matched when it started
	Done        int64      `json:"done"`    // queued for replay, or discarded
	Skipped     int64      `json:"skipped"` // matched, but no longer new when reached
	Status      string     `json:"status"`  // running, done, cancelled
	Interrupted bool       `json:"interrupted"`
	Runner      string     `json:"runner,omitempty"`
	HeartbeatAt *time.Time `json:"heartbeat_at,omitempty"`
	CreatedAt   time.Time  `json:"created_at"`
	FinishedAt  *time.Time `json:"finished_at,omitempty"`
	CancelledBy string     `json:"cancelled_by,omitempty"`
	// What became of a replay's records so far: applied, skipped as a duplicate by its
	// idempotency key (a copy was applied before), dead-lettered again, or still on their way
	// (held behind their key, or in the retry tiers).
	Applied          int64 `json:"applied"`
	SkippedDuplicate int64 `json:"skipped_duplicate"`
	DeadAgain        int64 `json:"dead_again"`
	Pending          int64 `json:"pending"`
}

// lease is how long a runner may go without a heartbeat before its task counts as interrupted.
const lease = 15 * time.Second

// chunk is how many dead letters a task acts on per transaction at most.
const chunk = 200

// StartTask creates a task that applies act to the new dead letters f matches, audited with a.
// RunTask runs it. If f matches dead letters but none is new (the same replay run again), it
// creates nothing and returns a *NothingNewError; if f matches none at all, bad usage.
func (o *Ops) StartTask(ctx context.Context, act Action, f Filter, a Actor, rate float64) (Task, error) {
	if act != Replay && act != Discard {
		return Task{}, usage("unknown action %q", act)
	}
	if err := a.check(); err != nil {
		return Task{}, err
	}
	if rate < 0 {
		return Task{}, usage("rate %v must be positive (records per second), or 0 for no limit", rate)
	}
	nf, err := actionable(f)
	if err != nil {
		return Task{}, err
	}
	if err := nf.Validate(); err != nil {
		return Task{}, err
	}
	filter, err := json.Marshal(nf)
	if err != nil {
		return Task{}, err
	}
	var id int64
	err = pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		args := []any{o.group}
		where := nf.where(&args)
		var maxID, matched int64
		if err := tx.QueryRow(ctx, `SELECT coalesce(max(d.id), 0), count(*) FROM `+o.table("dead_letters")+` d WHERE `+where, args...).Scan(&maxID, &matched); err != nil {
			return fmt.Errorf("count matching dead letters: %w", err)
		}
		if matched == 0 {
			return o.nothingNew(ctx, tx, act, f)
		}
		var r *float64
		if rate > 0 {
			r = &rate
		}
		if err := tx.QueryRow(ctx, `INSERT INTO `+o.table("tasks")+` (consumer_group, action, filter, reason, actor, rate, max_id, matched)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id`, o.group, act, filter, a.Reason, a.Name, r, maxID, matched).Scan(&id); err != nil {
			return fmt.Errorf("create task: %w", err)
		}
		return o.audit(ctx, tx, a, string(act), id, map[string]any{"filter": nf, "matched": matched, "rate": rate})
	})
	if err != nil {
		return Task{}, err
	}
	return o.Task(ctx, id)
}

// NothingNewError is StartTask's answer when the filter matches dead letters but none of them is
// new: they were replayed or discarded before (or are being replayed). Running the same replay
// again is safe, and finding nothing new is its success, not a mistake: callers report it and
// succeed. A filter that matches no dead letter at all is bad usage instead (ErrUsage).
type NothingNewError struct {
	Action Action `json:"action"`
	// NotNew is how many dead letters the filter matches, none of them new; Replaying how many of
	// them a replay brought back and has not settled yet.
	NotNew    int64 `json:"not_new"`
	Replaying int64 `json:"replaying"`
}

func (e *NothingNewError) Error() string {
	msg := fmt.Sprintf("nothing to %s: %d matching dead letters were already replayed or discarded", e.Action, e.NotNew)
	if e.Replaying > 0 {
		msg += fmt.Sprintf(" (%d of them still being replayed)", e.Replaying)
	}
	return msg
}

// nothingNew is StartTask's error when f matches no new dead letter: a *NothingNewError if it
// matches some that are not new, bad usage if it matches none.
func (o *Ops) nothingNew(ctx context.Context, tx pgx.Tx, act Action, f Filter) error {
	all := f
	all.Status = ""
	args := []any{o.group}
	where := all.where(&args)
	e := &NothingNewError{Action: act}
	if err := tx.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE d.status = 'replaying') FROM `+o.table("dead_letters")+` d WHERE `+where,
		args...).Scan(&e.NotNew, &e.Replaying); err != nil {
		return fmt.Errorf("count matching dead letters: %w", err)
	}
	if e.NotNew == 0 {
		return usage("no dead letter matches the filter: nothing to %s", act)
	}
	return e
}

// taskColumns are a Task's columns, in scanTask's order.
const taskColumns = `id, action, filter, reason, actor, coalesce(rate, 0), max_id, matched, done, skipped, status,
	status = 'running' AND (heartbeat_at IS NULL OR heartbeat_at < now() - make_interval(secs => $2)),
	coalesce(runner, ''), heartbeat_at, created_at, finished_at, coalesce(cancelled_by, '')`

func (o *Ops) scanTasks(rows pgx.Rows) ([]Task, error) {
	var out []Task
	var t Task
	var filter []byte
	_, err := pgx.ForEachRow(rows, []any{&t.ID, &t.Action, &filter, &t.Reason, &t.Actor, &t.Rate, &t.MaxID, &t.Matched, &t.Done, &t.Skipped,
		&t.Status, &t.Interrupted, &t.Runner, &t.HeartbeatAt, &t.CreatedAt, &t.FinishedAt, &t.CancelledBy}, func() error {
		if err := json.Unmarshal(filter, &t.Filter); err != nil {
			return fmt.Errorf("task %d: filter: %w", t.ID, err)
		}
		out = append(out, t)
		t = Task{}
		return nil
	})
	return out, err
}

// outcomes fills in what became of the records t replayed: for each it queued, the first of
// replayed, skipped_duplicate or dead_lettered that followed in its history.
func (o *Ops) outcomes(ctx context.Context, t *Task) error {
	if t.Action != Replay {
		return nil
	}
	ev := o.table("dead_letter_events")
	return o.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE next = 'replayed'), count(*) FILTER (WHERE next = 'skipped_duplicate'),
			count(*) FILTER (WHERE next = 'dead_lettered'), count(*) FILTER (WHERE next IS NULL)
		FROM (SELECT (SELECT n.event FROM `+ev+` n WHERE n.dead_letter_id = q.dead_letter_id AND n.id > q.id
					AND n.event IN ('replayed', 'skipped_duplicate', 'dead_lettered')
				ORDER BY n.id LIMIT 1) AS next
			FROM `+ev+` q WHERE q.task_id = $1 AND q.event = 'replay_queued') x`, t.ID).Scan(&t.Applied, &t.SkippedDuplicate, &t.DeadAgain, &t.Pending)
}

// Task returns task id, with its outcomes so far.
func (o *Ops) Task(ctx context.Context, id int64) (Task, error) {
	t, err := o.taskRow(ctx, id)
	if err != nil {
		return t, err
	}
	if err := o.outcomes(ctx, &t); err != nil {
		return t, fmt.Errorf("read outcomes of task %d: %w", id, err)
	}
	return t, nil
}

// taskRow returns task id without its outcomes (which cost a look at each record it replayed).
func (o *Ops) taskRow(ctx context.Context, id int64) (Task, error) {
	rows, err := o.pool.Query(ctx, `SELECT `+taskColumns+` FROM `+o.table("tasks")+` WHERE consumer_group = $1 AND id = $3`,
		o.group, lease.Seconds(), id)
	if err != nil {
		return Task{}, fmt.Errorf("read task %d: %w", id, err)
	}
	ts, err := o.scanTasks(rows)
	if err != nil {
		return Task{}, fmt.Errorf("read task %d: %w", id, err)
	}
	if len(ts) == 0 {
		return Task{}, fmt.Errorf("task %d of group %s: %w", id, o.group, ErrNotFound)
	}
	return ts[0], nil
}

// Tasks returns the group's latest tasks, newest first.
func (o *Ops) Tasks(ctx context.Context, limit int) ([]Task, error) {
	rows, err := o.pool.Query(ctx, `SELECT `+taskColumns+` FROM `+o.table("tasks")+` WHERE consumer_group = $1 ORDER BY id DESC LIMIT $3`,
		o.group, lease.Seconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("list tasks: %w", err)
	}
	ts, err := o.scanTasks(rows)
	if err != nil {
		return nil, fmt.Errorf("list tasks: %w", err)
	}
	for i := range ts {
		if err := o.outcomes(ctx, &ts[i]); err != nil {
			return nil, fmt.Errorf("read outcomes of task %d: %w", ts[i].ID, err)
		}
	}
	return ts, nil
}

// Cancel stops a running task after its chunk in flight; what it did stays done. The audit
// records a.
func (o *Ops) Cancel(ctx context.Context, id int64, a Actor) (Task, error) {
	if a.Reason == "" {
		a.Reason = "(no reason given)"
	}
	if err := a.check(); err != nil {
		return Task{}, err
	}
	err := pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		var status string
		err := tx.QueryRow(ctx, `SELECT status FROM `+o.table("tasks")+` WHERE consumer_group = $1 AND id = $2 FOR UPDATE`, o.group, id).Scan(&status)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("task %d of group %s: %w", id, o.group, ErrNotFound)
		}
		if err != nil {
			return fmt.Errorf("cancel task %d: %w", id, err)
		}
		if status != "running" {
			return usage("task %d is %s: nothing to cancel", id, status)
		}
		if _, err := tx.Exec(ctx, `UPDATE `+o.table("tasks")+` SET status = 'cancelled', finished_at = now(), cancelled_by = $2,
			skipped = greatest(matched - done, 0) WHERE id = $1`, id, a.Name); err != nil {
			return fmt.Errorf("cancel task %d: %w", id, err)
		}
		return o.audit(ctx, tx, a, "cancel", id, map[string]any{})
	})
	if err != nil {
		return Task{}, err
	}
	return o.Task(ctx, id)
}

// ErrTaskBusy means another runner is running the task (it heart-beat within the lease).
var ErrTaskBusy = errors.New("the task is being run by another runner")

// RunTask runs task id until it is done, cancelled, or ctx ends (it is then interrupted and can
// be resumed with RunTask again), calling progress after every chunk. runner names this runner
// (host and process) in the task row. A task another runner is running is refused with
// ErrTaskBusy; one that is finished is returned as it is.
//
// Each chunk is one transaction: it locks the task row (a cancel or another runner taking over
// is seen there), acts on the next dead letters in id order (see retrytopics.Store.Replay and
// Discard: only rows still new are acted on, so a chunk run twice changes nothing the second
// time) and moves the task's cursor past them.
func (o *Ops) RunTask(ctx context.Context, id int64, runner string, progress func(Task)) (Task, error) {
	var t Task
	tag, err := o.pool.Exec(ctx, `UPDATE `+o.table("tasks")+` SET runner = $3, heartbeat_at = now()
		WHERE consumer_group = $1 AND id = $2 AND status = 'running'
		AND (runner IS NULL OR runner = $3 OR heartbeat_at IS NULL OR heartbeat_at < now() - make_interval(secs => $4))`,
		o.group, id, runner, lease.Seconds())
	if err != nil {
		return t, fmt.Errorf("take task %d: %w", id, err)
	}
	if t, err = o.Task(ctx, id); err != nil {
		return t, err
	}
	if tag.RowsAffected() == 0 {
		if t.Status != "running" {
			return t, nil
		}
		return t, fmt.Errorf("task %d: %w (%s, last heartbeat %s ago)", id, ErrTaskBusy, t.Runner, time.Since(*t.HeartbeatAt).Round(time.Second))
	}
	o.analyze(ctx)
	n := chunk
	if t.Rate > 0 {
		n = max(1, min(chunk, int(t.Rate/4)))
	}
	start, acted := time.Now(), 0
	for {
		var more bool
		for failures := 0; ; failures++ {
			var k int
			k, more, err = o.runChunk(ctx, t, runner, n)
			if k > 0 && acted == 0 && t.Action == Replay {
				// The first chunk put records where none may have been: the held-record
				// appliers' plans need to know (see retrytopics.Store.AnalyzeHeld).
				_ = o.store.AnalyzeHeld(ctx, o.pool)
			}
			acted += k
			if err == nil || !transient(err) || ctx.Err() != nil {
				break
			}
			if failures+1 == maxChunkFailures {
				err = fmt.Errorf("task %d: %d tries of its next chunk failed, the last with: %w (the task keeps its place: resume it)", id, maxChunkFailures, err)
				break
			}
			if !backoff.Sleep(ctx, nil, chunkBackoff.Delay(failures+1)) {
				break
			}
		}
		if t2, rerr := o.taskRow(context.WithoutCancel(ctx), id); rerr == nil {
			t = t2
		}
		if err != nil {
			if ctx.Err() != nil {
				return t, fmt.Errorf("task %d interrupted; resume it with its id: %w", id, ctx.Err())
			}
			return t, err
		}
		if progress != nil {
			progress(t)
		}
		if !more || t.Status != "running" {
			return o.Task(context.WithoutCancel(ctx), id)
		}
		if t.Rate > 0 {
			// Pace to the rate, heart-beating while waiting.
			until := start.Add(time.Duration(float64(acted) / t.Rate * float64(time.Second)))
			for time.Now().Before(until) {
				if !backoff.Sleep(ctx, nil, min(time.Until(until), lease/3)) {
					return t, fmt.Errorf("task %d interrupted; resume it with its id: %w", id, ctx.Err())
				}
				if _, err := o.pool.Exec(ctx, `UPDATE `+o.table("tasks")+` SET heartbeat_at = now() WHERE id = $1 AND runner = $2`, id, runner); err != nil && ctx.Err() == nil {
					return t, fmt.Errorf("task %d: heartbeat: %w", id, err)
				}
			}
		}
	}
}

// analyze refreshes the planner's statistics of the tables a task's chunks read, before its first
// chunk. Dead letters often arrive in a burst (a downstream outage) and are replayed soon after,
// before autovacuum has analyzed them: a table that statistics still say is nearly empty is read
// through its status index, every new row filtered against the chunk's ids, and each chunk reads
// the whole table. BenchmarkReplay queued 20,000 dead letters at 2,000 records/s without it (60 of
// each chunk's 95 ms in that scan, growing with the backlog), and at 5,350 with it. A failure (a
// role that does not own the tables: Postgres skips them with a warning) changes nothing else.
func (o *Ops) analyze(ctx context.Context) {
	_, _ = o.pool.Exec(ctx, `ANALYZE `+o.table("dead_letters")+`, `+o.table("dead_letter_events"))
}

// runChunk acts on the task's next n dead letters in one transaction. It returns how many it
// acted on and whether more may follow; it stops, with no error, when the task is no longer
// running or no longer this runner's.
func (o *Ops) runChunk(ctx context.Context, t Task, runner string, n int) (acted int, more bool, err error) {
	err = pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		acted, more = 0, false
		var status, owner string
		var cursor int64
		err := tx.QueryRow(ctx, `SELECT status, coalesce(runner, ''), cursor_id FROM `+o.table("tasks")+` WHERE id = $1 FOR UPDATE`, t.ID).
			Scan(&status, &owner, &cursor)
		if err != nil {
			return fmt.Errorf("lock task %d: %w", t.ID, err)
		}
		if status != "running" || owner != runner {
			return nil
		}
		args := []any{o.group}
		where := t.Filter.where(&args)
		args = append(args, cursor, t.MaxID, n)
		l := len(args)
		rows, err := tx.Query(ctx, `SELECT d.id FROM `+o.table("dead_letters")+` d WHERE `+where+`
			AND d.id > $`+strconv.Itoa(l-2)+` AND d.id <= $`+strconv.Itoa(l-1)+` ORDER BY d.id LIMIT $`+strconv.Itoa(l), args...)
		if err != nil {
			return fmt.Errorf("task %d: next dead letters: %w", t.ID, err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return fmt.Errorf("task %d: next dead letters: %w", t.ID, err)
		}
		var done []int64
		if t.Action == Replay {
			done, err = o.store.Replay(ctx, tx, ids, t.ID)
		} else {
			done, err = o.store.Discard(ctx, tx, ids, t.ID)
			if err == nil {
				err = o.numbersDone(ctx, tx, done)
			}
		}
		if err != nil {
			return err
		}
		acted, more = len(done), len(ids) == n
		next := cursor
		if len(ids) > 0 {
			next = ids[len(ids)-1]
		}
		finish := ""
		if !more {
			finish = `, status = 'done', finished_at = now(), skipped = greatest(matched - (done + $3), 0)`
		}
		_, err = tx.Exec(ctx, `UPDATE `+o.table("tasks")+` SET cursor_id = $2, done = done + $3, heartbeat_at = now()`+finish+` WHERE id = $1`,
			t.ID, next, len(done))
		return err
	})
	if err != nil {
		return 0, false, err // rolled back
	}
	return acted, more, nil
}

// transient reports whether a chunk's failure may pass by retrying it: a deadlock or
// serialization failure (class 40), or the connection failing.
func transient(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return len(pgErr.Code) == 5 && pgErr.Code[:2] == "40"
	}
	return pgconn.SafeToRetry(err) || errors.Is(err, context.DeadlineExceeded)
}

// Purge deletes replayed and discarded dead letters whose status changed more than olderThan
// ago, with their history; new and replaying ones are never purged. Without execute it only
// counts them.
func (o *Ops) Purge(ctx context.Context, olderThan time.Duration, execute bool, a Actor) (int64, error) {
	if olderThan <= 0 {
		return 0, usage("older-than %v must be positive", olderThan)
	}
	cond := `consumer_group = $1 AND status IN ('replayed', 'discarded') AND status_changed_at < now() - make_interval(secs => $2)`
	if !execute {
		var n int64
		err := o.pool.QueryRow(ctx, `SELECT count(*) FROM `+o.table("dead_letters")+` WHERE `+cond, o.group, olderThan.Seconds()).Scan(&n)
		return n, err
	}
	if err := a.check(); err != nil {
		return 0, err
	}
	var n int64
	err := pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `DELETE FROM `+o.table("dead_letters")+` WHERE `+cond, o.group, olderThan.Seconds())
		if err != nil {
			return fmt.Errorf("purge: %w", err)
		}
		n = tag.RowsAffected()
		return o.audit(ctx, tx, a, "purge", 0, map[string]any{"older_than": olderThan.String(), "deleted": n})
	})
	return n, err
}

// maxChunkFailures bounds the tries of a chunk that keeps failing transiently (Postgres down):
// the runner then gives up, and the task waits to be resumed.
const maxChunkFailures = 10

// chunkBackoff spaces the retries of a chunk that failed transiently.
var chunkBackoff = backoff.Policy{Base: 100 * time.Millisecond, Max: 5 * time.Second}
