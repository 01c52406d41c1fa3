package streams

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
)

// Store reads and writes a schema's lineages (idempotency_lineages: one row per group and root,
// the Lineage as JSON), inside the caller's transaction.
type Store struct {
	ensure, lock, write string
}

// NewStore returns the Store of schema.
func NewStore(schema string) *Store {
	t := pgx.Identifier{schema, "idempotency_lineages"}.Sanitize()
	return &Store{
		// A row for every lineage asked for, so that its lock covers a lineage met for the
		// first time too: a second transaction inserting the same row waits for the first.
		ensure: `INSERT INTO ` + t + ` (consumer_group, root, topic, partition, state, updated_at)
			SELECT $1, r, $2, $3, '{"streams":[]}', now() FROM unnest($4::uuid[]) AS u(r) ORDER BY r
			ON CONFLICT DO NOTHING`,
		// In a later statement than ensure: its snapshot sees every row ensure waited for.
		lock: `SELECT root, state FROM ` + t + ` WHERE consumer_group = $1 AND root = ANY($2) ORDER BY root FOR UPDATE`,
		write: `UPDATE ` + t + ` AS l SET state = u.state, updated_at = now()
			FROM unnest($2::uuid[], $3::jsonb[]) AS u(root, state) WHERE l.consumer_group = $1 AND l.root = u.root`,
	}
}

// Lock locks and reads group's lineages of roots, in root order (no deadlock between two
// transactions locking the same ones). With create, a lineage without a row gets one first (its
// events are in partition of topic); without, it is left out.
func (s *Store) Lock(ctx context.Context, tx pgx.Tx, group string, roots []ID, create bool, topic string, partition int32) (map[ID]*Lineage, error) {
	var want [][16]byte
	for _, r := range roots {
		if !slices.Contains(want, [16]byte(r)) {
			want = append(want, [16]byte(r))
		}
	}
	slices.SortFunc(want, func(a, b [16]byte) int { return bytes.Compare(a[:], b[:]) })
	out := map[ID]*Lineage{}
	if len(want) == 0 {
		return out, nil
	}
	b := &pgx.Batch{}
	if create {
		b.Queue(s.ensure, group, topic, partition, want)
	}
	b.Queue(s.lock, group, want)
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	if create {
		if _, err := br.Exec(); err != nil {
			return nil, err
		}
	}
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var root [16]byte
		var state []byte
		if err := rows.Scan(&root, &state); err != nil {
			rows.Close()
			return nil, err
		}
		l := &Lineage{}
		if err := json.Unmarshal(state, l); err != nil {
			rows.Close()
			return nil, fmt.Errorf("lineage %s: %w", ID(root), err)
		}
		l.Root = root
		out[l.Root] = l
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if create && len(out) != len(want) {
		return nil, fmt.Errorf("%d of %d lineages have no row after they were ensured", len(want)-len(out), len(want))
	}
	return out, nil
}

// Save writes lineages (locked by Lock in tx) back.
func (s *Store) Save(ctx context.Context, tx pgx.Tx, group string, lineages []*Lineage) error {
	if len(lineages) == 0 {
		return nil
	}
	roots := make([][16]byte, len(lineages))
	states := make([][]byte, len(lineages))
	for i, l := range lineages {
		b, err := json.Marshal(l)
		if err != nil {
			return err
		}
		roots[i], states[i] = [16]byte(l.Root), b
	}
	_, err := tx.Exec(ctx, s.write, group, roots, states)
	return err
}
