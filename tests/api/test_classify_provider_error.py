"""ClassifyProviderError over a real server, fed with what real providers answer over HTTP."""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime
from typing import Any

import grpc
import httpx
import pytest

from compactd import config
from compactd.api.server import create_server
from compactd.testing import provider_errors as pe
from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import compaction_service_pb2_grpc
from tests.api.rpc import details

CONTEXT = cpb.PROVIDER_ERROR_KIND_CONTEXT_WINDOW_EXCEEDED
IMAGES = cpb.PROVIDER_ERROR_KIND_IMAGE_OFFLOAD_REQUIRED


async def answered(loop: OpenAICompatServer, reply: Reply) -> cpb.RawProviderError:
    """What the provider answers a chat request with, as the runtime received it."""
    loop.enqueue(reply)
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{loop.base_url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    return cpb.RawProviderError(
        http_status=response.status_code, body=response.content, headers=dict(response.headers)
    )


async def classify(compaction: Any, raw: cpb.RawProviderError) -> cpb.ProviderErrorClassification:
    reply = await compaction.ClassifyProviderError(cpb.ClassifyProviderErrorRequest(raw=raw))
    classification: cpb.ProviderErrorClassification = reply.classification
    return classification


@pytest.mark.parametrize("provider", pe.OVERFLOW_PROVIDERS)
async def test_every_providers_overflow_is_classified_with_its_figures(
    compaction: Any, loop: OpenAICompatServer, provider: str
) -> None:
    raw = await answered(loop, pe.overflow(provider, window=32768, prompt_tokens=40000))

    got = await classify(compaction, raw)

    assert (got.reason, got.kind, got.retryable) == ("CONTEXT_WINDOW_EXCEEDED", CONTEXT, False)
    assert got.rule
    assert (got.context_window, got.prompt_tokens) == (32768, 40000)
    assert got.error == cpb.ProviderError(
        kind=CONTEXT, message=got.message, context_window=32768, prompt_tokens=40000
    )


async def test_an_image_limit_gives_the_count_over_it_when_the_runtime_says_how_many_it_sent(
    compaction: Any, loop: OpenAICompatServer
) -> None:
    raw = await answered(loop, pe.vllm_image_limit(2))
    raw.request_images = 5

    got = await classify(compaction, raw)

    assert (got.kind, got.offload_images, got.error.offload_images) == (IMAGES, 3, 3)


@pytest.mark.parametrize(
    ("reply", "reason", "retryable"),
    [
        (pe.rate_limited("gemini", retry_after=4), "RATE_LIMITED", True),
        (pe.quota_exhausted(), "RATE_LIMITED", False),
        (pe.unauthenticated("anthropic"), "UNAUTHENTICATED", False),
        (pe.unavailable("anthropic"), "PROVIDER_UNAVAILABLE", True),
        (Reply.http_error(400, "temperature must be at most 2"), "PROVIDER_ERROR", False),
    ],
    ids=["rate-limit", "quota", "auth", "overloaded", "unrecognized"],
)
async def test_other_failures_carry_no_recoverable_kind(
    compaction: Any, loop: OpenAICompatServer, reply: Reply, reason: str, retryable: bool
) -> None:
    got = await classify(compaction, await answered(loop, reply))

    assert (got.reason, got.retryable, got.kind) == (
        reason,
        retryable,
        cpb.PROVIDER_ERROR_KIND_UNSPECIFIED,
    )
    if reason == "RATE_LIMITED" and retryable:
        assert got.retry_after_seconds == 4.0


async def test_an_error_inside_a_stream_has_status_zero(compaction: Any) -> None:
    raw = cpb.RawProviderError(body=b'{"error":{"message":"maximum context length exceeded"}}')

    got = await classify(compaction, raw)

    assert got.reason == "CONTEXT_WINDOW_EXCEEDED"
    assert got.message.startswith("stream error: ")


async def test_an_empty_error_is_invalid_argument(compaction: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await classify(compaction, cpb.RawProviderError())

    got = details(caught.value)
    assert (got.code, got.fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["raw"])


HUGE = b"99999999999999999999"  # above int64: no real window or prompt
OVER, OFFLOAD, UNRECOGNIZED = "CONTEXT_WINDOW_EXCEEDED", "IMAGE_OFFLOAD_REQUIRED", "PROVIDER_ERROR"
#: Bodies no provider sends (a hostile or broken one), each with the reason it still gets.
HOSTILE = [
    pytest.param(b"[" * 100_000 + b"]" * 100_000, UNRECOGNIZED, id="deep-json"),
    pytest.param(b"maximum context length is " + HUGE + b" tokens.", OVER, id="int64-window"),
    pytest.param(b"maximum context length is " + b"9" * 5000 + b" tokens.", OVER, id="5000-digits"),
    pytest.param(
        b'{"error":{"message":"too many images","offload_images":99999999999}}',
        OFFLOAD,
        id="offload-above-int32",
    ),
    pytest.param(
        b'{"error":{"type":"exceed_context_size_error","n_ctx":%s,"n_prompt_tokens":%s}}'
        % (HUGE, HUGE),
        OVER,
        id="llama-above-int64",
    ),
    pytest.param(
        b"prompt is too long: %s tokens > %s maximum" % (HUGE, HUGE), OVER, id="anthropic-above"
    ),
    pytest.param(
        b"The input token count (%s) exceeds the maximum number of tokens allowed (%s)."
        % (HUGE, HUGE),
        OVER,
        id="gemini-above-int64",
    ),
    pytest.param(
        b'{"error":{"message":"\\ud800 context length exceeded"}}', OVER, id="lone-surrogate"
    ),
    pytest.param(b'{"error":{"message":"' + b"x" * 10_000_000 + b'"}}', UNRECOGNIZED, id="10MB"),
]


@pytest.mark.parametrize("provider", pe.OVERFLOW_PROVIDERS)
async def test_an_overflow_stating_figures_above_int64_is_classified_without_them(
    compaction: Any, loop: OpenAICompatServer, provider: str
) -> None:
    raw = await answered(loop, pe.overflow(provider, window=10**20, prompt_tokens=10**20 + 1))

    got = await classify(compaction, raw)

    assert (got.reason, got.kind) == (OVER, CONTEXT)
    assert got.rule
    assert (got.context_window, got.prompt_tokens) == (0, 0)


@pytest.mark.parametrize(("body", "reason"), HOSTILE)
async def test_a_hostile_body_is_classified_with_no_figure_it_cannot_mean(
    compaction: Any, body: bytes, reason: str
) -> None:
    got = await classify(compaction, cpb.RawProviderError(http_status=400, body=body))

    assert got.reason == reason
    assert (got.context_window, got.prompt_tokens, got.offload_images) == (0, 0, 0)
    assert got.error.kind == got.kind


async def test_an_http_date_retry_after_is_read_against_the_servers_clock(
    server_config: config.ServerConfig,
) -> None:
    now = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
    in_an_hour = email.utils.formatdate(now.timestamp() + 3600, usegmt=True)
    raw = cpb.RawProviderError(
        http_status=429, body=b"slow down", headers={"Retry-After": in_an_hour}
    )
    running = await create_server(server_config, wall_clock=lambda: now)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            got = await classify(compaction_service_pb2_grpc.CompactionServiceStub(channel), raw)
    finally:
        await running.stop(0)

    assert (got.reason, got.retryable) == ("RATE_LIMITED", True)
    assert got.HasField("retry_after_seconds")
    assert got.retry_after_seconds == 3600.0
