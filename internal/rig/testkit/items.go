package testkit

import (
	"encoding/json"

	"github.com/kafkapg/kafkapg/examples/ledger"
)

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

// Event is a ledger event of an account (its key), for tests that choose each record: it fails
// its first fail delivery attempts, or every one if poison.
func Event(id, account string, seq int64, fail int, poison bool) ledger.Item {
	ev := ledger.Event{EventID: id, Account: account, Amount: seq * 10, Seq: seq, FailAttempts: fail, Poison: poison}
	v, _ := json.Marshal(ev)
	kind := ledger.KindOK
	switch {
	case poison:
		kind = ledger.KindPoison
	case fail > 0:
		kind = ledger.KindFlaky
	}
	return ledger.Item{Kind: kind, Event: ev, Key: []byte(account), Value: v}
}
