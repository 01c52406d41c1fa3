// Command kafkapg is the local development loop of a service built on kafkapg: a Kafka-protocol
// broker and a Postgres server on this machine, the topics the service reads and writes, test
// records put on a topic, and what the service emitted read back. It needs Go and the
// PostgreSQL server binaries, nothing running. It is for development and tests, not production.
//
// From a service's own module (Go 1.26 and later, as kafkapg's go.mod says):
//
//	go get -tool github.com/kafkapg/kafkapg/cmd/kafkapg
//	go tool kafkapg dev -topics orders,inventory.reserved   # broker, Postgres, topics; Ctrl-C stops
//	. .kafkapg/env                                           # KAFKA_BROKERS, KAFKA_SASL_*, DATABASE_URL, in another shell
//	go tool kafkapg produce -topic orders -key-field order_id orders.jsonl
//	go tool kafkapg consume -topic inventory.reserved
//
// Commands:
//
//	dev      start a broker (kfake) and Postgres, create topics, write .kafkapg/env, and run
//	         until Ctrl-C, or run the command after -- with that environment and then stop
//	env      print the environment of the running dev loop (eval "$(go tool kafkapg env)")
//	produce  put records on a topic: one value from the flags, or JSON lines from files or stdin
//	consume  print a topic's records as JSON lines
//	topics   list topics, or create some
//
// produce, consume and topics reach the broker given by -brokers, else KAFKA_BROKERS, else the
// dev loop's .kafkapg/env (in the current directory, or -dir), and log in (SASL) as
// KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD of the same place: this
// process's environment, or the env file.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

const usage = `usage: kafkapg <command> [flags]

  dev      start a broker and Postgres, create topics, write .kafkapg/env; run until Ctrl-C,
           or run the command after -- with that environment (dev -h for the flags)
  env      print the running dev loop's environment: eval "$(go tool kafkapg env)"
  produce  put records on a topic: -value, or JSON lines from files or stdin (produce -h)
  consume  print a topic's records as JSON lines (consume -h)
  topics   list topics; topics create NAME[:PARTITIONS] ...

For development and tests only: the broker is franz-go's kfake, not Apache Kafka.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

// run runs the command args name and returns the exit status: 0, 2 for bad usage, 1 otherwise.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	var err error
	switch args[0] {
	case "dev":
		err = devCmd(ctx, args[1:], stdout, stderr)
	case "env":
		err = envCmd(args[1:], stdout, stderr)
	case "produce":
		err = produceCmd(ctx, args[1:], stdin, stdout, stderr)
	case "consume":
		err = consumeCmd(ctx, args[1:], stdout, stderr)
	case "topics":
		err = topicsCmd(ctx, args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "kafkapg: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
	var ue usageError
	var ee exitError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &ee):
		return int(ee)
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "kafkapg %s: %v\n", args[0], err)
		return 2
	default:
		fmt.Fprintf(stderr, "kafkapg %s: %v\n", args[0], err)
		return 1
	}
}

// usageError is bad usage: exit status 2.
type usageError string

func (e usageError) Error() string { return string(e) }

func usagef(format string, args ...any) error { return usageError(fmt.Sprintf(format, args...)) }

// exitError is the exit status of the command dev ran, passed on.
type exitError int

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// parse parses args with fs, whose errors are usage errors.
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError(err.Error())
	}
	return nil
}
