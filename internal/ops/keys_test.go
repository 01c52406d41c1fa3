package ops_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// keysGroup is the consumer group of the keys and trace tests.
const keysGroup = "kg"

// keysEnv is a migrated database with the Store and Ops of keysGroup.
type keysEnv struct {
	t     *testing.T
	pool  *pgxpool.Pool
	store *retrytopics.Store
	ops   *ops.Ops
}

func newKeysEnv(t *testing.T) *keysEnv {
	t.Helper()
	pool := testenv.Migrated(t)
	return &keysEnv{t: t, pool: pool, store: retrytopics.NewStore("kafkapg", keysGroup), ops: ops.New(pool, "kafkapg", keysGroup)}
}

// tx runs fn in a committed transaction.
func (e *keysEnv) tx(fn func(ctx context.Context, tx pgx.Tx) error) {
	e.t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return fn(ctx, tx) }); err != nil {
		e.t.Fatal(err)
	}
}

// exec runs a statement.
func (e *keysEnv) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

// scalar reads one value.
func scalar[T any](e *keysEnv, sql string, args ...any) T {
	e.t.Helper()
	var v T
	if err := e.pool.QueryRow(context.Background(), sql, args...).Scan(&v); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
	return v
}

func rec(topic string, partition int32, offset int64, key string) retrytopics.Rec {
	return retrytopics.Rec{Origin: retrytopics.Origin{Topic: topic, Partition: partition, Offset: offset}, Key: []byte(key),
		Value: []byte("v"), Timestamp: time.UnixMilli(1_700_000_000_000)}
}

// toTier sends r (its key held) from its source partition to retry tier 1, due at due.
func (e *keysEnv) toTier(r retrytopics.Rec, due time.Time) {
	e.t.Helper()
	e.tx(func(ctx context.Context, tx pgx.Tx) error {
		return e.store.ToTier(ctx, tx, retrytopics.Move{Rec: r, Held: true, From: retrytopics.FromSource, Attempt: 1, Tier: 1,
			Class: "retryable", Message: "boom\nagain", FirstFailedAt: time.Now().Add(-time.Minute), DueAt: due})
	})
}

// deadLetter dead-letters r from its source partition (blocking its key if block) and returns
// the dead letter's id.
func (e *keysEnv) deadLetter(r retrytopics.Rec, held, block bool) int64 {
	e.t.Helper()
	e.tx(func(ctx context.Context, tx pgx.Tx) error {
		return e.store.DeadLetter(ctx, tx, retrytopics.Move{Rec: r, Held: held, From: retrytopics.FromSource, Attempt: 1, Tier: 1,
			Class: "permanent", Message: "bad", FirstFailedAt: time.Now(), Block: block})
	})
	return scalar[int64](e, `SELECT id FROM kafkapg.dead_letters WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND "offset" = $4`,
		keysGroup, r.Topic, r.Partition, r.Offset)
}

// hold holds records behind their (held) key.
func (e *keysEnv) hold(recs ...retrytopics.Rec) {
	e.t.Helper()
	e.tx(func(ctx context.Context, tx pgx.Tx) error {
		held, err := e.store.LockHeldKeys(ctx, tx, recs[0].Topic, recs[0].Partition, [][]byte{recs[0].Key})
		if err != nil {
			return err
		}
		if !held[string(recs[0].Key)] {
			e.t.Fatalf("key %q is not held", recs[0].Key)
		}
		return e.store.Hold(ctx, tx, recs)
	})
}

// applied applies r from its tier: its key becomes ready (records are held behind it).
func (e *keysEnv) applied(r retrytopics.Rec) {
	e.t.Helper()
	e.tx(func(ctx context.Context, tx pgx.Tx) error {
		if _, err := e.store.LockRetries(ctx, tx, []retrytopics.Origin{r.Origin}); err != nil {
			return err
		}
		return e.store.Applied(ctx, tx, []retrytopics.Rec{r}, []bool{true})
	})
}

