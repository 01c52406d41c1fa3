package console

import (
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// keysShown bounds the held keys the retry path page lists (the longest held first).
const keysShown = 100

type tierRow struct {
	Tier    int
	Records int
	Overdue time.Duration
}

// keyRow is a held key on the retry path page.
type keyRow struct {
	ops.HeldKey
	// Releasable: the key is blocked, or has made no progress for Config.Stuck.Older (it may be
	// stuck: the release's dry run says).
	Releasable bool
}

type retryPathData struct {
	Stats retrytopics.Stats
	Tiers []tierRow
	Keys  []keyRow
	// CanRelease: the signed-in user is an operator of a console that may act.
	CanRelease bool
	StuckAfter time.Duration // Config.Stuck.Older
}

// retryPath shows the retry path: each tier's backlog and how overdue it is, and the held keys,
// the longest held first, each with the record it waits behind.
func (c *Console) retryPath(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	st, err := c.cfg.Ops.RetryPath(ctx)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	d := retryPathData{Stats: st, CanRelease: c.mayAct(r), StuckAfter: c.cfg.Stuck.Older}
	for tier, ts := range st.Tiers {
		d.Tiers = append(d.Tiers, tierRow{Tier: tier, Records: ts.Records, Overdue: ts.Overdue})
	}
	slices.SortFunc(d.Tiers, func(a, b tierRow) int { return a.Tier - b.Tier })
	keys, err := c.cfg.Ops.Keys(ctx, keysShown)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	for _, k := range keys {
		d.Keys = append(d.Keys, keyRow{HeldKey: k, Releasable: k.State == "blocked" || time.Since(k.UpdatedAt) >= c.cfg.Stuck.Older})
	}
	c.render(w, r, "retrypath", "Retry path", d)
}

type releaseData struct {
	Release ops.Release
	// KeySHA256 names the key in the release form (hex of its SHA-256): a key can be far larger
	// than a form should carry.
	KeySHA256 string
}

// confirmRelease shows what releasing a held key would do (ops.ReleaseKey's dry run) and asks
// for the reason the audit trail records.
func (c *Console) confirmRelease(w http.ResponseWriter, r *http.Request) {
	topic, partition, key, ok := c.heldKeyOf(w, r)
	if !ok {
		return
	}
	rel, err := c.cfg.Ops.ReleaseKey(r.Context(), topic, partition, key, c.cfg.Stuck, false, ops.Actor{})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "release", "Release a held key", releaseData{Release: rel, KeySHA256: keySHA256(key)})
}

// release releases a held key in the name of the signed-in operator and shows what it did.
func (c *Console) release(w http.ResponseWriter, r *http.Request) {
	topic, partition, key, ok := c.heldKeyOf(w, r)
	if !ok {
		return
	}
	rel, err := c.cfg.Ops.ReleaseKey(r.Context(), topic, partition, key, c.cfg.Stuck, true,
		ops.Actor{Name: "console:" + userOf(r).name, Reason: strings.TrimSpace(r.PostForm.Get("reason"))})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "release", "Key released", releaseData{Release: rel, KeySHA256: keySHA256(key)})
}

// heldKeyOf reads the held key a posted form names (topic, partition, and key_sha256, the hex of
// its SHA-256, or key_hex, the key itself); a bad one gets 400.
func (c *Console) heldKeyOf(w http.ResponseWriter, r *http.Request) (topic string, partition int32, key []byte, ok bool) {
	if err := r.ParseForm(); err != nil {
		http.Error(w, safetext.HTML(err.Error()), http.StatusBadRequest)
		return "", 0, nil, false
	}
	topic = r.PostForm.Get("topic")
	p, err := strconv.ParseInt(r.PostForm.Get("partition"), 10, 32)
	if topic == "" || err != nil || p < 0 {
		http.Error(w, "topic and partition: want a topic and a partition number", http.StatusBadRequest)
		return "", 0, nil, false
	}
	if h := r.PostForm.Get("key_sha256"); h != "" {
		hash, err := hex.DecodeString(h)
		if err != nil || len(hash) != sha256.Size {
			http.Error(w, "key_sha256: want the key's SHA-256 in hex", http.StatusBadRequest)
			return "", 0, nil, false
		}
		if key, err = c.cfg.Ops.KeyByHash(r.Context(), topic, int32(p), hash); err != nil {
			c.fail(w, r, err)
			return "", 0, nil, false
		}
		return topic, int32(p), key, true
	}
	if key, err = hex.DecodeString(r.PostForm.Get("key_hex")); err != nil {
		http.Error(w, "key_hex: want the key in hex", http.StatusBadRequest)
		return "", 0, nil, false
	}
	return topic, int32(p), key, true
}

// keySHA256 is the hex of key's SHA-256, as held_keys has it.
func keySHA256(key []byte) string {
	h := sha256.Sum256(key)
	return hex.EncodeToString(h[:])
}
