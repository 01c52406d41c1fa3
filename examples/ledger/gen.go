package ledger

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"

	"github.com/twmb/franz-go/pkg/kgo"
)

// Kind says what a generated record is meant to do.
type Kind int

const (
	KindOK        Kind = iota // a valid event that succeeds at once
	KindFlaky                 // a valid event with fail_attempts > 0
	KindPoison                // a valid event marked poison
	KindMalformed             // a value that is not a ledger event
)

func (k Kind) String() string {
	return [...]string{"ok", "flaky", "poison", "malformed"}[k]
}

// Item is one generated record and what is expected of it.
type Item struct {
	Kind  Kind
	Event Event // zero for KindMalformed
	Key   []byte
	Value []byte
	// Copy marks a second send of an event by its producer (Duplicate): the same key and value as
	// the original, at a later offset.
	Copy bool
}

// Dead reports whether the item must end in the dead-letter topic when records get maxAttempt
// delivery attempts (1 with no retry tiers).
func (it Item) Dead(maxAttempt int) bool {
	switch it.Kind {
	case KindPoison, KindMalformed:
		return true
	case KindFlaky:
		// An oversized one cannot travel through the retry tiers: its retry copy is over Kafka's
		// limit, so its first failure dead-letters it.
		return it.Event.FailAttempts >= maxAttempt || it.Event.Pad != ""
	}
	return false
}

// Oversized reports whether the item's record is just under a mebibyte (GenConfig.OversizedPerMille).
func (it Item) Oversized() bool { return it.Event.Pad != "" }

// Record returns the Kafka record for the item, keyed by account so that an account's events
// share a partition.
func (it Item) Record(topic string) *kgo.Record {
	return &kgo.Record{Topic: topic, Key: it.Key, Value: it.Value}
}

// GenConfig says what to generate. Shares are per mille of all events.
type GenConfig struct {
	Events            int
	Accounts          int
	PoisonPerMille    int
	MalformedPerMille int
	FlakyPerMille     int
	// MaxFailAttempts bounds the fail_attempts of flaky events (1..MaxFailAttempts). Defaults to 1.
	MaxFailAttempts int
	// Mistakes gives every other flaky event one of the Mistakes, for Careless to make.
	Mistakes bool
	// OversizedPerMille makes that share of the flaky events about 999,500 bytes large (each
	// a different size): under the default MAX_RECORD_BYTES (1 MiB), so they reach the handler,
	// but their retry copies (value plus kafkapg's headers) are over Kafka's producer limit
	// (1,000,012 bytes), so they are dead-lettered at their first failure. Producing them needs a
	// producer limit above a mebibyte (kgo.ProducerBatchMaxBytes).
	OversizedPerMille int
	Seed              uint64
	// Prefix makes event ids unique across generators. Defaults to "e".
	Prefix string
}

// Generate returns events in produce order. Each account's seq increases by one per event of that
// account, malformed records included (they carry a key but no event).
func Generate(cfg GenConfig) []Item {
	if cfg.Accounts <= 0 {
		cfg.Accounts = 1
	}
	if cfg.MaxFailAttempts <= 0 {
		cfg.MaxFailAttempts = 1
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "e"
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))
	seqs := make([]int64, cfg.Accounts)
	oversized := 0
	items := make([]Item, 0, cfg.Events)
	for i := range cfg.Events {
		a := rng.IntN(cfg.Accounts)
		seqs[a]++
		account := fmt.Sprintf("acct-%d", a)
		it := Item{Key: []byte(account)}
		roll := rng.IntN(1000)
		switch {
		case roll < cfg.MalformedPerMille:
			it.Kind = KindMalformed
			if rng.IntN(2) == 0 {
				it.Value = []byte(fmt.Sprintf(`{"event_id":"%s-%d","account":`, cfg.Prefix, i)) // truncated JSON
			} else {
				it.Value = []byte(fmt.Sprintf(`{"event_id":"%s-%d","amount":5}`, cfg.Prefix, i)) // no account
			}
			items = append(items, it)
			continue
		case roll < cfg.MalformedPerMille+cfg.PoisonPerMille:
			it.Kind = KindPoison
		case roll < cfg.MalformedPerMille+cfg.PoisonPerMille+cfg.FlakyPerMille:
			it.Kind = KindFlaky
		}
		it.Event = Event{
			EventID: fmt.Sprintf("%s-%d", cfg.Prefix, i),
			Account: account,
			Amount:  int64(rng.IntN(2000) - 500),
			Seq:     seqs[a],
			Poison:  it.Kind == KindPoison,
		}
		if it.Kind == KindFlaky {
			it.Event.FailAttempts = 1 + rng.IntN(cfg.MaxFailAttempts)
			if cfg.Mistakes && rng.IntN(2) == 0 {
				it.Event.Mistake = Mistakes[rng.IntN(len(Mistakes))]
			}
			if cfg.OversizedPerMille > 0 && rng.IntN(1000) < cfg.OversizedPerMille { // no draw when off: seeds keep their events
				// A size of its own: the DLQ copy, without its value, is told by it.
				base, _ := json.Marshal(it.Event)
				it.Event.Pad = strings.Repeat("p", 999_600+oversized-len(base)-len(`,"pad":""`))
				oversized++
			}
		}
		it.Value, _ = json.Marshal(it.Event)
		items = append(items, it)
	}
	return items
}
