package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

func TestDevbrokerServesKafkaProtocol(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var stderr bytes.Buffer
	ready := make(chan string, 1)
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"-listen", "127.0.0.1:0", "-partitions", "3"}, &stderr, ready) }()
	var addr string
	select {
	case addr = <-ready:
	case code := <-done:
		t.Fatalf("devbroker exited with %d: %s", code, stderr.String())
	case <-time.After(10 * time.Second):
		t.Fatal("devbroker did not start")
	}

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

	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("exit status %d", code)
	}
	if !strings.Contains(stderr.String(), "Do not use it in production") {
		t.Fatalf("no production warning in %q", stderr.String())
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
