"""Typed exceptions for failed compactd calls.

compactd reports every failure as a gRPC status whose ``grpc-status-details-bin`` trailer holds a
``google.rpc.Status`` with exactly one ``google.rpc.ErrorInfo`` (its ``reason`` is a stable
UPPER_SNAKE identifier such as ``SEQ_CONFLICT``) and, for malformed input, a
``google.rpc.BadRequest``; a tenant over a quota also gets a ``google.rpc.QuotaFailure`` and,
for a rate, a ``google.rpc.RetryInfo`` (``retry_delay``). :func:`from_rpc_error` turns such a
status into the most specific class below: first by reason, then by status code, so callers can
``except SeqConflictError`` or switch on ``err.reason``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "CallCancelledError",
    "CapacityUnknownError",
    "CompactdError",
    "CompactionBusyError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FieldViolation",
    "IncompleteStreamError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "QuotaViolation",
    "ResourceExhaustedError",
    "SeqConflictError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "from_rpc_error",
]


@dataclass(frozen=True)
class FieldViolation:
    """One bad request field, from ``google.rpc.BadRequest.FieldViolation``."""

    field: str
    description: str


@dataclass(frozen=True)
class QuotaViolation:
    """One quota a call went over, from ``google.rpc.QuotaFailure.Violation``."""

    subject: str
    quota: str
    description: str


class CompactdError(Exception):
    """Root of every error the client raises for a failed call.

    Attributes:
        code: The gRPC status code.
        message: The status message.
        reason: ``ErrorInfo.reason`` (e.g. ``SEQ_CONFLICT``); the status code's name when the
            server sent no ErrorInfo.
        domain: ``ErrorInfo.domain``, empty when absent.
        metadata: ``ErrorInfo.metadata`` (string to string).
        violations: The ``BadRequest`` field violations, if any.
        quota_violations: The ``QuotaFailure`` violations, if any.
        retry_delay: Seconds to wait before retrying (``RetryInfo``); None when not sent.
    """

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        reason: str = "",
        domain: str = "",
        metadata: Mapping[str, str] | None = None,
        violations: tuple[FieldViolation, ...] = (),
        quota_violations: tuple[QuotaViolation, ...] = (),
        retry_delay: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason or code.name
        self.domain = domain
        self.metadata: dict[str, str] = dict(metadata or {})
        self.violations = violations
        self.quota_violations = quota_violations
        self.retry_delay = retry_delay

    def __str__(self) -> str:
        return f"{self.code.name} ({self.reason}): {self.message}"


class CallCancelledError(CompactdError):
    """CANCELLED: the call was cancelled before it finished."""


class InvalidArgumentError(CompactdError):
    """INVALID_ARGUMENT: the request is malformed; ``violations`` name the fields."""


class DeadlineExceededError(CompactdError):
    """DEADLINE_EXCEEDED: the call's deadline passed."""


class NotFoundError(CompactdError):
    """NOT_FOUND: the session does not exist."""


class AlreadyExistsError(CompactdError):
    """ALREADY_EXISTS: the session id is taken."""


class PermissionDeniedError(CompactdError):
    """PERMISSION_DENIED: the caller may not do this."""


class UnauthenticatedError(CompactdError):
    """UNAUTHENTICATED: the call carried no valid credentials."""


class ResourceExhaustedError(CompactdError):
    """RESOURCE_EXHAUSTED: a limit (batch size, message size, rate) was exceeded."""


class QuotaExceededError(ResourceExhaustedError):
    """RESOURCE_EXHAUSTED with reason ``QUOTA_EXCEEDED``: the caller's tenant is over a quota
    (``quota_violations`` name it; for the append rate, wait ``retry_delay`` seconds)."""


class FailedPreconditionError(CompactdError):
    """FAILED_PRECONDITION: the session or configuration does not allow the operation."""


class CapacityUnknownError(FailedPreconditionError):
    """FAILED_PRECONDITION with reason ``CAPACITY_UNKNOWN``: the route declares no window."""


class AbortedError(CompactdError):
    """ABORTED: a concurrency conflict; re-read and retry."""


class SeqConflictError(AbortedError):
    """ABORTED with reason ``SEQ_CONFLICT``: ``expected_last_seq`` did not match the log."""


