package kafkacluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// How long Kill and Stop wait for the JVM to exit when ctx allows longer: a SIGKILLed process
// is gone within milliseconds; a controlled shutdown that takes more than a minute is stuck
// (the script's `node N stop` gives up at the same bound).
const (
	killWait = 10 * time.Second
	stopWait = 60 * time.Second
)

// procState is what /proc says about a node's pid file.
type procState int

const (
	procGone    procState = iota // no pid file, no such process, a zombie, or a recycled pid
	procRunning                  // the node's JVM, running (or sleeping)
	procFrozen                   // the node's JVM, stopped by SIGSTOP
)

// pid returns the pid in node id's pid file and the state of that process. A pid that now
// belongs to another program (the JVM exited and the pid was reused) counts as gone: signals
// go only to the JVM whose command line names this node's server.properties.
func (c *Cluster) pid(id int32) (int, procState) {
	n, ok := c.nodes[id]
	if !ok {
		return 0, procGone
	}
	b, err := os.ReadFile(n.pidFile)
	if err != nil {
		return 0, procGone
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, procGone
	}
	return pid, processState(pid, n.props)
}

// processState reads /proc/pid: the JVM is identified by kafka.Kafka and its properties file on
// its command line (a zombie has an empty one), and "T" in /proc/pid/stat means stopped.
func processState(pid int, props string) procState {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return procGone
	}
	args := bytes.Split(cmdline, []byte{0})
	if !containsArg(args, "kafka.Kafka") || !containsArg(args, props) {
		return procGone
	}
	st, ok := readStat(pid)
	if !ok {
		return procGone
	}
	switch st.state {
	case 'Z', 'X':
		return procGone
	case 'T', 't':
		return procFrozen
	default:
		return procRunning
	}
}

// stat is what Kill and Stop need from /proc/pid/stat.
type stat struct {
	state   byte   // R, S, D, T, Z, ...
	threads int    // num_threads
	start   uint64 // starttime, in clock ticks since boot: tells a pid's reuse apart
}

func readStat(pid int) (stat, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return stat{}, false
	}
	// "pid (comm) state ...": comm may hold spaces and parentheses, so cut at the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return stat{}, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 || len(f[0]) != 1 {
		return stat{}, false
	}
	threads, err1 := strconv.Atoi(f[17])            // field 20
	start, err2 := strconv.ParseUint(f[19], 10, 64) // field 22
	if err1 != nil || err2 != nil {
		return stat{}, false
	}
	return stat{state: f[0][0], threads: threads, start: start}, true
}

// exited reports whether the process pid that started at start has exited completely. A JVM's
// main thread exits first and shows as a zombie with an empty command line while its other
// threads are still exiting and its sockets are still open (a node started again then finds
// its port taken): only a zombie left with one thread, itself, is done. A different start time
// means the pid was reaped and reused.
func exited(pid int, start uint64) bool {
	st, ok := readStat(pid)
	if !ok || st.start != start {
		return true
	}
	return (st.state == 'Z' || st.state == 'X') && st.threads <= 1
}

func containsArg(args [][]byte, want string) bool {
	for _, a := range args {
		if string(a) == want {
			return true
		}
	}
	return false
}

// Running reports whether node id's JVM is alive; a frozen node is alive.
func (c *Cluster) Running(id int32) bool {
	_, st := c.pid(id)
	return st != procGone
}

// Frozen reports whether node id's JVM is stopped by Freeze.
func (c *Cluster) Frozen(id int32) bool {
	_, st := c.pid(id)
	return st == procFrozen
}

// Pid returns the pid of node id's JVM, or an error if it is not running.
func (c *Cluster) Pid(id int32) (int, error) {
	if err := c.known(id); err != nil {
		return 0, err
	}
	pid, st := c.pid(id)
	if st == procGone {
		return 0, fmt.Errorf("node %d is not running (pid file %s)", id, c.nodes[id].pidFile)
	}
	return pid, nil
}

