// Package backoff computes retry delays: exponential growth from a base, capped at a maximum, with
// jitter so that many workers retrying after the same outage do not hit the database in lockstep.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Policy describes an exponential backoff with "equal jitter": the n-th delay is drawn uniformly from
// [d/2, d], where d = min(Base·2^(n-1), Max).
type Policy struct {
	Base time.Duration
	Max  time.Duration
}

// Delay returns the delay before retry number n (n >= 1).
func (p Policy) Delay(n int) time.Duration {
	if n < 1 {
		n = 1
	}
	d := p.Base
	for i := 1; i < n && d < p.Max; i++ {
		d *= 2
	}
	if d > p.Max {
		d = p.Max
	}
	if d <= 0 {
		return 0
	}
	half := d / 2
	return half + rand.N(d-half+1)
}

// Sleep waits for d or until ctx is done or stop is closed, whichever comes first. It reports
// whether the full delay elapsed.
func Sleep(ctx context.Context, stop <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	case <-stop:
		return false
	}
}
