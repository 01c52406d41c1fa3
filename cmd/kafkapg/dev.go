package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/kafkapg/kafkapg/internal/pgcluster"
)

// devDatabase is the database the dev loop's DATABASE_URL names.
const devDatabase = "dev"

// devCmd runs the dev loop.
func devCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kafkapg dev", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", ".kafkapg", "where the broker's and Postgres's data and the env file live (kept between runs)")
	topicList := fs.String("topics", "", "topics to create if missing, NAME[:PARTITIONS],... (KAFKA_TOPICS's are created too): the service's sources and the topics its handlers emit to")
	partitions := fs.Int("partitions", 3, "partitions of a topic created without :PARTITIONS")
	kafkaAddr := fs.String("kafka", "127.0.0.1:19092", "address of the broker (port 0: a free one)")
	pgPort := fs.Int("postgres-port", 15432, "port of Postgres on 127.0.0.1 (0: a free one)")
	fresh := fs.Bool("fresh", false, "start from nothing: remove the broker's and Postgres's data first")
	fs.Usage = func() {
		fmt.Fprintf(stderr, `usage: kafkapg dev [flags] [-- command [args...]]

Starts a Kafka-protocol broker (franz-go's kfake) and a PostgreSQL server (from the PostgreSQL
binaries: initdb on first use) on this machine, creates the topics, and writes the environment
of a service that uses them (KAFKA_BROKERS, KAFKA_SASL_*, DATABASE_URL) to <dir>/env. Without
a command it runs until Ctrl-C; with one (go run . ) it runs the command in that environment
and stops when the command exits, with its exit status. Data is kept in <dir> between runs
(-fresh: not). Postgres asks for a password, generated on first use and kept in
<dir>/postgres-password (DATABASE_URL carries it); the broker asks for SASL/SCRAM-SHA-256 as
user kafkapg with the password of <dir>/kafka-password (KAFKA_SASL_MECHANISM,
KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD carry it); <dir>/env is private to you (0600).

`)
		fs.PrintDefaults()
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	command := fs.Args()
	if i := len(args) - len(command) - 1; len(command) > 0 && (i < 0 || args[i] != "--") {
		return usagef("unexpected %q: put the command to run after --", command[0])
	}
	topics, err := parseTopics(*topicList, *partitions)
	if err != nil {
		return err
	}
	if env := os.Getenv("KAFKA_TOPICS"); env != "" {
		more, err := parseTopics(env, *partitions)
		if err != nil {
			return usagef("KAFKA_TOPICS: %v", err)
		}
		topics = mergeTopics(topics, more)
	}
	host, port, err := splitAddr(*kafkaAddr)
	if err != nil {
		return usagef("-kafka %q: %v", *kafkaAddr, err)
	}
	if *pgPort < 0 || *pgPort > 65535 {
		return usagef("-postgres-port %d is not a port", *pgPort)
	}

	// Where things go, and why no other user can reach or replace them: see devdir.go. The dir
	// is 0755, not 0700: as root, the postgres user must enter it to reach postgres/.
	abs, err := filepath.Abs(*dir)
	if err != nil {
		return err
	}
	if err := secureDir(abs, 0o755); err != nil {
		return fmt.Errorf("-dir: %w", err)
	}
	envPath := filepath.Join(abs, "env")
	if pid, ok := runningLoop(envPath); ok {
		return fmt.Errorf("a dev loop is already running with %s (pid %d): stop it, or give another -dir", *dir, pid)
	}
	if err := tightenEnv(envPath); err != nil {
		return err
	}
	pgDir, err := devPostgresDir(abs, pgcluster.Reachable, stderr)
	if err != nil {
		return err
	}
	kafkaDir := filepath.Join(abs, "kafka")
	if *fresh {
		if err := errors.Join(os.RemoveAll(kafkaDir), os.RemoveAll(pgDir)); err != nil {
			return fmt.Errorf("-fresh: %w", err)
		}
	}
	if err := secureDir(kafkaDir, 0o700); err != nil {
		return err
	}
	password, err := devPassword(filepath.Join(abs, "postgres-password"), "the Postgres password")
	if err != nil {
		return err
	}
	kafkaPassword, err := devPassword(filepath.Join(abs, "kafka-password"), "the broker's password")
	if err != nil {
		return err
	}
	// kfake keeps its SASL users in its data (sasl.json) and, loading it, puts them in place of
	// those its options give: the data of a broker an older kafkapg dev ran (no users) would
	// shut everyone out, and so would a kafka-password removed to get a new one. The password
	// file is the login's one home: the broker is given it at each start.
	if err := os.Remove(filepath.Join(kafkaDir, "sasl.json")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("the broker's SASL users: %w", err)
	}

	if port == 0 {
		if port, err = freePort(host); err != nil {
			return err
		}
	}
	broker, err := kfake.NewCluster(
		kfake.NumBrokers(1),
		kfake.Ports(port),
		kfake.ListenFn(func(network, _ string) (net.Listener, error) {
			return net.Listen(network, net.JoinHostPort(host, strconv.Itoa(port)))
		}),
		kfake.DataDir(kafkaDir),
		// Without a login, any local user would read and write every topic.
		kfake.EnableSASL(),
		kfake.Superuser(devKafkaMechanism, devKafkaUser, kafkaPassword),
		kfake.DefaultNumPartitions(*partitions),
		kfake.GroupMinSessionTimeout(100*time.Millisecond),
		// Consumer-protocol members get the broker's heartbeat interval even when their group
		// sets its own (a kfake gap): kafkapg's own, 500ms.
		kfake.BrokerConfigs(map[string]string{"group.consumer.heartbeat.interval.ms": "500"}),
	)
	if err != nil {
		return fmt.Errorf("start the broker on %s: %w", net.JoinHostPort(host, strconv.Itoa(port)), err)
	}
	defer broker.Close()
	env := [][2]string{
		{"KAFKA_BROKERS", strings.Join(broker.ListenAddrs(), ",")},
		{"KAFKA_SASL_MECHANISM", devKafkaMechanism},
		{"KAFKA_SASL_USERNAME", devKafkaUser},
		{"KAFKA_SASL_PASSWORD", kafkaPassword},
	}
	// The dev loop's own client logs in as the env file says, as every other one will.
	kafka := kafkaConn{brokers: broker.ListenAddrs()}
	if kafka.login, err = saslLogin(lookupIn(env)); err != nil {
		return err
	}

	startCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	// A password, set on a cluster an older kafkapg dev made with trust too: without one, any
	// local user would be its superuser, and run programs as its OS user (COPY ... FROM PROGRAM).
	pg, err := pgcluster.Start(startCtx, pgcluster.Options{Dir: pgDir, Port: *pgPort, Password: password})
	if err != nil {
		return fmt.Errorf("start Postgres: %w", err)
	}
	defer func() {
		stopCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := pg.Stop(stopCtx); err != nil {
			fmt.Fprintf(stderr, "kafkapg dev: stop Postgres: %v\n", err)
		}
		pg.Close()
	}()
	if err := ensureDatabase(startCtx, pg.URL("postgres"), devDatabase); err != nil {
		return err
	}
	created, err := ensureTopics(startCtx, kafka, topics)
	if err != nil {
		return err
	}

	env = append(env, [2]string{"DATABASE_URL", pg.URL(devDatabase)})
	if err := writeEnv(envPath, env); err != nil {
		return err
	}
	defer os.Remove(envPath)

	fmt.Fprintf(stderr, "kafkapg dev: broker (kfake, for development only) at %s, SASL user %s, data in %s\n", strings.Join(kafka.brokers, ","), devKafkaUser, kafkaDir)
	fmt.Fprintf(stderr, "kafkapg dev: PostgreSQL at %s, database %s, data in %s\n", pg.Addr(), devDatabase, pgDir)
	for _, t := range topics {
		what := "exists"
		if created[t.name] {
			what = fmt.Sprintf("created, %d partitions", t.partitions)
		}
		fmt.Fprintf(stderr, "kafkapg dev: topic %s (%s)\n", t.name, what)
	}
	fmt.Fprintf(stderr, "kafkapg dev: the environment is in %s (. %s):\n", envPath, relPath(envPath))
	for _, kv := range env {
		fmt.Fprintf(stdout, "export %s=%s\n", kv[0], shellQuote(kv[1]))
	}

	if len(command) == 0 {
		fmt.Fprintln(stderr, "kafkapg dev: ready; Ctrl-C stops")
		<-ctx.Done()
		fmt.Fprintln(stderr, "kafkapg dev: stopping")
		return nil
	}
	return runWithEnv(ctx, command, env, stderr)
}

