package processor

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/twmb/franz-go/pkg/kgo"
)

// recordOverhead is what a buffered record costs in memory besides its key, value and headers:
// its kgo.Record (160 bytes), the processor.Record made of it while it is applied (about 200),
// the pointers to them and the allocator's rounding. Heap profiles of a deep backlog on 128
// partitions agree with the sum to within a few percent.
const recordOverhead = 448

// headerOverhead is a header's struct and the allocation of its key.
const headerOverhead = 56

// cost is what a buffered record is counted as in the buffer budget (Config.MaxBufferedBytes).
func cost(r *kgo.Record) int64 {
	n := len(r.Key) + len(r.Value) + recordOverhead
	for _, h := range r.Headers {
		n += len(h.Key) + len(h.Value) + headerOverhead
	}
	return int64(n)
}

// detachChunk is how many records detach allocates together: few allocations per record, and
// little memory kept alive by a chunk whose first records are applied and its last are not.
const detachChunk = 64

// detach returns copies of fetched records that share no memory with franz-go's buffers.
//
// franz-go decodes a fetch into slabs: one array of Records per partition's fetch, keys and values
// pointing into one decompressed buffer per batch (or into the raw response). A record kept in a
// queue keeps all of those alive, its applied neighbours included: with a deep backlog on many
// partitions that was most of the heap, and nothing the budget could count. Detached records cost
// what cost says (within one chunk), and franz-go's buffers are freed as soon as a poll has handed
// them out.
func detach(fetched []*kgo.Record) []*kgo.Record {
	out := make([]*kgo.Record, len(fetched))
	for start := 0; start < len(fetched); start += detachChunk {
		chunk := fetched[start:min(start+detachChunk, len(fetched))]
		n := 0
		for _, r := range chunk {
			n += len(r.Key) + len(r.Value)
			for _, h := range r.Headers {
				n += len(h.Value)
			}
		}
		structs := make([]kgo.Record, len(chunk))
		buf := make([]byte, 0, n)
		clone := func(b []byte) []byte {
			if b == nil {
				return nil // a null key or value stays null
			}
			buf = append(buf, b...)
			return buf[len(buf)-len(b) : len(buf) : len(buf)]
		}
		for i, r := range chunk {
			d := &structs[i]
			*d = kgo.Record{
				Key:           clone(r.Key),
				Value:         clone(r.Value),
				Timestamp:     r.Timestamp,
				Topic:         r.Topic,
				Partition:     r.Partition,
				Attrs:         r.Attrs,
				ProducerEpoch: r.ProducerEpoch,
				ProducerID:    r.ProducerID,
				LeaderEpoch:   r.LeaderEpoch,
				Offset:        r.Offset,
			}
			if len(r.Headers) > 0 {
				d.Headers = make([]kgo.RecordHeader, len(r.Headers))
				for j, h := range r.Headers {
					d.Headers[j] = kgo.RecordHeader{Key: strings.Clone(h.Key), Value: clone(h.Value)}
				}
			}
			out[start+i] = d
		}
	}
	return out
}

// costOf is the cost of recs.
func costOf(recs []*kgo.Record) int64 {
	var n int64
	for _, r := range recs {
		n += cost(r)
	}
	return n
}

// buffer accounts for the fetched records this process holds in memory, across all partitions,
// from the poll that handed them out until their transaction ends: the poll loop fetches no more
// while they cost Config.MaxBufferedBytes or more, and each partition pauses its own fetching at
// its share of the budget (see worker.push), so that one partition that cannot move on (a retry
// tier waiting for its due time, say) cannot starve the others.
type buffer struct {
	limit int64
	used  atomic.Int64

	mu    sync.Mutex
	freed chan struct{} // closed and replaced when used drops below limit
}

func newBuffer(limit int) *buffer {
	return &buffer{limit: int64(limit), freed: make(chan struct{})}
}

// add counts n more bytes.
func (b *buffer) add(n int64) { b.used.Add(n) }

// release counts n bytes less, and wakes the poll loop if that brings the total under the limit.
func (b *buffer) release(n int64) {
	if n == 0 {
		return
	}
	if after := b.used.Add(-n); after < b.limit && after+n >= b.limit {
		b.mu.Lock()
		close(b.freed)
		b.freed = make(chan struct{})
		b.mu.Unlock()
	}
}

// wait returns once the buffer holds less than its limit, or false when ctx is done.
func (b *buffer) wait(ctx context.Context) bool {
	for {
		b.mu.Lock()
		freed := b.freed
		b.mu.Unlock()
		if b.used.Load() < b.limit {
			return true
		}
		select {
		case <-freed:
		case <-ctx.Done():
			return false
		}
	}
}

// minPartitionShare is the least of the budget a partition may fill before it pauses, however
// many partitions share the budget.
const minPartitionShare = 64 << 10

// share is how many bytes one of n partitions may hold before its fetching pauses.
func (b *buffer) share(n int) int64 {
	return max(b.limit/int64(max(n, 1)), minPartitionShare)
}
