"""A typed Python client for compactd.

``CompactdClient`` (blocking) and ``AsyncCompactdClient`` (asyncio) wrap both gRPC services over
one channel; :mod:`compactd_client.events` builds the events to append;
:mod:`compactd_client.errors` holds the typed exceptions; ``prepare_step`` answers a
``PreparedStep`` (:mod:`compactd_client.steps`: the full request to send, the client holding the
session's last request so a step costs what it adds);
:mod:`compactd_client.openai` and :mod:`compactd_client.anthropic` convert OpenAI chat and
Anthropic messages to events and ``BuildRequest`` answers to ready request bodies;
:mod:`compactd_client.v1` re-exports the generated messages.
"""

from compactd_client.aio import AsyncCompactdClient
from compactd_client.client import CompactdClient
from compactd_client.config import RetryPolicy
from compactd_client.errors import (
    AbortedError,
    AlreadyExistsError,
    CapacityUnknownError,
    CompactdError,
    CompactionBusyError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    QuotaExceededError,
    SeqConflictError,
    UnavailableError,
    UnimplementedError,
)
from compactd_client.steps import HeldRequests, PreparedStep, step_request
from compactd_client.streams import (
    AsyncCompactionStream,
    AsyncServerStream,
    CompactionStream,
    ServerStream,
)

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "AsyncCompactdClient",
    "AsyncCompactionStream",
    "AsyncServerStream",
    "CapacityUnknownError",
    "CompactdClient",
    "CompactdError",
    "CompactionBusyError",
    "CompactionStream",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "HeldRequests",
    "InvalidArgumentError",
    "NotFoundError",
    "PreparedStep",
    "QuotaExceededError",
    "RetryPolicy",
    "SeqConflictError",
    "ServerStream",
    "UnavailableError",
    "UnimplementedError",
    "step_request",
]
