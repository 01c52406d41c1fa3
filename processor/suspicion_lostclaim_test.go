package processor_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/rig/testkit"
	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/processor"
)

// lostClaimScene is what the two owners of TestZombieAndOwnerAfterALostClaim share.
type lostClaimScene struct {
	phase   atomic.Int32 // 1: A held back, Z goes once A passed the fence; 2: Z held back, A goes
	aPassed atomic.Bool  // a transaction of A reached its handler with r1: it passed the fence
}

// lostClaimOwner is the handler of one of the two owners, "A" or "Z". Every record is written to
// lost_claim_applied in the batch transaction; r1 fails at its first delivery wherever it runs, so
// it goes to the retry tier and holds its key; an owner held back fails with Infrastructure (its
// transaction is rolled back and retried in place, applying nothing).
type lostClaimOwner struct {
	name  string
	scene *lostClaimScene
}

func (h lostClaimOwner) Handle(ctx context.Context, tx pgx.Tx, rec *processor.Record) error {
	v := string(rec.Value)
	switch phase := h.scene.phase.Load(); {
	case phase == 1 && h.name == "A":
		if v == "r1" {
			h.scene.aPassed.Store(true)
		}
		return processor.Infrastructure(errors.New("A is held back in phase 1"))
	case phase == 1 && h.name == "Z" && !h.scene.aPassed.Load():
		return processor.Infrastructure(errors.New("Z waits for A to pass the fence"))
	case phase == 2 && h.name == "Z":
		return processor.Infrastructure(errors.New("Z is held back in phase 2"))
	}
	if v == "r1" && rec.Attempt == 1 {
		return errors.New("r1 fails at its first delivery")
	}
	_, err := tx.Exec(ctx, `INSERT INTO lost_claim_applied (value, owner, attempt) VALUES ($1, $2, $3)`, v, h.name, rec.Attempt)
	return err
}

