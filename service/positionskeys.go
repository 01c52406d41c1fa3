package service

import (
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/processor"
)

// idempotencyKeys is how a rewind's dry run (positions set) finds its records' idempotency keys:
// the schema's key ring, and each topic's key function as the service has it
// (TOPIC_<topic>_IDEMPOTENCY_KEY, or its handler's; a handler's only with HANDLER set).
func (e *env) idempotencyKeys(hs *registry) ops.IdempotencyKeys {
	return ops.IdempotencyKeys{Ring: keyring.New(e.DBSchema), Of: func(topic string) func(*kgo.Record) ([]byte, error) {
		tp, _ := e.topicPolicy(hs, topic)
		key := tp.IdempotencyKey
		if key == nil {
			return nil
		}
		return func(r *kgo.Record) (k []byte, err error) {
			defer func() {
				if v := recover(); v != nil {
					err = fmt.Errorf("the idempotency key function panicked: %v", v)
				}
			}()
			return key(&processor.Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value,
				Headers: r.Headers, Timestamp: r.Timestamp, Attempt: 1})
		}
	}}
}
