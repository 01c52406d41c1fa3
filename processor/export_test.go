package processor

import "time"

// SetReadBackPause slows the read back of a fork down by d a record (for a read back longer than
// the batch transaction's idle timeout), until the function it returns is called.
func SetReadBackPause(d time.Duration) (restore func()) {
	readBackPause.Store(int64(d))
	return func() { readBackPause.Store(0) }
}
