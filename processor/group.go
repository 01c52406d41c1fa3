package processor

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/plugin/kslog"

	"github.com/kafkapg/kafkapg/internal/backoff"
	"github.com/kafkapg/kafkapg/offsets"
	"github.com/kafkapg/kafkapg/retrytopics"
	"github.com/kafkapg/kafkapg/sink"
)

// leaveGrace is how long shutdown lets the Kafka client leave the group by itself.
const leaveGrace = 2 * time.Second

// leaveByHand sends the group coordinator a LeaveGroup for this member (classic protocol), which
// the coordinator takes even while a join is pending. Under the consumer protocol it is refused,
// harmlessly.
func (p *Processor) leaveByHand(ctx context.Context, cl *kgo.Client) {
	member, _ := cl.GroupMetadata()
	if member == "" {
		return
	}
	req := kmsg.NewPtrLeaveGroupRequest()
	req.Group = p.cfg.Group
	req.MemberID = member
	m := kmsg.NewLeaveGroupRequestMember()
	m.MemberID = member
	req.Members = append(req.Members, m)
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	resp, err := req.RequestWith(ctx, cl)
	if err == nil {
		err = kerr.ErrorForCode(resp.ErrorCode)
	}
	if err != nil {
		p.log.Debug("leaving the group by hand", "err", err)
		return
	}
	p.log.Info("left the group by hand", "member", member)
}

// setGroupTimeouts asks the broker to give this group, under the consumer protocol, the session
// timeout and heartbeat interval the classic protocol would have: there they are the group's,
// kept by the broker (group.consumer.session.timeout.ms and .heartbeat.interval.ms, 45 s and 5 s
// by default), not the client's. The broker refuses values outside its
// group.consumer.min/max.session.timeout.ms and .heartbeat.interval.ms (45-60 s and 5-15 s by
// default), and refuses the request whole: so the limits are read first and what is asked is
// moved into them (groupTimeouts), with a warning when the session timeout is not
// SessionTimeout. Without the limits (no permission to describe the brokers' configs) the
// values are asked as they are. A broker that refuses keeps its own; the warning says which.
func (p *Processor) setGroupTimeouts(ctx context.Context, cl *kgo.Client) {
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	session, heartbeat := p.cfg.SessionTimeout, p.heartbeatInterval()
	lim, limErr := brokerGroupLimits(rctx, kadm.NewClient(cl))
	fits := true
	if limErr != nil {
		p.log.Warn("cannot read the brokers' limits on a group's session timeout and heartbeat interval (consumer protocol; "+
			"describing the brokers' configs needs DESCRIBE_CONFIGS on the cluster): asking for SessionTimeout and its heartbeat interval "+
			"as they are, which a broker refuses outside its group.consumer.min/max.session.timeout.ms and "+
			"group.consumer.min/max.heartbeat.interval.ms (45-60s and 5-15s unless configured)",
			"wanted_session_timeout", session, "wanted_heartbeat_interval", heartbeat, "err", limErr)
	} else {
		session, heartbeat, fits = groupTimeouts(p.cfg.SessionTimeout, lim)
		if !fits {
			p.log.Warn("no session timeout and heartbeat interval fit the brokers' limits (consumer protocol; a heartbeat interval "+
				"must be below the session timeout): its own group.consumer.session.timeout.ms and group.consumer.heartbeat.interval.ms apply, "+
				"not SessionTimeout", "session_timeout", p.cfg.SessionTimeout, "limits", lim.String())
			return
		}
	}
	// Both in one request, which the broker takes whole or not at all: a session timeout set alone
	// could fall below the broker's heartbeat interval.
	res := kmsg.NewIncrementalAlterConfigsRequestResource()
	res.ResourceType = kmsg.ConfigResourceTypeGroupConfig
	res.ResourceName = p.cfg.Group
	for name, d := range map[string]time.Duration{"consumer.session.timeout.ms": session, "consumer.heartbeat.interval.ms": heartbeat} {
		c := kmsg.NewIncrementalAlterConfigsRequestResourceConfig()
		c.Name, c.Op, c.Value = name, kmsg.IncrementalAlterConfigOpSet, kmsg.StringPtr(strconv.FormatInt(d.Milliseconds(), 10))
		res.Configs = append(res.Configs, c)
	}
	req := kmsg.NewPtrIncrementalAlterConfigsRequest()
	req.Resources = append(req.Resources, res)
	resp, err := req.RequestWith(rctx, cl)
	if err == nil && len(resp.Resources) > 0 {
		if err = kerr.ErrorForCode(resp.Resources[0].ErrorCode); err != nil && resp.Resources[0].ErrorMessage != nil {
			err = fmt.Errorf("%w: %s", err, *resp.Resources[0].ErrorMessage)
		}
	}
	if err != nil {
		p.log.Warn("the broker refused this group's session timeout and heartbeat interval (consumer protocol): its own group.consumer.session.timeout.ms "+
			"and group.consumer.heartbeat.interval.ms apply (45s and 5s unless configured), not SessionTimeout",
			"wanted_session_timeout", session, "wanted_heartbeat_interval", heartbeat, "err", err)
		return
	}
	if limErr != nil {
		return
	}
	switch {
	case session > p.cfg.SessionTimeout && p.cfg.SessionTimeout < lim.minSession:
		p.log.Warn("SessionTimeout is below the brokers' minimum for a group (consumer protocol): a silent member keeps its partitions "+
			"for the session timeout that applies; to apply SessionTimeout, lower group.consumer.min.session.timeout.ms on the brokers",
			"session_timeout", p.cfg.SessionTimeout, "broker_allows", lim.sessionRange(), "applied_session_timeout", session, "applied_heartbeat_interval", heartbeat)
	case session > p.cfg.SessionTimeout:
		p.log.Warn("SessionTimeout is less than three of the brokers' shortest heartbeat intervals for a group (consumer protocol): "+
			"a silent member keeps its partitions for the session timeout that applies; to apply SessionTimeout, lower "+
			"group.consumer.min.heartbeat.interval.ms on the brokers",
			"session_timeout", p.cfg.SessionTimeout, "broker_allows", lim.String(), "applied_session_timeout", session, "applied_heartbeat_interval", heartbeat)
	case session < p.cfg.SessionTimeout:
		p.log.Warn("SessionTimeout is above the brokers' maximum for a group (consumer protocol); to apply it, raise "+
			"group.consumer.max.session.timeout.ms on the brokers",
			"session_timeout", p.cfg.SessionTimeout, "broker_allows", lim.sessionRange(), "applied_session_timeout", session, "applied_heartbeat_interval", heartbeat)
	}
	if want := min(500*time.Millisecond, session/3); heartbeat != want {
		p.log.Info("the group's heartbeat interval is held to the brokers' limits (consumer protocol): members learn that the group changed "+
			"(a member died, partitions moved) within it; group.consumer.min.heartbeat.interval.ms on the brokers lowers it",
			"wanted_heartbeat_interval", want, "broker_allows", lim.heartbeatRange(), "applied_heartbeat_interval", heartbeat)
	}
}

