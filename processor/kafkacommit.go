package processor

import (
	"encoding/base64"
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
//
// Releases before the start was recorded committed with franz-go's default metadata, the member id
// (kgo's commit sets every partition's Metadata to &req.MemberID), in one of two forms:
//
//   - Under the classic protocol the broker makes the member id: the client id, "-", a UUID
//     ("kafkapg-6f1c0a2e-8a7d-4e1b-9c1e-0d3f5a7b9c2d"). It begins with "kafkapg", and nothing but a
//     client named so makes it. (A release given its own kgo.ClientID or kgo.InstanceID in
//     Config.KafkaOptions made member ids that begin with those instead: not recognised, as
//     nothing tells them from another service's.)
//   - Under the consumer protocol (KIP-848, what GroupProtocolAuto uses on Kafka 4) the client makes
//     it, and franz-go (v1.22.3, newStringUUID in consumer_group_848.go) makes it of 16 random bytes
//     in padded URL-safe base64, whatever the client id: 24 characters, the last two "==", the one
//     before them A, Q, g or w ("aLGwFOiptr_8qct5sMouZA=="). The broker echoes it back (franz-go
//     pins ConsumerGroupHeartbeat v1+, where the member id is the client's), and commits carry it.
//
// The second form names no client: every franz-go consumer under the consumer protocol that
// commits with the default metadata writes it. It is either a group kafkapg ran before this
// release, whose database forgot the partition (the partition must start at the start of the log
// again: its first start was not recorded), or a group migrated to kafkapg from another franz-go
// service (the partition should start at that service's commit). Only one of the two mistakes can
// be seen and undone. Taking kafkapg's commit for another's skips every record the database lost,
// silently and for good (TestNewBuildOnTheOldReleasesConsumerProtocolCommits: 0 of 40 applied
// again). Taking another service's commit for kafkapg's applies again what that service had
// consumed: loudly (a warning naming the partition and the metadata, the forgotten partitions
// counter and its alert), and avoidably, by committing the group's offsets again with metadata of
// its own, not beginning with "kafkapg", before the migration (kadm's CommitOffsets, the old
// service stopped). And a franz-go service opts in to the consumer protocol (kgo.ServerSideBalancer),
// while kafkapg has used it by default on Kafka 4 since it offered it. So the form is taken for
// kafkapg's, with that warning (resolveStarts). It is recognised exactly, so that a Java consumer's
// member id (Kafka's Uuid: 22 characters, no padding; Java commits empty metadata by default
// anyway) or any other metadata is not. This release never writes it: the ambiguity ends for each
// partition at its first commit by this release.

// commitMetaPrefix starts the metadata of every offset kafkapg commits to Kafka, and the classic
// member id of releases before the start was recorded (see above).
const commitMetaPrefix = "kafkapg"

// commitMeta is the metadata kafkapg commits with a partition's offset.
func commitMeta(start int64, known bool) string {
	if !known {
		return commitMetaPrefix
	}
	return commitMetaPrefix + " start=" + strconv.FormatInt(start, 10)
}

// parseCommitMeta reads the metadata of an offset committed to Kafka: whether kafkapg committed it
// and, if it recorded one, where the partition was first started. A consumer-protocol member id is
// taken for kafkapg's (see isConsumerMemberID).
func parseCommitMeta(meta string) (ours bool, start int64, known bool) {
	if isConsumerMemberID(meta) {
		return true, 0, false
	}
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

// isConsumerMemberID reports whether meta is a member id as franz-go makes it under the consumer
// protocol: 16 bytes in padded URL-safe base64, nothing else. Releases before the start was
// recorded committed with it, and so does any other franz-go consumer under that protocol (see
// above): the metadata cannot tell which.
func isConsumerMemberID(meta string) bool {
	if len(meta) != base64.URLEncoding.EncodedLen(16) {
		return false
	}
	// Strict: the padding bits are zero, as they are in every encoding of 16 bytes.
	b, err := base64.URLEncoding.Strict().DecodeString(meta)
	return err == nil && len(b) == 16
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
