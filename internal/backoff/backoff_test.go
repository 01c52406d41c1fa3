package backoff

import (
	"context"
	"testing"
	"time"
)

func TestDelayBounds(t *testing.T) {
	t.Parallel()
	p := Policy{Base: 100 * time.Millisecond, Max: time.Second}
	tests := []struct {
		n        int
		min, max time.Duration
	}{
		{n: 0, min: 50 * time.Millisecond, max: 100 * time.Millisecond},
		{n: 1, min: 50 * time.Millisecond, max: 100 * time.Millisecond},
		{n: 2, min: 100 * time.Millisecond, max: 200 * time.Millisecond},
		{n: 4, min: 400 * time.Millisecond, max: 800 * time.Millisecond},
		{n: 5, min: 500 * time.Millisecond, max: time.Second},
		{n: 500, min: 500 * time.Millisecond, max: time.Second},
	}
	for _, tt := range tests {
		for range 200 {
			if d := p.Delay(tt.n); d < tt.min || d > tt.max {
				t.Fatalf("Delay(%d) = %v, want within [%v, %v]", tt.n, d, tt.min, tt.max)
			}
		}
	}
}

func TestDelayJitters(t *testing.T) {
	t.Parallel()
	p := Policy{Base: time.Second, Max: time.Second}
	seen := map[time.Duration]bool{}
	for range 50 {
		seen[p.Delay(1)] = true
	}
	if len(seen) < 10 {
		t.Fatalf("50 delays gave only %d distinct values; jitter is missing", len(seen))
	}
}

func TestSleepStops(t *testing.T) {
	t.Parallel()
	stop := make(chan struct{})
	close(stop)
	if Sleep(context.Background(), stop, time.Hour) {
		t.Fatal("Sleep reported a full delay although stop was closed")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Sleep(ctx, nil, time.Hour) {
		t.Fatal("Sleep reported a full delay although ctx was done")
	}
	if !Sleep(context.Background(), nil, time.Millisecond) {
		t.Fatal("Sleep did not report a full delay")
	}
}
