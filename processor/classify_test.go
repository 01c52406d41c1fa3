package processor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kafkapg/kafkapg/sink"
)

// connectError returns the error of a real failed connection attempt: nothing listens on port 1.
func connectError(t *testing.T) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	conn, err := pgconn.Connect(ctx, "postgres://kafkapg@127.0.0.1:1/kafkapg?sslmode=disable&connect_timeout=1")
	if err == nil {
		conn.Close(ctx)
		t.Fatal("connected to 127.0.0.1:1")
	}
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		t.Fatalf("pgconn.Connect failed with %T %v, want a *pgconn.ConnectError", err, err)
	}
	return err
}

// safeToRetryError is an error pgconn.SafeToRetry understands, like the ones pgconn returns when a
// query failed before anything was sent.
type safeToRetryError struct{ safe bool }

func (e safeToRetryError) Error() string     { return fmt.Sprintf("safe to retry: %v", e.safe) }
func (e safeToRetryError) SafeToRetry() bool { return e.safe }

func pgErr(severity, code string) *pgconn.PgError {
	return &pgconn.PgError{Severity: severity, SeverityUnlocalized: severity, Code: code, Message: "pg says " + code}
}

func TestClassify(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	tests := []struct {
		name string
		err  error
		want ErrorClass
	}{
		// Classify must not panic on nil; it gives the default class.
		{name: "nil", err: nil, want: ClassRetryable},
		{name: "plain error", err: boom, want: ClassRetryable},
		{name: "handler's own timeout", err: fmt.Errorf("call API: %w", context.DeadlineExceeded), want: ClassRetryable},
		{name: "handler's own network error", err: &net.OpError{Op: "dial", Net: "tcp", Err: boom}, want: ClassRetryable},
		{name: "handler panic", err: &PanicError{Value: "nil map", Stack: []byte("goroutine 1")}, want: ClassRetryable},
		{name: "handler panic in a batch", err: RecordFailed(3, &PanicError{Value: 42}), want: ClassRetryable},

		{name: "Permanent", err: Permanent(boom), want: ClassPermanent},
		{name: "Permanent wrapped with %w", err: fmt.Errorf("apply p3@1200: %w", Permanent(boom)), want: ClassPermanent},
		{name: "Permanent in a batch", err: RecordFailed(0, Permanent(boom)), want: ClassPermanent},
		{name: "Permanent around an infrastructure SQLSTATE", err: Permanent(pgErr("ERROR", "40001")), want: ClassPermanent},
		{name: "Permanent in an errors.Join", err: errors.Join(boom, Permanent(boom)), want: ClassPermanent},

		{name: "Infrastructure", err: Infrastructure(boom), want: ClassInfrastructure},
		{name: "Infrastructure wrapped with %w", err: fmt.Errorf("call API: %w", Infrastructure(boom)), want: ClassInfrastructure},
		{name: "Infrastructure in a batch", err: RecordFailed(1, Infrastructure(boom)), want: ClassInfrastructure},
		{name: "Infrastructure around Permanent", err: Infrastructure(Permanent(boom)), want: ClassInfrastructure},
		{name: "Infrastructure around a constraint violation", err: Infrastructure(pgErr("ERROR", "23505")), want: ClassInfrastructure},

		{name: "connection failure 08006", err: pgErr("ERROR", "08006"), want: ClassInfrastructure},
		{name: "connection exception 08000", err: pgErr("ERROR", "08000"), want: ClassInfrastructure},
		{name: "serialization failure 40001", err: pgErr("ERROR", "40001"), want: ClassInfrastructure},
		{name: "deadlock 40P01", err: pgErr("ERROR", "40P01"), want: ClassInfrastructure},
		{name: "too many connections 53300", err: pgErr("FATAL", "53300"), want: ClassInfrastructure},
		{name: "disk full 53100", err: pgErr("ERROR", "53100"), want: ClassInfrastructure},
		{name: "admin shutdown 57P01", err: pgErr("FATAL", "57P01"), want: ClassInfrastructure},
		{name: "admin shutdown 57P01 with ERROR severity", err: pgErr("ERROR", "57P01"), want: ClassInfrastructure},
		{name: "crash shutdown 57P02", err: pgErr("ERROR", "57P02"), want: ClassInfrastructure},
		{name: "cannot connect now 57P03", err: pgErr("ERROR", "57P03"), want: ClassInfrastructure},
		{name: "database dropped 57P04", err: pgErr("ERROR", "57P04"), want: ClassInfrastructure},
		{name: "idle session timeout 57P05", err: pgErr("ERROR", "57P05"), want: ClassInfrastructure},
		{name: "system error 58030", err: pgErr("ERROR", "58030"), want: ClassInfrastructure},
		{name: "read-only transaction 25006", err: pgErr("ERROR", "25006"), want: ClassInfrastructure},
		{name: "FATAL with an unlisted code", err: pgErr("FATAL", "XX000"), want: ClassInfrastructure},
		{name: "PANIC", err: pgErr("PANIC", "XX000"), want: ClassInfrastructure},
		{name: "SQLSTATE wrapped with %w", err: fmt.Errorf("insert entry: %w", pgErr("ERROR", "40P01")), want: ClassInfrastructure},
		{name: "SQLSTATE in a batch", err: RecordFailed(2, fmt.Errorf("x: %w", pgErr("ERROR", "08006"))), want: ClassInfrastructure},

		{name: "idle in transaction timeout 25P03", err: pgErr("ERROR", "25P03"), want: ClassRetryable},
		{name: "idle in transaction timeout 25P03 as FATAL", err: pgErr("FATAL", "25P03"), want: ClassRetryable},
		{name: "25P03 wrapped in Infrastructure (the processor's own statements)", err: Infrastructure(pgErr("ERROR", "25P03")), want: ClassRetryable},
		{name: "unique violation 23505", err: pgErr("ERROR", "23505"), want: ClassRetryable},
		{name: "undefined table 42P01", err: pgErr("ERROR", "42P01"), want: ClassRetryable},
		{name: "invalid text representation 22P02", err: pgErr("ERROR", "22P02"), want: ClassRetryable},
		{name: "statement timeout 57014", err: pgErr("ERROR", "57014"), want: ClassRetryable},
		{name: "in failed transaction 25P02", err: pgErr("ERROR", "25P02"), want: ClassRetryable},
		{name: "malformed SQLSTATE", err: pgErr("ERROR", "08"), want: ClassRetryable},

		{name: "connect error", err: connectError(t), want: ClassInfrastructure},
		{name: "connect error wrapped", err: fmt.Errorf("open pool: %w", connectError(t)), want: ClassInfrastructure},
		{name: "pgconn safe to retry", err: fmt.Errorf("query: %w", safeToRetryError{safe: true}), want: ClassInfrastructure},
		{name: "pgconn not safe to retry", err: safeToRetryError{safe: false}, want: ClassRetryable},

		{name: "sink.ErrConnLost", err: fmt.Errorf("%w: %w", sink.ErrConnLost, boom), want: ClassInfrastructure},
		{name: "sink.ErrConnLost around a constraint violation", err: fmt.Errorf("%w: %w", sink.ErrConnLost, pgErr("ERROR", "23505")), want: ClassInfrastructure},
		{name: "sink.ErrConnLost around Permanent", err: fmt.Errorf("%w: %w", sink.ErrConnLost, Permanent(boom)), want: ClassInfrastructure},
		{name: "sink.ErrConnLost wrapped twice", err: fmt.Errorf("apply: %w", fmt.Errorf("%w: %w", sink.ErrConnLost, boom)), want: ClassInfrastructure},
		{name: "sink.ErrCommitUnknown", err: fmt.Errorf("%w: %w", sink.ErrCommitUnknown, boom), want: ClassInfrastructure},
		{name: "sink.ErrCommitUnknown wrapped", err: fmt.Errorf("apply p0@5: %w", fmt.Errorf("%w: %w", sink.ErrCommitUnknown, boom)), want: ClassInfrastructure},
		{name: "sink.HandlerError around a deadlock", err: &sink.HandlerError{Err: pgErr("ERROR", "40P01")}, want: ClassInfrastructure},
		{name: "sink.HandlerError around Permanent", err: &sink.HandlerError{Err: Permanent(boom)}, want: ClassPermanent},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := Classify(tt.err); got != tt.want {
				t.Errorf("Classify(%v) = %v, want %v", tt.err, got, tt.want)
			}
		})
	}
}

