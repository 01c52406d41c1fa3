package processor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kafkapg/kafkapg/sink"
)

// ErrorClass says whose fault a failure is, which decides what happens to the record.
type ErrorClass int

const (
	// ClassRetryable: the record may succeed later. It is retried with backoff
	// (Config.LocalAttempts tries), then goes through the retry tiers (Config.RetryTiers), then is
	// dead-lettered.
	ClassRetryable ErrorClass = iota
	// ClassPermanent: the record can never succeed (Permanent was used). It is dead-lettered at
	// once.
	ClassPermanent
	// ClassInfrastructure: a dependency failed, not the record: Postgres unreachable or
	// restarting, a serialization failure or deadlock, a broker error. The transaction is retried
	// in place with backoff, as long as it takes; the partition keeps its position and nothing is
	// dead-lettered or counted as an attempt.
	ClassInfrastructure
)

func (c ErrorClass) String() string {
	switch c {
	case ClassRetryable:
		return "retryable"
	case ClassPermanent:
		return "permanent"
	case ClassInfrastructure:
		return "infrastructure"
	}
	return "unknown"
}

// Classify is the one place that decides the class of a handler or transaction error (a Handler
// can override it by implementing ErrorClassifier):
//
//   - the connection to Postgres was lost during the transaction, or the COMMIT's outcome is
//     unknown: infrastructure;
//   - Infrastructure(err): infrastructure; Permanent(err): permanent;
//   - a Postgres error in class 08 (connection exception), 40 (transaction rollback:
//     serialization failure, deadlock), 53 (insufficient resources), 57P01-57P05 (server
//     shutting down, unavailable), 58 (system error), or 25006 (read-only transaction, as during
//     a failover), or any FATAL error (the server ended the session): infrastructure — except
//     25P03, the transaction idled longer than Config.TxIdleTimeout, which is retryable: a
//     handler that is that slow inside its transaction would otherwise be retried forever;
//   - a failure to connect to Postgres: infrastructure;
//   - the end of a context of the handler's own (a timeout it set), also when pgx closed the
//     connection because of it (sink.ErrConnClosedByHandler, decided after checking that Postgres
//     answers), and a handler that returned nil from a transaction one of its statements had
//     aborted (sink.ErrTxAborted): retryable, whatever the handler's ErrorClassifier says;
//   - anything else: retryable. That includes other Postgres errors (constraint violations, bad
//     SQL), handler panics, and errors from the handler's own dependencies (an HTTP API, say):
//     wrap those with Infrastructure if an outage of that dependency should hold the partition
//     instead of failing its records.
//
// Errors outside the handler (BEGIN, the offset update, COMMIT without a server answer) are
// always treated as infrastructure and never reach Classify.
func Classify(err error) ErrorClass {
	if c, ok := fixedClass(err); ok {
		return c
	}
	if IsPermanent(err) {
		return ClassPermanent
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		code := pgErr.Code
		severity := pgErr.SeverityUnlocalized // not translated; empty before Postgres 9.6
		if severity == "" {
			severity = pgErr.Severity
		}
		switch {
		case severity == "FATAL" || severity == "PANIC":
			return ClassInfrastructure
		case len(code) == 5 && (code[:2] == "08" || code[:2] == "40" || code[:2] == "53" || code[:2] == "58"):
			return ClassInfrastructure
		case code == "57P01", code == "57P02", code == "57P03", code == "57P04", code == "57P05", code == "25006":
			return ClassInfrastructure
		}
		return ClassRetryable
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		// A context of the handler's own (the transaction's is never done when an error is
		// classified): a timeout it set, which the same record will hit again.
		return ClassRetryable
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) || pgconn.SafeToRetry(err) {
		return ClassInfrastructure
	}
	return ClassRetryable
}

// lostConnection reports whether err, from one of kafkapg's own statements, is the connection to
// Postgres failing under it (reset, closed mid-answer: io.ErrUnexpectedEOF), not an answer of
// the server's. pgconn.SafeToRetry says no once the statement was sent, which is right for a
// handler's call to elsewhere, but for kafkapg's own statements (retried in place, whatever the
// class) the question is only whether it was Postgres: a failover or a cut must not count as an
// internal error (kafkapg_internal_errors_total, a critical alert).
func lostConnection(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return false
	}
	var netErr net.Error
	return errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) || errors.As(err, &netErr) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNREFUSED)
}

// IsOutage reports whether err, from a transaction of kafkapg's own statements (a migration, a
// setup, a batch), is Postgres failing rather than an answer of its: an infrastructure error, or
// the connection lost mid-statement (io.ErrUnexpectedEOF, a reset), which Classify calls
// retryable because the statement was sent. Such a transaction was rolled back; trying it again
// when Postgres answers is safe.
func IsOutage(err error) bool { return ownOutage(err) }