// groupLimits are the brokers' bounds on a consumer-protocol group's session timeout and
// heartbeat interval: group.consumer.min/max.session.timeout.ms and
// group.consumer.min/max.heartbeat.interval.ms, the strictest over the brokers. Zero is a bound
// the brokers did not state (kfake states none).
type groupLimits struct {
	minSession, maxSession, minHeartbeat, maxHeartbeat time.Duration
}

// groupLimitConfigs names the broker configs of groupLimits, and says which field each fills
// and whether it is a minimum.
var groupLimitConfigs = map[string]struct {
	field func(*groupLimits) *time.Duration
	isMin bool
}{
	"group.consumer.min.session.timeout.ms":    {func(l *groupLimits) *time.Duration { return &l.minSession }, true},
	"group.consumer.max.session.timeout.ms":    {func(l *groupLimits) *time.Duration { return &l.maxSession }, false},
	"group.consumer.min.heartbeat.interval.ms": {func(l *groupLimits) *time.Duration { return &l.minHeartbeat }, true},
	"group.consumer.max.heartbeat.interval.ms": {func(l *groupLimits) *time.Duration { return &l.maxHeartbeat }, false},
}

// brokerGroupLimits reads groupLimits from every broker's configs. Each broker is asked, not the
// cluster's dynamic defaults (the empty resource name), which leave out server.properties.
func brokerGroupLimits(ctx context.Context, adm *kadm.Client) (groupLimits, error) {
	var lim groupLimits
	md, err := adm.BrokerMetadata(ctx)
	if err != nil {
		return lim, fmt.Errorf("list brokers: %w", err)
	}
	ids := md.Brokers.NodeIDs()
	if len(ids) == 0 {
		return lim, errors.New("list brokers: none")
	}
	rcs, err := adm.DescribeBrokerConfigs(ctx, ids...)
	if err != nil {
		return lim, fmt.Errorf("describe broker configs: %w", err)
	}
	for _, rc := range rcs {
		if rc.Err != nil {
			return lim, fmt.Errorf("describe broker %s's configs: %w %s", rc.Name, rc.Err, rc.ErrMessage)
		}
		for _, c := range rc.Configs {
			lc, ok := groupLimitConfigs[c.Key]
			if !ok || c.Value == nil {
				continue
			}
			ms, err := strconv.ParseInt(*c.Value, 10, 32)
			if err != nil || ms <= 0 {
				return lim, fmt.Errorf("broker %s's %s = %q: not a positive number of milliseconds", rc.Name, c.Key, *c.Value)
			}
			d, f := time.Duration(ms)*time.Millisecond, lc.field(&lim)
			if *f == 0 || (lc.isMin && d > *f) || (!lc.isMin && d < *f) {
				*f = d
			}
		}
	}
	return lim, nil
}

func (l groupLimits) String() string {
	return "session timeout " + l.sessionRange() + ", heartbeat interval " + l.heartbeatRange()
}

func (l groupLimits) sessionRange() string   { return fmtRange(l.minSession, l.maxSession) }
func (l groupLimits) heartbeatRange() string { return fmtRange(l.minHeartbeat, l.maxHeartbeat) }

func fmtRange(lo, hi time.Duration) string {
	s := func(d time.Duration) string {
		if d == 0 {
			return "?"
		}
		return d.String()
	}
	return s(lo) + " to " + s(hi)
}

