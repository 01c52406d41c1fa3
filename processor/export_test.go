package processor

import "time"

// SetReadBackPause slows the read back of a fork down by d a record (for a read back longer than
// the batch transaction's idle timeout), until the function it returns is called.
func SetReadBackPause(d time.Duration) (restore func()) {
	readBackPause.Store(int64(d))
	return func() { readBackPause.Store(0) }
}

// SetReadBackChunks makes a read back read n records a chunk and tells done of each chunk it
// finished (an error ends the read back there), until the function it returns is called.
func SetReadBackChunks(n int64, done func(from, to int64) error) (restore func()) {
	was := readBackChunk
	readBackChunk, readBackChunkDone = n, done
	return func() { readBackChunk, readBackChunkDone = was, nil }
}

// SetWindowEvery makes processors read the upgrade window every d, until the function it returns
// is called.
func SetWindowEvery(d time.Duration) (restore func()) {
	was := windowEvery
	windowEvery = d
	return func() { windowEvery = was }
}
