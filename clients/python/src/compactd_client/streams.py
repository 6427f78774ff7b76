"""Iterators over server-streaming calls, for the sync and the asyncio client.

Two shapes:

* :class:`ServerStream` / :class:`AsyncServerStream`: every message of the stream, projected
  (``WatchPressure`` yields ``PressureReport``; ``ListEvents`` yields ``SessionEvent``).
* :class:`CompactionStream` / :class:`AsyncCompactionStream`: the compaction RPCs stream one
  ``CompactionProgress`` per bracket step and then one final result; iteration yields the
  progress updates, ``result()`` drains the rest and returns the result.

Failures surface as :class:`compactd_client.errors.CompactdError` subclasses. ``cancel()`` (or
leaving the ``with`` block) cancels the call; iteration then simply ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import grpc
import grpc.aio

from compactd_client.errors import IncompleteStreamError, from_rpc_error
from compactd_client.v1.compaction_service_pb2 import CompactionProgress

__all__ = [
    "AsyncCompactionStream",
    "AsyncServerStream",
    "CompactionStream",
    "ServerStream",
]

# The end-of-stream sentinel of `UnaryStreamCall.read()` (missing from grpc-stubs).
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]

T = TypeVar("T")
R = TypeVar("R")

#: Splits one compaction stream message into its progress update or its final result.
Extract = Callable[[Any], "CompactionProgress | R | None"]


class ServerStream(Generic[T]):
    """The projected messages of one server-streaming call (blocking iterator)."""

    def __init__(self, call: grpc.CallIterator[Any], project: Callable[[Any], T]) -> None:
        self._call = call
        self._responses: Iterator[Any] = iter(call)
        self._project = project
        self._cancelled = False

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> T:
        if self._cancelled:  # grpc may still hold a message received before the cancel
            raise StopIteration
        try:
            response = next(self._responses)
        except grpc.RpcError as err:
            if self._cancelled and err.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise from_rpc_error(err) from err
        return self._project(response)

    def cancel(self) -> None:
        """Cancels the call; a pending or later ``next()`` ends the iteration."""
        self._cancelled = True
        self._call.cancel()  # type: ignore[no-untyped-call]  # untyped in grpc-stubs

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class CompactionStream(Generic[R]):
    """Progress updates of one compaction call, then its result (blocking).

    Iterating yields each ``CompactionProgress``; :meth:`result` drains what is left and
    returns the final result. ``progress`` keeps every update seen so far.
    """

    def __init__(self, call: grpc.CallIterator[Any], extract: Extract[R]) -> None:
        self._stream: ServerStream[CompactionProgress | R | None] = ServerStream(call, extract)
        self._result: R | None = None
        self.progress: list[CompactionProgress] = []

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> CompactionProgress:
        for item in self._stream:
            if isinstance(item, CompactionProgress):
                self.progress.append(item)
                return item
            if item is not None:
                self._result = item
        raise StopIteration

    def result(self) -> R:
        """Consumes the rest of the stream and returns the final result.

        Raises:
            CompactdError: the call failed (e.g. ``CompactionBusyError``).
            IncompleteStreamError: the stream ended without a result.
        """
        for _ in self:
            pass
        if self._result is None:
            raise IncompleteStreamError("the stream ended without a result")
        return self._result

    def cancel(self) -> None:
        """Cancels the call (a compaction already committed on the server stays committed)."""
        self._stream.cancel()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class AsyncServerStream(Generic[T]):
    """The projected messages of one server-streaming call (``async for``)."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall[Any, Any], project: Callable[[Any], T]
    ) -> None:
        self._call = call
        self._project = project
        self._cancelled = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        if self._cancelled:
            raise StopAsyncIteration
        try:
            response = await self._call.read()
        except grpc.RpcError as err:
            if self._cancelled and err.code() == grpc.StatusCode.CANCELLED:
                raise StopAsyncIteration from None
            raise from_rpc_error(err) from err
        except asyncio.CancelledError:
            if self._cancelled and not _task_cancelling():
                raise StopAsyncIteration from None
            raise
        if response is _EOF:
            raise StopAsyncIteration
        return self._project(response)

    def cancel(self) -> None:
        """Cancels the call; a pending or later read ends the iteration."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class AsyncCompactionStream(Generic[R]):
    """Progress updates of one compaction call, then its result (``async for``).

    ``async for`` yields each ``CompactionProgress``; :meth:`result` drains what is left and
    returns the final result. ``progress`` keeps every update seen so far.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall[Any, Any], extract: Extract[R]) -> None:
        self._stream: AsyncServerStream[CompactionProgress | R | None] = AsyncServerStream(
            call, extract
        )
        self._result: R | None = None
        self.progress: list[CompactionProgress] = []

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> CompactionProgress:
        async for item in self._stream:
            if isinstance(item, CompactionProgress):
                self.progress.append(item)
                return item
            if item is not None:
                self._result = item
        raise StopAsyncIteration

    async def result(self) -> R:
        """Consumes the rest of the stream and returns the final result.

        Raises:
            CompactdError: the call failed (e.g. ``CompactionBusyError``).
            IncompleteStreamError: the stream ended without a result.
        """
        async for _ in self:
            pass
        if self._result is None:
            raise IncompleteStreamError("the stream ended without a result")
        return self._result

    def cancel(self) -> None:
        """Cancels the call (a compaction already committed on the server stays committed)."""
        self._stream.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


def _task_cancelling() -> bool:
    """Whether the current task itself is being cancelled (then CancelledError must propagate)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