// alwaysPermanent reclassifies every error as permanent.
type alwaysPermanent struct{ Handler }

func (alwaysPermanent) ClassifyError(error) ErrorClass { return ClassPermanent }

// TestProcessorClassify: a handler's ErrorClassifier decides, except for the classes no handler
// may change. A transaction ended for idling (25P03), even when the processor's own statement in
// it reported the error wrapped in Infrastructure, stays retryable: retried in place, a too-slow
// handler would be retried for ever.
func TestProcessorClassify(t *testing.T) {
	c := &Config{Topics: []string{"orders"}, Handler: alwaysPermanent{}}
	p := &Processor{cfg: c, policies: map[string]*policy{"orders": c.policy("orders")}}
	for _, tt := range []struct {
		name string
		err  error
		want ErrorClass
	}{
		{"handler's own error", errors.New("bad"), ClassPermanent},
		{"idled past TxIdleTimeout", pgErr("ERROR", "25P03"), ClassRetryable},
		{"idled, seen by the processor's settle statement", Infrastructure(pgErr("ERROR", "25P03")), ClassRetryable},
		{"connection lost", fmt.Errorf("x: %w", sink.ErrConnLost), ClassInfrastructure},
		{"Infrastructure", Infrastructure(errors.New("api down")), ClassInfrastructure},
	} {
		if got := p.classify("orders", tt.err); got != tt.want {
			t.Errorf("%s: classify = %v, want %v", tt.name, got, tt.want)
		}
	}
}

