#!/usr/bin/env bash
# Run a command against a throwaway PostgreSQL cluster.
#
# Usage: scripts/with-postgres.sh VAR CMD [ARG...]
#
#   scripts/with-postgres.sh TEST_DATABASE_URL go test ./...
#   scripts/with-postgres.sh DATABASE_URL sh -c 'psql "$DATABASE_URL" -c "select version()"'
#
# If VAR is already set (non-empty), CMD is exec'd unchanged against that database.
# Otherwise this script initdb's a cluster in a temp dir, starts it on a free TCP port
# on 127.0.0.1 (unix socket in the temp dir), creates database `kafkapg`, sets
#
#   VAR=postgres://postgres:PASSWORD@127.0.0.1:PORT/kafkapg?sslmode=disable
#
# PASSWORD is random, made for this cluster: every connection must give it (scram-sha-256),
# so no other local user logs in as its superuser while CMD runs.
#
# runs CMD, then stops the server and removes the temp dir (also on Ctrl-C/TERM) and
# exits with CMD's exit status.
#
# The cluster is tuned for tests: fsync, synchronous_commit and full_page_writes are
# off (a crash of this machine loses the data, which is thrown away anyway),
# max_connections=300, shared_buffers=128MB. For benchmarks whose figures you report,
# run with PG_FSYNC=on to keep the durable defaults.
#
# Server binaries are found via pg_config --bindir, the newest /usr/lib/postgresql/*/bin,
# or initdb/pg_ctl on PATH. As root (CI containers), initdb refuses to run, so the
# cluster is created and run as the `postgres` system user.
#
# Environment: PG_FSYNC=on|off (default off), PG_START_TIMEOUT seconds (default 60),
# PG_KEEP=1 keeps the temp dir for debugging.
set -euo pipefail

prog="with-postgres"
say() { printf '%s: %s\n' "$prog" "$*" >&2; }
die() {
	printf '%s: ERROR: %s\n' "$prog" "$*" >&2
	exit 1
}