// groupTimeouts is the session timeout and heartbeat interval to ask the brokers for a group
// wanting session, within lim: the session timeout moved into its bounds, and the heartbeat
// interval min(500ms, a third of that session timeout) moved into its own. Where the heartbeat's
// minimum is a third of the session timeout or more, the session timeout is raised to three
// heartbeats (within its maximum), never left at or below one, which the brokers refuse: a member
// would be fenced for a heartbeat a little late. fits is false when no pair is within lim.
func groupTimeouts(session time.Duration, lim groupLimits) (s, heartbeat time.Duration, fits bool) {
	within := func(d, lo, hi time.Duration) time.Duration {
		if lo > 0 {
			d = max(d, lo)
		}
		if hi > 0 {
			d = min(d, hi)
		}
		return d
	}
	s = within(session, lim.minSession, lim.maxSession)
	heartbeat = within(min(500*time.Millisecond, s/3), lim.minHeartbeat, lim.maxHeartbeat)
	if heartbeat > s/3 {
		s = within(3*heartbeat, lim.minSession, lim.maxSession)
	}
	fits = heartbeat < s && (lim.minHeartbeat == 0 || heartbeat >= lim.minHeartbeat) &&
		(lim.maxSession == 0 || s <= lim.maxSession) && (lim.minSession == 0 || s >= lim.minSession)
	return s, heartbeat, fits
}

// heartbeatInterval is how often members heartbeat: how soon they learn that the group changed
// (a member died, partitions moved), which adds to a dead member's session timeout before its
// partitions flow elsewhere. Under the classic protocol the client is given it as it is; under
// the consumer protocol it is the group's, asked of the broker within its limits
// (setGroupTimeouts).
func (p *Processor) heartbeatInterval() time.Duration {
	return min(500*time.Millisecond, p.cfg.SessionTimeout/3)
}

func (p *Processor) newClient() (*kgo.Client, error) {
	if p.cfg.RelayOnly {
		opts := []kgo.Opt{
			kgo.SeedBrokers(p.cfg.Brokers...),
			kgo.ClientID("kafkapg"),
			kgo.RecordPartitioner(sink.Partitioner()),
			kgo.WithLogger(kslog.New(p.cfg.Logger.With("component", "kafka"))),
			kgo.WithHooks(p.kprom),
			kgo.WithContext(p.clientCtx),
		}
		cl, err := kgo.NewClient(append(opts, p.cfg.KafkaOptions...)...)
		if err != nil {
			return nil, fmt.Errorf("processor: kafka client: %w", err)
		}
		return cl, nil
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(p.cfg.Brokers...),
		kgo.ClientID("kafkapg"),
		kgo.ConsumerGroup(p.cfg.Group),
		kgo.Balancers(kgo.CooperativeStickyBalancer()),
		// Where a partition starts is resolved once, at its first claim, and stored in Postgres
		// (see resolveStarts): StartOffset is applied there. This is only what an
		// out-of-range position (records deleted by retention) resets to, and what tells
		// resolveStarts that Kafka has no committed offset.
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.SessionTimeout(p.cfg.SessionTimeout),
		kgo.RebalanceTimeout(p.cfg.RebalanceTimeout),
		kgo.HeartbeatInterval(p.heartbeatInterval()),
		kgo.BlockRebalanceOnPoll(),
		// Records of aborted Kafka transactions never happened. Their markers are fetched, so the
		// stored position can move past them (see worker.records).
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.KeepControlRecords(),
		// A partition resumed after a pause joins the next fetch to its broker, which starts
		// when the one in flight returns; with nothing else to fetch that takes FetchMaxWait.
		// At Kafka's 500ms, a fast handler (COPY) spent most of its time waiting for resumed
		// partitions' records (BenchmarkCopy: 0.20x a hand-written loop; 0.65x at 100ms, 0.82x
		// at 50ms). The price: an idle processor sends each broker 20 fetches a second.
		kgo.FetchMaxWait(50 * time.Millisecond),
		// franz-go holds one fetch per broker until it is polled, decoded (three to four times
		// its size on the wire for ledger records): keep those small beside the budget (see
		// Config.MaxBufferedBytes). With an eighth of it, franz-go's decoded fetches took 78 MB of a
		// processor's heap on 128 partitions (one broker), and it was killed in a 256 MiB container.
		kgo.FetchMaxBytes(int32(min(max(p.cfg.MaxBufferedBytes/32, 1<<20), 50<<20))),
		kgo.FetchMaxPartitionBytes(int32(min(max(p.cfg.MaxBufferedBytes/128, 128<<10), 1<<20))),
		kgo.AutoCommitMarks(),
		// The outbox relay publishes retry and dead-letter records to their source record's
		// partition number.
		kgo.RecordPartitioner(sink.Partitioner()),
		kgo.AdjustFetchOffsetsFn(p.claimAssigned),
		kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, m map[string][]int32) {
			// Called after every join, also with nothing new assigned.
			p.joined.Store(true)
			if len(m) > 0 {
				p.metrics.rebalances.WithLabelValues("assigned").Inc()
			}
		}),
		kgo.OnPartitionsRevoked(p.onRevoked),
		kgo.OnPartitionsLost(p.onLost),
		kgo.WithLogger(kslog.New(p.cfg.Logger.With("component", "kafka"))),
		kgo.WithHooks(p.kprom),
	}
	if p.cfg.GroupProtocol != GroupProtocolClassic {
		// Kafka 4's consumer group protocol where the broker offers it (franz-go falls back to
		// classic otherwise): no group-wide join barrier, so a dead member no longer holds up
		// the rest of the group, nor a member that wants to leave.
		opts = append(opts, kgo.ServerSideBalancer())
	}
	// Every offset committed to Kafka, automatically or on revoke, says that kafkapg committed it
	// and where its partition was first started (see kafkacommit.go).
	opts = append(opts, kgo.WithContext(kgo.PreCommitFnContext(p.clientCtx, p.stampCommit)))
	opts = append(opts, p.cfg.KafkaOptions...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("processor: kafka client: %w", err)
	}
	return cl, nil
}

