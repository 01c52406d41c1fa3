package kafkacluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Cluster is a multi-node cluster started by `scripts/kafka.sh cluster start` (three nodes,
// each a broker and a KRaft controller in one JVM). Its methods are safe for concurrent use.
type Cluster struct {
	script string
	dir    string
	ids    []int32
	nodes  map[int32]*node

	cl  *kgo.Client  // seeded with every node: for kadm's any-broker requests
	adm *kadm.Client // over cl
}

// node is one JVM of the cluster, as the script laid it out in <state dir>/node-N/.
type node struct {
	id      int32
	addr    string // the PLAINTEXT listener clients use, host:port
	props   string // server.properties: also how the JVM is told apart from other processes
	pidFile string
	logFile string
	cl      *kgo.Client // seeded with this node only, for requests that must reach it
}

// Attach finds the nodes of the cluster whose state directory is stateDir (KAFKA_CLUSTER_DIR of
// the script, /tmp/kafkapg-kafka-cluster by default): their ids, listeners, pid files and logs,
// read from node-N/server.properties. script is the path to scripts/kafka.sh, which Start and
// RollingRestart run. It fails if the directory holds no cluster or none of its nodes runs.
// Close releases the Kafka clients it opens.
func Attach(script, stateDir string) (*Cluster, error) {
	if st, err := os.Stat(script); err != nil {
		return nil, fmt.Errorf("attach to Kafka cluster: script: %w", err)
	} else if st.IsDir() || st.Mode()&0o111 == 0 {
		return nil, fmt.Errorf("attach to Kafka cluster: script %s is not an executable file", script)
	}
	script, err := filepath.Abs(script)
	if err != nil {
		return nil, fmt.Errorf("attach to Kafka cluster: %w", err)
	}
	// The script makes its state directory absolute and resolves symlinks, and each JVM's
	// command line names its server.properties by that path: do the same to recognise them.
	if stateDir, err = filepath.Abs(stateDir); err != nil {
		return nil, fmt.Errorf("attach to Kafka cluster: %w", err)
	}
	if resolved, err := filepath.EvalSymlinks(stateDir); err == nil {
		stateDir = resolved
	}
	c := &Cluster{script: script, dir: stateDir, nodes: map[int32]*node{}}

	props, _ := filepath.Glob(filepath.Join(stateDir, "node-*", "server.properties"))
	if len(props) == 0 {
		return nil, fmt.Errorf("attach to Kafka cluster: no cluster in %s (no node-N/server.properties); start one with `%s cluster start`", stateDir, script)
	}
	for _, p := range props {
		n, err := readNode(p)
		if err != nil {
			return nil, fmt.Errorf("attach to Kafka cluster: %w", err)
		}
		if _, dup := c.nodes[n.id]; dup {
			return nil, fmt.Errorf("attach to Kafka cluster: node.id %d appears twice in %s", n.id, stateDir)
		}
		c.nodes[n.id] = n
		c.ids = append(c.ids, n.id)
	}
	slices.Sort(c.ids)

	if !slices.ContainsFunc(c.ids, c.Running) {
		return nil, fmt.Errorf("attach to Kafka cluster: none of the nodes in %s is running (pid files node-N/kafka.pid); start the cluster with `%s cluster start`", stateDir, script)
	}

	if err := c.openClients(); err != nil {
		c.Close()
		return nil, fmt.Errorf("attach to Kafka cluster: %w", err)
	}
	return c, nil
}

// readNode reads node.id and the PLAINTEXT address from a node's server.properties.
func readNode(props string) (*node, error) {
	f, err := os.Open(props)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	kv := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == '!' {
			continue
		}
		if k, v, ok := strings.Cut(line, "="); ok {
			kv[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", props, err)
	}
	id, err := strconv.ParseInt(kv["node.id"], 10, 32)
	if err != nil {
		return nil, fmt.Errorf("%s: node.id %q: %w", props, kv["node.id"], err)
	}
	listeners := kv["advertised.listeners"]
	if listeners == "" {
		listeners = kv["listeners"]
	}
	var addr string
	for l := range strings.SplitSeq(listeners, ",") {
		if a, ok := strings.CutPrefix(strings.TrimSpace(l), "PLAINTEXT://"); ok {
			addr = a
			break
		}
	}
	if addr == "" {
		return nil, fmt.Errorf("%s: no PLAINTEXT listener in %q", props, listeners)
	}
	dir := filepath.Dir(props)
	return &node{
		id:      int32(id),
		addr:    addr,
		props:   props,
		pidFile: filepath.Join(dir, "kafka.pid"),
		logFile: filepath.Join(dir, "kafka.log"),
	}, nil
}

// requestTimeout bounds every request the Cluster sends: a frozen broker accepts connections
// (the kernel completes the handshake) and then never answers.
const requestTimeout = 3 * time.Second

func clientOpts(seeds ...string) []kgo.Opt {
	return []kgo.Opt{
		kgo.SeedBrokers(seeds...),
		kgo.ClientID("kafkapg-kafkacluster"),
		kgo.DialTimeout(time.Second),
		kgo.RetryTimeout(requestTimeout),
		kgo.RequestTimeoutOverhead(requestTimeout),
		kgo.MetadataMinAge(100 * time.Millisecond),
	}
}

func (c *Cluster) openClients() error {
	var err error
	if c.cl, err = kgo.NewClient(clientOpts(c.Brokers()...)...); err != nil {
		return err
	}
	c.adm = kadm.NewClient(c.cl)
	for _, id := range c.ids {
		n := c.nodes[id]
		if n.cl, err = kgo.NewClient(clientOpts(n.addr)...); err != nil {
			return err
		}
	}
	return nil
}

// Close closes the Kafka clients of the Cluster; the cluster itself keeps running.
func (c *Cluster) Close() {
	if c.cl != nil {
		c.cl.Close()
	}
	for _, n := range c.nodes {
		if n.cl != nil {
			n.cl.Close()
		}
	}
}

// Brokers returns the bootstrap addresses (host:port) of every node, in node id order.
func (c *Cluster) Brokers() []string {
	out := make([]string, len(c.ids))
	for i, id := range c.ids {
		out[i] = c.nodes[id].addr
	}
	return out
}

// Nodes returns the node ids, ascending (1, 2, 3).
func (c *Cluster) Nodes() []int32 { return slices.Clone(c.ids) }

// Addr returns the address of node id's broker, or "" if there is no such node.
func (c *Cluster) Addr(id int32) string {
	if n, ok := c.nodes[id]; ok {
		return n.addr
	}
	return ""
}

// StateDir returns the cluster's state directory.
func (c *Cluster) StateDir() string { return c.dir }

func (c *Cluster) known(id int32) error {
	if _, ok := c.nodes[id]; !ok {
		return fmt.Errorf("no node %d in the cluster at %s (nodes %v)", id, c.dir, c.ids)
	}
	return nil
}

// Start starts node id's JVM again on its existing data (`script node N start`) and returns once
// that broker serves requests and is registered in the cluster again; a node that is already
// running is only checked. The error carries the script's output, with the tail of the node's
// log. The script waits at most KAFKA_START_TIMEOUT (120 s by default), or until ctx ends.
func (c *Cluster) Start(ctx context.Context, id int32) error {
	if err := c.known(id); err != nil {
		return fmt.Errorf("start node %d: %w", id, err)
	}
	if err := c.run(ctx, "node", strconv.Itoa(int(id)), "start"); err != nil {
		return fmt.Errorf("start node %d: %w", id, err)
	}
	return nil
}

// RollingRestart restarts every node in turn with a controlled shutdown
// (`script cluster rolling-restart`), waiting before each node and at the end until every
// partition of every topic is fully in sync.
func (c *Cluster) RollingRestart(ctx context.Context) error {
	if err := c.run(ctx, "cluster", "rolling-restart"); err != nil {
		return fmt.Errorf("rolling restart: %w", err)
	}
	return nil
}

// run runs the script with args against this cluster's state directory.
func (c *Cluster) run(ctx context.Context, args ...string) error {
	cmd := exec.CommandContext(ctx, c.script, args...)
	cmd.Env = append(os.Environ(), "KAFKA_CLUSTER_DIR="+c.dir)
	// The JVM a `node N start` launches writes only to its log file, but should anything keep a
	// copy of the output pipe open, do not wait on it forever.
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		msg := strings.TrimSpace(string(out))
		var exit *exec.ExitError
		if errors.As(err, &exit) && msg != "" {
			return fmt.Errorf("%s %s: %w:\n%s", filepath.Base(c.script), strings.Join(args, " "), err, msg)
		}
		return fmt.Errorf("%s %s: %w", filepath.Base(c.script), strings.Join(args, " "), err)
	}
	return nil
}
