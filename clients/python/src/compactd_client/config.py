"""Channel configuration: retries through the gRPC service config, and channel options.

Retries are done by gRPC itself (``retryPolicy`` in the channel's service config), not by a
loop in the client: gRPC retries only attempts that the server has not started answering, with
jittered exponential backoff, and counts them against the call's deadline.

Only idempotent RPCs are retried: the reads (:data:`IDEMPOTENT_METHODS`). ``CreateSession``,
``AppendEvents``, ``DeleteSession`` and the compaction RPCs change the log, so a blind retry
could apply them twice; an append whose events all carry an ``event_id`` is safe to retry by
hand (the server deduplicates it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_RETRY",
    "IDEMPOTENT_METHODS",
    "RetryPolicy",
    "auth_metadata",
    "channel_options",
    "service_config",
]

#: (service, method) pairs whose retry cannot change the outcome.
IDEMPOTENT_METHODS: tuple[tuple[str, str], ...] = (
    ("compactd.v1.SessionService", "ListEvents"),
    ("compactd.v1.SessionService", "GetSurface"),
    ("compactd.v1.SessionService", "BuildRequest"),
    ("compactd.v1.SessionService", "ListSessions"),
    ("compactd.v1.SessionService", "Recall"),
    ("compactd.v1.CompactionService", "CheckPressure"),
    ("compactd.v1.CompactionService", "WatchPressure"),
    ("compactd.v1.CompactionService", "ClassifyProviderError"),
    ("compactd.v1.CompactionService", "PlanCompaction"),
    ("compactd.v1.CompactionService", "ListBrackets"),
)

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class RetryPolicy:
    """A gRPC ``retryPolicy`` for the idempotent RPCs.

    Attributes:
        max_attempts: Attempts in total, the first included (gRPC caps it at 5).
        initial_backoff: Seconds before the first retry (jittered by gRPC).
        max_backoff: Upper bound of the backoff, in seconds.
        backoff_multiplier: Growth of the backoff per attempt.
        retryable_status_codes: Status code names that trigger a retry.
    """

    max_attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    backoff_multiplier: float = 2.0
    retryable_status_codes: tuple[str, ...] = field(default=("UNAVAILABLE",))

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= 5:
            raise ValueError("max_attempts must be between 2 and 5")
        if self.initial_backoff <= 0 or self.max_backoff < self.initial_backoff:
            raise ValueError("backoffs must be positive and max_backoff >= initial_backoff")
        if self.backoff_multiplier <= 0:
            raise ValueError("backoff_multiplier must be positive")
        if not self.retryable_status_codes:
            raise ValueError("retryable_status_codes must not be empty")


#: Up to 4 attempts on UNAVAILABLE, backing off from 0.1 s to 2 s.
DEFAULT_RETRY = RetryPolicy()


def service_config(retry: RetryPolicy | None = DEFAULT_RETRY) -> str:
    """Returns the channel's service config JSON: ``retry`` on :data:`IDEMPOTENT_METHODS`.

    Args:
        retry: The policy; None disables retries.
    """
    if retry is None:
        return json.dumps({"methodConfig": []})
    names = [{"service": s, "method": m} for s, m in IDEMPOTENT_METHODS]
    policy = {
        "maxAttempts": retry.max_attempts,
        "initialBackoff": f"{retry.initial_backoff}s",
        "maxBackoff": f"{retry.max_backoff}s",
        "backoffMultiplier": retry.backoff_multiplier,
        "retryableStatusCodes": list(retry.retryable_status_codes),
    }
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def channel_options(
    retry: RetryPolicy | None = DEFAULT_RETRY,
    extra: Sequence[tuple[str, str | int]] = (),
) -> list[tuple[str, str | int]]:
    """Returns the channel options: the service config, retries on, large messages allowed.

    Args:
        retry: The retry policy for idempotent RPCs; None disables retries.
        extra: More options; one naming a default's key replaces that default.
    """
    defaults: list[tuple[str, str | int]] = [
        ("grpc.service_config", service_config(retry)),
        ("grpc.enable_retries", 1 if retry is not None else 0),
        # Surfaces and requests with large tool outputs exceed grpc's 4 MiB default.
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ]
    # grpc keeps the first of two options with one key: a default left before the caller's
    # would win over it.
    named = {key for key, _ in extra}
    return [*(option for option in defaults if option[0] not in named), *extra]


def auth_metadata(
    token: str | None, metadata: Sequence[tuple[str, str]] = ()
) -> tuple[tuple[str, str], ...]:
    """``metadata`` plus ``authorization: Bearer <token>`` when a token is given."""
    if token is None:
        return tuple(metadata)
    return (*metadata, ("authorization", f"Bearer {token}"))