class CompactionBusyError(AbortedError):
    """ABORTED with reason ``COMPACTION_BUSY``: a bracket is live or a turn is open."""


class UnimplementedError(CompactdError):
    """UNIMPLEMENTED: the server does not offer this RPC."""


class UnavailableError(CompactdError):
    """UNAVAILABLE: the server or one of its dependencies is unreachable; safe to retry."""


class InternalError(CompactdError):
    """INTERNAL, UNKNOWN or DATA_LOSS: a server-side bug or broken invariant."""


class IncompleteStreamError(CompactdError):
    """A compaction stream ended without its final result message."""


_BY_REASON: dict[str, type[CompactdError]] = {
    "SEQ_CONFLICT": SeqConflictError,
    "COMPACTION_BUSY": CompactionBusyError,
    "CAPACITY_UNKNOWN": CapacityUnknownError,
    "QUOTA_EXCEEDED": QuotaExceededError,
}

_BY_CODE: dict[grpc.StatusCode, type[CompactdError]] = {
    grpc.StatusCode.CANCELLED: CallCancelledError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}


class _StatusCall(Protocol):
    """What both ``grpc.RpcError`` (sync) and ``grpc.aio.AioRpcError`` expose synchronously."""

    def code(self) -> grpc.StatusCode: ...

    def details(self) -> str | None: ...

    def trailing_metadata(self) -> object: ...


def error_class(code: grpc.StatusCode, reason: str) -> type[CompactdError]:
    """Returns the most specific exception class for a status code and ErrorInfo reason."""
    by_reason = _BY_REASON.get(reason)
    if by_reason is not None and issubclass(by_reason, _BY_CODE.get(code, CompactdError)):
        return by_reason
    return _BY_CODE.get(code, CompactdError)


def from_rpc_error(err: grpc.RpcError) -> CompactdError:
    """Converts a failed call (sync or asyncio) into a typed :class:`CompactdError`.

    The rich status is read from ``grpc-status-details-bin`` with grpcio-status; a status
    without it (or an inconsistent one) still maps by code, with ``reason`` set to the code's
    name.

    Args:
        err: The exception raised by a grpc stub (``grpc.RpcError`` or ``AioRpcError``).

    Returns:
        The exception to raise in its place (the caller chains ``err`` as its cause).
    """
    call: _StatusCall = err
    code = call.code()
    message = call.details() or ""
    rich = _rich_status(call)
    info, violations = _details(rich) if rich is not None else (None, ())
    quotas, retry_delay = _quota_details(rich) if rich is not None else ((), None)
    reason = info.reason if info is not None else ""
    return error_class(code, reason)(
        message,
        code=code,
        reason=reason,
        domain=info.domain if info is not None else "",
        metadata=dict(info.metadata) if info is not None else None,
        violations=violations,
        quota_violations=quotas,
        retry_delay=retry_delay,
    )


def _rich_status(call: _StatusCall) -> status_pb2.Status | None:
    """Parses ``grpc-status-details-bin``; None when absent or inconsistent with the call."""
    try:
        status: status_pb2.Status | None = rpc_status.from_call(call)  # type: ignore[arg-type]
    except ValueError:
        return None
    return status


def _details(
    status: status_pb2.Status,
) -> tuple[error_details_pb2.ErrorInfo | None, tuple[FieldViolation, ...]]:
    """Unpacks the first ErrorInfo and every BadRequest field violation of a status."""
    info: error_details_pb2.ErrorInfo | None = None
    violations: list[FieldViolation] = []
    for detail in status.details:
        if info is None and detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend(
                FieldViolation(field=v.field, description=v.description)
                for v in bad.field_violations
            )
    return info, tuple(violations)


def _quota_details(
    status: status_pb2.Status,
) -> tuple[tuple[QuotaViolation, ...], float | None]:
    """Unpacks every QuotaFailure violation and the RetryInfo delay (seconds) of a status."""
    quotas: list[QuotaViolation] = []
    delay: float | None = None
    for detail in status.details:
        if detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            failure = error_details_pb2.QuotaFailure()
            detail.Unpack(failure)
            quotas.extend(
                QuotaViolation(subject=v.subject, quota=v.quota_id, description=v.description)
                for v in failure.violations
            )
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            delay = retry.retry_delay.ToTimedelta().total_seconds()
    return tuple(quotas), delay