// ensureTopics creates missing retry-tier and dead-letter topics (unless DisableTopicCreation),
// waiting (with backoff) for the source topics to exist and for the broker to answer. A missing
// retry or dead-letter topic that it may not create is an error.
func (p *Processor) ensureTopics(ctx context.Context, adm *kadm.Client) error {
	for failures := 1; ; failures++ {
		created, missing, err := retrytopics.EnsureTopics(ctx, adm, p.cfg.Group, p.tierCounts(), retrytopics.EnsureOptions{
			Create:            !p.cfg.DisableTopicCreation,
			ReplicationFactor: p.cfg.TopicReplicationFactor,
			MinInsyncReplicas: p.cfg.TopicMinInsyncReplicas,
			UnderReplicated: func(topic string, replicas int, source string, sourceReplicas int) {
				p.log.Warn("a retry or dead-letter topic has fewer replicas than its source topic: it loses its records with fewer brokers' disks; "+
					"raise its replication factor (kafka-reassign-partitions)", "topic", topic, "replicas", replicas, "source_topic", source, "source_replicas", sourceReplicas)
			},
		})
		for _, t := range created {
			p.log.Info("created topic", "topic", t)
		}
		if errors.Is(err, retrytopics.ErrTopicMissing) {
			return fmt.Errorf("processor: %w; create them, or let the processor create them (DisableTopicCreation false)", err)
		}
		if err == nil && len(missing) == 0 {
			p.waiting.Store(nil)
			return nil
		}
		d := p.backoff.Delay(failures)
		var why string
		if err != nil {
			why = fmt.Sprintf("waiting for kafka (brokers %s): %v", strings.Join(p.cfg.Brokers, ","), err)
			p.log.Warn("cannot check the topics on kafka yet (is it reachable?); retrying", "brokers", p.cfg.Brokers, "err", err, "retry_in", d)
		} else {
			why = fmt.Sprintf("waiting for source topics to exist: %s", strings.Join(missing, ", "))
			p.log.Warn("waiting for source topics to exist", "missing", missing, "retry_in", d)
		}
		p.waiting.Store(&why)
		if !backoff.Sleep(ctx, nil, d) {
			return ctx.Err()
		}
	}
}

// poll fetches records and hands them to the partition workers until ctx is done.
func (p *Processor) poll(ctx context.Context, cl *kgo.Client) {
	maxPoll := 4 * p.cfg.BatchMaxRecords
	for {
		// The records fetched and not yet applied cost MaxBufferedBytes: fetch no more until
		// some are applied (franz-go buffers at most one fetch per broker meanwhile).
		if !p.buf.wait(ctx) {
			return
		}
		// A rewind wakes the poll (p.rewind), which may wait for records that do not come.
		pctx, wake := context.WithCancel(ctx)
		p.mu.Lock()
		p.wakePoll = wake
		rewinds := len(p.rewinds) > 0
		p.mu.Unlock()
		if rewinds {
			wake()
		}
		fetches := cl.PollRecords(pctx, maxPoll)
		wake()
		if ctx.Err() != nil || fetches.IsClientClosed() {
			cl.AllowRebalance()
			return
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			if errors.Is(err, context.Canceled) {
				return // woken
			}
			p.log.Warn("fetch error", "topic", topic, "partition", partition, "err", err)
		})
		fetches.EachPartition(func(ftp kgo.FetchTopicPartition) {
			if len(ftp.Records) == 0 {
				return
			}
			if w := p.worker(offsets.Partition{Topic: ftp.Topic, Partition: ftp.Partition}); w != nil {
				w.push(ftp.Records)
			}
		})
		// While no revoke can run (before AllowRebalance), as franz-go wants for SetOffsets.
		p.applyRewinds(cl)
		// Rebalance callbacks wait for this: a revoke never races with handing out records.
		cl.AllowRebalance()
	}
}

// rewindReq is a worker's request to fetch its partition again from offset, and, with replace,
// to hand the partition to a new worker (restartPartition).
type rewindReq struct {
	w       *worker
	offset  int64
	replace *worker
}

// rewind asks the poll loop to move w's partition's fetch back to offset (see
// worker.dropWaiting), and wakes it.
func (p *Processor) rewind(w *worker, offset int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.rewinds == nil {
		p.rewinds = map[offsets.Partition]rewindReq{}
	}
	p.rewinds[w.tp] = rewindReq{w: w, offset: offset}
	if p.wakePoll != nil {
		p.wakePoll()
	}
}