func TestClassifyMarkersOfNil(t *testing.T) {
	t.Parallel()
	if err := Permanent(nil); err != nil {
		t.Errorf("Permanent(nil) = %v, want nil", err)
	}
	if err := Infrastructure(nil); err != nil {
		t.Errorf("Infrastructure(nil) = %v, want nil", err)
	}
}

func TestClassifyMarkersKeepCause(t *testing.T) {
	t.Parallel()
	cause := pgErr("ERROR", "23505")
	tests := []struct {
		name    string
		err     error
		wantMsg string
	}{
		{name: "Permanent", err: Permanent(cause), wantMsg: "permanent: " + cause.Error()},
		{name: "Infrastructure", err: Infrastructure(cause), wantMsg: "infrastructure: " + cause.Error()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := tt.err.Error(); got != tt.wantMsg {
				t.Errorf("Error() = %q, want %q", got, tt.wantMsg)
			}
			var pe *pgconn.PgError
			if !errors.As(tt.err, &pe) || pe != cause {
				t.Errorf("errors.As does not reach the cause through %s", tt.name)
			}
		})
	}
}

func TestClassifyErrorClassString(t *testing.T) {
	t.Parallel()
	tests := []struct {
		class ErrorClass
		want  string
	}{
		{ClassRetryable, "retryable"},
		{ClassPermanent, "permanent"},
		{ClassInfrastructure, "infrastructure"},
		{ErrorClass(-1), "unknown"},
		{ErrorClass(3), "unknown"},
	}
	for _, tt := range tests {
		if got := tt.class.String(); got != tt.want {
			t.Errorf("ErrorClass(%d).String() = %q, want %q", int(tt.class), got, tt.want)
		}
	}
}

// TestOwnOutage: a transaction of kafkapg's own retried in place counts as an outage (not an
// internal error, whose alert says "a bug") when Postgres failed under it — the connection lost,
// a FATAL, a server shutting down — or ended it for idling past TxIdleTimeout (a process frozen or
// starved: seen in a chaos run as four internal errors after a SIGSTOP); an answer of the
// server's to a wrong statement stays an internal error.
func TestOwnOutage(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		err  error
		want bool
	}{
		{"idled past TxIdleTimeout", own(fmt.Errorf("record idempotency keys: %w", &pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: "25P03"})), true},
		{"idled past TxIdleTimeout, no severity", own(&pgconn.PgError{Code: "25P03"}), true},
		{"connection lost mid-answer", own(fmt.Errorf("hold records: %w", io.ErrUnexpectedEOF)), true},
		{"server shutting down", own(&pgconn.PgError{Severity: "FATAL", Code: "57P01"}), true},
		{"a wrong statement", own(&pgconn.PgError{Severity: "ERROR", Code: "42P01"}), false},
		{"a unique violation", own(&pgconn.PgError{Severity: "ERROR", Code: "23505"}), false},
	} {
		if got := ownOutage(tt.err); got != tt.want {
			t.Errorf("%s: ownOutage(%v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}
