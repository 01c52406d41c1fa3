package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/internal/upgrade"
)

const upgradeUsage = `usage: %[1]s upgrade status
       %[1]s upgrade finalize [--execute --reason R] [--unchecked]

The upgrade window (docs/upgrading.md): while migrations the release before does not know are
pending, its processes may run beside this release on the schema, and a rollback to it works.

  status    the window, and each member of the schema's groups with the release it runs
            (KAFKA_BROKERS to ask the broker; without it, the window only)
  finalize  close the window: the release before refuses the schema from then on. Refused while
            a member of the release before runs in any group of the schema (asked of the broker
            at KAFKA_BROKERS; --unchecked skips that, on your word). A dry run without --execute.
`

// upgradeCmd runs `upgrade status|finalize`.
func upgradeCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	prog := progName()
	out, errw := safetext.TerminalWriter(stdout), safetext.TerminalWriter(stderr)
	if len(args) == 0 || (args[0] != "status" && args[0] != "finalize") {
		fmt.Fprintf(errw, upgradeUsage, prog)
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
			return errHelpShown
		}
		return usagef("upgrade: want status or finalize")
	}
	fs := flag.NewFlagSet(prog+" upgrade "+args[0], flag.ContinueOnError)
	fs.SetOutput(errw)
	execute := fs.Bool("execute", false, "finalize: do it (without: a dry run that changes nothing)")
	reason := fs.String("reason", "", "finalize: why (required with --execute)")
	unchecked := fs.Bool("unchecked", false, "finalize: do not ask the broker for members of the release before")
	if err := parse(fs, args[1:]); err != nil {
		return err
	}
	e, err := loadDBEnv()
	if err != nil {
		return err
	}
	var sec kafkaSecurityEnv
	var brokers struct {
		KafkaBrokers []string `envconfig:"KAFKA_BROKERS"`
	}
	if err := errors.Join(process(&sec), process(&brokers)); err != nil {
		return &configError{err}
	}
	pool, adapt, err := openPool(ctx, e)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := adapt(ctx, nil); err != nil {
		return fmt.Errorf("database: %w", err)
	}
	var adm *kadm.Client
	if bs := cleanList(brokers.KafkaBrokers); len(bs) > 0 && !(args[0] == "finalize" && *unchecked) {
		opts, err := sec.options()
		if err != nil {
			return &configError{err}
		}
		cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(bs...)}, opts...)...)
		if err != nil {
			return &configError{fmt.Errorf("KAFKA_BROKERS: %w", err)}
		}
		defer cl.Close()
		adm = kadm.NewClient(cl)
	} else if args[0] == "finalize" && !*unchecked {
		return &configError{errors.New("KAFKA_BROKERS is required for upgrade finalize: it asks the broker whether a member of the release before still runs (or give --unchecked)")}
	}
	s, err := upgrade.Read(ctx, pool, e.DBSchema, adm)
	if err != nil {
		return err
	}
	printUpgrade(out, e.DBSchema, s, adm != nil)
	if args[0] == "status" {
		return nil
	}
	if !s.Open() {
		fmt.Fprintln(errw, "the window is closed: nothing to finalize")
		return nil
	}
	if !*execute {
		if before := s.Before(); len(before) > 0 {
			fmt.Fprintf(errw, "dry run: finalize would be refused: %d members of the release before run\n", len(before))
		} else {
			fmt.Fprintf(errw, "dry run: finalize would make versions %v final; the release before would refuse the schema from then on (run again with --execute --reason R)\n", s.Pending)
		}
		return nil
	}
	if strings.TrimSpace(*reason) == "" {
		return usagef("--execute needs --reason: why you finalize the upgrade now")
	}
	moved, err := upgrade.Finalize(ctx, pool, e.DBSchema, adm) // adm is nil only with --unchecked: checked again, at the last moment
	if err != nil {
		return err
	}
	fmt.Fprintf(errw, "finalized versions %v of schema %s (actor %s, reason %s): the release before refuses the schema from now on\n",
		moved, e.DBSchema, defaultActor(), safetext.Text(oneLine(*reason), 200))
	return nil
}

func printUpgrade(w io.Writer, schemaName string, s upgrade.Status, asked bool) {
	state := "closed"
	if s.Open() {
		state = fmt.Sprintf("open: versions %v pending", s.Pending)
	}
	fmt.Fprintf(w, "schema %s: version %d final; upgrade window %s\n", schemaName, s.Finalized, state)
	groups := strings.Join(s.Groups, ", ")
	if groups == "" {
		groups = "none yet"
	}
	if !asked {
		fmt.Fprintf(w, "groups: %s (members not asked: set KAFKA_BROKERS)\n", groups)
		return
	}
	if len(s.Members) == 0 {
		fmt.Fprintf(w, "groups: %s; no member in any of them now\n", groups)
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "GROUP\tMEMBER\tCLIENT\tHOST\tRELEASE")
	for _, m := range s.Members {
		rel := m.Release
		if rel == "" {
			rel = "before (none said)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", m.Group, m.MemberID, m.ClientID, m.Host, rel)
	}
	tw.Flush()
}