// applyRewinds moves the fetch of the partitions whose workers asked for it back, and resumes
// them. A request of a worker that has since been replaced (its partition revoked) is dropped:
// the new owner fetches from its own position.
func (p *Processor) applyRewinds(cl *kgo.Client) {
	p.mu.Lock()
	reqs := p.rewinds
	p.rewinds = nil
	var live []rewindReq
	for tp, r := range reqs {
		switch {
		case p.workers[tp] == r.w:
			live = append(live, r)
		case r.replace != nil:
			r.replace.cancel() // never run: the partition was revoked meanwhile
		}
	}
	p.mu.Unlock()
	for _, r := range live {
		tp := r.w.tp
		if r.replace != nil {
			p.mu.Lock()
			p.workers[tp] = r.replace
			p.mu.Unlock()
			p.rememberStart(r.replace.pos)
			go r.replace.run()
		}
		cl.SetOffsets(map[string]map[int32]kgo.EpochOffset{tp.Topic: {tp.Partition: {Epoch: -1, Offset: r.offset}}})
		if r.replace != nil {
			cl.ResumeFetchPartitions(map[string][]int32{tp.Topic: {tp.Partition}}) // paused by the worker replaced
			p.log.Info("partition started again from its stored position", "topic", tp.Topic, "partition", tp.Partition,
				"token", r.replace.pos.Token, "from_offset", r.offset)
		} else {
			r.w.rewound()
		}
	}
}

// restartPartition starts w's partition again from the position Postgres has for it, after w
// found that position moved under it (offsets.ErrMoved) and stopped. In the background, retrying
// while Postgres fails, it reads the stored position (claiming the partition again, above w's
// token, if the database lost w's claim or the row, and resolving a start if it lost the first
// commit), then has the poll
// loop hand the partition to a new worker and move its fetch there. It gives up once w is no
// longer the partition's worker (revoked meanwhile), once another owner has claimed the
// partition (that one goes on), and at shutdown.
func (p *Processor) restartPartition(w *worker) {
	go func() {
		for failures := 1; ; failures++ {
			if !p.isWorker(w) || p.lameDuck.Load() {
				return
			}
			// What the database lost may be applied again and emit its events again, under
			// other numbers: its streams fork at their next number all the same (the
			// database's identity includes its start; see sink.DatabaseIdentitySQL).
			pos, err := p.storedPosition(p.clientCtx, w)
			if errors.Is(err, offsets.ErrFenced) {
				p.metrics.fenced.Inc()
				w.log.Warn("partition was claimed by another owner; this worker stops and applies nothing more", "err", err)
				return
			}
			if err == nil {
				p.mu.Lock()
				if p.rewinds == nil {
					p.rewinds = map[offsets.Partition]rewindReq{}
				}
				p.rewinds[w.tp] = rewindReq{w: w, offset: pos.Next, replace: newWorker(p, w.cl, pos)}
				if p.wakePoll != nil {
					p.wakePoll()
				}
				p.mu.Unlock()
				return
			}
			p.metrics.infraRetries.Inc()
			d := p.backoff.Delay(failures)
			w.log.Warn("cannot fork the partition's streams or read its stored position; retrying", "err", err, "retry_in", d)
			if !backoff.Sleep(p.clientCtx, nil, d) {
				return
			}
		}
	}()
}

// isWorker reports whether w is its partition's worker.
func (p *Processor) isWorker(w *worker) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.workers[w.tp] == w
}

// storedPosition returns the position Postgres has for w's partition, for a new worker: with w's
// token if the database still has it, or a new one above it if the database lost w's claim or
// the row (claimed again), and a resolved start if it lost the first commit. offsets.ErrFenced:
// another owner has claimed it since.
//
// A lost claim is never taken over: the stored token below w's is the previous owner's claim (or
// an older one). That owner may be a zombie (frozen, cut off from the group) that has not found
// out that w's claim fenced it. Both holding one token, both would pass the fence, each with the
// held keys it read, blind to the keys the other holds: a key's later record applied by one while
// the other held the key (TestZombieAndOwnerAfterALostClaim). Claimed again above w's token and
// its generation's floor, the partition fences every owner before w once more.
func (p *Processor) storedPosition(ctx context.Context, w *worker) (offsets.Position, error) {
	pos, err := p.store.Load(ctx, p.pool, w.tp)
	if err != nil {
		return pos, err
	}
	switch {
	case pos.Token > w.pos.Token:
		return pos, fmt.Errorf("%s: token %d, now %d: %w", w.tp, w.pos.Token, pos.Token, offsets.ErrFenced)
	case pos.Token < w.pos.Token: // the database lost w's claim (no row: token 0)
		member, gen := w.cl.GroupMetadata()
		owner := fmt.Sprintf("%s member=%s generation=%d", p.cfg.InstanceName, member, gen)
		var claimed offsets.Position
		err := p.claimTx(ctx, func(tx pgx.Tx) (err error) {
			claimed, err = p.store.Reclaim(ctx, tx, owner, w.pos, offsets.TokenFloor(gen))
			return err
		})
		if err != nil {
			return pos, err
		}
		w.log.Warn("claimed the partition again: the database had lost this owner's claim", "stored_token", pos.Token,
			"lost_token", w.pos.Token, "token", claimed.Token)
		pos = claimed
	}
	if !pos.Known {
		// As at an assignment: Kafka's committed offset, unless kafkapg made it.
		at := kgo.NewOffset().AtStart()
		if c, ok := w.cl.CommittedOffsets()[w.tp.Topic][w.tp.Partition]; ok && c.Offset >= 0 {
			at = kgo.NewOffset().At(c.Offset)
		}
		claims, err := p.resolveStarts(ctx, w.cl, map[string]map[int32]kgo.Offset{w.tp.Topic: {w.tp.Partition: at}}, []offsets.Position{pos})
		if err != nil {
			return pos, err
		}
		pos = claims[0]
	}
	return pos, nil
}

