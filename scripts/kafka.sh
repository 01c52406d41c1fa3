#!/usr/bin/env bash
# Start/stop a real single-node Apache Kafka broker (KRaft, broker+controller in one
# JVM) for integration tests, or a three-node KRaft cluster for fault injection,
# without Docker and without the Kafka download site: the broker's jars come from
# Maven Central via scripts/kafka/pom.xml.
#
# Usage: scripts/kafka.sh start|stop|status|restart|fetch|log
#        scripts/kafka.sh cluster start|stop|status|brokers|rolling-restart
#        scripts/kafka.sh node N start|stop|kill|freeze|thaw|pid|log
#
# Single broker:
#
#   start    fetch jars (cached), wipe the state dir, format storage, start the broker
#            in the background and wait until it really serves requests (metadata and
#            a group coordinator, checked by internal/rig/kafkaready).
#   stop     stop the broker started by `start` (TERM, then KILL after 15 s). Ok if not running.
#   status   exit 0 if the broker answers requests, 1 otherwise.
#   restart  stop, then start.
#   fetch    only download the jars into the cache.
#   log      print the last 100 lines of the broker log.
#
# Cluster (three nodes, each broker+controller in one JVM, in KAFKA_CLUSTER_DIR/node-N/):
#   cluster start    wipe the cluster state dir, format the three nodes with one cluster id,
#                    start them in the background and wait until each broker serves requests
#                    and all three are registered. Prints the bootstrap list.
#   cluster stop     stop all nodes (TERM, then KILL after 15 s). Ok if not running.
#   cluster status   show each node's process; exit 0 if all three brokers serve requests.
#   cluster brokers  print the bootstrap list (comma separated), e.g. for KAFKA_BROKERS.
#   cluster rolling-restart
#                    for each node in turn: wait until every partition of every topic is in
#                    sync (ISR == replicas), stop it (controlled shutdown), start it again;
#                    then wait until all are in sync again.
#   node N start     start node N (1-3) on its existing data and wait until that broker serves
#                    requests and is back in the cluster's metadata. Ok if already running.
#   node N stop      SIGTERM: controlled shutdown (leaders move first); waits up to
#                    KAFKA_NODE_STOP_TIMEOUT seconds for the JVM to exit.
#   node N kill      SIGKILL (an unclean crash); waits for the JVM to exit.
#   node N freeze    SIGSTOP (a hung broker: it accepts connections, answers nothing, drops out
#                    of the ISR after replica.lag.time.max.ms=10s and is fenced after ~9s).
#   node N thaw      SIGCONT: the frozen node runs on.
#   node N pid       print the node's JVM pid (exit 1 if it is not running).
#   node N log       print the last 100 lines of the node's log.
# User topics keep Apache Kafka's own defaults (default.replication.factor=1,
# min.insync.replicas=1): code under test must choose its topics' replication itself.
# Internal topics (__consumer_offsets, __transaction_state, share state) have 3 replicas.
#
# Environment (all optional):
#   KAFKAPG_CACHE          jar cache root          (default $HOME/.cache/kafkapg)
#   KAFKA_STATE_DIR        data, log, pid file     (default /tmp/kafkapg-kafka; wiped by start)
#   KAFKA_PORT             PLAINTEXT listener      (default 9092, on 127.0.0.1)
#   KAFKA_CONTROLLER_PORT  KRaft controller        (default 9093, on 127.0.0.1)
#   KAFKA_CHAOS_PORT       second PLAINTEXT listener for `make chaos` (default 9094, on 127.0.0.1);
#                          it advertises KAFKA_CHAOS_ADVERTISED (default 127.0.0.1:19094), where
#                          the chaos suite puts a fault-injecting proxy in front of it
#   KAFKA_START_TIMEOUT    seconds to wait for a broker, node or cluster to serve (default 120)
#   KAFKA_STOCK_GROUP_SETTINGS  1: `start` leaves the group settings at Apache Kafka's defaults
#                          (consumer protocol: session timeout 45 s within 45-60 s, heartbeat
#                          5 s within 5-15 s; classic: minimum session 6 s, first join delayed
#                          3 s) instead of lowering them for fast rebalances; for the tests of
#                          what a stock broker accepts (processor/stockbroker_test.go)
#   KAFKA_CLUSTER_DIR      cluster data, logs, pid files (default /tmp/kafkapg-kafka-cluster;
#                          wiped by `cluster start`)
#   KAFKA_CLUSTER_PORT_BASE        cluster PLAINTEXT listeners: node N on base+N-1 (default 9192)
#   KAFKA_CLUSTER_CONTROLLER_BASE  cluster KRaft controllers: node N on base+N-1 (default 9292)
#   KAFKA_SYNC_TIMEOUT     seconds `cluster rolling-restart` waits for partitions to be in sync
#                          (default 300)
#   KAFKA_NODE_STOP_TIMEOUT  seconds `node N stop` waits for a controlled shutdown (default 60)
#   KAFKA_HEAP_OPTS        JVM heap, per JVM       (default "-Xms256m -Xmx512m")
#   JAVA                   java binary             (default: $JAVA_HOME/bin/java or java on PATH; needs 17+)
#   MVN                    maven binary            (default: mvn on PATH)
#
# Tests then connect to 127.0.0.1:${KAFKA_PORT}, or to the cluster's bootstrap list
# (`scripts/kafka.sh cluster brokers`); internal/rig/kafkacluster drives the cluster's faults from Go.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
REPO_ROOT="$(cd -- "$SCRIPT_DIR/.." && pwd -P)"

