package main

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/localrun"
)

// operator plays the operator after the run, with the processor still running: the dead
// letters are listed, one is traced, all are replayed (dry run, then --execute) with the
// processor binary's own commands, and then replayed once more. It returns the events the
// replay recovered, for the ledger's check.
func operator(ctx context.Context, bin string, env []string, pool *pgxpool.Pool, items []ledger.Item) (map[string]bool, error) {
	run := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, filepath.Join(bin, "processor"), args...)
		cmd.Env = env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		fmt.Printf("\n  $ processor %s\n", strings.Join(quote(args), " "))
		for _, l := range strings.Split(strings.TrimRight(out.String(), "\n"), "\n") {
			fmt.Printf("    %s\n", l)
		}
		if err != nil {
			return out.String(), fmt.Errorf("processor %s: %v", strings.Join(args, " "), err)
		}
		return out.String(), nil
	}
	fmt.Println("\noperator   the dead letters, as an operator finds them (the processor keeps running):")
	if _, err := run("dlq", "list", "--summary"); err != nil {
		return nil, err
	}
	// A flaky event that outlasted the tiers: a replay recovers it.
	var id, partition, offset int64
	err := pool.QueryRow(ctx, `SELECT id, partition, "offset" FROM dead_letters WHERE error_class = 'retryable' ORDER BY id LIMIT 1`).Scan(&id, &partition, &offset)
	if err != nil {
		return nil, fmt.Errorf("find a retryable dead letter: %w", err)
	}
	if _, err := run("dlq", "show", fmt.Sprint(id)); err != nil { // its value decoded, in Avro
		return nil, err
	}
	if _, err := run("trace", "--topic", topic, "--partition", fmt.Sprint(partition), "--offset", fmt.Sprint(offset)); err != nil {
		return nil, err
	}
	if _, err := run("dlq", "replay"); err != nil {
		return nil, err
	}
	if _, err := run("dlq", "replay", "--execute", "--reason", "demo: the flaky dependency is fixed", "--actor", "demo", "--wait", "1m"); err != nil {
		return nil, err
	}
	if _, err := run("trace", "--topic", topic, "--partition", fmt.Sprint(partition), "--offset", fmt.Sprint(offset)); err != nil {
		return nil, err
	}
	// Replaying again applies nothing twice: the replayed rows are no longer new, and the
	// poison ones die again in their own rows.
	before, err := ledger.ReadProgress(ctx, pool, schema, group)
	if err != nil {
		return nil, err
	}
	if _, err := run("dlq", "replay", "--execute", "--reason", "demo: replaying again changes nothing", "--actor", "demo", "--wait", "1m"); err != nil {
		return nil, err
	}
	after, err := ledger.ReadProgress(ctx, pool, schema, group)
	if err != nil {
		return nil, err
	}
	if after.Applied != before.Applied || after.DeadRows != before.DeadRows {
		return nil, fmt.Errorf("replaying again changed the ledger (%d -> %d events) or the dead letters (%d -> %d rows)",
			before.Applied, after.Applied, before.DeadRows, after.DeadRows)
	}
	if _, err := run("dlq", "tasks"); err != nil {
		return nil, err
	}
	if err := localrun.WaitFor(ctx, time.Minute, func() error {
		var replaying int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM dead_letters WHERE status = 'replaying'`).Scan(&replaying); err != nil {
			return err
		}
		if replaying > 0 {
			return fmt.Errorf("%d dead letters still replaying", replaying)
		}
		return nil
	}); err != nil {
		return nil, err
	}
	recovered := map[string]bool{}
	rows, err := pool.Query(ctx, `SELECT value FROM dead_letters WHERE status = 'replayed'`) // bytes: Avro, or JSON
	if err != nil {
		return nil, err
	}
	byValue := map[string]ledger.Item{}
	for _, it := range items {
		byValue[string(it.Value)] = it
	}
	for rows.Next() {
		var v []byte
		if err := rows.Scan(&v); err != nil {
			rows.Close()
			return nil, err
		}
		it, ok := byValue[string(v)]
		if !ok || it.Kind != ledger.KindFlaky {
			rows.Close()
			return nil, fmt.Errorf("a replay applied a record that must never apply: %.80q", v)
		}
		recovered[it.Event.EventID] = true
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	for _, it := range items {
		if it.Kind == ledger.KindFlaky && it.Dead(maxAttempt) && !recovered[it.Event.EventID] {
			return nil, fmt.Errorf("flaky event %s outlasted the tiers but the replay did not recover it", it.Event.EventID)
		}
	}
	return recovered, nil
}

// quote quotes the arguments that need it for a shell.
func quote(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		if strings.ContainsAny(a, " :'\"") {
			a = "'" + a + "'"
		}
		out[i] = a
	}
	return out
}
