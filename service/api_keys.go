package service

import (
	"encoding/hex"
	"fmt"
	"net/http"
	"strconv"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// stuckScope is what counts as a stuck key for the service's configuration (see
// processor.StuckKeys): its source topics' retry tiers and its STALL_TIMEOUT.
func (e *env) stuckScope() retrytopics.StuckScope {
	tiers := map[string]int{}
	for _, t := range e.KafkaTopics {
		n := len(e.tiers)
		if tp, ok := e.topics[t]; ok && tp.policy.RetryTiers != nil {
			n = len(tp.policy.RetryTiers)
		}
		tiers[t] = n
	}
	return retrytopics.StuckScope{Older: e.StallTimeout, Tiers: tiers}
}

// keysRoutes returns the API's keys and trace routes. Traces read Kafka with one client for the
// API (its admin requests; each trace's reads use short-lived consumers of its own, at most
// ops.MaxTraces at once in the process), closed by the returned keysAPI's close; they read only
// the group's topics: those of KAFKA_TOPICS and those it has positions for (ops.CheckTopic).
func keysRoutes(a *api, e *env, concurrency map[string]int) keysAPI {
	c := &opsCmd{env: e}
	traces := a.ops.WithTopics(e.KafkaTopics...)
	kc, kerr := c.kafka()
	closeKafka := func() {}
	if kerr == nil {
		closeKafka = kc.Close
	} else {
		kc = nil
	}
	return keysAPI{
		close:     closeKafka,
		positions: positionsRoutes(a, traces, kc, kerr),
		keys: func(w http.ResponseWriter, r *http.Request) {
			n, err := limit(r, 100)
			if err != nil {
				fail(w, err)
				return
			}
			ks, err := a.ops.Keys(r.Context(), n)
			respond(w, map[string]any{"keys": ks}, err)
		},
		release: func(w http.ResponseWriter, r *http.Request) {
			var req struct {
				Topic     string `json:"topic"`
				Partition int32  `json:"partition"`
				Key       string `json:"key"`
				KeyHex    string `json:"key_hex"`
				Execute   bool   `json:"execute"`
				Reason    string `json:"reason"`
				Actor     string `json:"actor"`
			}
			if !decode(w, r, &req) {
				return
			}
			key := []byte(req.Key)
			if req.Key != "" && req.KeyHex != "" {
				writeError(w, http.StatusBadRequest, fmt.Errorf("key and key_hex: give one of them"))
				return
			}
			if req.KeyHex != "" {
				var err error
				if key, err = hex.DecodeString(req.KeyHex); err != nil {
					writeError(w, http.StatusBadRequest, fmt.Errorf("key_hex: %v", err))
					return
				}
			}
			who, err := actor(r, req.Actor)
			if err != nil {
				fail(w, err)
				return
			}
			rel, err := a.ops.ReleaseKey(r.Context(), req.Topic, req.Partition, key, e.stuckScope(), req.Execute,
				ops.Actor{Name: who, Reason: req.Reason})
			if err != nil {
				fail(w, err)
				return
			}
			writeJSON(w, http.StatusOK, rel)
		},
		trace: func(w http.ResponseWriter, r *http.Request) {
			q := r.URL.Query()
			tq := ops.TraceQuery{Topic: q.Get("topic")}
			tq.Concurrency = concurrency[tq.Topic]
			var err error
			num := func(name string, bits int) int64 {
				if err != nil || !q.Has(name) {
					return 0
				}
				var n int64
				n, err = strconv.ParseInt(q.Get(name), 10, bits)
				if err != nil {
					err = fmt.Errorf("%w: %s %q is not a number", ops.ErrUsage, name, q.Get(name))
				}
				return n
			}
			tq.Partition = int32(num("partition", 32))
			tq.Offset = num("offset", 64)
			tq.Limit = int(num("limit", 32))
			tq.Scan = int(num("scan", 32))
			if err != nil {
				fail(w, err)
				return
			}
			if q.Has("key") {
				tq.Key = []byte(q.Get("key"))
			}
			res, err := traces.Trace(r.Context(), tq, kc)
			if err != nil {
				fail(w, err)
				return
			}
			if kerr != nil {
				res.Notes = append(res.Notes, "Kafka was not read (the broker's retention and the key's records there are unknown): "+kerr.Error())
			}
			writeJSON(w, http.StatusOK, res)
		},
	}
}
