"""The one place where domain errors become gRPC statuses (and back, for clients in Python).

Each failure carries a ``google.rpc.Status`` with exactly one ``ErrorInfo`` (its ``reason`` is the
error's AIP-193 reason, its metadata the error's) plus ``BadRequest`` field violations for
invalid arguments, and ``QuotaFailure`` (with ``RetryInfo`` for a rate) for a tenant over
quota. Handlers are wrapped by ``handle_errors``: a domain error aborts with its status;
anything else is logged with its traceback and answers INTERNAL without one.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar, cast

import grpc
from google.protobuf import any_pb2, duration_pb2, message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from compactd import deadlines, errors
from compactd.reasons import TRANSIENT

log = logging.getLogger(__name__)

DOMAIN = "compactd.v1"

# Most specific first: the first isinstance match wins.
_CODES: list[tuple[type[errors.CompactdError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.SeqConflict, grpc.StatusCode.ABORTED),
    (errors.CompactionBusy, grpc.StatusCode.ABORTED),
    (errors.Fenced, grpc.StatusCode.ABORTED),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DataLoss, grpc.StatusCode.DATA_LOSS),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.Internal, grpc.StatusCode.INTERNAL),
]


def code_for(error: errors.CompactdError) -> grpc.StatusCode:
    """The gRPC code for a domain error: transient reasons are UNAVAILABLE, else by class."""
    if error.reason in TRANSIENT:
        return grpc.StatusCode.UNAVAILABLE
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.FAILED_PRECONDITION


# Trailing metadata must fit a client's default limit (8 KiB): the message travels twice
# (percent-encoded in grpc-message, base64 inside grpc-status-details-bin), so every text an
# error echoes from a request (an id, a field path) is clipped and violations are capped.
MAX_MESSAGE_BYTES = 400
MAX_METADATA_ENTRIES = 8
MAX_METADATA_VALUE_BYTES = 128
MAX_VIOLATIONS = 8
MAX_FIELD_BYTES = 128
MAX_DESCRIPTION_BYTES = 160
MAX_DETAILS_BYTES = 4096


def to_status(error: errors.CompactdError) -> grpc.Status:
    """The gRPC status (with ``google.rpc`` details in trailing metadata) for a domain error.

    Texts are clipped and violations capped (see ``MAX_DETAILS_BYTES``) so the status always
    reaches the client: an oversized one would arrive as RESOURCE_EXHAUSTED instead.
    """
    code = code_for(error)
    metadata = {
        clip(key, MAX_METADATA_VALUE_BYTES): clip(value, MAX_METADATA_VALUE_BYTES)
        for key, value in list(error.metadata.items())[:MAX_METADATA_ENTRIES]
    }
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=metadata)
    violations = list(getattr(error, "violations", ()))
    message = error.message
    kept = violations[:MAX_VIOLATIONS]
    extra = _quota_details(error)
    while True:
        status = _status(code, clip(message, MAX_MESSAGE_BYTES), info, kept, extra)
        if status.ByteSize() <= MAX_DETAILS_BYTES or not kept:
            break
        kept = kept[:-1]
    if len(kept) < len(violations):
        more = f" ({len(violations) - len(kept)} more violation(s) not shown)"
        message = clip(message, MAX_MESSAGE_BYTES - len(more)) + more
        status = _status(code, message, info, kept, extra)
    result: grpc.Status = rpc_status.to_status(status)
    return result


def _status(
    code: grpc.StatusCode,
    message: str,
    info: error_details_pb2.ErrorInfo,
    violations: list[errors.FieldViolation],
    extra: Sequence[message.Message] = (),
) -> status_pb2.Status:
    packed: list[Any] = [info, *extra]
    if violations:
        packed.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=clip(v.field, MAX_FIELD_BYTES),
                        description=clip(v.description, MAX_DESCRIPTION_BYTES),
                    )
                    for v in violations
                ]
            )
        )
    status = status_pb2.Status(code=_rpc_code(code), message=message)
    for detail in packed:
        holder = any_pb2.Any()
        holder.Pack(detail)
        status.details.append(holder)
    return status


def _quota_details(error: errors.CompactdError) -> list[message.Message]:
    """``QuotaFailure`` (and ``RetryInfo`` for a rate) of a ``QuotaExceeded``; else nothing."""
    if not isinstance(error, errors.QuotaExceeded):
        return []
    failure = error_details_pb2.QuotaFailure(
        violations=[
            error_details_pb2.QuotaFailure.Violation(
                subject=clip(v.subject, MAX_FIELD_BYTES),
                description=clip(v.description, MAX_DESCRIPTION_BYTES),
                quota_id=v.quota,
                quota_value=int(v.limit) if float(v.limit).is_integer() else 0,
            )
            for v in error.quota_violations[:MAX_VIOLATIONS]
        ]
    )
    details: list[message.Message] = [failure]
    if error.retry_after is not None:
        delay = duration_pb2.Duration()
        # Rounded up to the millisecond: a client that waits exactly this long must fit.
        delay.FromMilliseconds(max(1, math.ceil(error.retry_after * 1000)))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    return details


def clip(text: str, max_bytes: int) -> str:
    """``text`` within ``max_bytes`` UTF-8 bytes, cut at a character with ``…`` when clipped."""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    return raw[: max(0, max_bytes - 3)].decode("utf-8", "ignore") + "…"


def _rpc_code(code: grpc.StatusCode) -> int:
    value = code.value[0]
    assert isinstance(value, int)
    return value if value in code_pb2.Code.values() else code_pb2.UNKNOWN


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: errors.CompactdError) -> None:
    """Abort the call with the error's status (never returns)."""
    status = to_status(error)
    await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)


Handler = TypeVar("Handler", bound=Callable[..., Any])


def handle_errors(handler: Handler) -> Handler:
    """Wrap a unary or server-streaming servicer method so errors map to statuses; the call's
    deadline is bound for the work under it (``compactd.deadlines``)."""
    if _is_async_gen(handler):

        @functools.wraps(handler)
        async def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            deadlines.bind(context.time_remaining())
            try:
                async for item in handler(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except errors.CompactdError as error:
                await abort(context, error)
            except Exception:
                await _internal(context, handler.__name__)

        return cast(Handler, stream)

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        deadlines.bind(context.time_remaining())
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except errors.CompactdError as error:
            await abort(context, error)
        except Exception:
            await _internal(context, handler.__name__)

    return cast(Handler, unary)


async def _internal(context: grpc.aio.ServicerContext[Any, Any], name: str) -> None:
    log.exception("unexpected error in %s", name)
    await abort(context, errors.Internal(f"internal error in {name}; see the server log"))


def _is_async_gen(fn: Callable[..., Any]) -> bool:
    return inspect.isasyncgenfunction(fn)