KAFKA_VERSION=4.1.2
POM="$SCRIPT_DIR/kafka/pom.xml"
LOG4J_CONF="$SCRIPT_DIR/kafka/log4j2.properties"

CACHE_ROOT="${KAFKAPG_CACHE:-${HOME:-/tmp}/.cache/kafkapg}"
KAFKA_HOME="$CACHE_ROOT/kafka-$KAFKA_VERSION"
LIBS="$KAFKA_HOME/libs"
MARKER="$LIBS/.complete"

STATE_DIR="${KAFKA_STATE_DIR:-/tmp/kafkapg-kafka}"
PORT="${KAFKA_PORT:-9092}"
CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-9093}"
CHAOS_PORT="${KAFKA_CHAOS_PORT:-9094}"
CHAOS_ADVERTISED="${KAFKA_CHAOS_ADVERTISED:-127.0.0.1:19094}"
START_TIMEOUT="${KAFKA_START_TIMEOUT:-120}"
HEAP_OPTS="${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m}"
STOCK_GROUP_SETTINGS="${KAFKA_STOCK_GROUP_SETTINGS:-0}"
[[ "$STOCK_GROUP_SETTINGS" =~ ^[01]$ ]] || {
	printf 'kafka.sh: ERROR: KAFKA_STOCK_GROUP_SETTINGS=%s: want 1 or 0\n' "$STOCK_GROUP_SETTINGS" >&2
	exit 2
}

# Absolute and without symlinks: a node's JVM is recognised by its server.properties path.
CLUSTER_DIR="$(realpath -m -- "${KAFKA_CLUSTER_DIR:-/tmp/kafkapg-kafka-cluster}")"
CLUSTER_PORT_BASE="${KAFKA_CLUSTER_PORT_BASE:-9192}"
CLUSTER_CONTROLLER_BASE="${KAFKA_CLUSTER_CONTROLLER_BASE:-9292}"
CLUSTER_NODES=(1 2 3)
SYNC_TIMEOUT="${KAFKA_SYNC_TIMEOUT:-300}"
NODE_STOP_TIMEOUT="${KAFKA_NODE_STOP_TIMEOUT:-60}"
CLUSTER_READY_BIN="$CLUSTER_DIR/kafkaready"

PID_FILE="$STATE_DIR/kafka.pid"
LOG_FILE="$STATE_DIR/kafka.log"
READY_BIN="$STATE_DIR/kafkaready"

say() { printf 'kafka.sh: %s\n' "$*" >&2; }
die() {
	printf '\nkafka.sh: ERROR: %s\n\n' "$*" >&2
	exit 1
}

java_bin() {
	if [[ -n "${JAVA:-}" ]]; then
		echo "$JAVA"
	elif [[ -n "${JAVA_HOME:-}" && -x "$JAVA_HOME/bin/java" ]]; then
		echo "$JAVA_HOME/bin/java"
	elif command -v java >/dev/null 2>&1; then
		command -v java
	else
		die "java not found (Kafka $KAFKA_VERSION needs Java 17+): apt-get install -y openjdk-17-jre-headless, or set JAVA_HOME"
	fi
}

pom_sum() { cksum <"$POM" | awk '{print $1 "-" $2}'; }

jars_ready() { [[ -f "$MARKER" && "$(cat "$MARKER" 2>/dev/null)" == "$(pom_sum)" ]]; }

# Copy Kafka's runtime dependencies (plus the SLF4J->log4j2 binding) into $LIBS.
# Runs against a copy of the pom outside the repo so Maven leaves nothing behind in
# the work tree; writes into a temp dir and renames, so an interrupted download is
# never mistaken for a complete one. The marker holds the pom's checksum.
fetch_jars() {
	if jars_ready; then
		return 0
	fi
	local mvn="${MVN:-mvn}"
	command -v "$mvn" >/dev/null 2>&1 || die "maven ($mvn) not found: apt-get install -y maven (needs Maven Central access)"
	mkdir -p "$KAFKA_HOME"
	local work
	work="$(mktemp -d "$KAFKA_HOME/fetch.XXXXXX")"
	cp "$POM" "$work/pom.xml"
	say "fetching Kafka $KAFKA_VERSION jars from Maven Central into $LIBS (first time only; may take minutes)"
	local t0=$SECONDS
	# Batch mode, no stdin: never prompts. Uses ~/.m2 (and its settings.xml) as usual.
	# Output goes to a file (Maven 3.8 prints stray ANSI resets even with -B -q) and is
	# shown only on failure.
	if ! (cd "$work" && "$mvn" -B -q -ntp -f "$work/pom.xml" \
		dependency:copy-dependencies \
		-DincludeScope=runtime \
		-DoutputDirectory="$work/libs" </dev/null >"$work/mvn.log" 2>&1); then
		sed 's/\x1b\[[0-9;]*m//g' "$work/mvn.log" >&2 || true
		rm -rf "$work"
		die "mvn dependency:copy-dependencies failed (output above); is Maven Central reachable?"
	fi
	compgen -G "$work/libs/kafka_2.13-$KAFKA_VERSION.jar" >/dev/null ||
		{ rm -rf "$work"; die "maven finished but kafka_2.13-$KAFKA_VERSION.jar is missing from $work/libs"; }
	compgen -G "$work/libs/log4j-slf4j-impl-*.jar" >/dev/null ||
		{ rm -rf "$work"; die "maven finished but log4j-slf4j-impl is missing from $work/libs"; }
	rm -rf "$LIBS"
	mv "$work/libs" "$LIBS"
	rm -rf "$work"
	pom_sum >"$MARKER"
	say "fetched $(find "$LIBS" -name '*.jar' | wc -l) jars in $((SECONDS - t0))s"
}

