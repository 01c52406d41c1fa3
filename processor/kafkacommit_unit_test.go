package processor

import (
	"crypto/rand"
	"encoding/base64"
	"io"
	"testing"
)

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
		// Captured from a franz-go v1.22.3 client under the consumer protocol against kfake
		// (TestNewBuildOnTheOldReleasesConsumerProtocolCommits).
		{"an earlier release (consumer-protocol member id)", "aLGwFOiptr_8qct5sMouZA==", true, 0, false},
		{"another consumer", "kgo-1b2c", false, 0, false},
		{"another franz-go consumer (classic member id)", "kgo-6f1c0a2e-8a7d-4e1b-9c1e-0d3f5a7b9c2d", false, 0, false},
		{"a Java consumer-protocol member id (Kafka's Uuid, unpadded)", "gAKkMfikjElZs46JsJjhyQ", false, 0, false},
		{"padding bits set (not an encoding of 16 bytes)", "gAKkMfikjElZs46JsJjhyR==", false, 0, false},
		{"standard base64 alphabet", "gAKkMfikjElZs46J+Jjh/Q==", false, 0, false},
		{"24 characters of something else", "gAKkMfikjElZs46JsJjhyQ=x", false, 0, false},
		{"a padded base64 of another length", "gAKkMfikjElZs46JsJjhyQAB", false, 0, false},
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

// TestCommitMetaOfFranzGoConsumerMemberIDs: every member id franz-go can make under the consumer
// protocol is recognised. They are made here as franz-go v1.22.3 makes them (newStringUUID in
// pkg/kgo/consumer_group_848.go), the last byte run through all its values, which are all that
// decide the character before the padding.
func TestCommitMetaOfFranzGoConsumerMemberIDs(t *testing.T) {
	for last := range 256 {
		var uuid [16]byte
		if _, err := io.ReadFull(rand.Reader, uuid[:15]); err != nil {
			t.Fatal(err)
		}
		uuid[15] = byte(last)
		id := base64.URLEncoding.EncodeToString(uuid[:])
		if ours, _, known := parseCommitMeta(id); !ours || known {
			t.Fatalf("parseCommitMeta(%q) = %v, _, %v; want ours, start unknown", id, ours, known)
		}
	}
}
