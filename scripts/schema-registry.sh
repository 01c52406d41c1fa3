#!/usr/bin/env bash
# Start/stop a real Confluent-compatible Schema Registry for tests, without Docker: Apicurio
# Registry 2.6 from Maven Central (its in-memory storage: everything is lost when it stops), whose
# /apis/ccompat/v7 API is the Confluent Schema Registry's (see ../shared/notes/schema-registry.md).
#
# Usage: scripts/schema-registry.sh start|stop|status|restart|fetch|url|log
#        scripts/schema-registry.sh with VAR CMD [ARG...]
#
#   start    fetch the registry (cached), start it in the background and wait until it answers.
#            Prints its Confluent-compatible URL (for SCHEMA_REGISTRY_URL).
#   stop     stop it (TERM, then KILL after 15 s). Ok if not running. Its schemas are gone.
#   status   exit 0 if it answers, 1 otherwise.
#   restart  stop, then start (an empty registry again).
#   fetch    only download it into the cache.
#   url      print the Confluent-compatible URL.
#   log      print the last 100 lines of its log.
#   with     run CMD with VAR set to the URL of a registry of its own (a free port, a temp
#            directory), stopped afterwards; if VAR is already set, CMD runs against that one.
#            `make test` runs the tests so: scripts/schema-registry.sh with TEST_SCHEMA_REGISTRY_URL go test ...
#   with-optional  the same, but a registry that cannot start (no java, Maven Central out of reach)
#            is not an error: CMD runs without VAR, after a note on stderr. `make demo` runs so.
#
# Environment (all optional):
#   KAFKAPG_CACHE          cache root                   (default $HOME/.cache/kafkapg)
#   SCHEMA_REGISTRY_DIR    log and pid file             (default /tmp/kafkapg-schema-registry)
#   SCHEMA_REGISTRY_PORT   HTTP port, on 127.0.0.1      (default 8081, the Confluent default)
#   SCHEMA_REGISTRY_START_TIMEOUT  seconds to wait for it to answer (default 120)
#   JAVA                   java binary (default: $JAVA_HOME/bin/java or java on PATH; 17 is enough for 2.6)
#   MVN                    maven binary (default: mvn on PATH)
set -euo pipefail

APICURIO_VERSION=2.6.13.Final
ARTIFACT="io.apicurio:apicurio-registry-app:$APICURIO_VERSION:tar.gz:all"

CACHE_ROOT="${KAFKAPG_CACHE:-$HOME/.cache/kafkapg}"
HOME_DIR="$CACHE_ROOT/apicurio-registry-$APICURIO_VERSION"
STATE_DIR="${SCHEMA_REGISTRY_DIR:-/tmp/kafkapg-schema-registry}"
PORT="${SCHEMA_REGISTRY_PORT:-8081}"
START_TIMEOUT="${SCHEMA_REGISTRY_START_TIMEOUT:-120}"
PID_FILE="$STATE_DIR/registry.pid"
LOG_FILE="$STATE_DIR/registry.log"
URL="http://127.0.0.1:$PORT/apis/ccompat/v7"

if [[ -n "${JAVA:-}" ]]; then :
elif [[ -n "${JAVA_HOME:-}" && -x "$JAVA_HOME/bin/java" ]]; then JAVA="$JAVA_HOME/bin/java"
else JAVA=java
fi
MVN="${MVN:-mvn}"

die() { echo "schema-registry.sh: $*" >&2; exit 1; }

runner() { ls "$HOME_DIR"/apicurio-registry-app-*-runner.jar 2>/dev/null | head -1; }

