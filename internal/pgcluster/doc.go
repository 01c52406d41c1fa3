// Package pgcluster runs real PostgreSQL servers, streaming standbys and PgBouncer on
// 127.0.0.1: the throwaway servers of a team's local loop (go tool kafkapg dev) and handler
// tests (processortest.DB), and the rig's topologies: start a primary, copy it into standbys,
// make them synchronous, crash the primary, promote a standby, make the old primary follow the
// new one, copy a running server's data dir and start the copy in its place (a restore that
// keeps the database's identity), put PgBouncer in front and move it to another server, and give
// a server a TLS certificate. It is for development and tests: trust authentication unless
// Options.Password asks for one, loopback only, fsync off unless asked.
//
// # What it guarantees
//
//   - Every server and bouncer is a child process of this one, run as the postgres user when
//     this process is root (initdb, postgres and pgbouncer refuse root). On Linux each is sent a
//     signal if this process dies (postgres SIGQUIT, an immediate shutdown; pgbouncer SIGKILL),
//     so a crashed or timed-out test leaves no server running; its temp dir under /tmp
//     (pgcluster-*, pgbouncer-*) is then left behind, unless CloseWhenProcessExits was called.
//     Close stops it and removes its temp dir.
//   - A call that returns has done what it says: Start and Standby return once the server
//     accepts connections, Promote once pg_is_in_recovery() is false, SetSynchronous once
//     pg_stat_replication shows the standby as sync, WaitReplayed once the standby has replayed
//     the primary's WAL position, StartBouncer once a query through it reached Postgres,
//     Retarget once no server connection to the old backend is left, Snapshot once the copy is
//     made and the server thawed, Restore once the copy, started in the server's place, accepts
//     connections. Every wait ends with its
//     ctx, or after DefaultTimeout when ctx has no deadline.
//   - Errors name the server (its Name, address and dir), the operation, and end with the last
//     lines of its log (Dir/postgres.log, pgbouncer.log, or the initdb and pg_basebackup logs).
//   - Kill is a crash of the server process (SIGQUIT, as pg_ctl stop -m immediate): WAL that
//     had not reached a standby is missing there. Stop is a clean shutdown (SIGINT, -m fast).
//     Promote uses pg_promote(), as pg_ctl promote does.
//   - Snapshot freezes every process of the server (SIGSTOP) while it copies the data dir, so the
//     copy is crash-consistent: it holds every commit acknowledged before the freeze. Restore
//     starts it in the server's place, on its port: the commits made after the copy are gone, and
//     the system identifier and WAL timeline are unchanged (a failover's promotion starts a new
//     timeline), so nothing in the database says it forgot them.
//
// # What it does not do
//
//   - It does not survive a crash of the machine: fsync and full_page_writes are off unless
//     Options.Durable. synchronous_commit stays on, so a synchronous standby means what it says.
//   - No password unless Options.Password (then scram-sha-256 for every connection); no
//     client certificates, no unix sockets, nothing but 127.0.0.1.
//   - As root, the servers' dirs belong to the postgres user. This package, writing into them
//     as root, follows no symlink out of a server's dir nor at the file it writes, and writes
//     no file through a hard link; it refuses an Options.Dir that is a symlink or someone
//     else's. That the dir's parent is safe (no one else can replace the dir) is the caller's
//     business: the temp dirs it makes are new, random names.
//   - Follow re-copies the data dir (pg_basebackup) rather than pg_rewind: simple and always
//     correct, slower for big clusters, which tests do not have.
//   - PgBouncer talks to its backend without TLS.
//   - Snapshot works on Linux only: it finds the server's processes (each postgres child is a
//     process group of its own) in /proc.
//
// # Facts checked on this machine (Debian 12, PostgreSQL 15, PgBouncer 1.18.0, pgx 5.12)
//
// The tests of this package check each of these; the error texts are verbatim.
//
//   - pgx sends only "user" and "database" in its startup message by default (with PGAPPNAME,
//     PGOPTIONS and the like unset). Every URL parameter pgx does not know itself becomes a
//     startup parameter; default_query_exec_mode, statement_cache_capacity and
//     description_cache_capacity are pgx's own and are not sent.
//   - PgBouncer 1.18 passes on the parameters it tracks (application_name, TimeZone,
//     client_encoding, DateStyle were checked) and refuses any other, e.g. search_path,
//     extra_float_digits (sent by JDBC and lib/pq), statement_timeout and options:
//     "FATAL: unsupported startup parameter: search_path (SQLSTATE 08P01)". A parameter in
//     ignore_startup_parameters is accepted and dropped: search_path=s in the URL then leaves
//     the server's default, `"$user", public`; set it with SET LOCAL, ALTER ROLE or ALTER
//     DATABASE instead.
//   - pgx's default query mode (cache_statement) prepares named statements,
//     "stmtcache_" + the hex of 24 bytes of the SHA-256 of the SQL, so the same SQL has the same
//     name on every connection. Through PgBouncer 1.18 in transaction mode, a second client
//     that runs the same SQL on the server connection where a first client prepared it gets
//     `ERROR: prepared statement "stmtcache_01ec8e…" already exists (SQLSTATE 42P05)`; a client
//     whose statement was prepared on another server connection gets `ERROR: prepared
//     statement "stmtcache_…" does not exist (SQLSTATE 26000)` (pgx then forgets it and
//     prepares it again on the next try). default_query_exec_mode=cache_describe and =exec
//     use the unnamed statement and pass, with four clients on two server connections.
//   - LISTEN through transaction mode does not reach the listener: its server connection
//     goes back to the pool, and a notification goes to whichever client holds that connection
//     when it arrives (with one server connection, the client that sent the NOTIFY). Session
//     mode delivers it.
//   - Retarget: RELOAD with a changed "*" entry re-routes the databases PgBouncer already
//     created from it; in transaction mode, a client keeps its connection and its next
//     transaction reaches the new server. A session cut by KILL reads
//     "FATAL: database removed (SQLSTATE 08P01)".
//   - PgBouncer's auth_type=trust still wants the user in auth_file, else
//     `FATAL: "trust" authentication failed`. Its admin console speaks only the simple
//     protocol: "ERROR: extended query protocol not supported by admin console (SQLSTATE
//     08P01)" for pgx's default mode, so use default_query_exec_mode=simple_protocol.
//   - A commit on a primary whose synchronous standby is down blocks. statement_timeout does not
//     end the wait (the server disables it before the commit of a simple-protocol statement).
//     On a ctx deadline pgx returns "timeout: context deadline exceeded" and closes the
//     connection with a cancel request; the cancel ends the server's wait with "WARNING:
//     canceling wait for synchronous replication due to user request", and the commit, already
//     in the WAL, becomes visible on the primary and later reaches the standby, although the
//     client saw an error. Until the wait ends the commit is invisible, even on the primary.
//   - An async standby that was stopped, then promoted after the primary was killed, lacks the
//     commits the primary acknowledged meanwhile; the killed primary, restarted, still has them
//     (its WAL survived), so the two have diverged; Follow discards the old primary's extra.
//   - With TLS, sslmode=verify-full&sslrootcert=<ca> to host localhost connects; a wrong CA
//     fails with "tls: failed to verify certificate: x509: certificate signed by unknown
//     authority"; host 127.0.0.1 with a certificate for localhost only with "x509: cannot
//     validate certificate for 127.0.0.1 because it doesn't contain any IP SANs"; sslmode=disable
//     with `FATAL: no pg_hba.conf entry for host "127.0.0.1", user "postgres", database
//     "postgres", no encryption (SQLSTATE 28000)`.
//
// Typical times here (2 cores, gVisor, idle): Start (initdb + start) 0.6–1.3 s, Standby
// 0.3–0.8 s, WaitReplayed 10 ms, Kill 10 ms, Promote 30 ms, Follow 0.45 s, Snapshot of a
// 40 MB data dir 0.15 s frozen, StartBouncer 35 ms, Retarget 0.3 s in transaction mode (1 s
// more when a session must be cut). With other test suites running on the machine Start took
// up to 8 s.
package pgcluster
