package service

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/processor"
)

// opsCmd is what an operator command (dlq, keys, trace) works with: the service's environment,
// a pool on its database (migrated), the group's operations, and where to write.
type opsCmd struct {
	prog string
	env  *env
	pool *pgxpool.Pool
	ops  *ops.Ops
	// out and err reach a person's terminal: whatever came from outside (keys, headers, error
	// texts, actors and reasons) is written with its control characters escaped
	// (safetext.TerminalWriter); rawOut is out for JSON, which escapes them its own way.
	out    io.Writer // results: tables
	err    io.Writer // progress and notes
	rawOut io.Writer
}

// newOpsCmd returns the operator commands of e's group on pool, writing to stdout and stderr.
func newOpsCmd(prog string, e *env, pool *pgxpool.Pool, stdout, stderr io.Writer) *opsCmd {
	// The group's topics, which are all that trace may read (ops.CheckTopic).
	o := ops.New(pool, e.DBSchema, e.KafkaGroupID).WithTopics(e.KafkaTopics...)
	return &opsCmd{prog: prog, env: e, pool: pool, ops: o,
		out: safetext.TerminalWriter(stdout), err: safetext.TerminalWriter(stderr), rawOut: safetext.JSONWriter(stdout)}
}

// kafka returns a client for the service's brokers (with its TLS and SASL settings), for
// commands that read records; the caller closes it.
func (c *opsCmd) kafka(extra ...kgo.Opt) (*kgo.Client, error) {
	if len(c.env.KafkaBrokers) == 0 {
		return nil, &configError{errors.New("KAFKA_BROKERS is required for this command: it reads records from Kafka")}
	}
	sec, err := c.env.kafkaSecurityEnv.options()
	if err != nil {
		return nil, &configError{err}
	}
	opts := append([]kgo.Opt{kgo.SeedBrokers(c.env.KafkaBrokers...)}, sec...)
	return kgo.NewClient(append(opts, extra...)...)
}

// operate runs the operator command cmd (dlq, keys, trace) with args, configured by e
// (loadOpsEnv).
func operate(ctx context.Context, e *env, cmd string, args []string, hs *registry, stdout, stderr io.Writer) error {
	pool, adapt, err := openPool(ctx, &e.dbEnv)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := adapt(ctx, nil); err != nil {
		return fmt.Errorf("database: %w", err)
	}
	// Tools see the same tables as the processors: bring them up to date first (a no-op when
	// they are).
	if err := processor.Migrate(ctx, pool, e.DBSchema); err != nil {
		return fmt.Errorf("database: %w", err)
	}
	if len(e.KafkaTopics) == 0 {
		// Run from elsewhere than the service's pod (a laptop with DATABASE_URL and the group):
		// the group's topics are those it has positions for.
		if e.KafkaTopics, err = groupTopics(ctx, pool, e.DBSchema, e.KafkaGroupID); err != nil {
			return fmt.Errorf("database: %w", err)
		}
	}
	c := newOpsCmd(progName(), e, pool, stdout, stderr)
	c.ops = c.ops.WithIdempotencyKeys(e.idempotencyKeys(hs))
	switch cmd {
	case "dlq":
		return dlqCmd(ctx, c, args)
	case "keys":
		return keysCmd(ctx, c, args)
	case "positions":
		return positionsCmd(ctx, c, args)
	case "trace":
		return traceCmd(ctx, c, args)
	}
	return fmt.Errorf("unknown operator command %q", cmd)
}

// groupTopics returns the source topics group has positions for in Postgres (not its retry
// tiers', which have positions too).
func groupTopics(ctx context.Context, pool *pgxpool.Pool, schema, group string) ([]string, error) {
	rows, err := pool.Query(ctx, `SELECT DISTINCT topic FROM `+pgx.Identifier{schema, "offsets"}.Sanitize()+` WHERE consumer_group = $1 ORDER BY topic`, group)
	if err != nil {
		return nil, err
	}
	all, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	tier := "." + group + ".retry."
	return slices.DeleteFunc(all, func(t string) bool {
		i := strings.LastIndex(t, tier)
		if i <= 0 {
			return false
		}
		_, err := strconv.Atoi(t[i+len(tier):])
		return err == nil
	}), nil
}

// usageError is bad usage of an operator command: exit status 2, with the message.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// usagef returns a usageError.
func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

// flags returns a flag set for a subcommand that reports its errors as usage errors.
func (c *opsCmd) flags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(c.prog+" "+name, flag.ContinueOnError)
	fs.SetOutput(c.err)
	return fs
}

// parse parses args with fs; a bad flag is a usageError (flag has printed the usage).
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return errHelpShown
		}
		return &usageError{err.Error()}
	}
	return nil
}

// errHelpShown: the command printed its help as asked; exit 0.
var errHelpShown = errors.New("help shown")

// table returns a tabwriter for aligned columns on c.out; Flush it.
func (c *opsCmd) table() *tabwriter.Writer { return tabwriter.NewWriter(c.out, 0, 0, 2, ' ', 0) }

// json writes v as indented JSON on stdout.
func (c *opsCmd) json(v any) error {
	enc := json.NewEncoder(c.rawOut)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// defaultActor is the OS user running the command.
func defaultActor() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	return "unknown"
}
