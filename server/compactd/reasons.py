"""Every error reason compactd answers or records: the one list.

A reason is the stable UPPER_SNAKE identifier of an AIP-193 ``google.rpc.ErrorInfo`` (clients
switch on it), also written to the log as ``compaction/end.error_reason`` and given as a start-up
failure's name. Every raise site names its reason through ``Reason``; ``docs/errors.md`` holds the
table of them with their gRPC codes, and a test keeps the two equal (``tests/test_reasons.py``), as
it keeps the clients' typed errors (Python, TypeScript, Go) to reasons listed here.

``Reason`` is a ``StrEnum``: a member is its string, so ``error.reason == Reason.SEQ_CONFLICT``
and the wire value ``"SEQ_CONFLICT"`` are the same thing.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """The reasons, grouped by the gRPC code they answer with (``docs/errors.md``)."""

    # INVALID_ARGUMENT: the request or an event breaks a rule; nothing was written.
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    REPLACEMENT_REJECTED = "REPLACEMENT_REJECTED"
    TOOL_RESULT_WITHOUT_CALL = "TOOL_RESULT_WITHOUT_CALL"
    IDEMPOTENCY_MISMATCH = "IDEMPOTENCY_MISMATCH"
    DUPLICATE_EVENT_ID = "DUPLICATE_EVENT_ID"
    POLICY_INVALID = "POLICY_INVALID"
    SERVER_ONLY_EVENT = "SERVER_ONLY_EVENT"
    STEP_BRACKET = "STEP_BRACKET"
    EVENT_TOO_LARGE = "EVENT_TOO_LARGE"
    UNDECODABLE_REQUEST = "UNDECODABLE_REQUEST"
    FORK_SEQ_INVALID = "FORK_SEQ_INVALID"
    # UNAUTHENTICATED
    CREDENTIALS_INVALID = "CREDENTIALS_INVALID"
    # NOT_FOUND, ALREADY_EXISTS
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RECALL_HANDLE_UNKNOWN = "RECALL_HANDLE_UNKNOWN"
    COMPACTION_UNKNOWN = "COMPACTION_UNKNOWN"
    # ABORTED: retry once the conflict is gone.
    SEQ_CONFLICT = "SEQ_CONFLICT"
    COMPACTION_BUSY = "COMPACTION_BUSY"
    LEASE_LOST = "LEASE_LOST"
    # FAILED_PRECONDITION: the session or configuration does not allow the call.
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    CAPACITY_UNKNOWN = "CAPACITY_UNKNOWN"
    REVERT_BLOCKED = "REVERT_BLOCKED"
    ROUTE_UNKNOWN = "ROUTE_UNKNOWN"
    NO_OPEN_TURN = "NO_OPEN_TURN"
    SUMMARY_TARGET_UNKNOWN = "SUMMARY_TARGET_UNKNOWN"
    SUMMARIZER_MISCONFIGURED = "SUMMARIZER_MISCONFIGURED"
    CONFIG_INVALID = "CONFIG_INVALID"
    TOKENIZER_UNAVAILABLE = "TOKENIZER_UNAVAILABLE"
    MODEL_SWITCH_COMPACTION_FAILED = "MODEL_SWITCH_COMPACTION_FAILED"
    RETRIES_EXHAUSTED = "RETRIES_EXHAUSTED"
    SUMMARY_NOT_SMALLER = "SUMMARY_NOT_SMALLER"
    SUMMARY_REJECTED = "SUMMARY_REJECTED"
    SPAN_DRIFT = "SPAN_DRIFT"
    SUMMARY_FAILED = "SUMMARY_FAILED"
    SUMMARY_TRUNCATED = "SUMMARY_TRUNCATED"
    UNSUPPORTED_CONTENT = "UNSUPPORTED_CONTENT"
    CONTEXT_WINDOW_EXCEEDED = "CONTEXT_WINDOW_EXCEEDED"
    IMAGE_OFFLOAD_REQUIRED = "IMAGE_OFFLOAD_REQUIRED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    # UNAVAILABLE: try again later.
    TIMEOUT = "TIMEOUT"
    RATE_LIMITED = "RATE_LIMITED"
    PROVIDER_UNAVAILABLE = "PROVIDER_UNAVAILABLE"
    UNAVAILABLE = "UNAVAILABLE"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    SERVER_SHUTTING_DOWN = "SERVER_SHUTTING_DOWN"
    # RESOURCE_EXHAUSTED
    SURFACE_FULL = "SURFACE_FULL"
    PINS_OVER_WINDOW = "PINS_OVER_WINDOW"
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    # DATA_LOSS: the store's file is damaged where the call reads or writes.
    DATA_LOSS = "DATA_LOSS"
    STORE_CORRUPT = "STORE_CORRUPT"
    # INTERNAL: a bug.
    INTERNAL = "INTERNAL"
    # The log only: a bracket whose caller went away.
    CANCELLED = "CANCELLED"
    # Start-up failures (exit 3).
    ADDRESS_IN_USE = "ADDRESS_IN_USE"
    STORE_LOCKED = "STORE_LOCKED"
    STARTUP_FAILED = "STARTUP_FAILED"
    SCHEMA_TOO_OLD = "SCHEMA_TOO_OLD"
    SCHEMA_TOO_NEW = "SCHEMA_TOO_NEW"


#: Failures of a dependency that may pass: retrying later can succeed (answered UNAVAILABLE).
TRANSIENT = frozenset({Reason.TIMEOUT, Reason.PROVIDER_UNAVAILABLE, Reason.RATE_LIMITED})
