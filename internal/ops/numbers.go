package ops

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/streams"
	"github.com/kafkapg/kafkapg/sink"
)

// numbersDone marks, in tx, the stream numbers of the dead letters ids (just discarded) done in
// their lineages (idempotency_lineages, the processor's state of numbered events: see package
// internal/streams): a discarded event's number is not kept missing for ever, and a copy of it
// that comes later is skipped as the discarded one was. Dead letters of a topic that is not
// deduplicated by streams (no lineage of theirs here) are left alone.
func (o *Ops) numbersDone(ctx context.Context, tx pgx.Tx, ids []int64) error {
	if len(ids) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, `SELECT topic, partition, "offset", header_keys, header_values FROM `+o.table("dead_letters")+`
		WHERE id = ANY($1) ORDER BY id`, ids)
	if err != nil {
		return fmt.Errorf("read the discarded dead letters' headers: %w", err)
	}
	var evs []streams.Event
	var roots [][16]byte
	for rows.Next() {
		var topic string
		var partition int32
		var offset int64
		var keys, values [][]byte
		if err := rows.Scan(&topic, &partition, &offset, &keys, &values); err != nil {
			rows.Close()
			return err
		}
		hs := make([]kgo.RecordHeader, 0, len(keys))
		for i := range min(len(keys), len(values)) {
			hs = append(hs, kgo.RecordHeader{Key: string(keys[i]), Value: values[i]})
		}
		st, ok := sink.ParseStream(hs)
		if !ok || !st.Fits(topic, partition) {
			continue
		}
		evs = append(evs, streams.Event{Header: streams.Header{Stream: st.ID, Seq: st.Seq, Root: st.Root, Src: st.SourceOffset,
			Parent: st.Parent, ForkSeq: st.ForkSeq, Since: st.Since}, Offset: offset})
		if !slices.Contains(roots, [16]byte(st.Root)) {
			roots = append(roots, [16]byte(st.Root))
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	if len(evs) == 0 {
		return nil
	}
	slices.SortFunc(roots, func(a, b [16]byte) int { return bytes.Compare(a[:], b[:]) })
	lrows, err := tx.Query(ctx, `SELECT root, state FROM `+o.table("idempotency_lineages")+`
		WHERE consumer_group = $1 AND root = ANY($2) ORDER BY root FOR UPDATE`, o.group, roots)
	if err != nil {
		return fmt.Errorf("lock the discarded dead letters' lineages: %w", err)
	}
	lins := map[streams.ID]*streams.Lineage{}
	for lrows.Next() {
		var root [16]byte
		var state []byte
		if err := lrows.Scan(&root, &state); err != nil {
			lrows.Close()
			return err
		}
		l := &streams.Lineage{Root: root}
		if err := json.Unmarshal(state, l); err != nil {
			lrows.Close()
			return fmt.Errorf("lineage %s: %w", streams.ID(root), err)
		}
		lins[l.Root] = l
	}
	lrows.Close()
	if err := lrows.Err(); err != nil {
		return err
	}
	changed := map[streams.ID]bool{}
	for _, e := range evs {
		if l := lins[e.Root]; l != nil {
			l.Done(e, false)
			changed[e.Root] = true
		}
	}
	var uroots [][16]byte
	var states [][]byte
	for r := range changed {
		b, err := json.Marshal(lins[r])
		if err != nil {
			return err
		}
		uroots, states = append(uroots, [16]byte(r)), append(states, b)
	}
	if len(uroots) == 0 {
		return nil
	}
	_, err = tx.Exec(ctx, `UPDATE `+o.table("idempotency_lineages")+` AS l SET state = u.state, updated_at = now()
		FROM unnest($2::uuid[], $3::jsonb[]) AS u(root, state) WHERE l.consumer_group = $1 AND l.root = u.root`, o.group, uroots, states)
	return err
}
