package processor

import (
	"strconv"
	"strings"

	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kafkapg/kafkapg/offsets"
)

// The offsets kafkapg commits to Kafka are advisory where Postgres has the partition's row (lag
// tools read them; a partition without one reads them, see offsets' doc), and they are committed
// after Postgres's. A database can therefore forget what Kafka still remembers: a failover to an
// asynchronous standby loses the commits the standby had not received, and a restore from a backup
// loses everything after the backup. Where Postgres still has the partition's row, its position
// wins and the partition is applied again from there, with its effects. But a partition whose first
// claim was lost has no position at all, and its start would be resolved from Kafka's committed
// offset, which kafkapg itself made after applying records the database no longer holds: they would
// never be applied again.
//
// So every offset kafkapg commits carries, as its metadata, where the partition was first started
// ("kafkapg start=<offset>"), and resolveStarts never takes a commit with that metadata for a
// start: it starts the partition where it was first started, again. Commits by other consumers
// (a service the group ran before kafkapg) carry other metadata and are taken as before.

// commitMetaPrefix starts the metadata of every offset kafkapg commits to Kafka. Releases before
// the start was recorded committed with franz-go's default metadata, the member id, which the
// broker forms from the client id ("kafkapg") under the classic protocol: they are recognised too.
const commitMetaPrefix = "kafkapg"

// commitMeta is the metadata kafkapg commits with a partition's offset.
func commitMeta(start int64, known bool) string {
	if !known {
		return commitMetaPrefix
	}
	return commitMetaPrefix + " start=" + strconv.FormatInt(start, 10)
}

// parseCommitMeta reads the metadata of an offset committed to Kafka: whether kafkapg committed it
// and, if it recorded one, where the partition was first started.
func parseCommitMeta(meta string) (ours bool, start int64, known bool) {
	if !strings.HasPrefix(meta, commitMetaPrefix) {
		return false, 0, false
	}
	for _, f := range strings.Fields(meta[len(commitMetaPrefix):]) {
		if v, ok := strings.CutPrefix(f, "start="); ok {
			if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
				return true, n, true
			}
		}
	}
	return true, 0, false
}

// rememberStart keeps where a claimed partition was first started, for the metadata of its commits
// (stampCommit). Starts never change: an entry outlives the partition's worker.
func (p *Processor) rememberStart(pos offsets.Position) {
	if pos.StartKnown {
		p.starts.Store(pos.TP(), pos.Start)
	}
}

// stampCommit sets the metadata of every offset in an offset commit (kgo.PreCommitFnContext on the
// client's context, so it runs for the automatic commits, those on revoke and the last one).
func (p *Processor) stampCommit(req *kmsg.OffsetCommitRequest) error {
	for i := range req.Topics {
		t := &req.Topics[i]
		for j := range t.Partitions {
			start, known := p.starts.Load(offsets.Partition{Topic: t.Topic, Partition: t.Partitions[j].Partition})
			var s int64
			if known {
				s = start.(int64)
			}
			meta := commitMeta(s, known)
			t.Partitions[j].Metadata = &meta
		}
	}
	return nil
}
