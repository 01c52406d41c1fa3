#!/usr/bin/env bash
# Start/stop a real single-node Apache Kafka broker (KRaft, broker+controller in one
# JVM) for integration tests, without Docker and without the Kafka download site:
# the broker's jars come from Maven Central via scripts/kafka/pom.xml.
#
# Usage: scripts/kafka.sh start|stop|status|restart|fetch|log
#
#   start    fetch jars (cached), wipe the state dir, format storage, start the broker
#            in the background and wait until it really serves requests (metadata and
#            a group coordinator, checked by internal/cmd/kafkaready).
#   stop     stop the broker started by `start` (TERM, then KILL after 15 s). Ok if not running.
#   status   exit 0 if the broker answers requests, 1 otherwise.
#   restart  stop, then start.
#   fetch    only download the jars into the cache.
#   log      print the last 100 lines of the broker log.
#
# Environment (all optional):
#   KAFKAPG_CACHE          jar cache root          (default $HOME/.cache/kafkapg)
#   KAFKA_STATE_DIR        data, log, pid file     (default /tmp/kafkapg-kafka; wiped by start)
#   KAFKA_PORT             PLAINTEXT listener      (default 9092, on 127.0.0.1)
#   KAFKA_CONTROLLER_PORT  KRaft controller        (default 9093, on 127.0.0.1)
#   KAFKA_CHAOS_PORT       second PLAINTEXT listener for `make chaos` (default 9094, on 127.0.0.1);
#                          it advertises KAFKA_CHAOS_ADVERTISED (default 127.0.0.1:19094), where
#                          the chaos suite puts a fault-injecting proxy in front of it
#   KAFKA_START_TIMEOUT    seconds to wait         (default 120)
#   KAFKA_HEAP_OPTS        JVM heap                (default "-Xms256m -Xmx512m")
#   JAVA                   java binary             (default: $JAVA_HOME/bin/java or java on PATH; needs 17+)
#   MVN                    maven binary            (default: mvn on PATH)
#
# Tests then connect to 127.0.0.1:${KAFKA_PORT}.
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

build_ready_helper() {
	command -v go >/dev/null 2>&1 || die "go not found; it is needed to build internal/cmd/kafkaready"
	(cd "$REPO_ROOT" && go build -o "$READY_BIN" ./internal/cmd/kafkaready) ||
		die "could not build internal/cmd/kafkaready"
}

show_log_tail() {
	if [[ -f "$LOG_FILE" ]]; then
		printf '\n----- last 50 lines of %s -----\n' "$LOG_FILE" >&2
		tail -n 50 "$LOG_FILE" >&2 || true
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
	echo "kafka ready at 127.0.0.1:$PORT (pid $pid, took $((SECONDS - t0))s: jars $((t_fetched - t0))s, broker $((SECONDS - t_launched))s)"
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
		command -v go >/dev/null 2>&1 || die "go not found; it is needed to run internal/cmd/kafkaready"
		ready=(go run ./internal/cmd/kafkaready)
	fi
	if (cd "$REPO_ROOT" && "${ready[@]}" -brokers "127.0.0.1:$PORT" -timeout 5s -quiet 2>/dev/null); then
		echo "kafka ready at 127.0.0.1:$PORT${pid:+ (pid $pid)}"
		return 0
	fi
	echo "kafka not ready at 127.0.0.1:$PORT"
	return 1
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
*)
	echo "usage: $0 start|stop|status|restart|fetch|log" >&2
	exit 2
	;;
esac