func (e *keysEnv) keyState(topic string, partition int32, key []byte) string {
	e.t.Helper()
	var state string
	err := e.pool.QueryRow(context.Background(), `SELECT state FROM kafkapg.held_keys
		WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key = $4`, keysGroup, topic, partition, key).Scan(&state)
	if errors.Is(err, pgx.ErrNoRows) {
		return "not held"
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return state
}

func (e *keysEnv) audits() int {
	e.t.Helper()
	return scalar[int](e, `SELECT count(*)::int FROM kafkapg.audit WHERE consumer_group = $1`, keysGroup)
}

// backdate makes a key look as if it had made no progress for an hour (and its head, if in a
// tier, an hour overdue).
func (e *keysEnv) backdate(topic string, partition int32, key []byte) {
	e.t.Helper()
	e.exec(`UPDATE kafkapg.held_keys SET updated_at = now() - interval '1 hour'
		WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key = $4`, keysGroup, topic, partition, key)
	e.exec(`UPDATE kafkapg.retries SET due_at = now() - interval '1 hour'
		WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key = $4`, keysGroup, topic, partition, key)
}

var operator = ops.Actor{Name: "alice", Reason: "INC-42"}

// due is a due time in the future, to the second.
var due = time.Date(2099, 1, 2, 3, 4, 5, 0, time.UTC)

// TestKeysSayWhy: Keys lists the held keys in every state, the longest held first, with their
// held records and what each waits for.
func TestKeysSayWhy(t *testing.T) {
	e := newKeysEnv(t)
	ctx := context.Background()

	e.toTier(rec("orders", 0, 10, "acct-1"), due)
	e.hold(rec("orders", 0, 11, "acct-1"), rec("orders", 0, 12, "acct-1"))
	bin := string([]byte{0xff, 0x00})
	dl := e.deadLetter(rec("orders", 1, 20, bin), true, true)
	e.hold(rec("orders", 1, 21, bin))
	e.toTier(rec("orders", 2, 30, "c"), due)
	e.hold(rec("orders", 2, 31, "c"))
	e.applied(rec("orders", 2, 30, "c"))

	keys, err := e.ops.Keys(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		topic     string
		partition int32
		keyText   string
		state     string
		head      int64 // -1: none
		held      int64
		why       string
		dl        int64
	}
	want := []row{
		{"orders", 0, "acct-1", "retrying", 10, 2,
			"record at offset 10 is in retry tier 1 (orders.kg.retry.1), attempt 2, due 2099-01-02T03:04:05Z, last error retryable: boom again", 0},
		{"orders", 1, "0xff00", "blocked", 20, 1, "record at offset 20 was dead-lettered (dead letter #" + strconv.FormatInt(dl, 10) + ", permanent, new)", dl},
		{"orders", 2, "c", "ready", -1, 1, "its held records are being applied", 0},
	}
	if len(keys) != len(want) {
		t.Fatalf("Keys = %+v, want %d keys", keys, len(want))
	}
	for i, k := range keys {
		head := int64(-1)
		if k.HeadOffset != nil {
			head = *k.HeadOffset
		}
		got := row{k.Topic, k.Partition, k.KeyText, k.State, head, k.Held, k.Why, k.DeadLetterID}
		if got != want[i] {
			t.Errorf("key %d:\n got %+v\nwant %+v", i, got, want[i])
		}
		if k.Since.IsZero() || k.UpdatedAt.Before(k.Since) {
			t.Errorf("key %d: since %v, updated %v", i, k.Since, k.UpdatedAt)
		}
	}
	if string(keys[1].Key) != bin {
		t.Errorf("blocked key = %x, want ff00", keys[1].Key)
	}

	if keys, err := e.ops.Keys(ctx, 1); err != nil || len(keys) != 1 || keys[0].KeyText != "acct-1" {
		t.Errorf("Keys(1) = %+v, %v; want the longest held key only", keys, err)
	}
	if _, err := e.ops.Keys(ctx, 0); !errors.Is(err, ops.ErrUsage) {
		t.Errorf("Keys(0): %v, want ErrUsage", err)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestReleaseBlockedKey: a dry run says what it would do and changes nothing; executing needs a
// reason, makes the key ready and writes the audit row in the same transaction.
func TestReleaseBlockedKey(t *testing.T) {
	e := newKeysEnv(t)
	ctx := context.Background()
	key := []byte{0xff, 0x00}
	dl := e.deadLetter(rec("orders", 1, 20, string(key)), true, true)
	e.hold(rec("orders", 1, 21, string(key)))
	scope := retrytopics.StuckScope{Older: time.Minute, Tiers: map[string]int{"orders": 3}}

	rel, err := e.ops.ReleaseKey(ctx, "orders", 1, key, scope, false, ops.Actor{})
	if err != nil {
		t.Fatal(err)
	}
	wantAction := "release the blocked key: its 1 held record is applied next by the group's processors; the dead letter stays as it is (replay or discard it with dlq)"
	if rel.Executed || rel.Reason != "blocked" || rel.State != "blocked" || rel.Action != wantAction || rel.Held != 1 || rel.DeadLetterID != dl {
		t.Errorf("dry run = %+v", rel)
	}
	if s := e.keyState("orders", 1, key); s != "blocked" || e.audits() != 0 {
		t.Fatalf("after a dry run: key %s, %d audit rows; want blocked and none", s, e.audits())
	}

	_, err = e.ops.ReleaseKey(ctx, "orders", 1, key, scope, true, ops.Actor{Name: "alice"})
	if !errors.Is(err, ops.ErrUsage) || !strings.Contains(err.Error(), "reason") {
		t.Errorf("execute without a reason: %v, want ErrUsage naming the reason", err)
	}
	if s := e.keyState("orders", 1, key); s != "blocked" {
		t.Fatalf("after a refused release: key %s, want blocked", s)
	}

	rel, err = e.ops.ReleaseKey(ctx, "orders", 1, key, scope, true, operator)
	if err != nil {
		t.Fatal(err)
	}
	if !rel.Executed || rel.Reason != "blocked" || rel.LostDeadLetterID != 0 {
		t.Errorf("release = %+v", rel)
	}
	if s := e.keyState("orders", 1, key); s != "ready" {
		t.Errorf("key %s after the release, want ready", s)
	}
	if n := scalar[int](e, `SELECT count(*)::int FROM kafkapg.held_keys WHERE consumer_group = $1 AND head_offset IS NULL`, keysGroup); n != 1 {
		t.Errorf("%d released keys without a head, want 1", n)
	}
	if n := scalar[int](e, `SELECT count(*)::int FROM kafkapg.dead_letters WHERE id = $1 AND status = 'new'`, dl); n != 1 {
		t.Errorf("the blocking dead letter changed")
	}
	var actor, reason string
	var detail map[string]any
	err = e.pool.QueryRow(ctx, `SELECT actor, reason, detail FROM kafkapg.audit WHERE consumer_group = $1 AND action = 'release_key'`, keysGroup).
		Scan(&actor, &reason, &detail)
	if err != nil {
		t.Fatal(err)
	}
	wantDetail := map[string]any{"topic": "orders", "partition": 1.0, "key_base64": base64.StdEncoding.EncodeToString(key), "state": "blocked",
		"reason": "blocked", "head_offset": 20.0, "held": 1.0, "dead_letter_id": float64(dl)}
	if actor != "alice" || reason != "INC-42" || !equalJSON(detail, wantDetail) {
		t.Errorf("audit row: %s, %s, %v; want alice, INC-42, %v", actor, reason, detail, wantDetail)
	}

	// Released, the key is ready: there is nothing more to release.
	if _, err := e.ops.ReleaseKey(ctx, "orders", 1, key, scope, true, operator); !errors.Is(err, ops.ErrUsage) || !strings.Contains(err.Error(), "is ready") {
		t.Errorf("releasing a ready key: %v, want ErrUsage saying it is ready", err)
	}
}

func equalJSON(a, b any) bool {
	return string(must(json.Marshal(a))) == string(must(json.Marshal(b)))
}

// TestReleaseStuckKeys: a key stuck overdue or orphaned has its head dead-lettered as lost and
// goes on with its held records; a stuck ready key is woken up; a key that is retrying and not
// stuck, ready and not stuck, or not held is refused with ErrUsage and nothing changes.
func TestReleaseStuckKeys(t *testing.T) {
	e := newKeysEnv(t)
	ctx := context.Background()
	scope := retrytopics.StuckScope{Older: time.Minute, Tiers: map[string]int{"orders": 3}}

	e.toTier(rec("orders", 0, 10, "acct-1"), due)
	e.hold(rec("orders", 0, 11, "acct-1"))
	e.toTier(rec("gone", 0, 5, "acct-2"), due) // a topic no longer consumed
	e.toTier(rec("orders", 2, 30, "c"), due)
	e.hold(rec("orders", 2, 31, "c"))
	e.applied(rec("orders", 2, 30, "c"))

	refused := []struct {
		name      string
		topic     string
		partition int32
		key       string
		want      string
		notFound  bool
	}{
		{"retrying, not stuck", "orders", 0, "acct-1", "key acct-1 of orders[0] is retrying and not stuck: record at offset 10 is in retry tier 1", false},
		{"ready, not stuck", "orders", 2, "c", "key c of orders[2] is ready: its held records are being applied (1 held)", false},
		{"not held", "orders", 0, "nobody", "key nobody of orders[0] is not held", true},
		{"other partition", "orders", 1, "acct-1", "key acct-1 of orders[1] is not held", true},
	}
	for _, tc := range refused {
		for _, execute := range []bool{false, true} {
			_, err := e.ops.ReleaseKey(ctx, tc.topic, tc.partition, []byte(tc.key), scope, execute, operator)
			if !errors.Is(err, ops.ErrUsage) || !strings.Contains(err.Error(), tc.want) || errors.Is(err, ops.ErrNotFound) != tc.notFound {
				t.Errorf("%s (execute %v): %v; want ErrUsage containing %q (not found: %v)", tc.name, execute, err, tc.want, tc.notFound)
			}
		}
	}
	if e.audits() != 0 {
		t.Fatalf("refused releases wrote %d audit rows", e.audits())
	}

	e.backdate("orders", 0, []byte("acct-1"))
	e.backdate("gone", 0, []byte("acct-2"))
	e.backdate("orders", 2, []byte("c"))

	released := []struct {
		name      string
		topic     string
		partition int32
		key       string
		head      int64 // -1: no record is dead-lettered
		reason    string
		action    string
		after     string // the key's state after the release
	}{
		{"overdue", "orders", 0, "acct-1", 10, retrytopics.StuckOverdue,
			"dead-letter the record at offset 10 as lost (class lost; its value stays in the source topic), forget its retry state, then its 1 held record is applied next by the group's processors",
			"ready"},
		{"orphaned", "gone", 0, "acct-2", 5, retrytopics.StuckOrphaned,
			"dead-letter the record at offset 5 as lost (class lost; its value stays in the source topic), forget its retry state, then it has no held records, so it is no longer held and its next records are applied as they come",
			"not held"},
		{"unapplied", "orders", 2, "c", -1, retrytopics.StuckUnapplied,
			"wake the key up: its 1 held record is applied next by the group's processors", "ready"},
	}
	for _, tc := range released {
		t.Run(tc.name, func(t *testing.T) {
			e.t = t
			key := []byte(tc.key)
			before := e.keyState(tc.topic, tc.partition, key)
			audits := e.audits()
			dry, err := e.ops.ReleaseKey(ctx, tc.topic, tc.partition, key, scope, false, ops.Actor{})
			if err != nil {
				t.Fatal(err)
			}
			if dry.Executed || dry.Reason != tc.reason || dry.Action != tc.action {
				t.Errorf("dry run = %+v\nwant reason %s, action %q", dry, tc.reason, tc.action)
			}
			if s := e.keyState(tc.topic, tc.partition, key); s != before || e.audits() != audits {
				t.Fatalf("the dry run changed something: key %s (was %s), %d audit rows (were %d)", s, before, e.audits(), audits)
			}
			rel, err := e.ops.ReleaseKey(ctx, tc.topic, tc.partition, key, scope, true, operator)
			if err != nil {
				t.Fatal(err)
			}
			if !rel.Executed || rel.Reason != tc.reason {
				t.Errorf("release = %+v", rel)
			}
			if s := e.keyState(tc.topic, tc.partition, key); s != tc.after {
				t.Errorf("key %s after the release, want %s", s, tc.after)
			}
			if e.audits() != audits+1 {
				t.Errorf("%d audit rows after the release, want %d", e.audits(), audits+1)
			}
			lastReason := scalar[string](e, `SELECT detail->>'reason' FROM kafkapg.audit WHERE consumer_group = $1 ORDER BY id DESC LIMIT 1`, keysGroup)
			if lastReason != tc.reason {
				t.Errorf("audit detail reason %q, want %q", lastReason, tc.reason)
			}
			if tc.head < 0 {
				if rel.LostDeadLetterID != 0 {
					t.Errorf("an unapplied key's release dead-lettered #%d", rel.LostDeadLetterID)
				}
				if late := scalar[bool](e, `SELECT updated_at < now() - interval '1 minute' FROM kafkapg.held_keys
					WHERE consumer_group = $1 AND topic = $2 AND key = $3`, keysGroup, tc.topic, key); late {
					t.Errorf("the unapplied key was not woken up")
				}
				return
			}
			var class string
			var off int64
			err = e.pool.QueryRow(ctx, `SELECT error_class, "offset" FROM kafkapg.dead_letters WHERE id = $1`, rel.LostDeadLetterID).Scan(&class, &off)
			if err != nil || class != "lost" || off != tc.head {
				t.Errorf("lost dead letter #%d: %s at %d, %v; want class lost at %d", rel.LostDeadLetterID, class, off, err, tc.head)
			}
			if n := scalar[int](e, `SELECT count(*)::int FROM kafkapg.retries WHERE consumer_group = $1 AND topic = $2 AND "offset" = $3`,
				keysGroup, tc.topic, tc.head); n != 0 {
				t.Errorf("the lost record's retry state is kept")
			}
		})
	}
	e.t = t
}

func TestKeyText(t *testing.T) {
	for _, tc := range []struct {
		key  []byte
		want string
	}{
		{nil, "<null>"},
		{[]byte{}, "0x"},
		{[]byte("acct-7"), "acct-7"},
		{[]byte("ключ 7"), "ключ 7"},
		{[]byte("0x41"), "0x30783431"},
		{[]byte("a\tb"), "0x610962"},
		{[]byte{0xff}, "0xff"},
	} {
		if got := ops.KeyText(tc.key); got != tc.want {
			t.Errorf("KeyText(%q) = %q, want %q", tc.key, got, tc.want)
		}
	}
}

// TestListsReadKeysBoundedInBytes: a list of dead letters or held keys reads each key's first
// ListedKeyBytes (and says there is more), so that a page costs kilobytes whatever the keys (a
// list of 51 dead letters with 900 KB keys took 46 MB a page); Show reads ShownKeyBytes of it,
// and KeyByHash names a held key whole by its SHA-256.
func TestListsReadKeysBoundedInBytes(t *testing.T) {
	e := newKeysEnv(t)
	ctx := context.Background()
	huge := strings.Repeat("k", 900_000)
	r := rec("t", 0, 5, huge)
	id := e.deadLetter(r, true, true) // blocks its key
	list, err := e.ops.List(ctx, ops.Filter{}, 10)
	if err != nil || len(list) != 1 {
		t.Fatalf("List = %d rows, %v", len(list), err)
	}
	if dl := list[0]; len(dl.Key) != ops.ListedKeyBytes || !dl.KeyTruncated || dl.KeySize != len(huge) {
		t.Errorf("listed key: %d bytes, truncated %v, size %d; want %d, true, %d", len(dl.Key), dl.KeyTruncated, dl.KeySize, ops.ListedKeyBytes, len(huge))
	}
	dl, err := e.ops.Show(ctx, id, ops.ShowOptions{})
	if err != nil || string(dl.Key) != huge[:ops.ShownKeyBytes] || !dl.KeyTruncated || dl.KeySize != len(huge) {
		t.Errorf("Show: key of %d bytes, truncated %v, size %d, %v; want its first %d bytes of %d", len(dl.Key), dl.KeyTruncated, dl.KeySize, err, ops.ShownKeyBytes, len(huge))
	}
	keys, err := e.ops.Keys(ctx, 10)
	if err != nil || len(keys) != 1 {
		t.Fatalf("Keys = %d, %v", len(keys), err)
	}
	k := keys[0]
	if len(k.Key) != ops.ListedKeyBytes || !k.KeyTruncated || k.KeySize != len(huge) || len(k.KeyHash) != 32 {
		t.Errorf("held key: %d bytes, truncated %v, size %d, hash %d bytes", len(k.Key), k.KeyTruncated, k.KeySize, len(k.KeyHash))
	}
	whole, err := e.ops.KeyByHash(ctx, "t", 0, k.KeyHash)
	if err != nil || string(whole) != huge {
		t.Errorf("KeyByHash: %d bytes, %v; want the key whole", len(whole), err)
	}
	if _, err := e.ops.KeyByHash(ctx, "t", 1, k.KeyHash); !errors.Is(err, ops.ErrNotFound) || !errors.Is(err, ops.ErrUsage) {
		t.Errorf("KeyByHash of another partition: %v; want not found, as bad usage", err)
	}
}
