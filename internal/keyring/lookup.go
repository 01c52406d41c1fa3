package keyring

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Lookup reports which of keys (full hashes) the ring has, by their short hash, without
// recording any: for an operator's dry run (which records of a rewind a key would skip). It reads
// the tables of the ring's state at the moment, in a transaction of its own that waits at most 2
// seconds for a lock (a move empties a generation with TRUNCATE): it then fails, and the caller
// says the keys were not checked. A key recorded by a transaction still open is not found.
func (k *Ring) Lookup(ctx context.Context, pool *pgxpool.Pool, keys [][32]byte) (map[[16]byte]bool, error) {
	found := map[[16]byte]bool{}
	if len(keys) == 0 {
		return found, nil
	}
	short := make([][16]byte, len(keys))
	full := make([][]byte, len(keys))
	for i := range keys {
		short[i], full[i] = Short(keys[i]), keys[i][:]
	}
	err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '2s'`); err != nil {
			return err
		}
		s, err := k.read(ctx, tx, "")
		if err != nil {
			return err
		}
		v := s.View()
		var in []string
		for g := range Generations {
			if (v.Keys|v.Insert)&bit(g) != 0 {
				in = append(in, "EXISTS (SELECT 1 FROM "+k.generation[g]+" x WHERE x.key_hash = k.u)")
			}
			if v.Runs&bit(g) != 0 {
				in = append(in, inRuns(k.runs[g], "k.u"))
			}
		}
		if v.Legacy {
			in = append(in, "EXISTS (SELECT 1 FROM "+k.legacy+" x WHERE x.key_hash = k.h)")
		}
		if len(in) == 0 {
			return nil
		}
		rows, err := tx.Query(ctx, `SELECT k.u FROM unnest($1::uuid[], $2::bytea[]) AS k(u, h) WHERE `+strings.Join(in, " OR "), short, full)
		if err != nil {
			return err
		}
		hs, err := pgx.CollectRows(rows, pgx.RowTo[[16]byte])
		for _, h := range hs {
			found[h] = true
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("look keys up in the idempotency key ring: %w", err)
	}
	return found, nil
}

// Hash is the ring's hash of key, an idempotency key of a record of topic in group: the SHA-256
// of the group, the topic and the key, each of the first two preceded by its length. The
// processor records keys under it, and ops looks them up under it.
func Hash(group, topic string, key []byte) [32]byte {
	h := sha256.New()
	for _, s := range []string{group, topic} {
		h.Write(binary.AppendUvarint(nil, uint64(len(s))))
		h.Write([]byte(s))
	}
	h.Write(key)
	var out [32]byte
	h.Sum(out[:0])
	return out
}