// ownOutage reports whether err, a failure of a transaction retried in place, is the
// infrastructure's (counted as an outage, not as an internal error that fires the alert): an
// infrastructure error, the connection failing under kafkapg's own statement, or the transaction
// ended by TxIdleTimeout (25P03: this process stalled — frozen, starved — past it; Postgres
// closed the connection, and the next try opens another).
func ownOutage(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "25P03" {
		return true
	}
	return Classify(err) == ClassInfrastructure || lostConnection(err)
}

// ErrorClassifier is an optional interface for a Handler that decides itself how its errors are
// classified, overriding Classify. It is called with every error the handler returned (or its
// recovered panic); call Classify for the errors it has no opinion on. Failures of Postgres
// outside the handler's own statements (a lost connection, a COMMIT with unknown outcome) are
// always infrastructure and do not reach it.
type ErrorClassifier interface {
	ClassifyError(err error) ErrorClass
}

// fixedClass is the class of errors no handler may reclassify: a transaction that idled past
// TxIdleTimeout, a handler that returned nil from an aborted transaction and a connection the
// handler's own context closed are retryable (even wrapped in Infrastructure: retrying those in
// place would never end); a lost connection, a commit with unknown outcome and Infrastructure
// errors are infrastructure.
func fixedClass(err error) (ErrorClass, bool) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "25P03" { // idle_in_transaction_session_timeout
		return ClassRetryable, true
	}
	if errors.Is(err, sink.ErrTxAborted) || errors.Is(err, sink.ErrConnClosedByHandler) {
		return ClassRetryable, true
	}
	var infra *infrastructureError
	if errors.Is(err, sink.ErrConnLost) || errors.Is(err, sink.ErrCommitUnknown) || errors.As(err, &infra) {
		return ClassInfrastructure, true
	}
	var de *DecodeError
	if errors.As(err, &de) {
		return de.class(), true
	}
	return 0, false
}

// classify classifies an error of the handler of source topic, letting the handler override
// Classify (ErrorClassifier) except for the classes fixedClass decides.
func (p *Processor) classify(topic string, err error) ErrorClass {
	if c, ok := fixedClass(err); ok {
		return c
	}
	if c := p.policy(topic).classifier; c != nil {
		return c.ClassifyError(err)
	}
	return Classify(err)
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

// Infrastructure marks err as a failure of a dependency rather than of the record: the
// transaction is retried in place, without counting an attempt, until it succeeds or the
// partition is revoked. Infrastructure(nil) returns nil.
func Infrastructure(err error) error {
	if err == nil {
		return nil
	}
	return &infrastructureError{err: err}
}

type infrastructureError struct{ err error }

func (e *infrastructureError) Error() string { return "infrastructure: " + e.err.Error() }
func (e *infrastructureError) Unwrap() error { return e.err }

// ErrRecordTooLarge is the (permanent) error of a record whose key, value and headers (each
// header's key and value) are larger together than Config.MaxRecordBytes: it is dead-lettered
// without being handed to the handler.
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

// failedRecord returns the index of the record a handler error names (RecordFailed) among n
// records, and the record's own error; -1 and err if it names none.
//
// The record's error keeps what sink.Apply found about the whole transaction: that the handler's
// own context closed its connection (sink.ErrConnClosedByHandler wraps the batch's error, not the
// record's), so that the record is classified the same wherever it is.
func failedRecord(err error, n int) (int, error) {
	var rerr *RecordError
	if !errors.As(err, &rerr) || rerr.Index < 0 || rerr.Index >= n {
		return -1, err
	}
	cause := rerr.Err
	if cause == nil {
		cause = errNilRecordError
	}
	if errors.Is(err, sink.ErrConnClosedByHandler) && !errors.Is(cause, sink.ErrConnClosedByHandler) {
		cause = fmt.Errorf("%w: %w", sink.ErrConnClosedByHandler, cause)
	}
	return rerr.Index, cause
}

// errNilRecordError is the cause of a record a batch handler named with RecordFailed(i, nil).
var errNilRecordError = errors.New("the handler reported this record failed (RecordFailed) without an error")

// ownError marks the failure of one of kafkapg's own statements inside a transaction that also
// runs the handler: it is never the record's fault. inPlace retries it in place, quietly if
// Postgres is down (Classify says infrastructure), loudly otherwise.
type ownError struct{ err error }

func (e *ownError) Error() string { return e.err.Error() }
func (e *ownError) Unwrap() error { return e.err }

// own marks err as the failure of a statement of kafkapg's own. own(nil) is nil.
func own(err error) error {
	if err == nil {
		return nil
	}
	return &ownError{err: err}
}

// errStopped means the worker was asked to stop (revoke, shutdown) while the batch was not yet
// committed: what was not committed is left for the partition's next owner.
var errStopped = errors.New("worker stopped")
