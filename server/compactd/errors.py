"""The domain error tree.

Every failure the service reports is one of these. Each carries an AIP-193 ``reason`` (a stable
UPPER_SNAKE identifier clients can switch on) and string metadata; ``compactd.api.status`` is the
one place that maps them to gRPC status codes and ``google.rpc`` details.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from compactd.reasons import Reason


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request (``google.rpc.BadRequest.FieldViolation``)."""

    field: str
    description: str


class CompactdError(Exception):
    """Root of every error compactd reports."""

    reason: str = Reason.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidArgument(CompactdError):
    """Malformed input; ``violations`` name the fields."""

    reason = Reason.INVALID_ARGUMENT

    def __init__(
        self,
        message: str,
        *,
        violations: Sequence[FieldViolation] = (),
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.violations = tuple(violations)


class ReplacementRejected(InvalidArgument):
    """A surface REPLACE broke one of the replacement rules (the message names the rule)."""

    reason = Reason.REPLACEMENT_REJECTED


class NotFound(CompactdError):
    """A named resource does not exist."""

    reason = Reason.NOT_FOUND


class AlreadyExists(CompactdError):
    """A resource with that name already exists."""

    reason = Reason.ALREADY_EXISTS


class SeqConflict(CompactdError):
    """``expected_last_seq`` did not match the log."""

    reason = Reason.SEQ_CONFLICT


class CompactionBusy(CompactdError):
    """Another operation holds the session (a live compaction bracket or an open turn)."""

    reason = Reason.COMPACTION_BUSY


class FailedPrecondition(CompactdError):
    """The session or configuration is not in a state that allows the operation."""

    reason = Reason.FAILED_PRECONDITION


class CapacityUnknown(FailedPrecondition):
    """A route has no declared context window."""

    reason = Reason.CAPACITY_UNKNOWN


class ConfigError(CompactdError):
    """Invalid configuration; the message names the bad key."""

    reason = Reason.CONFIG_INVALID


class Unavailable(CompactdError):
    """A dependency (store, provider) is temporarily unreachable."""

    reason = Reason.UNAVAILABLE


class ServerShuttingDown(Unavailable):
    """The server is stopping: a stream that follows a session ends at once; reconnect (the
    client's channel picks another replica, or this one once it is back)."""

    reason = Reason.SERVER_SHUTTING_DOWN

    def __init__(self) -> None:
        super().__init__("the server is shutting down: reconnect to continue the stream")


class ResourceExhausted(CompactdError):
    """A limit was exceeded (batch size, message size, rate)."""

    reason = Reason.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class QuotaViolation:
    """One quota a call went over (``google.rpc.QuotaFailure.Violation``).

    Attributes:
        subject: Who is held to it: ``tenant:ID``.
        quota: The quota's setting name (``appends_per_second``, ``max_bytes``, ...).
        description: What was exceeded, in words.
        limit: The quota's value for the subject.
    """

    subject: str
    quota: str
    description: str
    limit: float


class QuotaExceeded(ResourceExhausted):
    """A tenant went over one of its quotas; ``retry_after`` (seconds) is set for a rate."""

    reason = Reason.QUOTA_EXCEEDED

    def __init__(
        self,
        message: str,
        *,
        quota_violations: Sequence[QuotaViolation],
        retry_after: float | None = None,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.quota_violations = tuple(quota_violations)
        self.retry_after = retry_after


class Unauthenticated(CompactdError):
    """The call carries no credentials, or ones the server does not accept (one fixed message,
    whatever was wrong)."""

    reason = Reason.CREDENTIALS_INVALID


class Internal(CompactdError):
    """A bug or broken invariant: the details are logged, the caller gets the reason."""

    reason = Reason.INTERNAL


class StartupError(CompactdError):
    """The server cannot start here: its port or its store is taken (the message says which)."""

    reason = Reason.STARTUP_FAILED


# --- replicas and the PostgreSQL store (issue 12) ------------------------------------------------


class StoreUnavailable(Unavailable):
    """The database behind the store failed or cannot be reached; nothing was written.

    Retry later: the store recovers by itself once the database answers again.
    """

    reason = Reason.STORE_UNAVAILABLE


class DataLoss(CompactdError):
    """Stored data cannot be read back as it was written: retrying does not help."""

    reason = Reason.DATA_LOSS


class StoreCorrupt(DataLoss):
    """The store's file is damaged where the call reads or writes (SQLite finds its pages
    malformed, or a stored event does not parse). Other sessions keep working; restoring the
    file from a backup is the remedy."""

    reason = Reason.STORE_CORRUPT


class Fenced(CompactdError):
    """A compaction bracket's write came after its lease was lost to another replica."""

    reason = Reason.LEASE_LOST
