package ops

import (
	"context"
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
	var roots []streams.ID
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
			Parent: st.Parent, ForkSeq: st.ForkSeq, Since: st.Since, Keyed: st.Keyed}, Offset: offset})
		roots = append(roots, st.Root)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	if len(evs) == 0 {
		return nil
	}
	store := streams.NewStore(o.schema)
	lins, err := store.Lock(ctx, tx, o.group, roots, false, "", 0)
	if err != nil {
		return fmt.Errorf("lock the discarded dead letters' lineages: %w", err)
	}
	var changed []*streams.Lineage
	for _, e := range evs {
		if l := lins[e.Root]; l != nil {
			l.Done(e, false)
			if !slices.Contains(changed, l) {
				changed = append(changed, l)
			}
		}
	}
	return store.Save(ctx, tx, o.group, changed)
}
