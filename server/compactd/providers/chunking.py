"""``ChunkingSummarizer``: bounded summaries of spans larger than the summarizer's own window.

During overflow recovery the span to summarize can be nearly the whole context window of the
summary route, so sending it in one request would fail. This wrapper bounds the request instead:

1. **Fits?** When ``count_tokens(messages + [instruction], tools) + max_tokens <= window_tokens``
   the request goes to the inner summarizer unchanged (the common case, one call).
2. **Split.** Otherwise the span is cut into *units* that are never split: one message, or an
   assistant message with tool calls together with the tool results that answer it (a chunk must
   not separate a call from its result, or the provider rejects the chunk). Units are packed
   greedily, in order, into consecutive chunks that each fit the window with the instruction,
   the tools and the output cap. The first chunk keeps the system head, so its prefix matches the
   conversation and the provider's prefix cache is reused; later chunks carry no head.
3. **Oversized unit.** A unit that cannot fit even alone is shrunk: reasoning is dropped, then the
   longest text (or tool-call arguments) is cut repeatedly and ends with ``TRUNCATION_MARKER``;
   images become a short placeholder as a last resort. If it still does not fit, the summary fails
   with ``CONTEXT_WINDOW_EXCEEDED``.
4. **Summarize each chunk** with the inner summarizer and the original instruction. The chunks
   are independent, so up to ``concurrency`` of them are in flight at once (the
   ``[summarizer] chunk_concurrency`` setting): a span of five chunks with a 3 s model waits about
   3 s for its chunks, not 15 s. The partial summaries keep the chunks' order whatever order they
   finish in, so the merge request is the same as one-at-a-time would send. The first chunk that
   fails cancels the others (each cancelled request is closed, no task outlives the call) and
   its error is raised; when several fail, the earliest chunk's error is. A chunk summarized
   before (the same messages, instruction, tools and cap: the first chunk of a span that grew
   since its bracket failed, say) is not sent again: the last ``CHUNK_CACHE`` chunk summaries are
   kept (merges' too; chunks that finished before a failure too; a whole request's too, which
   is the first chunk of its span once that grows), and identical chunks of one span are sent
   once, so no identical request goes to the model twice. A chunk the provider refused before
   with an error that says sending it again cannot help fails again with it, unsent.
5. **Merge.** One final call receives the partial summaries, each framed as a prior checkpoint
   (``prompts.frame_checkpoint``), with the same instruction, which already tells the model to fold
   prior checkpoints into one. If the partial summaries themselves do not fit, they are chunked
   and merged again, at most ``max_rounds`` times. A single chunk needs no merge.

Usage is summed over every call; provider, model and finish reason are the final call's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence

from compactd.core import prompts
from compactd.core.pins import head_length
from compactd.providers.base import Summarizer, SummaryError, SummaryRequest, SummaryResult
from compactd.providers.openai_wire import add_usage
from compactd.reasons import Reason
from compactd.v1 import events_pb2, session_service_pb2

Message = session_service_pb2.Message
TokenCounter = Callable[
    [Sequence[session_service_pb2.Message], Sequence[events_pb2.ToolDeclaration]], int
]

TRUNCATION_MARKER = "\n[... truncated by compactd to fit the summarizer's context window ...]"
IMAGE_PLACEHOLDER = "[image omitted to fit the summarizer's context window]"
_MAX_SHRINK_STEPS = 64
#: Chunk summaries kept per summarizer (least recently used dropped first).
CHUNK_CACHE = 64
#: Chunk requests of one summary in flight at once, unless the caller says otherwise.
DEFAULT_CONCURRENCY = 4


class ChunkingSummarizer:
    """Wraps a summarizer so that no single request exceeds ``window_tokens``."""

    def __init__(
        self,
        inner: Summarizer,
        *,
        window_tokens: int,
        count_tokens: TokenCounter,
        max_rounds: int = 3,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        """Wrap ``inner``.

        Args:
            inner: The summarizer that makes each call.
            window_tokens: Context window of the summary route, in tokens.
            count_tokens: Price of a request input carrying these messages and tools, in the
                summary route's tokens (the token meter's route price).
            max_rounds: Merge rounds allowed when partial summaries need chunking themselves.
            concurrency: Chunk requests of one summary in flight at once (1: one after another).
        """
        if window_tokens <= 0:
            raise ValueError("window_tokens must be positive")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.name = inner.name
        self._inner = inner
        self._window = window_tokens
        self._count = count_tokens
        self._max_rounds = max_rounds
        self._concurrency = concurrency
        self._partials: OrderedDict[str, SummaryResult] = OrderedDict()
        #: Requests the provider refused for good (a failure sending them again cannot mend):
        #: the first chunk of a span that grew since is not sent again.
        self._refused: OrderedDict[str, SummaryError] = OrderedDict()

    @property
    def concurrency(self) -> int:
        """Chunk requests of one summary in flight at once, at most."""
        return self._concurrency

    async def summarize(self, request: SummaryRequest) -> SummaryResult:
        """Summarize in one call when the request fits, otherwise chunk and merge.

        Raises:
            SummaryError: From the inner summarizer, or ``CONTEXT_WINDOW_EXCEEDED`` when the
                instruction, tools and output cap leave no room, or one unit cannot be shrunk
                enough.
        """
        if self.fits(request.messages, request):
            # Sent whatever it got before (failure memory decides whether the same span may go
            # again), and kept: it is the first chunk of the same span once that grows.
            return await self._sent(request)
        return await self._chunked(request, round_=1)

    async def _sent(self, request: SummaryRequest) -> SummaryResult:
        """The inner summarizer's summary of ``request``, kept by its digest; a refusal that
        says sending it again cannot help is kept too."""
        key = _digest(request)
        try:
            result = await self._inner.summarize(request)
        except SummaryError as error:
            if not error.retryable:
                self._refused[key] = error
                while len(self._refused) > CHUNK_CACHE:
                    self._refused.popitem(last=False)
            raise
        self._partials[key] = result
        self._partials.move_to_end(key)
        while len(self._partials) > CHUNK_CACHE:
            self._partials.popitem(last=False)
        return result

    def fits(self, messages: Sequence[Message], request: SummaryRequest) -> bool:
        """Whether ``messages`` with ``request``'s instruction, tools and cap fit the window."""
        instruction = _user(request.instruction)
        used = self._count([*messages, instruction], request.tools) + request.max_tokens
        return used <= self._window

    def chunks(self, request: SummaryRequest) -> list[list[Message]]:
        """The consecutive chunks ``request.messages`` is summarized in (the plan, no calls)."""
        self._check_room(request)
        head, units = split_units(request.messages)
        chunks: list[list[Message]] = []
        current: list[Message] = list(head)
        for unit in units:
            if self.fits([*current, *unit], request):
                current.extend(unit)
                continue
            if _has_span(current, head, chunks):
                chunks.append(current)
                current = []
            if self.fits([*current, *unit], request):
                current.extend(unit)
                continue
            chunks.append(self._shrink_unit(current, unit, request))
            current = []
        if _has_span(current, head, chunks):
            chunks.append(current)
        return chunks

    async def _chunked(self, request: SummaryRequest, round_: int) -> SummaryResult:
        chunks = self.chunks(request)
        if not chunks:
            raise SummaryError("nothing to summarize: the span is empty")
        partials = await self._partials_of([dataclasses.replace(request, messages=chunk)
                                            for chunk in chunks])  # fmt: skip
        usage: events_pb2.Usage | None = None
        for result in partials:
            usage = add_usage(usage, result.usage)
        if len(partials) == 1:
            return dataclasses.replace(partials[0], usage=usage)
        final = await self._merge(request, partials, round_)
        return dataclasses.replace(final, usage=add_usage(usage, final.usage))

    async def _partials_of(self, chunks: Sequence[SummaryRequest]) -> list[SummaryResult]:
        """Every chunk's summary, in the chunks' order, ``concurrency`` requests at a time.

        Identical chunks are summarized once (the copies' usage is not counted again). A failure
        cancels the chunks still running or waiting, and the earliest failed chunk's error is
        raised once they have all ended.
        """
        keys = [_digest(chunk) for chunk in chunks]
        unique = dict(zip(keys, chunks, strict=True))  # the first of each identical chunk
        gate = asyncio.Semaphore(self._concurrency)

        async def summarize(chunk: SummaryRequest) -> SummaryResult:
            async with gate:
                return await self._partial(chunk)

        tasks: dict[str, asyncio.Task[SummaryResult]] = {}
        try:
            async with asyncio.TaskGroup() as group:
                for key, chunk in unique.items():
                    tasks[key] = group.create_task(summarize(chunk))
        except BaseExceptionGroup:
            raise _earliest_error(list(tasks.values())) from None
        seen: set[str] = set()
        results = []
        for key in keys:
            result = tasks[key].result()
            results.append(result if key not in seen else dataclasses.replace(result, usage=None))
            seen.add(key)
        return results

    async def _partial(self, chunk: SummaryRequest) -> SummaryResult:
        """One chunk's summary: the inner summarizer's, or the one it wrote for the same chunk
        before (its usage is then not counted again)."""
        key = _digest(chunk)
        kept = self._partials.get(key)
        if kept is not None:
            self._partials.move_to_end(key)
            return dataclasses.replace(kept, usage=None)
        refused = self._refused.get(key)
        if refused is not None:  # refused for good before (as a whole request, say): unsent
            self._refused.move_to_end(key)
            raise _again(refused)
        return await self._sent(chunk)

    async def _merge(
        self, request: SummaryRequest, partials: Sequence[SummaryResult], round_: int
    ) -> SummaryResult:
        framed = [_user(prompts.frame_checkpoint(partial.text)) for partial in partials]
        merge = dataclasses.replace(request, messages=framed, tools=())
        if self.fits(framed, merge):
            return await self._partial(merge)
        if round_ >= self._max_rounds:
            raise SummaryError(
                f"{len(partials)} partial summaries still exceed the summarizer window of "
                f"{self._window} tokens after {round_} merge rounds; lower maxTokens or use a "
                "summary route with a larger window",
                reason=Reason.CONTEXT_WINDOW_EXCEEDED,
            )
        return await self._chunked(merge, round_ + 1)

    def _check_room(self, request: SummaryRequest) -> None:
        if not self.fits([], request):
            raise SummaryError(
                f"the instruction, {len(request.tools)} tool declarations and max_tokens="
                f"{request.max_tokens} alone exceed the summarizer window of {self._window} "
                "tokens",
                reason=Reason.CONTEXT_WINDOW_EXCEEDED,
            )

    def _shrink_unit(
        self, prefix: list[Message], unit: Sequence[Message], request: SummaryRequest
    ) -> list[Message]:
        """``prefix`` plus ``unit`` shrunk until they fit; without the prefix if it must go."""
        for base_messages in (prefix, []):
            shrunk = self._shrink(base_messages, unit, request)
            if shrunk is not None:
                return [*base_messages, *shrunk]
        raise SummaryError(
            f"one message (role {unit[0].role}) cannot fit the summarizer window of "
            f"{self._window} tokens even truncated",
            reason=Reason.CONTEXT_WINDOW_EXCEEDED,
        )

    def _shrink(
        self, prefix: Sequence[Message], unit: Sequence[Message], request: SummaryRequest
    ) -> list[Message] | None:
        messages = [_without_reasoning(message) for message in unit]
        for _ in range(_MAX_SHRINK_STEPS):
            if self.fits([*prefix, *messages], request):
                return messages
            excess = (
                self._count([*prefix, *messages, _user(request.instruction)], request.tools)
                + request.max_tokens
                - self._window
            )
            if not _cut_longest(messages, excess) and not _drop_one_image(messages):
                return None
        return messages if self.fits([*prefix, *messages], request) else None