// runWithEnv runs command with env added to this process's environment, passing on SIGINT and
// SIGTERM (ctx's end) as SIGTERM, and returns its exit status as an exitError (nil for 0).
func runWithEnv(ctx context.Context, command []string, env [][2]string, stderr io.Writer) error {
	cmd := exec.Command(command[0], command[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = os.Environ()
	for _, kv := range env {
		cmd.Env = append(cmd.Env, kv[0]+"="+kv[1])
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("run %s: %w", command[0], err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		_ = cmd.Process.Signal(syscall.SIGTERM)
		err = <-done
	}
	var ee *exec.ExitError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &ee):
		fmt.Fprintf(stderr, "kafkapg dev: %s exited: %v\n", command[0], err)
		if code := ee.ExitCode(); code > 0 {
			return exitError(code)
		}
		return exitError(1)
	}
	return err
}

// topicSpec is a topic to create and its partition count.
type topicSpec struct {
	name       string
	partitions int
}

// parseTopics parses NAME[:PARTITIONS],...
func parseTopics(list string, partitions int) ([]topicSpec, error) {
	var out []topicSpec
	for _, item := range strings.Split(list, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, n, ok := strings.Cut(item, ":")
		t := topicSpec{name: name, partitions: partitions}
		if ok {
			p, err := strconv.Atoi(n)
			if err != nil || p < 1 {
				return nil, usagef("topic %q: the partition count after ':' must be a positive integer", item)
			}
			t.partitions = p
		}
		if name == "" {
			return nil, usagef("topic %q has no name", item)
		}
		out = append(out, t)
	}
	return out, nil
}

// mergeTopics appends to a those of b it does not name.
func mergeTopics(a, b []topicSpec) []topicSpec {
	for _, t := range b {
		found := false
		for _, u := range a {
			found = found || u.name == t.name
		}
		if !found {
			a = append(a, t)
		}
	}
	return a
}

// ensureTopics creates the topics that do not exist, and returns which it created.
func ensureTopics(ctx context.Context, kafka kafkaConn, topics []topicSpec) (map[string]bool, error) {
	created := map[string]bool{}
	if len(topics) == 0 {
		return created, nil
	}
	cl, err := kafka.client()
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	for _, t := range topics {
		res, err := adm.CreateTopic(ctx, int32(t.partitions), 1, nil, t.name)
		switch {
		case errors.Is(err, kerr.TopicAlreadyExists) || errors.Is(res.Err, kerr.TopicAlreadyExists):
		case err != nil:
			return nil, fmt.Errorf("create topic %s: %w", t.name, err)
		case res.Err != nil:
			return nil, fmt.Errorf("create topic %s: %w", t.name, res.Err)
		default:
			created[t.name] = true
		}
	}
	return created, nil
}

// ensureDatabase creates database name on the server of adminURL if it does not exist.
func ensureDatabase(ctx context.Context, adminURL, name string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("connect to Postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		return fmt.Errorf("look for database %s: %w", name, err)
	}
	if !exists {
		if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
			return fmt.Errorf("create database %s: %w", name, err)
		}
	}
	return nil
}

