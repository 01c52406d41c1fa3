package sink

import (
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"
)

// SplitHeaders splits record headers into the two arrays kafkapg's tables store them as
// (header_keys bytea[], header_values bytea[]). Keys are bytes, as in Kafka: they may hold NUL
// and invalid UTF-8, which a text column would refuse.
func SplitHeaders(hs []kgo.RecordHeader) (keys, vals [][]byte) {
	keys = make([][]byte, len(hs))
	vals = make([][]byte, len(hs))
	for i, h := range hs {
		keys[i], vals[i] = []byte(h.Key), h.Value
	}
	return keys, vals
}

// JoinHeaders is the inverse of SplitHeaders. Arrays of different lengths (a row edited by
// hand) are an error rather than silently truncated headers.
func JoinHeaders(keys, vals [][]byte) ([]kgo.RecordHeader, error) {
	if len(keys) != len(vals) {
		return nil, fmt.Errorf("%d header keys but %d values", len(keys), len(vals))
	}
	if len(keys) == 0 {
		return nil, nil
	}
	out := make([]kgo.RecordHeader, len(keys))
	for i := range keys {
		out[i] = kgo.RecordHeader{Key: string(keys[i]), Value: vals[i]}
	}
	return out, nil
}
