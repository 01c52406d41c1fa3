package ops

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// HeldKey is a key of a source partition whose later records wait (held_keys), and why.
type HeldKey struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	// Key is the key's first ListedKeyBytes (KeyTruncated says when there is more; KeySize is its
	// length, KeyHash its SHA-256, which names it whole: KeyByHash).
	Key          []byte `json:"key"`
	KeySize      int    `json:"key_size"`
	KeyTruncated bool   `json:"key_truncated,omitempty"`
	KeyHash      []byte `json:"key_sha256"`
	KeyText      string `json:"key_text"` // Key for people (KeyText)
	// State is retrying (the head is in a retry tier), blocked (the head was dead-lettered and
	// waits for an operator) or ready (the head is settled; the held records are being applied).
	State string `json:"state"`
	// HeadOffset is the offset of the record the key waits for; nil when ready.
	HeadOffset *int64    `json:"head_offset"`
	Since      time.Time `json:"since"`      // held since
	UpdatedAt  time.Time `json:"updated_at"` // last change of state or head
	Held       int64     `json:"held"`       // records held behind the key
	// Why says in words what the key waits for.
	Why string `json:"why"`
	// DeadLetterID is the dead letter a blocked key waits for; 0 otherwise.
	DeadLetterID int64 `json:"dead_letter_id,omitempty"`
}

// heldKeySQL selects held keys (alias h) with what Why needs: the head's retry state and, for a
// blocked key, its dead letter. where adds conditions; $1 is the group.
func (o *Ops) heldKeySQL(where, tail string) string {
	return `SELECT h.topic, h.partition, substring(h.key from 1 for ` + strconv.Itoa(ListedKeyBytes) + `), octet_length(h.key), h.key_hash,
			h.state, h.head_offset, h.held_since, h.updated_at,
			(SELECT count(*) FROM ` + o.table("held_records") + ` r WHERE r.consumer_group = h.consumer_group AND r.topic = h.topic
				AND r.partition = h.partition AND r.key_hash = h.key_hash AND r.key = h.key),
			rt.attempt, rt.tier, rt.due_at, rt.error_class, rt.error_message, d.id, d.error_class, d.status
		FROM ` + o.table("held_keys") + ` h
		LEFT JOIN ` + o.table("retries") + ` rt ON h.state = 'retrying' AND rt.consumer_group = h.consumer_group
			AND rt.topic = h.topic AND rt.partition = h.partition AND rt."offset" = h.head_offset
		LEFT JOIN ` + o.table("dead_letters") + ` d ON h.state = 'blocked' AND d.consumer_group = h.consumer_group
			AND d.topic = h.topic AND d.partition = h.partition AND d."offset" = h.head_offset
		WHERE h.consumer_group = $1 ` + where + ` ` + tail
}

// scanHeldKeys reads the rows of heldKeySQL.
func (o *Ops) scanHeldKeys(rows pgx.Rows) ([]HeldKey, error) {
	out := []HeldKey{}
	var k HeldKey
	var attempt, tier *int
	var due *time.Time
	var class, msg, dlClass, dlStatus *string
	var dlID *int64
	_, err := pgx.ForEachRow(rows, []any{&k.Topic, &k.Partition, &k.Key, &k.KeySize, &k.KeyHash, &k.State, &k.HeadOffset, &k.Since, &k.UpdatedAt, &k.Held,
		&attempt, &tier, &due, &class, &msg, &dlID, &dlClass, &dlStatus}, func() error {
		k.KeyTruncated = k.KeySize > len(k.Key)
		k.KeyText = KeyText(k.Key)
		head := int64(-1)
		if k.HeadOffset != nil {
			head = *k.HeadOffset
		}
		switch {
		case k.State == "ready":
			k.Why = "its held records are being applied"
		case k.State == "retrying" && attempt != nil:
			k.Why = fmt.Sprintf("record at offset %d is in retry tier %d (%s), attempt %d, due %s, last error %s",
				head, *tier, retrytopics.TierTopic(k.Topic, o.group, *tier), *attempt, timeText(*due), errorText(*class, *msg))
		case k.State == "retrying":
			k.Why = fmt.Sprintf("record at offset %d should be in a retry tier but has no retry state: it cannot come back (keys release)", head)
		case k.State == "blocked" && dlID != nil:
			k.DeadLetterID = *dlID
			k.Why = fmt.Sprintf("record at offset %d was dead-lettered (dead letter #%d, %s, %s)", head, *dlID, *dlClass, *dlStatus)
		case k.State == "blocked":
			k.Why = fmt.Sprintf("record at offset %d was dead-lettered (no dead letter row is left)", head)
		default:
			k.Why = "state " + k.State
		}
		out = append(out, k)
		k, attempt, tier, due, class, msg, dlID, dlClass, dlStatus = HeldKey{}, nil, nil, nil, nil, nil, nil, nil, nil
		return nil
	})
	return out, err
}