fetch() {
	if [[ -n "$(runner)" ]]; then
		return 0
	fi
	command -v "$MVN" >/dev/null || die "maven ($MVN) is not installed: it fetches the registry from Maven Central"
	local tmp
	tmp="$(mktemp -d)"
	echo "schema-registry.sh: fetching $ARTIFACT from Maven Central (about 142 MB, once)" >&2
	# Maven writes colour codes even with -q: its output goes to a log.
	if ! "$MVN" -B -q org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy \
		-Dartifact="$ARTIFACT" -DoutputDirectory="$tmp" >"$tmp/mvn.log" 2>&1; then
		cat "$tmp/mvn.log" >&2
		die "could not fetch $ARTIFACT"
	fi
	mkdir -p "$HOME_DIR"
	tar -xzf "$tmp"/apicurio-registry-app-*.tar.gz -C "$HOME_DIR" --strip-components=0
	# The archive may keep its files in a directory of its own: bring the runner jar's up.
	if [[ -z "$(runner)" ]]; then
		local jar
		jar="$(find "$HOME_DIR" -name 'apicurio-registry-app-*-runner.jar' | head -1)"
		[[ -n "$jar" ]] || die "no runner jar in $ARTIFACT"
		local dir
		dir="$(dirname "$jar")"
		shopt -s dotglob
		mv "$dir"/* "$HOME_DIR"/
		shopt -u dotglob
	fi
	rm -rf "$tmp"
}

answers() { curl -fsS -o /dev/null --max-time 2 "$URL/subjects"; }

running_pid() {
	[[ -f "$PID_FILE" ]] || return 1
	local pid
	pid="$(cat "$PID_FILE")"
	kill -0 "$pid" 2>/dev/null || return 1
	echo "$pid"
}

start() {
	fetch
	if running_pid >/dev/null; then
		die "already running (pid $(running_pid)); stop it first"
	fi
	if answers 2>/dev/null; then
		die "something else answers at $URL: set SCHEMA_REGISTRY_PORT"
	fi
	mkdir -p "$STATE_DIR"
	: >"$LOG_FILE"
	local started=$SECONDS
	(cd "$HOME_DIR" && exec "$JAVA" -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
		-Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$PORT" \
		-jar "$(runner)" >>"$LOG_FILE" 2>&1) &
	echo $! >"$PID_FILE"
	while ! answers 2>/dev/null; do
		if ! running_pid >/dev/null; then
			tail -50 "$LOG_FILE" >&2
			die "the registry exited before answering (log $LOG_FILE)"
		fi
		if ((SECONDS - started > START_TIMEOUT)); then
			tail -50 "$LOG_FILE" >&2
			stop
			die "the registry did not answer within ${START_TIMEOUT}s (log $LOG_FILE)"
		fi
		sleep 0.3
	done
	echo "schema registry ready at $URL (pid $(running_pid), took $((SECONDS - started))s)" >&2
	echo "$URL"
}

stop() {
	local pid
	if ! pid="$(running_pid)"; then
		rm -f "$PID_FILE"
		return 0
	fi
	kill -TERM "$pid" 2>/dev/null || true
	for _ in $(seq 1 150); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$pid" 2>/dev/null; then
		kill -KILL "$pid" 2>/dev/null || true
	fi
	rm -f "$PID_FILE"
	echo "schema-registry.sh: registry (pid $pid) stopped" >&2
}

# with VAR CMD...: see the usage above.
with() {
	local optional=false
	if [[ "${1:-}" == --optional ]]; then
		optional=true
		shift
	fi
	local var="${1:-}"
	shift || true
	[[ -n "$var" && $# -gt 0 ]] || die "usage: $0 with VAR CMD [ARG...]"
	if [[ -n "${!var:-}" ]]; then
		exec "$@"
	fi
	STATE_DIR="$(mktemp -d)"
	PID_FILE="$STATE_DIR/registry.pid"
	LOG_FILE="$STATE_DIR/registry.log"
	trap 'stop; rm -rf "$STATE_DIR"' EXIT
	trap 'exit 130' INT TERM
	# A free port below the ephemeral range (32768 on): a port a client socket holds cannot be
	# bound. Another process may still take it first: then a new port, up to three times.
	local try
	for try in 1 2 3; do
		local p
		for _ in $(seq 1 50); do
			p=$((20000 + RANDOM % 12000))
			if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
				break
			fi
		done
		PORT="$p"
		URL="http://127.0.0.1:$PORT/apis/ccompat/v7"
		if (start >/dev/null); then
			break
		fi
		if ((try == 3)); then
			$optional || die "no registry after three ports"
			echo "schema-registry.sh: no Schema Registry could start (the reason is above); running without $var" >&2
			stop
			rm -rf "$STATE_DIR"
			trap - EXIT
			exec "$@"
		fi
	done
	export "$var=$URL"
	local rc=0
	"$@" || rc=$?
	exit "$rc"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) answers ;;
restart) stop; start ;;
fetch) fetch ;;
url) echo "$URL" ;;
log) tail -100 "$LOG_FILE" ;;
with) shift; with "$@" ;;
with-optional) shift; with --optional "$@" ;;
*) die "usage: $0 start|stop|status|restart|fetch|url|log, or $0 with|with-optional VAR CMD [ARG...]" ;;
esac