// Kill sends SIGKILL to node id's JVM, an unclean crash, and waits until the process is gone
// (at most 10 s, or until ctx ends).
func (c *Cluster) Kill(ctx context.Context, id int32) error {
	pid, start, err := c.target(id)
	if err != nil {
		return fmt.Errorf("kill node %d: %w", id, err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill node %d (pid %d): %w", id, pid, err)
	}
	if err := waitExited(ctx, pid, start, killWait); err != nil {
		return fmt.Errorf("kill node %d (pid %d): %w", id, pid, err)
	}
	return nil
}

// Stop sends SIGTERM to node id's JVM, a controlled shutdown (the node moves its leaderships to
// other brokers, then exits), and waits until the process is gone (at most 60 s, or until ctx
// ends). A frozen node is thawed after the signal, since a stopped process handles no signal.
func (c *Cluster) Stop(ctx context.Context, id int32) error {
	pid, start, err := c.target(id)
	if err != nil {
		return fmt.Errorf("stop node %d: %w", id, err)
	}
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		return fmt.Errorf("stop node %d (pid %d): %w", id, pid, err)
	}
	_ = syscall.Kill(pid, syscall.SIGCONT)
	if err := waitExited(ctx, pid, start, stopWait); err != nil {
		return fmt.Errorf("stop node %d (pid %d): controlled shutdown did not finish: %w%s", id, pid, err, c.logTail(id))
	}
	return nil
}

// Freeze sends SIGSTOP to node id's JVM and waits (briefly) until the kernel reports it stopped.
func (c *Cluster) Freeze(id int32) error {
	return c.signalState(id, syscall.SIGSTOP, procFrozen, "freeze")
}

// Thaw sends SIGCONT to node id's JVM, which runs on from where Freeze stopped it.
func (c *Cluster) Thaw(id int32) error {
	return c.signalState(id, syscall.SIGCONT, procRunning, "thaw")
}

func (c *Cluster) signalState(id int32, sig syscall.Signal, want procState, what string) error {
	pid, err := c.Pid(id)
	if err != nil {
		return fmt.Errorf("%s node %d: %w", what, id, err)
	}
	if err := syscall.Kill(pid, sig); err != nil {
		return fmt.Errorf("%s node %d (pid %d): %w", what, id, pid, err)
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		_, st := c.pid(id)
		switch {
		case st == want:
			return nil
		case st == procGone:
			return fmt.Errorf("%s node %d (pid %d): the process is gone", what, id, pid)
		case time.Now().After(deadline):
			return fmt.Errorf("%s node %d (pid %d): the process did not change state within 2s", what, id, pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// target returns the pid of node id's JVM and its start time, for a signal and the wait after it.
func (c *Cluster) target(id int32) (int, uint64, error) {
	pid, err := c.Pid(id)
	if err != nil {
		return 0, 0, err
	}
	st, ok := readStat(pid)
	if !ok {
		return 0, 0, fmt.Errorf("node %d (pid %d) exited just now", id, pid)
	}
	return pid, st.start, nil
}

var errStillRunning = errors.New("the process is still running")

// waitExited polls until process pid (started at start) has exited completely, for at most
// bound or until ctx ends.
func waitExited(ctx context.Context, pid int, start uint64, bound time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if exited(pid, start) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %w", errStillRunning, context.Cause(ctx))
		case <-tick.C:
		}
	}
}

// logTail returns the last lines of node id's log, as a suffix for an error message.
func (c *Cluster) logTail(id int32) string {
	const lines = 30
	b, err := os.ReadFile(c.nodes[id].logFile)
	if err != nil || len(b) == 0 {
		return ""
	}
	all := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return fmt.Sprintf("\n----- last %d lines of %s -----\n%s\n-----", len(all), c.nodes[id].logFile, strings.Join(all, "\n"))
}
