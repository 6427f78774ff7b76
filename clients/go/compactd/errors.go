package compactd

import (
	"errors"
	"fmt"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// FieldViolation is one bad request field, from google.rpc.BadRequest.
type FieldViolation struct {
	Field       string
	Description string
}

// Error is a failed compactd call: the gRPC status plus its google.rpc.ErrorInfo.
//
// Match a specific cause with errors.Is(err, ErrSeqConflict), or switch on Reason.
type Error struct {
	// Code is the gRPC status code.
	Code codes.Code
	// Message is the status message.
	Message string
	// Reason is ErrorInfo.reason (e.g. SEQ_CONFLICT); the code's name when the server sent none.
	Reason string
	// Domain is ErrorInfo.domain.
	Domain string
	// Metadata is ErrorInfo.metadata.
	Metadata map[string]string
	// Violations are the BadRequest field violations, if any.
	Violations []FieldViolation
	cause      error
}

// Sentinels for errors.Is; they match on code and reason.
var (
	// ErrSeqConflict: ABORTED, AppendEvents' expected_last_seq did not match the log.
	ErrSeqConflict = &Error{Code: codes.Aborted, Reason: "SEQ_CONFLICT"}
	// ErrCompactionBusy: ABORTED, a bracket is live or a turn is open.
	ErrCompactionBusy = &Error{Code: codes.Aborted, Reason: "COMPACTION_BUSY"}
	// ErrCapacityUnknown: FAILED_PRECONDITION, the route declares no context window.
	ErrCapacityUnknown = &Error{Code: codes.FailedPrecondition, Reason: "CAPACITY_UNKNOWN"}
	// ErrIncompleteStream: a compaction stream ended without its result.
	ErrIncompleteStream = errors.New("compactd: the stream ended without a result")
)

func (e *Error) Error() string {
	return fmt.Sprintf("%s (%s): %s", codeName(e.Code), e.Reason, e.Message)
}

// Is matches another *Error with the same code and reason.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && t.Reason == e.Reason
}

// Unwrap returns the original gRPC status error.
func (e *Error) Unwrap() error { return e.cause }

// FromError converts a gRPC error into an *Error; nil stays nil and non-status errors pass
// through unchanged.
func FromError(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	out := &Error{Code: st.Code(), Message: st.Message(), Metadata: map[string]string{}, cause: err}
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.ErrorInfo:
			if out.Reason == "" {
				out.Reason, out.Domain = d.GetReason(), d.GetDomain()
				for k, v := range d.GetMetadata() {
					out.Metadata[k] = v
				}
			}
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				out.Violations = append(out.Violations, FieldViolation{v.GetField(), v.GetDescription()})
			}
		}
	}
	if out.Reason == "" {
		out.Reason = codeName(out.Code)
	}
	return out
}

// codeName is the gRPC spelling of a code (ABORTED, not Aborted).
func codeName(c codes.Code) string {
	names := map[codes.Code]string{
		codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
		codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
		codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
		codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
		codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED",
		codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED",
		codes.Internal: "INTERNAL", codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS",
		codes.Unauthenticated: "UNAUTHENTICATED",
	}
	if name, ok := names[c]; ok {
		return name
	}
	return c.String()
}
