package processor

import "testing"

func TestCommitMeta(t *testing.T) {
	tests := []struct {
		name      string
		meta      string
		wantOurs  bool
		wantStart int64
		wantKnown bool
	}{
		{"this release", commitMeta(1234, true), true, 1234, true},
		{"start unknown", commitMeta(0, false), true, 0, false},
		{"an earlier release (classic member id)", "kafkapg-6f1c0a2e-8a7d-4e1b-9c1e-0d3f5a7b9c2d", true, 0, false},
		{"another consumer", "kgo-1b2c", false, 0, false},
		{"none", "", false, 0, false},
		{"garbled start", "kafkapg start=x", true, 0, false},
		{"negative start", "kafkapg start=-5", true, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ours, start, known := parseCommitMeta(tt.meta)
			if ours != tt.wantOurs || start != tt.wantStart || known != tt.wantKnown {
				t.Errorf("parseCommitMeta(%q) = %v, %d, %v; want %v, %d, %v", tt.meta, ours, start, known, tt.wantOurs, tt.wantStart, tt.wantKnown)
			}
		})
	}
}