// Keys returns up to limit of the group's held keys, in any state (retrying, blocked, ready), the
// longest held first, each with what it waits for.
func (o *Ops) Keys(ctx context.Context, limit int) ([]HeldKey, error) {
	if limit <= 0 {
		return nil, usage("limit must be positive, got %d", limit)
	}
	rows, err := o.pool.Query(ctx, o.heldKeySQL("", `ORDER BY h.held_since, h.topic, h.partition, h.key_hash LIMIT $2`), o.group, limit)
	if err != nil {
		return nil, fmt.Errorf("read held keys: %w", err)
	}
	keys, err := o.scanHeldKeys(rows)
	if err != nil {
		return nil, fmt.Errorf("read held keys: %w", err)
	}
	return keys, nil
}

// KeyByHash returns the whole key of topic's partition whose SHA-256 is hash, as held_keys keeps
// it (HeldKey.KeyHash): how a page that shows the keys' first bytes names one for a release.
func (o *Ops) KeyByHash(ctx context.Context, topic string, partition int32, hash []byte) ([]byte, error) {
	if err := text("topic", topic); err != nil {
		return nil, err
	}
	var key []byte
	err := o.pool.QueryRow(ctx, `SELECT key FROM `+o.table("held_keys")+` WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND key_hash = $4`,
		o.group, topic, partition, hash).Scan(&key)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w: no held key of %s[%d] has that SHA-256: there is nothing to release (%w)", ErrUsage, topic, partition, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("read held key: %w", err)
	}
	return key, nil
}

// heldKey reads one held key in q, locking its row if lock; ErrNotFound if the key is not held.
func (o *Ops) heldKey(ctx context.Context, q pgx.Tx, topic string, partition int32, key []byte, lock bool) (HeldKey, error) {
	tail := ""
	if lock {
		tail = "FOR UPDATE OF h"
	}
	rows, err := q.Query(ctx, o.heldKeySQL(`AND h.topic = $2 AND h.partition = $3 AND h.key_hash = sha256($4::bytea) AND h.key = $4`, tail),
		o.group, topic, partition, key)
	if err != nil {
		return HeldKey{}, fmt.Errorf("read held key: %w", err)
	}
	keys, err := o.scanHeldKeys(rows)
	if err != nil {
		return HeldKey{}, fmt.Errorf("read held key: %w", err)
	}
	if len(keys) == 0 {
		return HeldKey{}, fmt.Errorf("%w: key %s of %s[%d] is not held: there is nothing to release (%w)", ErrUsage, safetext.Truncate(KeyText(key), 64), topic, partition, ErrNotFound)
	}
	return keys[0], nil
}

// Release is what ReleaseKey did, or would do in a dry run.
type Release struct {
	HeldKey // the key as it was before the release
	// Reason is why the key can be released: blocked, or the retrytopics.Stuck* reason it is
	// stuck for (orphaned, overdue, unapplied).
	Reason string `json:"reason"`
	// Action says in words what the release does.
	Action   string `json:"action"`
	Executed bool   `json:"executed"`
	// LostDeadLetterID is the dead letter the release wrote for the record an orphaned or
	// overdue key waited for (class lost); 0 in a dry run and for other releases.
	LostDeadLetterID int64 `json:"lost_dead_letter_id,omitempty"`
}

// maxStuckScan bounds the stuck keys ReleaseKey reads to find out whether its key is one of them.
const maxStuckScan = 100_000