# Pid of the broker we started, if it is still alive (and still a Kafka JVM).
running_pid() {
	[[ -f "$PID_FILE" ]] || return 1
	local pid
	pid="$(cat "$PID_FILE" 2>/dev/null || true)"
	[[ "$pid" =~ ^[0-9]+$ ]] || return 1
	kill -0 "$pid" 2>/dev/null || return 1
	if [[ -r "/proc/$pid/cmdline" ]] && ! tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'kafka\.Kafka'; then
		return 1 # pid was recycled by something else
	fi
	echo "$pid"
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# build_ready_helper [OUTPUT]: build internal/rig/kafkaready (default output $READY_BIN).
build_ready_helper() {
	local out="${1:-$READY_BIN}"
	command -v go >/dev/null 2>&1 || die "go not found; it is needed to build internal/rig/kafkaready"
	(cd "$REPO_ROOT" && go build -o "$out" ./internal/rig/kafkaready) ||
		die "could not build internal/rig/kafkaready"
}

# show_log_tail [FILE [LINES]]: print the end of a broker log (default: the single broker's).
show_log_tail() {
	local file="${1:-$LOG_FILE}" lines="${2:-50}"
	if [[ -f "$file" ]]; then
		printf '\n----- last %s lines of %s -----\n' "$lines" "$file" >&2
		tail -n "$lines" "$file" >&2 || true
		printf -- '----- end of broker log -----\n' >&2
	fi
}

# A Kafka cluster id is a random 16-byte UUID in URL-safe base64 without padding
# (what `kafka.tools.StorageTool random-uuid` prints); making it here saves a JVM start.
# Like Kafka's Uuid.randomUuid, avoid ids that start with '-'.
random_cluster_id() {
	local id
	while :; do
		id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
		[[ ${#id} -eq 22 && "$id" != -* ]] && break
	done
	echo "$id"
}

write_properties() {
	cat >"$STATE_DIR/server.properties" <<EOF
# Written by scripts/kafka.sh for integration tests. Not for production.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT,CHAOS://127.0.0.1:$CHAOS_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT,CHAOS://$CHAOS_ADVERTISED
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,CHAOS:PLAINTEXT
log.dirs=$STATE_DIR/data

num.partitions=1
default.replication.factor=1
auto.create.topics.enable=false
delete.topic.enable=true

# Internal topics: one replica, few partitions (fewer partitions = faster startup).
offsets.topic.replication.factor=1
offsets.topic.num.partitions=3
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=3
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
EOF
	if [[ "$STOCK_GROUP_SETTINGS" == 1 ]]; then
		printf '\n%s\n' "# Group settings: Apache Kafka's defaults (KAFKA_STOCK_GROUP_SETTINGS=1)." >>"$STATE_DIR/server.properties"
		return
	fi
	cat >>"$STATE_DIR/server.properties" <<EOF

# Fast group rebalances in tests (classic and KIP-848 consumer groups).
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
group.consumer.min.session.timeout.ms=1000
group.consumer.min.heartbeat.interval.ms=100
group.consumer.heartbeat.interval.ms=1000
EOF
}

cmd_start() {
	local t0=$SECONDS pid
	if pid="$(running_pid)"; then
		say "stopping the broker already running from $STATE_DIR (pid $pid)"
		cmd_stop
		t0=$SECONDS
	fi
	port_in_use "$PORT" && die "127.0.0.1:$PORT is already in use by another process; stop it or set KAFKA_PORT"
	port_in_use "$CONTROLLER_PORT" && die "127.0.0.1:$CONTROLLER_PORT is already in use by another process; stop it or set KAFKA_CONTROLLER_PORT"

	local java
	java="$(java_bin)"
	fetch_jars
	local t_fetched=$SECONDS

	case "$STATE_DIR" in "" | / | "$HOME") die "refusing to wipe KAFKA_STATE_DIR=$STATE_DIR" ;; esac
	rm -rf "$STATE_DIR"
	mkdir -p "$STATE_DIR/data"
	write_properties

	local cp="$LIBS/*" # expanded by the JVM, not the shell
	local jvm_common=(-Djava.awt.headless=true "-Dlog4j2.configurationFile=$LOG4J_CONF" "-Dkafka.logs.dir=$STATE_DIR")
	local cluster_id
	cluster_id="$(random_cluster_id)"
	if ! "$java" "${jvm_common[@]}" -cp "$cp" kafka.tools.StorageTool format \
		-t "$cluster_id" -c "$STATE_DIR/server.properties" >>"$LOG_FILE" 2>&1; then
		show_log_tail
		die "formatting Kafka storage in $STATE_DIR/data failed"
	fi

	# shellcheck disable=SC2086 # HEAP_OPTS is a list of JVM flags
	nohup "$java" $HEAP_OPTS -XX:+UseG1GC -XX:MaxGCPauseMillis=20 "${jvm_common[@]}" \
		-cp "$cp" kafka.Kafka "$STATE_DIR/server.properties" \
		</dev/null >>"$LOG_FILE" 2>&1 &
	pid=$!
	echo "$pid" >"$PID_FILE"
	local t_launched=$SECONDS
	say "broker launched (pid $pid, cluster id $cluster_id, log $LOG_FILE); waiting up to ${START_TIMEOUT}s for it to serve requests"

	# Build the readiness helper while the JVM boots.
	build_ready_helper

	local remaining=$((START_TIMEOUT - (SECONDS - t_launched)))
	((remaining >= 10)) || remaining=10 # a slow first `go build` must not starve the wait
	"$READY_BIN" -brokers "127.0.0.1:$PORT" -timeout "${remaining}s" -quiet &
	local ready_pid=$!
	while kill -0 "$ready_pid" 2>/dev/null; do
		if ! kill -0 "$pid" 2>/dev/null; then
			kill "$ready_pid" 2>/dev/null || true
			wait "$ready_pid" 2>/dev/null || true
			local status=0
			wait "$pid" 2>/dev/null || status=$?
			rm -f "$PID_FILE"
			show_log_tail
			die "the Kafka broker (pid $pid) exited during startup (exit status $status); see $LOG_FILE"
		fi
		sleep 0.2
	done
	if ! wait "$ready_pid"; then
		show_log_tail
		cmd_stop || true
		die "the Kafka broker did not serve requests within ${START_TIMEOUT}s; see $LOG_FILE"
	fi
	echo "kafka ready at 127.0.0.1:$PORT$([[ "$STOCK_GROUP_SETTINGS" == 0 ]] || echo ' with stock group settings') (pid $pid, took $((SECONDS - t0))s: jars $((t_fetched - t0))s, broker $((SECONDS - t_launched))s)"
}

cmd_stop() {
	local pid
	if ! pid="$(running_pid)"; then
		rm -f "$PID_FILE"
		say "no broker running from $STATE_DIR"
		return 0
	fi
	kill -TERM "$pid" 2>/dev/null || true
	local i
	for ((i = 0; i < 150; i++)); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$pid" 2>/dev/null; then
		say "broker (pid $pid) still running after 15s; sending KILL"
		kill -KILL "$pid" 2>/dev/null || true
		for ((i = 0; i < 50; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
	fi
	rm -f "$PID_FILE"
	say "broker (pid $pid) stopped"
}

cmd_status() {
	local pid
	if pid="$(running_pid)"; then
		say "broker process running (pid $pid)"
	else
		say "no broker process from $STATE_DIR"
	fi
	local ready=("$READY_BIN")
	if [[ ! -x "$READY_BIN" ]]; then
		command -v go >/dev/null 2>&1 || die "go not found; it is needed to run internal/rig/kafkaready"
		ready=(go run ./internal/rig/kafkaready)
	fi
	if (cd "$REPO_ROOT" && "${ready[@]}" -brokers "127.0.0.1:$PORT" -timeout 5s -quiet 2>/dev/null); then
		echo "kafka ready at 127.0.0.1:$PORT${pid:+ (pid $pid)}"
		return 0
	fi
	echo "kafka not ready at 127.0.0.1:$PORT"
	return 1
}

# ---------------------------------------------------------------------------
# Three-node cluster. Each node is a broker and a KRaft controller in one JVM, laid out in
# $CLUSTER_DIR/node-N/: server.properties, data/, kafka.log, kafka.pid. Commands on a running
# cluster read each node's ports from its server.properties, so they work whatever
# KAFKA_CLUSTER_PORT_BASE was when the cluster was started.

usage() {
	cat >&2 <<EOF
usage: $0 start|stop|status|restart|fetch|log
       $0 cluster start|stop|status|brokers|rolling-restart
       $0 node N start|stop|kill|freeze|thaw|pid|log    (N = 1, 2 or 3)
EOF
	exit 2
}

check_node_id() {
	[[ "$1" =~ ^[1-3]$ ]] || die "unknown node '$1': the cluster's nodes are 1, 2 and 3"
}

node_dir() { echo "$CLUSTER_DIR/node-$1"; }

# node_listener N NAME: host:port of listener NAME (PLAINTEXT, CONTROLLER) of node N, from its
# server.properties if it exists, else from the environment's port bases.
node_listener() {
	local n=$1 name=$2 props addr=""
	props="$(node_dir "$n")/server.properties"
	if [[ -f "$props" ]]; then
		addr="$(sed -n 's/^listeners=//p' "$props" | tr ',' '\n' | sed -n "s|^$name://||p" | head -n 1)"
	fi
	if [[ -z "$addr" ]]; then
		case "$name" in
		PLAINTEXT) addr="127.0.0.1:$((CLUSTER_PORT_BASE + n - 1))" ;;
		CONTROLLER) addr="127.0.0.1:$((CLUSTER_CONTROLLER_BASE + n - 1))" ;;
		esac
	fi
	echo "$addr"
}

node_addr() { node_listener "$1" PLAINTEXT; }

cluster_brokers() {
	local n list=()
	for n in "${CLUSTER_NODES[@]}"; do list+=("$(node_addr "$n")"); done
	local IFS=,
	echo "${list[*]}"
}

# node_pid N: print the pid of node N's JVM if it is alive (running or frozen). The JVM is
# recognised by kafka.Kafka and its own server.properties on its command line, so a recycled pid
# or another broker (the single one, another cluster) is never mistaken for it; a zombie has an
# empty command line.
node_pid() {
	local dir pid
	dir="$(node_dir "$1")"
	[[ -f "$dir/kafka.pid" ]] || return 1
	pid="$(cat "$dir/kafka.pid" 2>/dev/null || true)"
	[[ "$pid" =~ ^[0-9]+$ ]] || return 1
	[[ -r "/proc/$pid/cmdline" ]] || return 1
	local cmdline
	cmdline="$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null || true)"
	grep -qx 'kafka\.Kafka' <<<"$cmdline" || return 1
	grep -qxF "$dir/server.properties" <<<"$cmdline" || return 1
	echo "$pid"
}

# proc_stat PID: print "STATE THREADS STARTTIME" from /proc/PID/stat; 1 if there is no PID.
proc_stat() {
	local stat f
	stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
	[[ -n "$stat" ]] || return 1
	read -r -a f <<<"${stat##*) }" # comm may hold spaces: cut at the last ')'
	echo "${f[0]} ${f[17]} ${f[19]}" # fields 3 (state), 20 (num_threads), 22 (starttime)
}

# proc_state PID: the state letter of /proc/PID/stat (R, S, D, T, Z, ...), empty if gone.
proc_state() {
	local st
	st="$(proc_stat "$1")" || return 0
	echo "${st%% *}"
}

# proc_exited PID STARTTIME: true once process PID (started at STARTTIME) has exited completely.
# A JVM's main thread exits first and shows as a zombie with an empty command line while its
# other threads are still exiting and its sockets still open: only a zombie left with one
# thread (itself) is done. A different start time means the pid was reaped and reused.
proc_exited() {
	local st state threads start
	st="$(proc_stat "$1")" || return 0
	read -r state threads start <<<"$st"
	[[ "$start" == "$2" ]] || return 0
	[[ "$state" == [ZX] && "$threads" -le 1 ]]
}

node_frozen() {
	local pid
	pid="$(node_pid "$1")" || return 1
	[[ "$(proc_state "$pid")" == [Tt] ]]
}

# proc_start PID: the start time of process PID (to tell it from a later one with its pid).
proc_start() {
	local st
	st="$(proc_stat "$1")" || return 0
	echo "${st##* }"
}

# wait_gone PID STARTTIME SECONDS: wait until process PID has exited completely; 1 on timeout.
wait_gone() {
	local i
	for ((i = 0; i < $3 * 10; i++)); do
		proc_exited "$1" "$2" && return 0
		sleep 0.1
	done
	proc_exited "$1" "$2"
}

# wait_port_free PORT SECONDS: wait until nothing listens on 127.0.0.1:PORT; 1 on timeout.
wait_port_free() {
	local i
	for ((i = 0; i < $2 * 10; i++)); do
		port_in_use "$1" || return 0
		sleep 0.1
	done
	! port_in_use "$1"
}

write_node_properties() {
	local n=$1 dir voters="" m
	dir="$(node_dir "$n")"
	for m in "${CLUSTER_NODES[@]}"; do
		voters+="${voters:+,}$m@127.0.0.1:$((CLUSTER_CONTROLLER_BASE + m - 1))"
	done
	local port=$((CLUSTER_PORT_BASE + n - 1)) cport=$((CLUSTER_CONTROLLER_BASE + n - 1))
	cat >"$dir/server.properties" <<EOF
# Written by scripts/kafka.sh (cluster start) for fault-injection tests. Not for production.
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$dir/data

num.partitions=1
# default.replication.factor and min.insync.replicas are deliberately left at Apache Kafka's
# own defaults (1 and 1), which many real clusters keep: the tests must show that kafkapg
# chooses the replication of its topics itself.
auto.create.topics.enable=false
delete.topic.enable=true
controlled.shutdown.enable=true
# A follower that stops fetching (a frozen node) leaves the ISR after 10 s (Kafka's default: 30 s).
replica.lag.time.max.ms=10000

# Internal topics: three replicas, writes need two.
offsets.topic.replication.factor=3
offsets.topic.num.partitions=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
transaction.state.log.num.partitions=3
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2

# Fast group rebalances in tests (classic and KIP-848 consumer groups).
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
group.consumer.min.session.timeout.ms=1000
group.consumer.min.heartbeat.interval.ms=100
group.consumer.heartbeat.interval.ms=1000
EOF
}

# launch_node N JAVA: start node N's JVM in the background on its existing data dir.
launch_node() {
	local n=$1 java=$2 dir
	dir="$(node_dir "$n")"
	local cp="$LIBS/*" # expanded by the JVM, not the shell
	printf '\n===== %s: scripts/kafka.sh starts node %s =====\n' "$(date '+%F %T')" "$n" >>"$dir/kafka.log"
	# shellcheck disable=SC2086 # HEAP_OPTS is a list of JVM flags
	nohup "$java" $HEAP_OPTS -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
		"-Dlog4j2.configurationFile=$LOG4J_CONF" "-Dkafka.logs.dir=$dir" \
		-cp "$cp" kafka.Kafka "$dir/server.properties" \
		</dev/null >>"$dir/kafka.log" 2>&1 &
	echo "$!" >"$dir/kafka.pid"
}

ensure_cluster_ready_helper() {
	[[ -x "$CLUSTER_READY_BIN" ]] || build_ready_helper "$CLUSTER_READY_BIN"
}

show_node_logs() {
	local n
	for n in "$@"; do show_log_tail "$(node_dir "$n")/kafka.log" 30; done
}

# await_ready TIMEOUT WHAT "NODES" KAFKAREADY-ARGS...: run kafkaready with the args until it
# succeeds; fail (with the tails of the nodes' logs) if it times out or one of NODES exits.
await_ready() {
	local timeout=$1 what=$2 nodes=$3 n
	shift 3
	"$CLUSTER_READY_BIN" -timeout "${timeout}s" -quiet "$@" &
	local ready_pid=$!
	while kill -0 "$ready_pid" 2>/dev/null; do
		for n in $nodes; do
			if ! node_pid "$n" >/dev/null; then
				kill "$ready_pid" 2>/dev/null || true
				wait "$ready_pid" 2>/dev/null || true
				# The exit status is known only for a JVM this script launched (its child).
				local pid status=0 how=""
				pid="$(cat "$(node_dir "$n")/kafka.pid" 2>/dev/null || true)"
				if [[ "$pid" =~ ^[0-9]+$ ]]; then
					wait "$pid" 2>/dev/null || status=$?
					((status == 127)) || how=" (pid $pid, exit status $status)"
				fi
				show_node_logs "$n"
				die "node $n exited$how while waiting for $what; its log is $(node_dir "$n")/kafka.log (tail above)"
			fi
		done
		sleep 0.2
	done
	if ! wait "$ready_pid"; then
		# shellcheck disable=SC2086 # nodes is a list
		show_node_logs $nodes
		die "timed out after ${timeout}s waiting for $what (kafkaready's last error is above the logs)"
	fi
}

cmd_cluster_start() {
	local t0=$SECONDS n pid
	for n in "${CLUSTER_NODES[@]}"; do
		if node_pid "$n" >/dev/null; then
			say "stopping the cluster already running from $CLUSTER_DIR"
			cmd_cluster_stop
			t0=$SECONDS
			break
		fi
	done
	for n in "${CLUSTER_NODES[@]}"; do
		port_in_use $((CLUSTER_PORT_BASE + n - 1)) &&
			die "127.0.0.1:$((CLUSTER_PORT_BASE + n - 1)) (node $n's broker) is already in use by another process; stop it or set KAFKA_CLUSTER_PORT_BASE"
		port_in_use $((CLUSTER_CONTROLLER_BASE + n - 1)) &&
			die "127.0.0.1:$((CLUSTER_CONTROLLER_BASE + n - 1)) (node $n's controller) is already in use by another process; stop it or set KAFKA_CLUSTER_CONTROLLER_BASE"
	done

	local java
	java="$(java_bin)"
	fetch_jars
	local t_fetched=$SECONDS

	case "$CLUSTER_DIR" in "" | / | "$HOME") die "refusing to wipe KAFKA_CLUSTER_DIR=$CLUSTER_DIR" ;; esac
	rm -rf "$CLUSTER_DIR"
	for n in "${CLUSTER_NODES[@]}"; do
		mkdir -p "$(node_dir "$n")/data"
		write_node_properties "$n"
	done

	# Every node is formatted with the same cluster id and the static voter set of its
	# server.properties (no --standalone). The three formats run in parallel: each is a JVM start.
	local cluster_id cp="$LIBS/*" format_pids=()
	cluster_id="$(random_cluster_id)"
	for n in "${CLUSTER_NODES[@]}"; do
		"$java" -Djava.awt.headless=true "-Dlog4j2.configurationFile=$LOG4J_CONF" "-Dkafka.logs.dir=$(node_dir "$n")" \
			-cp "$cp" kafka.tools.StorageTool format -t "$cluster_id" -c "$(node_dir "$n")/server.properties" \
			>>"$(node_dir "$n")/kafka.log" 2>&1 &
		format_pids+=("$!")
	done
	local i failed=()
	for i in "${!format_pids[@]}"; do
		wait "${format_pids[$i]}" || failed+=("${CLUSTER_NODES[$i]}")
	done
	if ((${#failed[@]} > 0)); then
		show_node_logs "${failed[@]}"
		die "formatting the storage of node(s) ${failed[*]} in $CLUSTER_DIR failed (log tail above)"
	fi

	for n in "${CLUSTER_NODES[@]}"; do launch_node "$n" "$java"; done
	local t_launched=$SECONDS pids=()
	for n in "${CLUSTER_NODES[@]}"; do pids+=("$n:$(cat "$(node_dir "$n")/kafka.pid")"); done
	say "cluster launched (nodes ${pids[*]}, cluster id $cluster_id, logs $CLUSTER_DIR/node-N/kafka.log); waiting up to ${START_TIMEOUT}s for all three brokers to serve requests"

	build_ready_helper "$CLUSTER_READY_BIN" # while the JVMs boot

	local remaining=$((START_TIMEOUT - (SECONDS - t_launched)))
	((remaining >= 10)) || remaining=10
	if ! (await_ready "$remaining" "the cluster to serve requests with all three brokers registered" \
		"${CLUSTER_NODES[*]}" -brokers "$(cluster_brokers)" -each-seed -brokers-count ${#CLUSTER_NODES[@]}); then
		cmd_cluster_stop >/dev/null 2>&1 || true
		exit 1
	fi
	echo "kafka cluster ready at $(cluster_brokers) (nodes ${pids[*]}, took $((SECONDS - t0))s: jars $((t_fetched - t0))s, format $((t_launched - t_fetched))s, brokers $((SECONDS - t_launched))s)"
}

cmd_cluster_stop() {
	local n pid stopping=() starts=()
	for n in "${CLUSTER_NODES[@]}"; do
		if pid="$(node_pid "$n")"; then
			starts+=("$(proc_start "$pid")")
			kill -TERM "$pid" 2>/dev/null || true
			kill -CONT "$pid" 2>/dev/null || true # a frozen JVM handles no signal
			stopping+=("$n:$pid")
		fi
	done
	if ((${#stopping[@]} == 0)); then
		rm -f "$CLUSTER_DIR"/node-*/kafka.pid
		say "no cluster node running from $CLUSTER_DIR"
		return 0
	fi
	local t0=$SECONDS i np killed=()
	for i in "${!stopping[@]}"; do
		np="${stopping[$i]}"
		wait_gone "${np#*:}" "${starts[$i]}" $((15 - (SECONDS - t0) > 0 ? 15 - (SECONDS - t0) : 0)) && continue
		say "node ${np%%:*} (pid ${np#*:}) still running after 15s; sending KILL"
		kill -KILL "${np#*:}" 2>/dev/null || true
		killed+=("$i")
	done
	for i in ${killed[@]+"${killed[@]}"}; do
		np="${stopping[$i]}"
		wait_gone "${np#*:}" "${starts[$i]}" 5 || say "node ${np%%:*} (pid ${np#*:}) did not exit after KILL"
	done
	rm -f "$CLUSTER_DIR"/node-*/kafka.pid
	say "cluster stopped (nodes ${stopping[*]}, took $((SECONDS - t0))s)"
}

cmd_cluster_status() {
	local n pid
	for n in "${CLUSTER_NODES[@]}"; do
		if ! pid="$(node_pid "$n")"; then
			say "node $n ($(node_addr "$n")): not running"
		elif node_frozen "$n"; then
			say "node $n ($(node_addr "$n")): frozen (pid $pid)"
		else
			say "node $n ($(node_addr "$n")): running (pid $pid)"
		fi
	done
	ensure_cluster_ready_helper
	if "$CLUSTER_READY_BIN" -brokers "$(cluster_brokers)" -each-seed -brokers-count ${#CLUSTER_NODES[@]} \
		-timeout 5s -quiet; then
		echo "kafka cluster ready at $(cluster_brokers)"
		return 0
	fi
	echo "kafka cluster not ready at $(cluster_brokers)"
	return 1
}

# cluster_in_sync WHAT: wait until every broker lists all nodes and sees every partition in sync.
cluster_in_sync() {
	await_ready "$SYNC_TIMEOUT" "$1" "${CLUSTER_NODES[*]}" \
		-brokers "$(cluster_brokers)" -each-seed -brokers-count ${#CLUSTER_NODES[@]} -in-sync
}

cmd_cluster_rolling_restart() {
	local n t0=$SECONDS tn took=()
	for n in "${CLUSTER_NODES[@]}"; do
		node_pid "$n" >/dev/null || die "node $n is not running: a rolling restart needs the whole cluster (\`$0 node $n start\`)"
		! node_frozen "$n" || die "node $n is frozen: thaw it first (\`$0 node $n thaw\`)"
	done
	ensure_cluster_ready_helper
	for n in "${CLUSTER_NODES[@]}"; do
		tn=$SECONDS
		cluster_in_sync "every partition to be in sync before restarting node $n"
		say "rolling restart: restarting node $n"
		cmd_node_stop "$n" >&2
		cmd_node_start "$n" >&2
		took+=("node $n $((SECONDS - tn))s")
	done
	tn=$SECONDS
	cluster_in_sync "every partition to be in sync after restarting node ${CLUSTER_NODES[-1]}"
	took+=("final sync $((SECONDS - tn))s")
	local IFS=,
	echo "kafka cluster rolling restart done at $(cluster_brokers) (took $((SECONDS - t0))s:${took[*]/#/ })"
}

require_node_state() {
	local dir
	dir="$(node_dir "$1")"
	[[ -f "$dir/server.properties" && -d "$dir/data" ]] ||
		die "node $1 has no state in $dir: start the cluster first (\`$0 cluster start\`)"
}

cmd_node_start() {
	local n=$1 t0=$SECONDS pid dir
	dir="$(node_dir "$n")"
	require_node_state "$n"
	if pid="$(node_pid "$n")"; then
		node_frozen "$n" && die "node $n (pid $pid) is frozen: thaw it (\`$0 node $n thaw\`) rather than start it"
		say "node $n already running (pid $pid); checking that it serves requests"
	else
		local addr caddr
		addr="$(node_addr "$n")"
		caddr="$(node_listener "$n" CONTROLLER)"
		# A JVM that was just killed may still be closing its sockets.
		wait_port_free "${addr##*:}" 10 || die "$addr (node $n's broker) is already in use by another process"
		wait_port_free "${caddr##*:}" 10 || die "$caddr (node $n's controller) is already in use by another process"
		local java
		java="$(java_bin)"
		jars_ready || die "the Kafka jars in $LIBS are missing or stale: run \`$0 cluster start\` (or \`$0 fetch\`)"
		launch_node "$n" "$java"
		pid="$(cat "$dir/kafka.pid")"
		say "node $n launched (pid $pid, log $dir/kafka.log); waiting up to ${START_TIMEOUT}s for it to serve requests"
	fi
	ensure_cluster_ready_helper
	await_ready "$START_TIMEOUT" "node $n ($(node_addr "$n")) to serve requests and be registered in the cluster" \
		"$n" -brokers "$(node_addr "$n")" -each-seed
	echo "node $n ready at $(node_addr "$n") (pid $pid, took $((SECONDS - t0))s)"
}

cmd_node_stop() {
	local n=$1 pid t0=$SECONDS
	if ! pid="$(node_pid "$n")"; then
		say "node $n is not running"
		return 0
	fi
	local start
	start="$(proc_start "$pid")"
	kill -TERM "$pid" 2>/dev/null || true
	kill -CONT "$pid" 2>/dev/null || true # a frozen JVM handles no signal
	if ! wait_gone "$pid" "$start" "$NODE_STOP_TIMEOUT"; then
		show_node_logs "$n"
		die "node $n (pid $pid) is still running ${NODE_STOP_TIMEOUT}s after SIGTERM: its controlled shutdown did not finish (log tail above); \`$0 node $n kill\` ends it"
	fi
	echo "node $n (pid $pid) stopped (controlled shutdown, took $((SECONDS - t0))s)"
}

cmd_node_kill() {
	local n=$1 pid
	if ! pid="$(node_pid "$n")"; then
		say "node $n is not running"
		return 0
	fi
	local start
	start="$(proc_start "$pid")"
	kill -KILL "$pid" 2>/dev/null || true
	wait_gone "$pid" "$start" 10 || die "node $n (pid $pid) is still there 10s after SIGKILL"
	echo "node $n (pid $pid) killed"
}

cmd_node_freeze() {
	local n=$1 pid i
	pid="$(node_pid "$n")" || die "node $n is not running: nothing to freeze"
	kill -STOP "$pid"
	for ((i = 0; i < 50; i++)); do
		node_frozen "$n" && break
		sleep 0.1
	done
	node_frozen "$n" || die "node $n (pid $pid) did not stop after SIGSTOP"
	echo "node $n (pid $pid) frozen"
}

cmd_node_thaw() {
	local n=$1 pid
	pid="$(node_pid "$n")" || die "node $n is not running: nothing to thaw"
	kill -CONT "$pid"
	echo "node $n (pid $pid) thawed"
}

cmd_node_pid() {
	local pid
	pid="$(node_pid "$1")" || {
		say "node $1 is not running"
		return 1
	}
	echo "$pid"
}

case "${1:-}" in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
restart)
	cmd_stop
	cmd_start
	;;
fetch)
	fetch_jars
	echo "kafka $KAFKA_VERSION jars in $LIBS"
	;;
log) tail -n 100 "$LOG_FILE" ;;
cluster)
	case "${2:-}" in
	start) cmd_cluster_start ;;
	stop) cmd_cluster_stop ;;
	status) cmd_cluster_status ;;
	brokers) cluster_brokers ;;
	rolling-restart) cmd_cluster_rolling_restart ;;
	*) usage ;;
	esac
	;;
node)
	[[ $# -ge 3 ]] || usage
	check_node_id "$2"
	case "$3" in
	start) cmd_node_start "$2" ;;
	stop) cmd_node_stop "$2" ;;
	kill) cmd_node_kill "$2" ;;
	freeze) cmd_node_freeze "$2" ;;
	thaw) cmd_node_thaw "$2" ;;
	pid) cmd_node_pid "$2" ;;
	log) tail -n 100 "$(node_dir "$2")/kafka.log" ;;
	*) usage ;;
	esac
	;;
*) usage ;;
esac
