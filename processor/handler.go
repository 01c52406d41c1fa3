package processor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/retrytopics"
)

// Record is one Kafka record handed to a Handler. Whichever way it arrives (from its source
// topic, from a retry tier, or parked behind its key), Topic, Partition, Offset, Key, Value,
// Headers and Timestamp are those of the record in its source topic; kafkapg's own headers are
// removed.
type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []kgo.RecordHeader
	Timestamp time.Time
	// Attempt is the delivery attempt: 1 for the first delivery (from the source topic, or after
	// waiting behind its key), n+1 from retry tier n. Retries inside one delivery (see
	// Config.LocalAttempts) do not change it.
	Attempt int

	consumed    int64 // offset in the partition it was consumed from (source topic or tier)
	leaderEpoch int32
	stage       retrytopics.Stage
	ordered     bool      // its key orders it: a non-null key, from a source topic
	foreign     bool      // read from a retry tier without valid kafkapg headers: no origin to retry
	notOurs     bool      // read from a retry tier, but another group's or source topic's record: skipped
	control     bool      // a Kafka transaction marker: skipped, the offset moves past it
	firstFailed time.Time // zero until its first failure
}

// size is what Config.MaxRecordBytes bounds: key, value and headers.
func (r *Record) size() int {
	n := len(r.Key) + len(r.Value)
	for _, h := range r.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

func (r *Record) origin() retrytopics.Origin {
	return retrytopics.Origin{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset}
}

func (r *Record) rec() retrytopics.Rec {
	return retrytopics.Rec{Origin: r.origin(), Key: r.Key, Value: r.Value, Headers: r.Headers, Timestamp: r.Timestamp}
}

// Handler applies one record's effects. It is the main extension point of kafkapg.
//
// Handle runs inside the transaction tx that the processor opened for the record's batch; the
// same transaction advances the partition's stored offset and commits after the handler returns.
// Everything written through tx therefore takes effect exactly once. Handle must not commit or
// roll back tx, and should not keep it or the record after returning.
//
// Return nil on success; Permanent(err) for a record that can never succeed (it is dead-lettered
// without retries); any other error to have the record retried (with backoff within the
// delivery, then through the retry tiers, then dead-lettered). Errors caused by Postgres being unreachable are recognised and retried in
// place without counting against the record (see Classify). A panic is recovered and treated as a
// retryable error, with its stack logged.
//
// Work done outside tx (HTTP calls, e-mails) is not covered by the guarantee: the transaction may
// roll back after Handle returned, and the record is then handled again.
type Handler interface {
	Handle(ctx context.Context, tx pgx.Tx, rec *Record) error
}

// BatchHandler is an optional interface for a Handler that applies a whole batch at once, for
// example with COPY or a pgx.Batch. recs belong to one partition, in offset order. The rules of
// Handle apply; in addition, return RecordFailed(i, err) to say that recs[i] failed: the records
// before it are then applied without it, and recs[i] alone is retried or dead-lettered. If the
// error does not name a record, the processor splits the batch to find the failing ones.
type BatchHandler interface {
	HandleBatch(ctx context.Context, tx pgx.Tx, recs []*Record) error
}

// ErrorClassifier is an optional interface for a Handler that decides itself how its errors are
// classified, overriding Classify. It is called with every error the handler returned (or its
// recovered panic); call Classify for the errors it has no opinion on. Failures of Postgres
// outside the handler's own statements (a lost connection, a COMMIT with unknown outcome) are
// always infrastructure and do not reach it.
type ErrorClassifier interface {
	ClassifyError(err error) ErrorClass
}

// HandlerFunc adapts a function to the Handler interface.
type HandlerFunc func(ctx context.Context, tx pgx.Tx, rec *Record) error

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, tx pgx.Tx, rec *Record) error {
	return f(ctx, tx, rec)
}

// Permanent marks err as permanent: the record is dead-lettered at once, without retries.
// Permanent(nil) returns nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// ErrRecordTooLarge is the (permanent) error of a record whose key and value are larger than
// Config.MaxRecordBytes: it is dead-lettered without being handed to the handler.
var ErrRecordTooLarge = errors.New("record too large")

// RecordError says which record of a batch failed. See BatchHandler.
type RecordError struct {
	Index int
	Err   error
}

// RecordFailed returns an error saying that record index of the batch failed with err.
func RecordFailed(index int, err error) error { return &RecordError{Index: index, Err: err} }

func (e *RecordError) Error() string { return fmt.Sprintf("record %d of batch: %v", e.Index, e.Err) }
func (e *RecordError) Unwrap() error { return e.Err }

// PanicError is the error a recovered handler panic turns into.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panicked: %v", e.Value) }
