package processor

import "github.com/kafkapg/kafkapg/offsets"

// SetWorkerBug makes the workers of topic's partitions meet err after each batch they apply, as
// a worker that met a bug would, until the function it returns is called.
func SetWorkerBug(topic string, err error) (restore func()) {
	bug := func(tp offsets.Partition) error {
		if tp.Topic == topic {
			return err
		}
		return nil
	}
	workerBug.Store(&bug)
	return func() { workerBug.Store(nil) }
}