// claimAssigned runs when partitions are assigned, before fetching starts (AdjustFetchOffsetsFn).
// It claims them in Postgres, fencing any previous owner, starts a worker per partition, and
// makes fetching start at the stored positions. While Postgres is unreachable it retries; the
// partitions wait, nothing is fetched.
func (p *Processor) claimAssigned(ctx context.Context, assigned map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
	cl := p.client.Load()
	var parts []offsets.Partition
	for t, ps := range assigned {
		for part := range ps {
			parts = append(parts, offsets.Partition{Topic: t, Partition: part})
		}
	}
	offsets.SortPartitions(parts)
	member, gen := cl.GroupMetadata()
	owner := fmt.Sprintf("%s member=%s generation=%d", p.cfg.InstanceName, member, gen)

	var claims []offsets.Position
	for failures := 1; ; failures++ {
		var err error
		claims, err = p.claim(ctx, owner, offsets.TokenFloor(gen), parts)
		if err == nil {
			claims, err = p.resolveStarts(ctx, cl, assigned, claims)
		}
		if err == nil {
			break
		}
		if errors.Is(err, errHeld) && p.endStaleHolders(ctx, parts) {
			failures--
			continue // at once: what held the rows is gone
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("claim assigned partitions: %w", ctx.Err())
		}
		p.metrics.infraRetries.Inc()
		d := p.backoff.Delay(failures)
		p.log.Warn("cannot claim assigned partitions; retrying", "err", err, "retry_in", d, "partitions", len(parts))
		if !backoff.Sleep(ctx, nil, d) {
			return nil, fmt.Errorf("claim assigned partitions: %w", ctx.Err())
		}
	}

	p.mu.Lock()
	for _, pos := range claims {
		if old := p.workers[pos.TP()]; old != nil {
			// Not expected: revoke stops workers. Stop it now; its next transaction is fenced.
			old.stop()
		}
		p.rememberStart(pos)
		w := newWorker(p, cl, pos)
		p.workers[pos.TP()] = w
		go w.run()
		if pos.Known {
			assigned[pos.Topic][pos.Partition] = kgo.NewOffset().At(pos.Next).WithEpoch(-1)
		}
		from := "kafka position (claimed by another owner since)"
		if pos.Known {
			from = fmt.Sprint(pos.Next)
		}
		p.log.Info("partition claimed", "topic", pos.Topic, "partition", pos.Partition, "token", pos.Token, "from_offset", from)
	}
	p.nWorkers.Store(int32(len(p.workers)))
	p.metrics.assigned.Set(float64(len(p.workers)))
	p.mu.Unlock()
	return assigned, nil
}

// claimWait is how long a claim waits for the rows of its partitions before it looks for a frozen
// previous owner's transaction that holds them (see endStaleHolders).
const claimWait = time.Second

// errHeld means a claim waited claimWait for rows another transaction holds.
var errHeld = errors.New("the partitions' rows are held by another transaction")

// claim claims parts, each with a token of at least floor (offsets.TokenFloor of the generation
// that assigned them), in one transaction that waits at most claimWait for their rows.
func (p *Processor) claim(ctx context.Context, owner string, floor int64, parts []offsets.Partition) ([]offsets.Position, error) {
	var claims []offsets.Position
	err := p.claimTx(ctx, func(tx pgx.Tx) (err error) {
		claims, err = p.store.ClaimAbove(ctx, tx, owner, floor, parts)
		return err
	})
	return claims, err
}

// claimTx runs fn, a claim, in a transaction that waits at most claimWait for rows (errHeld).
func (p *Processor) claimTx(ctx context.Context, fn func(pgx.Tx) error) error {
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL lock_timeout = %d", claimWait.Milliseconds())); err != nil {
			return err
		}
		return fn(tx)
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
		return fmt.Errorf("%w: %w", errHeld, err)
	}
	return err
}

// endStaleHolders ends the transactions of a previous owner that hold parts' rows while waiting
// for their client (a process that froze or lost its network mid-batch). Without it, such an owner
// would hold up the claim of every partition assigned with its own until Postgres's
// idle-in-transaction timeout (TxIdleTimeout) ended it. It reports whether it ended any.
func (p *Processor) endStaleHolders(ctx context.Context, parts []offsets.Partition) bool {
	held, err := p.store.EndStaleHolders(ctx, p.pool, parts)
	if err != nil {
		p.log.Warn("cannot end the transactions that hold the assigned partitions' rows; waiting for them (TxIdleTimeout bounds it)", "err", err)
		return false
	}
	ended := false
	for _, h := range held {
		p.log.Warn("ended a stale transaction of a previous owner that held a partition's row (frozen or cut off mid-batch); its batch is rolled back and redone here",
			"topic", h.Partition.Topic, "partition", h.Partition.Partition, "backend_pid", h.PID, "ended", h.Ended)
		ended = ended || h.Ended
	}
	return ended
}