if [[ $# -lt 2 ]]; then
	echo "usage: $0 VAR CMD [ARG...]   (e.g. $0 TEST_DATABASE_URL go test ./...)" >&2
	exit 2
fi
VAR="$1"
shift
[[ "$VAR" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "not a valid environment variable name: $VAR"

# Already pointed at a database: run CMD unchanged.
if [[ -n "${!VAR:-}" ]]; then
	exec "$@"
fi

case "${PG_FSYNC:-off}" in
on | off) PG_FSYNC="${PG_FSYNC:-off}" ;;
*) die "PG_FSYNC must be on or off, not '$PG_FSYNC'" ;;
esac
START_TIMEOUT="${PG_START_TIMEOUT:-60}"

# ---- find the server binaries -------------------------------------------------------
has_server() { [[ -n "$1" && -x "$1/initdb" && -x "$1/pg_ctl" && -x "$1/postgres" ]]; }

find_bindir() {
	local d
	if command -v pg_config >/dev/null 2>&1; then
		d="$(pg_config --bindir 2>/dev/null || true)"
		if has_server "$d"; then
			echo "$d"
			return 0
		fi
	fi
	if compgen -G '/usr/lib/postgresql/*/bin' >/dev/null; then
		d="$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
		if has_server "$d"; then
			echo "$d"
			return 0
		fi
	fi
	if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
		d="$(dirname -- "$(command -v initdb)")"
		if has_server "$d"; then
			echo "$d"
			return 0
		fi
	fi
	return 1
}

if ! BIN="$(find_bindir)"; then
	{
		echo "$prog: ERROR: PostgreSQL server binaries (initdb, pg_ctl, postgres) not found."
		echo "  Looked at: pg_config --bindir, /usr/lib/postgresql/*/bin, initdb/pg_ctl on PATH."
		echo "  Install them:"
		echo "    Debian/Ubuntu:  apt-get install -y postgresql      (sudo if not root)"
		echo "    macOS:          brew install postgresql@16   (then put \$(brew --prefix postgresql@16)/bin on PATH)"
		echo "  Or point $VAR at an existing database: $VAR=postgres://... $0 $VAR ..."
	} >&2
	exit 1
fi

# ---- who runs the server ------------------------------------------------------------
# initdb and postgres refuse to run as root, so as root use the `postgres` user.
AS_USER=""
if [[ "$(id -u)" -eq 0 ]]; then
	AS_USER=postgres
	id "$AS_USER" >/dev/null 2>&1 ||
		die "running as root, and initdb refuses root, but there is no '$AS_USER' user to run PostgreSQL as (apt-get install -y postgresql creates it; or: useradd --system --home-dir /var/lib/postgresql --shell /bin/bash $AS_USER)"
fi

# Run a command as the server's user (root -> postgres; otherwise as ourselves).
as_server_user() {
	if [[ -z "$AS_USER" ]]; then
		"$@"
	elif command -v runuser >/dev/null 2>&1; then
		runuser -u "$AS_USER" -- "$@"
	else
		su -s /bin/sh "$AS_USER" -c "$(printf '%q ' "$@")"
	fi
}

# ---- temp dir and cleanup -----------------------------------------------------------
# As root the dir must be reachable by the postgres user, so use /tmp rather than a
# possibly private $TMPDIR.
if [[ -n "$AS_USER" ]]; then
	TMP_BASE=/tmp
else
	TMP_BASE="${TMPDIR:-/tmp}"
fi
TMP_BASE="${TMP_BASE%/}"
PGTMP="$(mktemp -d "$TMP_BASE/kafkapg-pg.XXXXXX")"
PGDATA_DIR="$PGTMP/data"
PGLOG="$PGTMP/postgres.log"
STARTED=0

# shellcheck disable=SC2317 # invoked from traps
cleanup() {
	local rc=$?
	trap - EXIT INT TERM HUP
	set +e
	if [[ "$STARTED" -eq 1 ]]; then
		if ! as_server_user "$BIN/pg_ctl" -D "$PGDATA_DIR" -m fast -w -t 30 stop >/dev/null 2>&1; then
			# Last resort: kill the postmaster directly.
			local ppid
			ppid="$(head -n 1 "$PGDATA_DIR/postmaster.pid" 2>/dev/null)"
			if [[ "$ppid" =~ ^[0-9]+$ ]]; then
				say "pg_ctl stop failed; killing postmaster $ppid"
				kill -QUIT "$ppid" 2>/dev/null
				sleep 1
				kill -KILL "$ppid" 2>/dev/null
			fi
		fi
	fi
	if [[ "${PG_KEEP:-}" == 1 ]]; then
		say "PG_KEEP=1: leaving $PGTMP"
	else
		rm -rf "$PGTMP"
	fi
	return "$rc"
}
# shellcheck disable=SC2317 # invoked from traps
on_signal() {
	local sig=$1 code=$2
	say "caught SIG$sig; stopping the throwaway PostgreSQL"
	trap - "$sig"
	cleanup
	exit "$code"
}
trap cleanup EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
trap 'on_signal HUP 129' HUP

if [[ -n "$AS_USER" ]]; then
	chown "$AS_USER:" "$PGTMP"
fi
chmod 700 "$PGTMP"

show_log() {
	local f
	for f in "$@"; do
		[[ -f "$f" ]] || continue
		printf -- '----- %s -----\n' "$f" >&2
		tail -n 40 "$f" >&2 || true
	done
}

# ---- initdb -------------------------------------------------------------------------
# A password of the cluster's own: with trust, any local user would be its superuser (and run
# commands as the server's user: COPY ... FROM PROGRAM).
PASSWORD="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
(umask 077 && printf '%s\n' "$PASSWORD" >"$PGTMP/pwfile")
[[ -z "$AS_USER" ]] || chown "$AS_USER:" "$PGTMP/pwfile"
if ! as_server_user "$BIN/initdb" -D "$PGDATA_DIR" -A scram-sha-256 --pwfile="$PGTMP/pwfile" -U postgres --no-sync \
	-E UTF8 --locale=C >"$PGTMP/initdb.log" 2>&1; then
	show_log "$PGTMP/initdb.log"
	die "initdb failed"
fi

cat >>"$PGDATA_DIR/postgresql.conf" <<EOF

# ---- added by scripts/with-postgres.sh (throwaway test cluster) ----
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PGTMP'
max_connections = 300
shared_buffers = 128MB
fsync = $PG_FSYNC
synchronous_commit = $PG_FSYNC
full_page_writes = $PG_FSYNC
logging_collector = off
log_min_messages = warning
EOF

# ---- start on a free port -----------------------------------------------------------
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

PORT=""
for attempt in 1 2 3 4 5 6 7 8; do
	candidate=$((20000 + (RANDOM * 32768 + RANDOM) % 40000))
	port_in_use "$candidate" && continue
	: >"$PGLOG"
	[[ -z "$AS_USER" ]] || chown "$AS_USER:" "$PGLOG"
	STARTED=1
	if as_server_user "$BIN/pg_ctl" -D "$PGDATA_DIR" -l "$PGLOG" -w -t "$START_TIMEOUT" \
		-o "-p $candidate" start >"$PGTMP/pg_ctl.log" 2>&1; then
		PORT="$candidate"
		break
	fi
	# Make sure nothing half-started is left before the next attempt.
	as_server_user "$BIN/pg_ctl" -D "$PGDATA_DIR" -m immediate -w stop >/dev/null 2>&1 || true
	STARTED=0
	if grep -q 'could not bind\|Address already in use' "$PGLOG" 2>/dev/null; then
		continue # lost a race for the port; try another
	fi
	show_log "$PGTMP/pg_ctl.log" "$PGLOG"
	die "could not start PostgreSQL (attempt $attempt, port $candidate)"
done
[[ -n "$PORT" ]] || {
	show_log "$PGLOG"
	die "could not find a free port for PostgreSQL"
}

ready=0
for ((i = 0; i < START_TIMEOUT * 10; i++)); do
	if "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres; then
		ready=1
		break
	fi
	sleep 0.1
done
if [[ "$ready" -ne 1 ]]; then
	show_log "$PGLOG"
	die "PostgreSQL on 127.0.0.1:$PORT not ready after ${START_TIMEOUT}s"
fi

if ! PGPASSWORD="$PASSWORD" "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres kafkapg >"$PGTMP/createdb.log" 2>&1; then
	show_log "$PGTMP/createdb.log" "$PGLOG"
	die "createdb kafkapg failed"
fi

URL="postgres://postgres:$PASSWORD@127.0.0.1:$PORT/kafkapg?sslmode=disable"
export "$VAR=$URL"
version="$("$BIN/postgres" --version 2>/dev/null | awk '{print $3}')"
say "throwaway PostgreSQL ${version:-?} at 127.0.0.1:$PORT (data $PGDATA_DIR, fsync=$PG_FSYNC${AS_USER:+, run as $AS_USER}); $VAR=$URL"

# Not exec: we must clean up afterwards. CMD runs in the foreground so it keeps the
# terminal (stdin, Ctrl-C); traps run once it has exited.
set +e
"$@"
status=$?
set -e
exit "$status"
