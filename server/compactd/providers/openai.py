"""``OpenAISummarizer``: summaries from any OpenAI-compatible chat-completions endpoint.

One summary is one streamed ``POST {base_url}/chat/completions``: the replayed prefix encoded
exactly as the conversation sent it (``openai_wire``), the latest header's tools, and our
instruction as the final user message. Only the returned text becomes the summary: reasoning and
tool calls are dropped, image (or audio) output fails with ``UNSUPPORTED_CONTENT``.

Transient failures (429, 5xx, 408, connection loss, timeouts, a stream cut short) are retried
with exponential backoff and jitter, honouring ``Retry-After``, up to ``RetryPolicy.max_attempts``
attempts; everything else fails at once with a classified ``SummaryError``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import compactd
from compactd.core.projection import offload_placeholder
from compactd.errors import InvalidArgument
from compactd.providers import errors, openai_wire
from compactd.providers.base import SummaryError, SummaryRequest, SummaryResult
from compactd.providers.openai_wire import Completion, SSEDecoder
from compactd.reasons import Reason
from compactd.v1 import events_pb2

_log = logging.getLogger(__name__)

PURPOSE_HEADER = "X-Compactd-Purpose"
PURPOSE = "compaction"


@dataclass(frozen=True)
class Timeouts:
    """Time limits of one attempt, in seconds.

    Attributes:
        connect: Establishing the connection.
        read: Longest silence between two received bytes (first token included).
        total: Wall-clock bound of one whole attempt, streaming included.
    """

    connect: float = 10.0
    read: float = 120.0
    total: float = 600.0


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of transient failures.

    The delay before attempt ``n + 1`` is ``min(max_backoff, initial_backoff * multiplier **
    (n - 1))``, reduced by up to ``jitter`` (a fraction) at random, and never shorter than the
    provider's ``Retry-After``. A ``Retry-After`` above ``max_retry_after`` fails at once.
    """

    max_attempts: int = 4
    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.5
    max_retry_after: float = 60.0