// resolveStarts gives the claimed partitions that have no position in Postgres yet one, and stores
// it, so that wherever and whenever the partition is assigned next, it starts from the same offset:
// Kafka's committed offset if the group has one from another consumer (the service the group ran
// before kafkapg), otherwise the start of the log, or its end for a source topic with
// StartOffset = StartLatest. A retry tier always starts from the beginning: its records must never
// be skipped.
//
// An offset that kafkapg itself committed to Kafka is never taken for a start: Postgres having no
// position for such a partition means the database forgot it (see kafkacommit.go), and the
// partition starts again where it was first started, as its commit's metadata says (the start of
// the log if it says nothing, or if retention has deleted the records from there).
func (p *Processor) resolveStarts(ctx context.Context, cl *kgo.Client, assigned map[string]map[int32]kgo.Offset, claims []offsets.Position) ([]offsets.Position, error) {
	var starts []offsets.Position
	topics := map[string]bool{}
	committed := false
	for _, pos := range claims {
		if !pos.Known {
			starts = append(starts, pos)
			topics[pos.Topic] = true
			// ConsumeResetOffset is AtStart (-2): anything else is an offset committed to Kafka.
			committed = committed || assigned[pos.Topic][pos.Partition].EpochOffset().Offset >= 0
		}
	}
	if len(starts) == 0 {
		return claims, nil
	}
	adm := kadm.NewClient(cl)
	names := slices.Sorted(maps.Keys(topics))
	first, err := adm.ListStartOffsets(ctx, names...)
	if err == nil {
		err = first.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("list start offsets: %w", err)
	}
	var end kadm.ListedOffsets
	if p.cfg.StartOffset == StartLatest {
		if end, err = adm.ListEndOffsets(ctx, names...); err == nil {
			err = end.Error()
		}
		if err != nil {
			return nil, fmt.Errorf("list end offsets: %w", err)
		}
	}
	// The commits' metadata says whether kafkapg made them: the group's offsets again, with it.
	var metas kadm.OffsetResponses
	if committed {
		if metas, err = adm.FetchOffsetsForTopics(ctx, p.cfg.Group, names...); err == nil {
			err = metas.Error()
		}
		if err != nil {
			return nil, fmt.Errorf("fetch committed offsets: %w", err)
		}
	}
	for i, pos := range starts {
		logStart, ok := first.Lookup(pos.Topic, pos.Partition)
		if !ok {
			return nil, fmt.Errorf("no offsets listed for %s", pos.TP())
		}
		starts[i].Next = logStart.Offset
		if _, tier := p.tierOf[pos.Topic]; !tier && p.cfg.StartOffset == StartLatest {
			o, ok := end.Lookup(pos.Topic, pos.Partition)
			if !ok {
				return nil, fmt.Errorf("no offsets listed for %s", pos.TP())
			}
			starts[i].Next = o.Offset
		}
		c := assigned[pos.Topic][pos.Partition].EpochOffset().Offset
		if c < 0 {
			continue
		}
		// Who made the commit is in its metadata, read again: a commit that fetch does not
		// show cannot be told from kafkapg's, so it is not taken for a start either way.
		r, ok := metas.Lookup(pos.Topic, pos.Partition)
		if !ok || r.Err != nil {
			return nil, fmt.Errorf("fetch committed offsets: %s not in the answer (%v)", pos.TP(), r.Err)
		}
		meta := r.Metadata
		if c = r.At; c < 0 {
			continue
		}
		ours, firstStart, known := parseCommitMeta(meta)
		if !ours {
			starts[i].Next = c
			continue
		}
		from := logStart.Offset
		if known && firstStart > from {
			from = firstStart
		}
		starts[i].Next = from
		p.metrics.forgotten.Inc()
		p.log.Warn("postgres has no position for this partition, but kafka holds an offset kafkapg committed for it: the database forgot it "+
			"(restored from a backup, or failed over to a standby that had not received it); starting again where it was first started, "+
			"to apply again what the database lost", "topic", pos.Topic, "partition", pos.Partition, "kafka_committed", c,
			"first_started_at", fmtStart(firstStart, known), "log_start", logStart.Offset, "from_offset", from)
		if isConsumerMemberID(meta) {
			p.log.Warn("the commit's metadata is a bare consumer-protocol member id: kafkapg's release before this one committed so, and so does "+
				"any other franz-go consumer under the consumer protocol; taken for kafkapg's, so the partition starts again at the start of the log. "+
				"If the group was migrated to kafkapg from another franz-go service, the records from from_offset to kafka_committed, which that service consumed, are applied again",
				"topic", pos.Topic, "partition", pos.Partition, "metadata", meta, "kafka_committed", c, "from_offset", from)
		}
		if known && firstStart < logStart.Offset {
			p.log.Error("records the database forgot were deleted by retention before they could be applied again: they are lost",
				"topic", pos.Topic, "partition", pos.Partition, "first_started_at", firstStart, "log_start", logStart.Offset, "lost_records", logStart.Offset-firstStart)
		}
	}
	stored, err := p.store.SetStart(ctx, p.pool, starts)
	if err != nil {
		return nil, err
	}
	byTP := map[offsets.Partition]offsets.Position{}
	for _, pos := range stored {
		if pos.Known {
			byTP[pos.TP()] = pos
		}
	}
	out := slices.Clone(claims)
	for i, pos := range out {
		if st, ok := byTP[pos.TP()]; ok {
			out[i] = st
		}
	}
	return out, nil
}

