package testkit

import "github.com/kafkapg/kafkapg/examples/ledger"

// TiersMaxAttempt is the last delivery attempt with three retry tiers.
const TiersMaxAttempt = 4

// FlakyMix is a ledger workload where a tenth of the events fail transiently, some for longer
// than three retry tiers last, across many keys.
func FlakyMix(events int, seed uint64, prefix string) []ledger.Item {
	return ledger.Generate(ledger.GenConfig{
		Events: events, Accounts: 40, Seed: seed, Prefix: prefix,
		PoisonPerMille: 10, MalformedPerMille: 10, FlakyPerMille: 100, MaxFailAttempts: TiersMaxAttempt + 1,
	})
}

// Mixed is a ledger workload with every kind of record.
func Mixed(events int, seed uint64, prefix string) []ledger.Item {
	return ledger.Generate(ledger.GenConfig{
		Events: events, Accounts: 40, Seed: seed, Prefix: prefix,
		PoisonPerMille: 10, MalformedPerMille: 10, FlakyPerMille: 20,
	})
}
