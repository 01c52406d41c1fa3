package processor_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/kafkapg/kafkapg/processor"
)

// A handler decides what happens to a record that fails by the error it returns.
func ExampleClassify() {
	bad := errors.New("amount is not a number")
	fmt.Println(processor.Classify(processor.Permanent(bad)))                // dead-lettered at once
	fmt.Println(processor.Classify(fmt.Errorf("call pricing API: %w", bad))) // retried, then dead-lettered
	fmt.Println(processor.Classify(processor.Infrastructure(bad)))           // partition waits, retries in place
	// Output:
	// permanent
	// retryable
	// infrastructure
}

// A batch handler says which record of the batch failed; the records before it are applied
// without it.
func ExampleRecordFailed() {
	var h processor.BatchHandler = batchFunc(func(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
		for i, r := range recs {
			if len(r.Value) == 0 {
				return processor.RecordFailed(i, processor.Permanent(errors.New("empty value")))
			}
		}
		return nil
	})
	err := h.HandleBatch(context.Background(), nil, []*processor.Record{{Value: []byte("x")}, {}})
	var re *processor.RecordError
	fmt.Println(errors.As(err, &re), re.Index, processor.Classify(err))
	// Output: true 1 permanent
}

type batchFunc func(context.Context, pgx.Tx, []*processor.Record) error

func (f batchFunc) HandleBatch(ctx context.Context, tx pgx.Tx, recs []*processor.Record) error {
	return f(ctx, tx, recs)
}