// ReleaseKey lets a held key of a source partition go on with its held records, which the
// group's processors then apply in offset order. It releases two kinds of keys:
//
//   - blocked (a dead letter under ON_DEAD_LETTER=block): the key becomes ready; the dead letter
//     stays as it is (replay or discard it with the dlq operations);
//   - stuck, as retrytopics.Store.StuckKeys finds with scope (the retry tiers of each consumed
//     topic, and how long without progress counts as stuck): the record an orphaned or overdue
//     key waits for is dead-lettered as lost (retrytopics.Store.ReleaseStuck), an unapplied key
//     is woken up.
//
// Any other key (retrying and not stuck: its record comes back by itself; ready; not held) is an
// ErrUsage error saying why. Without execute ReleaseKey changes nothing and returns what it would
// do; with execute it needs a's name and reason, and records them in the audit table (action
// release_key) in the transaction that releases the key.
func (o *Ops) ReleaseKey(ctx context.Context, topic string, partition int32, key []byte, scope retrytopics.StuckScope, execute bool, a Actor) (Release, error) {
	if topic == "" {
		return Release{}, usage("a topic is required")
	}
	if err := text("topic", topic); err != nil {
		return Release{}, err
	}
	if key == nil {
		return Release{}, usage("a key is required (records without a key are never held)")
	}
	opts := pgx.TxOptions{AccessMode: pgx.ReadOnly}
	if execute {
		if err := a.check(); err != nil {
			return Release{}, err
		}
		opts = pgx.TxOptions{}
	}
	var rel Release
	err := pgx.BeginTxFunc(ctx, o.pool, opts, func(tx pgx.Tx) error {
		var err error
		rel, err = o.releaseKey(ctx, tx, topic, partition, key, scope, execute, a)
		return err
	})
	if err != nil {
		return Release{}, err
	}
	return rel, nil
}

func (o *Ops) releaseKey(ctx context.Context, tx pgx.Tx, topic string, partition int32, key []byte, scope retrytopics.StuckScope, execute bool, a Actor) (Release, error) {
	hk, err := o.heldKey(ctx, tx, topic, partition, key, execute)
	if err != nil {
		return Release{}, err
	}
	rel := Release{HeldKey: hk}
	name := fmt.Sprintf("key %s of %s[%d]", safetext.Truncate(hk.KeyText, 64), topic, partition)
	then := heldNext(hk.Held)
	if hk.State == "blocked" {
		rel.Reason = "blocked"
		rel.Action = "release the blocked key: " + then + "; the dead letter stays as it is (replay or discard it with dlq)"
		if execute {
			n, err := o.store.Unblock(ctx, tx, topic, partition, key)
			if err != nil {
				return Release{}, err
			}
			if n != 1 {
				return Release{}, fmt.Errorf("release %s: %d keys released, want 1", name, n)
			}
		}
	} else {
		stuck, err := o.store.StuckKeys(ctx, tx, scope, maxStuckScan)
		if err != nil {
			return Release{}, err
		}
		var sk *retrytopics.StuckKey
		for i := range stuck {
			if stuck[i].Topic == topic && stuck[i].Partition == partition && bytes.Equal(stuck[i].Key.Key, key) {
				sk = &stuck[i]
				break
			}
		}
		if sk == nil {
			return Release{}, notReleasable(name, hk, scope)
		}
		rel.Reason = sk.Reason
		if sk.Reason == retrytopics.StuckUnapplied {
			rel.Action = "wake the key up: " + then
		} else {
			rel.Action = fmt.Sprintf("dead-letter the record at offset %d as lost (class lost; its value stays in the source topic), forget its retry state, then %s", sk.Head, then)
		}
		if execute {
			note := fmt.Sprintf("released by %s: %s", a.Name, a.Reason)
			if err := o.store.ReleaseStuck(ctx, tx, *sk, note); err != nil {
				return Release{}, fmt.Errorf("release %s: %w", name, err)
			}
			if sk.Reason != retrytopics.StuckUnapplied {
				err := tx.QueryRow(ctx, `SELECT id FROM `+o.table("dead_letters")+`
					WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND "offset" = $4`,
					o.group, topic, partition, sk.Head).Scan(&rel.LostDeadLetterID)
				if err != nil {
					return Release{}, fmt.Errorf("release %s: read the lost record's dead letter: %w", name, err)
				}
			}
		}
	}
	if !execute {
		return rel, nil
	}
	rel.Executed = true
	d := releaseDetail{Topic: topic, Partition: partition, State: hk.State, Reason: rel.Reason, HeadOffset: hk.HeadOffset,
		Held: hk.Held, DeadLetterID: hk.DeadLetterID, LostDeadLetterID: rel.LostDeadLetterID}
	if printableKey(key) {
		s := string(key)
		d.Key = &s
	} else {
		s := base64.StdEncoding.EncodeToString(key)
		d.KeyBase64 = &s
	}
	if err := o.audit(ctx, tx, a, "release_key", 0, d); err != nil {
		return Release{}, err
	}
	return rel, nil
}