// The env file: "export NAME=VALUE" lines a shell can source, after a comment that holds the
// dev loop's pid.

// writeEnv writes the env file, mode 0600 (DATABASE_URL holds the password): a new file of a
// random name (O_EXCL: no symlink followed) renamed over path, which replaces whatever was
// there, a symlink included, and never writes through it.
func writeEnv(path string, env [][2]string) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# kafkapg dev, pid %d: source it (. %s) or eval \"$(go tool kafkapg env)\"\n", os.Getpid(), relPath(path))
	for _, kv := range env {
		fmt.Fprintf(&b, "export %s=%s\n", kv[0], shellQuote(kv[1]))
	}
	f, err := os.CreateTemp(filepath.Dir(path), ".env-*")
	if err != nil {
		return err
	}
	_, err = f.WriteString(b.String())
	err = errors.Join(err, f.Chmod(0o600), f.Close())
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// readEnv reads the env file: the pid of the loop that wrote it and its variables.
func readEnv(path string) (pid int, env [][2]string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "# kafkapg dev, pid "); ok {
			n, _, _ := strings.Cut(rest, ":")
			pid, _ = strconv.Atoi(n)
			continue
		}
		rest, ok := strings.CutPrefix(line, "export ")
		if !ok {
			continue
		}
		name, value, _ := strings.Cut(rest, "=")
		env = append(env, [2]string{name, shellUnquote(value)})
	}
	return pid, env, sc.Err()
}

// runningLoop reports whether the env file at path was written by a dev loop that still runs.
func runningLoop(path string) (int, bool) {
	pid, _, err := readEnv(path)
	if err != nil || pid <= 0 || pid == os.Getpid() {
		return 0, false
	}
	if p, err := os.FindProcess(pid); err == nil && p.Signal(syscall.Signal(0)) == nil {
		return pid, true
	}
	return 0, false
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// shellUnquote undoes shellQuote.
func shellUnquote(s string) string {
	if len(s) >= 2 && s[0] == '\'' && s[len(s)-1] == '\'' {
		return strings.ReplaceAll(s[1:len(s)-1], `'\''`, "'")
	}
	return s
}

// relPath is path relative to the working directory, if it is under it.
func relPath(path string) string {
	if wd, err := os.Getwd(); err == nil {
		if rel, err := filepath.Rel(wd, path); err == nil && !strings.HasPrefix(rel, "..") {
			return rel
		}
	}
	return path
}

// splitAddr splits host:port, with a port from 0 to 65535.
func splitAddr(addr string) (string, int, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, errors.New("invalid port")
	}
	return host, port, nil
}

// freePort returns a port of host that was free a moment ago.
func freePort(host string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// envCmd prints the running dev loop's environment.
func envCmd(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kafkapg env", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", ".kafkapg", "the dev loop's -dir")
	if err := parse(fs, args); err != nil {
		return err
	}
	path := filepath.Join(*dir, "env")
	if _, ok := runningLoop(path); !ok {
		return fmt.Errorf("no dev loop is running with %s: start one with `go tool kafkapg dev`", *dir)
	}
	_, env, err := readEnv(path)
	if err != nil {
		return err
	}
	for _, kv := range env {
		fmt.Fprintf(stdout, "export %s=%s\n", kv[0], shellQuote(kv[1]))
	}
	return nil
}
