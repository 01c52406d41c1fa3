package main

import (
	"bytes"
	"context"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/internal/topicread"
)

func TestDevbrokerServesKafkaProtocol(t *testing.T) {
	ctx := context.Background()
	addr, stop := startBroker(t, "-listen", "127.0.0.1:0", "-partitions", "3")

	cl, err := kgo.NewClient(kgo.SeedBrokers(addr))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	// Created through the admin API with the broker's default partition count.
	resp, err := adm.CreateTopic(ctx, -1, -1, nil, "t")
	if err != nil || resp.Err != nil {
		t.Fatalf("create topic: %v %v", err, resp.Err)
	}
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "t", Value: []byte("v")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	details, err := adm.ListTopics(ctx, "t")
	if err != nil || len(details["t"].Partitions) != 3 {
		t.Fatalf("topic t: %+v, %v; want 3 partitions", details["t"], err)
	}

	code, stderr := stop()
	if code != 0 {
		t.Fatalf("exit status %d", code)
	}
	if !strings.Contains(stderr, "Do not use it in production") {
		t.Fatalf("no production warning in %q", stderr)
	}
}

func TestDevbrokerRejectsBadListen(t *testing.T) {
	var stderr bytes.Buffer
	if code := run(context.Background(), []string{"-listen", "nonsense"}, &stderr, nil); code != 2 {
		t.Fatalf("exit status %d, want 2", code)
	}
	if !strings.Contains(stderr.String(), "-listen") {
		t.Fatalf("error does not name -listen: %q", stderr.String())
	}
}

// startBroker runs devbroker with args until the test ends and returns the address it reports;
// stop stops it and returns its exit status and what it wrote to stderr.
func startBroker(t *testing.T, args ...string) (addr string, stop func() (int, string)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var stderr bytes.Buffer
	ready := make(chan string, 1)
	done := make(chan int, 1)
	go func() { done <- run(ctx, args, &stderr, ready) }()
	select {
	case addr = <-ready:
	case code := <-done:
		t.Fatalf("devbroker exited with %d: %s", code, stderr.String())
	case <-time.After(10 * time.Second):
		t.Fatal("devbroker did not start")
	}
	var once sync.Once
	var code int
	stop = func() (int, string) {
		once.Do(func() {
			cancel()
			code = <-done
		})
		return code, stderr.String()
	}
	t.Cleanup(func() { stop() })
	return addr, stop
}

// TestDevbrokerAdvertise: clients that reach the broker through a proxy are told to keep using
// the proxy, so cutting the proxy cuts them off.
func TestDevbrokerAdvertise(t *testing.T) {
	listen := testenv.FreeAddr(t)
	proxy := testenv.NewProxy(t, listen)
	addr, _ := startBroker(t, "-listen", listen, "-advertise", proxy.Addr())
	if addr != proxy.Addr() {
		t.Fatalf("broker reports %s, want the advertised %s", addr, proxy.Addr())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl, err := kgo.NewClient(kgo.SeedBrokers(proxy.Addr()), kgo.RequestRetries(0), kgo.RetryTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	if resp, err := adm.CreateTopic(ctx, 1, -1, nil, "t"); err != nil || resp.Err != nil {
		t.Fatalf("create topic through the proxy: %v %v", err, resp.Err)
	}
	brokers, err := adm.ListBrokers(ctx)
	if err != nil || len(brokers) != 1 || net.JoinHostPort(brokers[0].Host, strconv.Itoa(int(brokers[0].Port))) != proxy.Addr() {
		t.Fatalf("metadata lists brokers %+v (%v), want only %s", brokers, err, proxy.Addr())
	}
	proxy.Cut()
	cctx, ccancel := context.WithTimeout(ctx, 3*time.Second)
	defer ccancel()
	if err := cl.ProduceSync(cctx, &kgo.Record{Topic: "t", Value: []byte("v")}).FirstErr(); err == nil {
		t.Fatal("produce succeeded with the proxy cut: the client bypasses the advertised address")
	}
}

// TestDevbrokerDataDir: with -data-dir, topics and records survive a restart.
func TestDevbrokerDataDir(t *testing.T) {
	dir := t.TempDir()
	listen := testenv.FreeAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	addr, stop := startBroker(t, "-listen", listen, "-data-dir", dir)
	cl, err := kgo.NewClient(kgo.SeedBrokers(addr))
	if err != nil {
		t.Fatal(err)
	}
	if resp, err := kadm.NewClient(cl).CreateTopic(ctx, 2, -1, nil, "kept"); err != nil || resp.Err != nil {
		t.Fatalf("create topic: %v %v", err, resp.Err)
	}
	if err := cl.ProduceSync(ctx, &kgo.Record{Topic: "kept", Value: []byte("survives")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	stop()

	addr, _ = startBroker(t, "-listen", listen, "-data-dir", dir)
	recs, err := topicread.All(ctx, []string{addr}, "kept")
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 || string(recs[0].Value) != "survives" {
		t.Fatalf("after restart the topic holds %d records, want the one produced before", len(recs))
	}
}