// TestZombieAndOwnerAfterALostClaim (issue 39, S2): a claim the database lost must not let two
// owners pass the fence.
//
// Z owns the partition with token tZ. A is given it and claims it (token tA > tZ), fencing Z, which
// has not found out yet (a zombie: frozen, cut off from the group; here, a processor in another
// Kafka group, whose offsets rows are the same). Then the database loses A's claim: an
// asynchronous failover to a standby that had not received it, simulated by an UPDATE that puts
// the row back as Z left it (owner_token = tZ). A finds its token gone (offsets.ErrMoved) and
// starts the partition again. Before the fix it took the stored token, tZ: Z's token. Both then
// passed the fence, each with the held keys it had read, and each blind to the keys the other
// held: Z sent r1 (key k) to the retry tier and held k; A, whose held keys predate that, applied
// r2 (key k) at once, before r1. Per-key order broken, and two owners committing in turn.
//
// Now A claims again above every token it knows of (its own, and one derived from its group
// generation): Z's next transaction is fenced, and A, the only owner, applies r1 then r2.
func TestZombieAndOwnerAfterALostClaim(t *testing.T) {
	k := testenv.NewKfake(t)
	h := testkit.New(t, k, 1)
	ctx := context.Background()
	if _, err := h.Pool.Exec(ctx, `CREATE TABLE lost_claim_applied (id bigserial PRIMARY KEY, value text NOT NULL, owner text NOT NULL, attempt int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	scene := &lostClaimScene{}
	config := func(name string) *processor.Config {
		cfg := h.Config(lostClaimOwner{name, scene})
		cfg.RetryTiers = []time.Duration{300 * time.Millisecond}
		return cfg
	}
	produce := func(values ...string) {
		var recs []*kgo.Record
		for _, v := range values {
			key := "k"
			if v != "r1" && v != "r2" {
				key = v
			}
			recs = append(recs, &kgo.Record{Topic: h.Topic, Key: []byte(key), Value: []byte(v)})
		}
		k.Produce(t, recs...)
	}
	applied := func() (values []string, owners []string) {
		rows, err := h.Pool.Query(ctx, `SELECT value, owner FROM lost_claim_applied ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var v, o string
			if err := rows.Scan(&v, &o); err != nil {
				t.Fatal(err)
			}
			values, owners = append(values, v), append(owners, o)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return values, owners
	}
	store := offsets.NewStore("kafkapg", h.Group)
	tp := offsets.Partition{Topic: h.Topic, Partition: 0}
	load := func() offsets.Position {
		pos, err := store.Load(ctx, h.Pool, tp)
		if err != nil {
			t.Fatal(err)
		}
		return pos
	}

	// Z alone, in a Kafka group of its own: the group A joins next does not know it.
	zcfg := config("Z")
	zcfg.KafkaOptions = append(zcfg.KafkaOptions, kgo.ConsumerGroup(h.Group+"_zombie"))
	h.Start(zcfg)
	produce("s0", "s1", "s2")
	testenv.Eventually(t, 30*time.Second, func() error {
		if v, _ := applied(); len(v) != 3 {
			return fmt.Errorf("%d of 3 records applied by Z", len(v))
		}
		return nil
	})
	zpos := load()

	// A claims the partition; at once the database loses that claim (before Z could find out
	// about it: Z's position check runs every few seconds).
	a := h.Start(config("A"))
	deadline := time.Now().Add(30 * time.Second)
	for load().Token == zpos.Token {
		if time.Now().After(deadline) {
			t.Fatal("A did not claim the partition")
		}
		time.Sleep(time.Millisecond)
	}
	var owner string
	if err := h.Pool.QueryRow(ctx, `UPDATE kafkapg.offsets SET owner_token = $3, owner = 'Z (the claim A lost)'
		WHERE consumer_group = $1 AND topic = $2 RETURNING owner`, h.Group, h.Topic, zpos.Token).Scan(&owner); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, func() error {
		if a.Counter("kafkapg_forgotten_partitions_total") < 1 {
			return errors.New("A has not found that the database lost its claim")
		}
		return nil
	})

	// Phase 1: A is held back; Z goes once a transaction of A has passed the fence with r1.
	scene.phase.Store(1)
	produce("r1")
	testenv.Eventually(t, 30*time.Second, func() error {
		if !scene.aPassed.Load() {
			return errors.New("no transaction of A reached its handler with r1")
		}
		return nil
	})
	// Either Z's transaction passes too (routing r1 to the tier, holding k), or it is fenced:
	// give it the time to do one or the other.
	testenv.Eventually(t, 30*time.Second, func() error {
		if pos := load(); pos.Next == zpos.Next+1 {
			return nil // Z routed r1
		}
		var fenced bool
		err := h.Pool.QueryRow(ctx, `SELECT owner_token > $3 FROM kafkapg.offsets WHERE consumer_group = $1 AND topic = $2`,
			h.Group, h.Topic, zpos.Token).Scan(&fenced)
		if err != nil {
			return err
		}
		if fenced {
			return nil // A claimed above Z: Z's transactions are fenced
		}
		return errors.New("r1 is neither routed by Z nor Z fenced")
	})
	zRouted := load().Next == zpos.Next+1

	// Phase 2: Z is held back, A goes. r2, of r1's key, must wait for r1.
	scene.phase.Store(2)
	produce("r2")
	testenv.Eventually(t, 30*time.Second, func() error {
		if v, _ := applied(); len(v) != 5 {
			return fmt.Errorf("applied %v, want r1 and r2 too", v)
		}
		return nil
	})
	time.Sleep(500 * time.Millisecond) // anything applied twice shows by now
	values, owners := applied()
	t.Logf("applied %v by %v; Z routed r1 past A's fence: %v", values, owners, zRouted)
	if len(values) != 5 {
		t.Fatalf("applied %v: want s0, s1, s2, r1 and r2 once each", values)
	}
	if values[3] != "r1" || values[4] != "r2" {
		t.Errorf("key k's records applied in the order %v: r2 was applied before r1 (per-key order broken: two owners, each blind to the other's held keys)", values[3:])
	}
	if zRouted {
		t.Errorf("after the database lost A's claim, the zombie Z committed (it routed r1) while A also committed: two owners passed the fence")
	}
}