class OpenAISummarizer:
    """A ``Summarizer`` speaking the OpenAI chat-completions protocol over httpx.

    Each ``summarize`` call opens its own connection pool and closes it before returning, so the
    summarizer owns no resource between calls and can be shared across event loops.
    """

    name = "openai"

    def __init__(
        self,
        *,
        base_url: str,
        api_key_env: str | None = None,
        api_key_file: str | None = None,
        provider: str | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        stream: bool = True,
        send_metadata: bool = False,
        include_reasoning: bool = False,
        developer_role: str = "developer",
        max_tokens_field: str = "max_tokens",
        resolve_image: openai_wire.ImageResolver | None = None,
        extra_headers: Mapping[str, str] | None = None,
        allow_truncated: bool = False,
        transport: httpx.AsyncBaseTransport | None = None,
        rng: random.Random | None = None,
        environ: Mapping[str, str] | None = None,
        on_client: Callable[[httpx.AsyncClient], None] | None = None,
    ) -> None:
        """Configure the endpoint.

        Args:
            base_url: Endpoint root including the version, e.g. ``https://api.deepseek.com/v1``.
            api_key_env: NAME of the environment variable holding the API key (read at each
                call); None sends no ``Authorization`` header (local servers).
            api_key_file: A file holding the API key instead (read at each call, whitespace
                around it stripped), so rotating the key is rewriting the file.
            provider: Provider name reported in results; defaults to the request's.
            timeouts: Per-attempt time limits.
            retry: Retry policy for transient failures.
            stream: Use server-sent events (with a final usage chunk); False asks for one body.
            send_metadata: Also mark the purpose in the body as ``metadata.purpose`` (only for
                routes that accept ``metadata``); the purpose header is always sent.
            include_reasoning: Replay assistant reasoning (for routes that require it back).
            developer_role: Wire role of developer messages.
            max_tokens_field: Body key of the output cap.
            resolve_image: URL for images without inline data; an image it gives none for
                is sent as its offload text.
            extra_headers: Further request headers.
            allow_truncated: Accept a summary cut at ``max_tokens`` instead of failing with
                ``SUMMARY_TRUNCATED``.
            transport: httpx transport override (tests of transport-level failures).
            rng: Randomness of the backoff jitter.
            environ: Where to read the API key; defaults to ``os.environ``.
            on_client: Called with each HTTP client before its first request (instrumentation:
                the server traces every call and propagates ``traceparent``).
        """
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._api_key_env = api_key_env or None
        self._api_key_file = api_key_file or None
        self._provider = provider
        self._timeouts = timeouts or Timeouts()
        self._retry = retry or RetryPolicy()
        self._stream = stream
        self._send_metadata = send_metadata
        self._include_reasoning = include_reasoning
        self._developer_role = developer_role
        self._max_tokens_field = max_tokens_field
        self._resolve_image = resolve_image
        self._extra_headers = dict(extra_headers or {})
        self._allow_truncated = allow_truncated
        self._transport = transport
        self._rng = rng or random.Random()
        self._environ = environ if environ is not None else os.environ
        self._on_client = on_client

    def build_body(self, request: SummaryRequest) -> dict[str, Any]:
        """The request body ``summarize`` sends for ``request`` (before serialization).

        Raises:
            SummaryError: The request cannot be encoded (``UNSUPPORTED_CONTENT``) or names no
                model (``SUMMARIZER_MISCONFIGURED``).
        """
        return self._body(request, self._sendable(request.messages))

    def _body(
        self, request: SummaryRequest, sendable: Sequence[openai_wire.Message]
    ) -> dict[str, Any]:
        _check_request(request)
        try:
            messages = openai_wire.encode_messages(
                sendable,
                include_reasoning=self._include_reasoning,
                developer_role=self._developer_role,
                resolve_image=self._resolve_image,
            )
            messages.append(openai_wire.user_text_message(request.instruction))
            extra = {"metadata": {"purpose": PURPOSE}} if self._send_metadata else None
            return openai_wire.encode_request(
                messages,
                openai_wire.encode_tools(request.tools),
                request.config,
                stream=self._stream,
                max_tokens=request.max_tokens,
                extra=extra,
                max_tokens_field=self._max_tokens_field,
            )
        except InvalidArgument as exc:
            reason = (
                exc.reason if exc.reason == Reason.UNSUPPORTED_CONTENT else Reason.SUMMARY_FAILED
            )
            raise SummaryError(f"cannot encode the summary request: {exc}", reason=reason) from exc

    async def summarize(self, request: SummaryRequest) -> SummaryResult:
        """Request one summary, retrying transient failures.

        Raises:
            SummaryError: Classified failure; for retryable reasons, after the last attempt.
        """
        sendable = self._sendable(request.messages)
        body = openai_wire.dumps(self._body(request, sendable))
        headers = self._headers()
        images = _count_images(sendable)
        async with self._client() as client:
            completion = await self._with_retries(client, body, headers, images)
        return self._result(request, completion)

    def _sendable(self, messages: Sequence[openai_wire.Message]) -> Sequence[openai_wire.Message]:
        """``messages`` with each image the endpoint cannot be sent (neither inline data with
        its media type nor a URL from ``resolve_image``) carried as its offload text (name,
        attachment, path): a span holding a reference-only image is still summarized, where
        refusing it would stop every later summary of the session. Unchanged messages are
        returned as they are."""
        out: list[openai_wire.Message] | None = None
        for index, message in enumerate(messages):
            blocks = message.content
            if not any(b.HasField("image") and not self._can_send(b.image) for b in blocks):
                if out is not None:
                    out.append(message)
                continue
            if out is None:
                out = list(messages[:index])
            copy = openai_wire.Message()
            copy.CopyFrom(message)
            for block in copy.content:
                if block.HasField("image") and not self._can_send(block.image):
                    block.text.text = offload_placeholder(block.image)  # clears the image
            out.append(copy)
        return messages if out is None else out

    def _can_send(self, image: events_pb2.ImageBlock) -> bool:
        if image.data and image.media_type:
            return True
        return self._resolve_image is not None and bool(self._resolve_image(image))

    def _headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream" if self._stream else "application/json",
            "User-Agent": f"compactd/{compactd.__version__}",
            PURPOSE_HEADER: PURPOSE,
        }
        key = self._api_key()
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        headers.update(self._extra_headers)
        return headers

    def _api_key(self) -> str | None:
        """The key as it is now (from the file or the variable); None when the route has none.

        The errors name where the key should be, never a byte of what was found there.
        """
        if self._api_key_file is not None:
            try:
                key = Path(self._api_key_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise SummaryError(
                    f"cannot read the API key file {self._api_key_file} named by the summary "
                    f"route ({type(exc).__name__})",
                    reason=Reason.SUMMARIZER_MISCONFIGURED,
                ) from None
            if not key:
                raise SummaryError(
                    f"the API key file {self._api_key_file} named by the summary route is empty",
                    reason=Reason.SUMMARIZER_MISCONFIGURED,
                )
            return key
        if self._api_key_env is None:
            return None
        key = self._environ.get(self._api_key_env, "")
        if not key:
            raise SummaryError(
                f"the API key variable {self._api_key_env} named by the summary route is not "
                "set in the environment",
                reason=Reason.SUMMARIZER_MISCONFIGURED,
            )
        return key

    def _client(self) -> httpx.AsyncClient:
        limits = self._timeouts
        timeout = httpx.Timeout(limits.read, connect=limits.connect)
        client = httpx.AsyncClient(timeout=timeout, transport=self._transport)
        if self._on_client is not None:
            self._on_client(client)
        return client

    async def _with_retries(
        self, client: httpx.AsyncClient, body: bytes, headers: dict[str, str], images: int
    ) -> Completion:
        attempts = max(1, self._retry.max_attempts)
        for attempt in range(1, attempts + 1):
            try:
                return await self._attempt(client, body, headers, images)
            except SummaryError as exc:
                delay = self._retry_delay(exc, attempt, attempts)
                if delay is None and not exc.retryable:
                    raise
                if delay is None:
                    raise _exhausted(exc, attempt) from exc
                _log.warning(
                    "summary attempt %d failed (%s), retrying in %.2fs",
                    attempt,
                    exc.reason,
                    delay,
                    extra={"reason": exc.reason, "attempt": attempt},
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _retry_delay(self, exc: SummaryError, attempt: int, attempts: int) -> float | None:
        """Seconds to wait before the next attempt; None when the error must be raised."""
        policy = self._retry
        if not exc.retryable or attempt >= attempts:
            return None
        if exc.retry_after is not None and exc.retry_after > policy.max_retry_after:
            return None
        backoff = min(
            policy.max_backoff, policy.initial_backoff * policy.multiplier ** (attempt - 1)
        )
        delay = backoff * (1 - policy.jitter * self._rng.random())
        return max(delay, exc.retry_after or 0.0)

    async def _attempt(
        self, client: httpx.AsyncClient, body: bytes, headers: dict[str, str], images: int
    ) -> Completion:
        try:
            async with asyncio.timeout(self._timeouts.total):
                return await self._exchange(client, body, headers, images)
        except TimeoutError as exc:
            raise SummaryError(
                f"the summary request took longer than {self._timeouts.total}s",
                reason=Reason.TIMEOUT,
                retryable=True,
            ) from exc
        except httpx.TimeoutException as exc:
            raise SummaryError(
                f"the summary request timed out ({type(exc).__name__})",
                reason=Reason.TIMEOUT,
                retryable=True,
            ) from exc
        except httpx.TransportError as exc:
            raise SummaryError(
                f"cannot reach the summary provider at {self._url}: {type(exc).__name__}: {exc}",
                reason=Reason.PROVIDER_UNAVAILABLE,
                retryable=True,
            ) from exc

    async def _exchange(
        self, client: httpx.AsyncClient, body: bytes, headers: dict[str, str], images: int
    ) -> Completion:
        async with client.stream("POST", self._url, content=body, headers=headers) as response:
            if response.status_code >= 400:
                raw = await response.aread()
                raise _classified(
                    errors.classify(
                        response.status_code,
                        raw,
                        response.headers,
                        request_images=images,
                        now=time.time(),
                    )
                )
            if not self._stream:
                completion = Completion()
                completion.add_response(_json(await response.aread()))
                _raise_on_output(completion, images)
                return completion
            return await _read_stream(response, images)

    def _result(self, request: SummaryRequest, completion: Completion) -> SummaryResult:
        if completion.finish_reason == "length" and not self._allow_truncated:
            raise SummaryError(
                f"the summary was cut off at max_tokens={request.max_tokens} (reasoning tokens "
                "count against it); raise maxTokens for this route",
                reason=Reason.SUMMARY_TRUNCATED,
            )
        if completion.finish_reason == "content_filter":
            raise SummaryError("the provider's content filter stopped the summary")
        text = completion.text.strip()
        if not text:
            detail = " (it called tools instead)" if completion.tool_calls else ""
            raise SummaryError(f"the model returned no summary text{detail}")
        usage = openai_wire.parse_usage(completion.usage) if completion.usage else None
        return SummaryResult(
            text=text,
            usage=usage,
            provider=self._provider or request.config.provider,
            model=completion.model or request.config.model,
            finish_reason=completion.finish_reason or "stop",
            response_id=completion.id,
        )


async def _read_stream(response: httpx.Response, images: int) -> Completion:
    completion = Completion()
    decoder = SSEDecoder()
    done = False
    async for line in response.aiter_lines():
        data = decoder.feed_line(line)
        if data is not None and _consume(completion, data, images):
            done = True
            break
    if not done:
        tail = decoder.end()
        done = tail is not None and _consume(completion, tail, images)
    if not done and not completion.finish_reason:
        raise SummaryError(
            "the summary stream ended before the model finished",
            reason=Reason.PROVIDER_UNAVAILABLE,
            retryable=True,
        )
    return completion


def _consume(completion: Completion, data: str, images: int) -> bool:
    """Fold one event into ``completion``; True at the end-of-stream marker."""
    if data.strip() == openai_wire.SSE_DONE:
        return True
    completion.add_chunk(_json(data.encode("utf-8")))
    _raise_on_output(completion, images)
    return False


def _raise_on_output(completion: Completion, images: int) -> None:
    """Fail as soon as the stream carries an error or output a summary cannot hold."""
    if completion.error is not None:
        raise _classified(
            errors.classify(None, json.dumps(completion.error), request_images=images)
        )
    if completion.unsupported_output:
        kinds = ", ".join(completion.unsupported_output)
        raise SummaryError(
            f"the summary model returned {kinds} output; a summary can only be text",
            reason=Reason.UNSUPPORTED_CONTENT,
        )


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise SummaryError(f"the provider sent malformed JSON: {raw[:200]!r}") from exc
    if not isinstance(value, dict):
        raise SummaryError(f"the provider sent a non-object JSON value: {raw[:200]!r}")
    return value


def _classified(error: errors.ProviderFailure) -> SummaryError:
    """The summarizer's error for a classified provider failure (an unrecognized one is
    ``SUMMARY_FAILED``), naming the table rule that recognized it."""
    reason = Reason.SUMMARY_FAILED if error.reason == errors.PROVIDER_ERROR else error.reason
    return SummaryError(
        error.message,
        reason=reason,
        metadata={"rule": error.rule} if error.rule else None,
        retryable=error.retryable,
        offload_images=error.offload_images,
        status=error.status,
        retry_after=error.retry_after,
    )


def _exhausted(exc: SummaryError, attempt: int) -> SummaryError:
    """A retryable error we stop retrying, saying how many attempts were spent."""
    return SummaryError(
        f"{exc.message} (gave up after {attempt} attempt{'s' if attempt != 1 else ''})",
        reason=exc.reason,
        retryable=True,
        offload_images=exc.offload_images,
        status=exc.status,
        retry_after=exc.retry_after,
    )


def _check_request(request: SummaryRequest) -> None:
    if not request.config.model:
        raise SummaryError(
            "no summary model: set summarizationProvider and summarizationModel, or route one "
            "request first so the latest routed model can be used",
            reason=Reason.SUMMARIZER_MISCONFIGURED,
        )
    if request.max_tokens <= 0:
        raise SummaryError(
            f"max_tokens must be positive, got {request.max_tokens}",
            reason=Reason.SUMMARIZER_MISCONFIGURED,
        )


def _count_images(messages: Sequence[openai_wire.Message]) -> int:
    return sum(1 for message in messages for block in message.content if block.HasField("image"))
