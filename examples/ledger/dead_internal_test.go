package ledger

import (
	"testing"

	"github.com/kafkapg/kafkapg/processor"
)

// TestDeadMatchesHandler ties Item.Dead, which the verifiers use, to what the handler does: an
// item is dead for maxAttempt exactly when its record fails on every delivery attempt
// 1..maxAttempt (and, if it fails, fails permanently or on the last attempt).
func TestDeadMatchesHandler(t *testing.T) {
	t.Parallel()
	items := Generate(GenConfig{
		Events: 400, Accounts: 4, PoisonPerMille: 100, MalformedPerMille: 100, FlakyPerMille: 400,
		MaxFailAttempts: 4, Seed: 77,
	})
	for maxAttempt := 1; maxAttempt <= 5; maxAttempt++ {
		for i, it := range items {
			failedEvery := true
			for attempt := 1; attempt <= maxAttempt; attempt++ {
				_, err := check(&processor.Record{Topic: "t", Key: it.Key, Value: it.Value, Attempt: attempt})
				if err == nil {
					failedEvery = false
					break
				}
				if processor.IsPermanent(err) != (it.Kind == KindPoison || it.Kind == KindMalformed) {
					t.Fatalf("item %d (%v), attempt %d: IsPermanent(%v) = %v", i, it.Kind, attempt, err, processor.IsPermanent(err))
				}
			}
			if got := it.Dead(maxAttempt); got != failedEvery {
				t.Errorf("item %d (%v, fail_attempts %d): Dead(%d) = %v, but the handler fails on every attempt: %v",
					i, it.Kind, it.Event.FailAttempts, maxAttempt, got, failedEvery)
			}
		}
	}
}
