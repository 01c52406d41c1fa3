package service

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/ops"
)

// positionsAPI is the API's positions routes: the listing (GET /api/v1/positions), and pause,
// resume and set (POST /api/v1/positions/{pause,resume,set}), dry runs unless execute. kc is nil
// when Kafka cannot be reached (kerr says why): the listing then shows Postgres's positions only,
// and the changes are refused.
type positionsAPI struct {
	list, pause, resume, set http.HandlerFunc
}

// positionRequest is the body of a pause, resume or set: partition absent for every partition of
// the topic; for set, exactly one of offset, time (RFC 3339, or a duration: that long ago), start
// and end.
type positionRequest struct {
	Topic     string `json:"topic"`
	Partition *int32 `json:"partition"`
	Offset    *int64 `json:"offset"`
	Time      string `json:"time"`
	Start     bool   `json:"start"`
	End       bool   `json:"end"`
	Execute   bool   `json:"execute"`
	Reason    string `json:"reason"`
	Actor     string `json:"actor"`
}

func (q positionRequest) partition() int32 {
	if q.Partition == nil {
		return ops.AllPartitions
	}
	return *q.Partition
}

func positionsRoutes(a *api, o *ops.Ops, kc *kgo.Client, kerr error) positionsAPI {
	needKafka := func(w http.ResponseWriter) bool {
		if kc == nil {
			fail(w, fmt.Errorf("%w: Kafka is not reachable from this process (%v): positions are read from it", ops.ErrUsage, kerr))
			return false
		}
		return true
	}
	pause := func(resume bool) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			var req positionRequest
			if !decode(w, r, &req) || !needKafka(w) {
				return
			}
			if req.Offset != nil || req.Time != "" || req.Start || req.End {
				fail(w, fmt.Errorf("%w: offset, time, start and end go with set", ops.ErrUsage))
				return
			}
			who, err := actor(r, req.Actor)
			if err != nil {
				fail(w, err)
				return
			}
			do := o.Pause
			if resume {
				do = o.Resume
			}
			c, err := do(r.Context(), kc, req.Topic, req.partition(), req.Execute, ops.Actor{Name: who, Reason: req.Reason})
			respond(w, map[string]any{"dry_run": !req.Execute, "change": c}, err)
		}
	}
	return positionsAPI{
		list: func(w http.ResponseWriter, r *http.Request) {
			list, notes, err := o.Partitions(r.Context(), kc)
			if kc == nil {
				notes = append(notes, "Kafka was not read (committed and end offsets unknown): "+kerr.Error())
			}
			if list == nil {
				list = []ops.PartitionStatus{}
			}
			respond(w, map[string]any{"partitions": list, "notes": notes}, err)
		},
		pause:  pause(false),
		resume: pause(true),
		set: func(w http.ResponseWriter, r *http.Request) {
			var req positionRequest
			if !decode(w, r, &req) || !needKafka(w) {
				return
			}
			plan := ops.PositionPlan{Topic: req.Topic, Partition: req.partition(), Target: ops.Target{Offset: req.Offset, Start: req.Start, End: req.End}}
			if req.Time != "" {
				t, err := parseTimeOrAgo(req.Time, time.Now())
				if err != nil {
					var u *usageError
					if errors.As(err, &u) {
						err = fmt.Errorf("%w: %s", ops.ErrUsage, u.msg)
					}
					fail(w, err)
					return
				}
				plan.Target.Time = t
			}
			who, err := actor(r, req.Actor)
			if err != nil {
				fail(w, err)
				return
			}
			moves, err := o.SetPositions(r.Context(), kc, plan, req.Execute, ops.Actor{Name: who, Reason: req.Reason})
			respond(w, map[string]any{"dry_run": !req.Execute, "moves": moves}, err)
		},
	}
}