// fmtStart formats the start a commit's metadata recorded.
func fmtStart(start int64, known bool) string {
	if !known {
		return "not recorded (the start of the log)"
	}
	return strconv.FormatInt(start, 10)
}

func (p *Processor) onRevoked(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
	ws := p.removeWorkers(revoked)
	if len(ws) == 0 {
		return
	}
	p.metrics.rebalances.WithLabelValues("revoked").Inc()
	p.stopWorkers(stoppers(ws), p.cfg.HandoffTimeout)
	if err := cl.CommitMarkedOffsets(ctx); err != nil {
		p.log.Warn("kafka offset commit on revoke failed (advisory only)", "err", err)
	}
	cl.ResumeFetchPartitions(revoked)
	p.log.Info("partitions revoked", "partitions", revoked)
}

func (p *Processor) onLost(_ context.Context, cl *kgo.Client, lost map[string][]int32) {
	if len(lost) == 0 {
		return // called on every failed join attempt while the broker is unreachable
	}
	ws := p.removeWorkers(lost)
	p.metrics.rebalances.WithLabelValues("lost").Inc()
	p.joined.Store(false)
	// Whatever the workers commit from now on would be fenced anyway once the partitions are
	// claimed elsewhere; do not wait for them.
	p.stopWorkers(stoppers(ws), 0)
	cl.ResumeFetchPartitions(lost)
	p.log.Warn("partitions lost (session expired or fatal group error)", "partitions", lost)
}

// partitionShare is how much of the buffer budget one partition may fill before its fetching
// pauses: an equal share among the partitions that hold records, and never more than a quarter
// (with four partitions or more), so that a partition that filled the budget alone and then
// cannot move on leaves most of it to the others.
//
// Idle partitions (most retry-tier partitions, most of the time) reserve nothing. Counting them
// cut a draining partition's share to a fraction of one fetch; every pause then drops the fetch
// franz-go has buffered for the partition, to be fetched and decoded again on resume, which cost
// a COPY handler 30 % of its throughput (BenchmarkCopy).
func (p *Processor) partitionShare() int64 {
	return p.buf.share(max(int(p.busy.Load()), min(int(p.nWorkers.Load()), maxShareDivisor)))
}

// maxShareDivisor: one partition holds at most 1/maxShareDivisor of the buffer budget.
const maxShareDivisor = 4

// worker returns the worker of tp, or nil.
func (p *Processor) worker(tp offsets.Partition) *worker {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.workers[tp]
}

// removeWorkers removes and returns the workers of the given partitions (all if nil).
func (p *Processor) removeWorkers(which map[string][]int32) []*worker {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*worker
	if which == nil {
		for tp, w := range p.workers {
			out = append(out, w)
			delete(p.workers, tp)
		}
	} else {
		for t, ps := range which {
			for _, part := range ps {
				tp := offsets.Partition{Topic: t, Partition: part}
				if w := p.workers[tp]; w != nil {
					out = append(out, w)
					delete(p.workers, tp)
				}
			}
		}
	}
	p.nWorkers.Store(int32(len(p.workers)))
	p.metrics.assigned.Set(float64(len(p.workers)))
	return out
}

// stopper is what stopWorkers stops: a partition worker or the heldApplier.
type stopper interface {
	stop()                     // finish the transaction in flight, start nothing new
	abandon()                  // cancel the transaction in flight
	finished() <-chan struct{} // closed once it has stopped
	describe() []any           // log attributes naming it
}

// stopWorkers stops ss together: each finishes its transaction in flight for up to grace, then
// has it cancelled; one that still has not stopped a second later (a handler ignoring its
// context) is left behind with a warning: its transaction will be fenced or rolled back.
func (p *Processor) stopWorkers(ss []stopper, grace time.Duration) {
	if len(ss) == 0 {
		return
	}
	for _, s := range ss {
		s.stop()
	}
	allDone := make(chan struct{})
	go func() {
		for _, s := range ss {
			<-s.finished()
		}
		close(allDone)
	}()
	select {
	case <-allDone:
		return
	case <-time.After(grace):
	}
	for _, s := range ss {
		s.abandon()
	}
	select {
	case <-allDone:
		return
	case <-time.After(time.Second):
	}
	for _, s := range ss {
		select {
		case <-s.finished():
		default:
			p.log.Warn("did not stop (handler ignoring its context?); leaving it behind, its transaction will be fenced or rolled back", s.describe()...)
		}
	}
}

func stoppers(ws []*worker) []stopper {
	out := make([]stopper, len(ws), len(ws)+1)
	for i, w := range ws {
		out[i] = w
	}
	return out
}