def _earliest_error(tasks: Sequence[asyncio.Task[SummaryResult]]) -> BaseException:
    """The error of the earliest chunk that failed (not cancelled), all tasks having ended."""
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            assert error is not None
            return error
    raise AssertionError("a task group failed without a failed task")  # pragma: no cover


def _again(error: SummaryError) -> SummaryError:
    """A fresh copy of ``error`` to raise again (its traceback is the first call's)."""
    return SummaryError(
        error.message, reason=error.reason, retryable=error.retryable,
        offload_images=error.offload_images, status=error.status, retry_after=error.retry_after,
        metadata=error.metadata,
    )  # fmt: skip


def _digest(request: SummaryRequest) -> str:
    """A chunk request's identity: everything the provider would be sent."""
    digest = hashlib.blake2b(digest_size=16)
    for message in request.messages:
        digest.update(message.SerializeToString(deterministic=True))
    for declaration in request.tools:
        digest.update(declaration.SerializeToString(deterministic=True))
    digest.update(request.config.SerializeToString(deterministic=True))
    digest.update(f"{request.max_tokens}\0{request.instruction}".encode())
    return digest.hexdigest()


def split_units(
    messages: Sequence[Message],
) -> tuple[list[Message], list[list[Message]]]:
    """The head (a leading system message and the pinned-state message, if any: ``head_length``)
    and the span's indivisible units.

    A unit is one message, or an assistant message with tool calls followed by the tool results
    that answer those calls.
    """
    head = list(messages[: head_length(messages)])
    units: list[list[Message]] = []
    open_calls: set[str] = set()
    for message in messages[len(head) :]:
        is_answer = message.role == _TOOL and message.tool_call_id in open_calls
        if is_answer and units:
            units[-1].append(message)
            open_calls.discard(message.tool_call_id)
            continue
        units.append([message])
        open_calls = _call_ids(message)
    return head, units


