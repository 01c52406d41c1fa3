// Package kafkacluster is a test rig: it attaches to the local three-node Apache Kafka KRaft
// cluster that `scripts/kafka.sh cluster start` runs (one JVM per node, each broker and
// controller in one) and injects broker faults into it for the chaos suite and integration
// tests.
//
// The faults are those a real deployment sees:
//
//   - Kill: SIGKILL, an unclean crash. Leaders on the node move only once the controller
//     fences it (broker.session.timeout.ms, 9 s by default).
//   - Stop: SIGTERM, a controlled shutdown. The node hands its leaderships over before it exits.
//   - Freeze: SIGSTOP, a node that hangs (a long GC pause, a stalled disk, a frozen VM). Its
//     sockets still accept connections but nothing answers; it leaves the ISR after
//     replica.lag.time.max.ms (10 s in this cluster) and is fenced after the broker session
//     timeout. Thaw (SIGCONT) lets it run on from where it stopped.
//   - Start: the node's JVM is started again on its existing data (`scripts/kafka.sh node N
//     start`), and waits until that broker serves requests.
//   - RollingRestart: a controlled restart of every node in turn, waiting for every partition to
//     be fully in sync before the next (`scripts/kafka.sh cluster rolling-restart`).
//
// Signals go straight to the JVM whose pid the script wrote in the node's pid file; Start and
// RollingRestart run the script, which knows how to launch a node. Queries (Leader, Partition,
// Describe, WaitInSync) bound every request by a short timeout and are seeded with every node,
// so a dead or frozen broker costs a timeout, never a hang.
//
// What it does not do: it does not start or wipe the cluster (the script does), it does not
// touch any broker it did not find in the state directory's pid files, and it promises nothing
// about data on a node beyond what Kafka itself promises: a node that was killed restarts on
// whatever its log held.
//
// The cluster keeps Apache Kafka's own defaults for user topics (default.replication.factor=1,
// min.insync.replicas=1), so a test on it shows whether the code under test chooses the
// replication of its topics itself; only Kafka's internal topics are replicated three ways.
package kafkacluster
