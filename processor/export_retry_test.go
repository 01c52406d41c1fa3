package processor

import (
	"context"
	"time"
)

// InPlaceDelay is how long p waits before its n-th retry in place (n >= 1) of a transaction that
// failed for the infrastructure's sake: the backoff New built from Config.BackoffBase and
// BackoffMax, which inPlace sleeps.
func (p *Processor) InPlaceDelay(n int) time.Duration { return p.backoff.Delay(n) }

// RetryInPlace runs tx until it succeeds as a partition's transactions are run while Postgres
// fails: retried in place, with p's backoff, until ctx ends.
func (p *Processor) RetryInPlace(ctx context.Context, tx func() error) error {
	return p.inPlace(ctx, nil, p.log, "", nil, tx)
}

// KeyHash is the key_hash that record-level log lines carry for key.
var KeyHash = keyHash