_SYSTEM = session_service_pb2.MESSAGE_ROLE_SYSTEM
_TOOL = session_service_pb2.MESSAGE_ROLE_TOOL


def _has_span(
    current: Sequence[Message], head: Sequence[Message], chunks: Sequence[object]
) -> bool:
    """Whether ``current`` holds span messages (the first chunk also holds the head)."""
    return len(current) > (0 if chunks else len(head))


def _call_ids(message: Message) -> set[str]:
    return {block.tool_call.id for block in message.content if block.HasField("tool_call")}


def _user(text: str) -> Message:
    return Message(
        role=session_service_pb2.MESSAGE_ROLE_USER,
        content=[events_pb2.ContentBlock(text=events_pb2.TextBlock(text=text))],
    )


def _without_reasoning(message: Message) -> Message:
    copy = Message()
    copy.CopyFrom(message)
    del copy.content[:]
    copy.content.extend(block for block in message.content if not block.HasField("reasoning"))
    return copy


def _cut_longest(messages: list[Message], excess_tokens: int) -> bool:
    """Cut the longest text or tool-call arguments in place; False when nothing is left to cut."""
    target = _longest(messages)
    if target is None:
        return False
    block, length = target
    # At least a quarter each step, and about 4 characters per excess token.
    keep = max(0, length - max(excess_tokens * 4, length // 4, 1))
    if block.HasField("text"):
        original = block.text.text
        block.text.text = original[: max(0, keep - len(TRUNCATION_MARKER))] + TRUNCATION_MARKER
        return block.text.text != original
    arguments = block.tool_call.arguments_json
    shortened = json.dumps({"truncated_arguments": arguments[: max(0, keep - 40)]})
    block.tool_call.arguments_json = shortened
    return shortened != arguments


def _longest(messages: list[Message]) -> tuple[events_pb2.ContentBlock, int] | None:
    best: tuple[events_pb2.ContentBlock, int] | None = None
    for message in messages:
        for block in message.content:
            length = _cuttable_length(block)
            if length > 0 and (best is None or length > best[1]):
                best = (block, length)
    return best


def _cuttable_length(block: events_pb2.ContentBlock) -> int:
    """How much of a block can still be cut (0 once nothing but a marker is left)."""
    if block.HasField("text"):
        text = block.text.text
        return (
            0 if text == TRUNCATION_MARKER.lstrip("\n") or text == TRUNCATION_MARKER else len(text)
        )
    if block.HasField("tool_call"):
        arguments = block.tool_call.arguments_json
        return len(arguments) if len(arguments) > 64 else 0
    return 0


def _drop_one_image(messages: list[Message]) -> bool:
    for message in messages:
        for block in message.content:
            if block.HasField("image"):
                block.text.text = IMAGE_PLACEHOLDER
                return True
    return False