// releaseDetail is the audit detail of a release_key action. Trace reads head_offset back.
type releaseDetail struct {
	Topic            string  `json:"topic"`
	Partition        int32   `json:"partition"`
	Key              *string `json:"key,omitempty"`        // the key, if it is text
	KeyBase64        *string `json:"key_base64,omitempty"` // the key otherwise
	State            string  `json:"state"`
	Reason           string  `json:"reason"`
	HeadOffset       *int64  `json:"head_offset"`
	Held             int64   `json:"held"`
	DeadLetterID     int64   `json:"dead_letter_id,omitempty"`
	LostDeadLetterID int64   `json:"lost_dead_letter_id,omitempty"`
}

// notReleasable is ReleaseKey's answer for a key that is neither blocked nor stuck.
func notReleasable(name string, hk HeldKey, scope retrytopics.StuckScope) error {
	if hk.State == "ready" {
		return usage("%s is ready: %s (%d held); there is nothing to release. It is released once it makes no progress for %s (stuck: unapplied)",
			name, hk.Why, hk.Held, scope.Older)
	}
	return usage("%s is %s and not stuck: %s. It comes back by itself; a key that is not blocked can be released only once it is stuck (no progress for %s: orphaned or overdue)",
		name, hk.State, hk.Why, scope.Older)
}

// heldNext says what happens to n held records once their key is released.
func heldNext(n int64) string {
	switch n {
	case 0:
		return "it has no held records, so it is no longer held and its next records are applied as they come"
	case 1:
		return "its 1 held record is applied next by the group's processors"
	}
	return fmt.Sprintf("its %d held records are applied next, in offset order, by the group's processors", n)
}

// KeyText returns a record key for people: the key itself if it is printable UTF-8 (and does not
// start with "0x"), otherwise "0x" and its bytes in hex ("0x" alone for an empty key); "<null>"
// for a nil key. At most maxKeyText bytes: a longer key is cut, marked with "…" (Key has it
// whole).
func KeyText(key []byte) string {
	switch {
	case key == nil:
		return "<null>"
	case printableKey(key):
		return safetext.Truncate(string(key), maxKeyText)
	}
	return safetext.Truncate("0x"+hex.EncodeToString(key[:min(len(key), maxKeyText)]), maxKeyText)
}

// maxKeyText bounds KeyText.
const maxKeyText = 1024

// printableKey reports whether key shows as itself: non-empty printable UTF-8 that cannot be
// mistaken for a hex key.
func printableKey(key []byte) bool {
	if len(key) == 0 || !utf8.Valid(key) || bytes.HasPrefix(key, []byte("0x")) {
		return false
	}
	for _, r := range string(key) {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// timeText formats a time for the descriptions: UTC, to the second.
func timeText(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// errorText formats an error class and message for a description: one line, bounded.
func errorText(class, msg string) string { return safetext.Truncate(ErrorText(class, msg), 200) }

// ErrorText is an error's class and message, on one line, for people: the class once, though the
// message may begin with it already (a handler's processor.Permanent error reads "permanent: …").
func ErrorText(class, msg string) string {
	msg = oneLine(msg)
	if class == "" || strings.HasPrefix(msg, class+": ") {
		return msg
	}
	return class + ": " + msg
}

// oneLine puts s on one line, its runs of white space (newlines too) made single spaces.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// RetryPath reads the group's retry path as a whole: the records in each retry tier and how
// overdue the most overdue of them is, the held keys and records, the dead letters by status.
func (o *Ops) RetryPath(ctx context.Context) (retrytopics.Stats, error) {
	return o.store.Stats(ctx, o.pool)
}
