"""The provider error table: every entry against its provider's real status code and body.

The bodies come from ``compactd.testing.provider_errors`` (the shapes providers send); each is
classified as the table reads it and, for the summarizer, sent through a real HTTP server.
"""

from __future__ import annotations

import json
import random

import pytest

from compactd.core import prompts
from compactd.core.limits import MAX_TOKEN_COUNT
from compactd.providers import errors
from compactd.providers.base import SummaryError, SummaryRequest
from compactd.providers.errors import ProviderFailure, classify, parse_retry_after
from compactd.providers.openai import OpenAISummarizer, RetryPolicy
from compactd.reasons import Reason
from compactd.testing import OpenAICompatServer, Reply
from compactd.testing import provider_errors as pe
from compactd.testing.messages import image_block, system, user
from compactd.v1 import events_pb2
from tests.runtime import OVERFLOW_RULES


def _classify(reply: Reply, *, request_images: int | None = 0) -> ProviderFailure:
    """Classify what the loopback sends for ``reply``: its status, body and headers."""
    body = reply.body if reply.body is not None else json.dumps({"error": reply.error})
    return classify(reply.status, body, reply.headers, request_images=request_images)


@pytest.mark.parametrize(("provider", "rule"), OVERFLOW_RULES)
def test_each_providers_overflow_is_context_window_exceeded_with_its_figures(
    provider: str, rule: str
) -> None:
    failure = _classify(pe.overflow(provider, window=8192, prompt_tokens=9731))

    assert (failure.reason, failure.rule, failure.status) == (
        Reason.CONTEXT_WINDOW_EXCEEDED,
        rule,
        400,
    )
    assert (failure.context_window, failure.prompt_tokens) == (8192, 9731)
    assert not failure.retryable
    assert failure.message.startswith("HTTP 400: ")


def test_llama_server_overflow_body_recorded_from_the_real_server() -> None:
    # Recorded from llama.cpp's llama-server (shared/tools/oai-server/README.md): `code` is an int.
    body = (
        '{"error":{"code":400,"message":"request (3031 tokens) exceeds the available context '
        'size (2048 tokens), try increasing it","type":"exceed_context_size_error",'
        '"n_prompt_tokens":3031,"n_ctx":2048}}'
    )

    failure = classify(400, body)

    assert (failure.reason, failure.rule) == (
        Reason.CONTEXT_WINDOW_EXCEEDED,
        "llama.cpp/exceed_context_size",
    )
    assert (failure.context_window, failure.prompt_tokens) == (2048, 3031)


def test_vllm_max_tokens_variant_and_an_unknown_servers_wording_are_overflow() -> None:
    vllm = (
        '{"object":"error","message":"\'max_tokens\' or \'max_completion_tokens\' is too large: '
        "1000. This model's maximum context length is 32768 tokens and your request has 32000 "
        'input tokens (1000 > 32768 - 32000).","type":"BadRequestError","param":null,"code":400}'
    )
    generic = '{"error":{"message":"Input is too long for requested model.","code":null}}'

    first, second = classify(400, vllm), classify(400, generic)

    assert first.reason == second.reason == Reason.CONTEXT_WINDOW_EXCEEDED
    assert (first.context_window, first.prompt_tokens) == (32768, 32000)
    assert second.rule == "generic/context_wording"


@pytest.mark.parametrize(
    ("reply", "request_images", "offload", "rule"),
    [
        (pe.gateway_image_budget(2), 0, 2, "compactd/offload_images"),
        (pe.vllm_image_limit(1), 4, 3, "vllm/image_limit"),
        (Reply.too_many_images(limit=8), 11, 3, "generic/too_many_images"),
    ],
    ids=["stated-count", "vllm-limit", "wording-with-limit"],
)
def test_image_budget_failures_require_offload_with_a_count(
    reply: Reply, request_images: int, offload: int, rule: str
) -> None:
    failure = _classify(reply, request_images=request_images)

    assert (failure.reason, failure.offload_images, failure.rule) == (
        Reason.IMAGE_OFFLOAD_REQUIRED,
        offload,
        rule,
    )


def test_a_413_is_an_image_budget_failure_only_when_the_request_carries_images() -> None:
    assert classify(413, "Request Entity Too Large", request_images=3).reason == (
        Reason.IMAGE_OFFLOAD_REQUIRED
    )
    assert classify(413, "Request Entity Too Large", request_images=0).reason == (
        Reason.CONTEXT_WINDOW_EXCEEDED
    )


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini"])
def test_rate_limits_are_retryable_with_retry_after_even_when_they_mention_tokens(
    provider: str,
) -> None:
    failure = _classify(pe.rate_limited(provider, retry_after=2))

    assert (failure.reason, failure.retryable, failure.retry_after) == (
        Reason.RATE_LIMITED,
        True,
        2.0,
    )


def test_an_exhausted_quota_is_a_rate_limit_that_retrying_does_not_fix() -> None:
    failure = _classify(pe.quota_exhausted())

    assert (failure.reason, failure.retryable, failure.rule) == (
        Reason.RATE_LIMITED,
        False,
        "openai/insufficient_quota",
    )


@pytest.mark.parametrize("provider", ["openai", "anthropic", "llama.cpp"])
def test_authentication_failures_are_not_retryable(provider: str) -> None:
    failure = _classify(pe.unauthenticated(provider))

    assert (failure.reason, failure.retryable) == (Reason.UNAUTHENTICATED, False)


@pytest.mark.parametrize(("provider", "status"), [("anthropic", 529), ("openai", 503), ("x", 500)])
def test_overload_and_server_errors_are_unavailable_and_retryable(
    provider: str, status: int
) -> None:
    failure = _classify(pe.unavailable(provider))

    assert (failure.reason, failure.retryable, failure.status) == (
        Reason.PROVIDER_UNAVAILABLE,
        True,
        status,
    )


def test_timeouts_stream_errors_and_unrecognized_failures() -> None:
    assert classify(408, "Request Timeout").reason == Reason.TIMEOUT
    stream = classify(None, '{"message":"upstream closed","type":"server_error"}')
    assert (stream.reason, stream.message) == (
        Reason.PROVIDER_UNAVAILABLE,
        "stream error: upstream closed",
    )
    unknown = classify(400, '{"error":{"message":"temperature must be <= 2"}}')
    assert (unknown.reason, unknown.rule, unknown.retryable) == (errors.PROVIDER_ERROR, "", False)


def test_every_rule_has_a_unique_name_and_a_canonical_reason() -> None:
    names = [rule.name for rule in errors.TABLE]
    assert len(names) == len(set(names))
    canonical = {
        Reason.CONTEXT_WINDOW_EXCEEDED,
        Reason.IMAGE_OFFLOAD_REQUIRED,
        Reason.RATE_LIMITED,
        Reason.UNAUTHENTICATED,
        Reason.TIMEOUT,
        Reason.PROVIDER_UNAVAILABLE,
    }
    assert {rule.reason for rule in errors.TABLE} == canonical


def test_retry_after_accepts_milliseconds_seconds_and_http_dates() -> None:
    assert parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert parse_retry_after({"retry-after": "0.25"}) == 0.25
    date = "Wed, 21 Oct 2015 07:28:10 GMT"
    assert parse_retry_after({"retry-after": date}, now=1445412480.0) == 10.0
    assert parse_retry_after({"retry-after": "soon"}) is None


def test_a_zoneless_http_date_is_gmt_and_one_beyond_any_calendar_is_none() -> None:
    zoneless = "Wed, 21 Oct 2015 07:28:10 -0000"
    assert parse_retry_after({"retry-after": zoneless}, now=1445412480.0) == 10.0
    beyond = "1 Jan 99999999999999999999 0:0:0 GMT"
    assert parse_retry_after({"retry-after": beyond}, now=0.0) is None


# ---- hostile bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stated", "read"),
    [(MAX_TOKEN_COUNT, MAX_TOKEN_COUNT), (MAX_TOKEN_COUNT + 1, 0), (0, 0)],
    ids=["at-the-bound", "above-it", "zero"],
)
def test_a_stated_window_is_read_up_to_the_largest_real_token_count(stated: int, read: int) -> None:
    worded = classify(400, f"This model's maximum context length is {stated:09d} tokens.")
    fields = {"type": "exceed_context_size_error", "n_ctx": stated, "n_prompt_tokens": stated}
    llama = classify(400, json.dumps({"error": fields}))

    assert (worded.reason, worded.context_window) == (Reason.CONTEXT_WINDOW_EXCEEDED, read)
    assert (llama.context_window, llama.prompt_tokens) == (read, read)


def test_an_image_count_is_read_up_to_int32() -> None:
    def stated(count: int) -> ProviderFailure:
        return classify(413, json.dumps({"error": {"offload_images": count}}), request_images=3)

    at, above = stated(errors.MAX_IMAGE_COUNT), stated(errors.MAX_IMAGE_COUNT + 1)
    limit = classify(400, f"At most {errors.MAX_IMAGE_COUNT + 1} image(s) may be provided.")

    assert (at.rule, at.offload_images) == ("compactd/offload_images", errors.MAX_IMAGE_COUNT)
    assert (above.reason, above.rule, above.offload_images) == (
        Reason.IMAGE_OFFLOAD_REQUIRED,
        "http/413_with_images",
        0,
    )
    assert (limit.rule, limit.offload_images) == ("vllm/image_limit", 0)


def test_only_the_first_max_body_bytes_of_a_body_are_read() -> None:
    padding = " " * errors.MAX_BODY_BYTES

    assert classify(400, "context length exceeded" + padding).reason == (
        Reason.CONTEXT_WINDOW_EXCEEDED
    )
    assert classify(400, padding + "context length exceeded").reason == errors.PROVIDER_ERROR


def test_json_nested_beyond_max_body_depth_is_read_as_text() -> None:
    def nested(depth: int) -> str:  # the error object and its message at depth 2
        details = "[" * (depth - 2) + "]" * (depth - 2)
        return '{"error":{"message":"context length exceeded","details":' + details + "}}"

    parsed = classify(400, nested(errors.MAX_BODY_DEPTH))
    text = classify(400, nested(errors.MAX_BODY_DEPTH + 1))

    assert parsed.reason == text.reason == Reason.CONTEXT_WINDOW_EXCEEDED  # wording in both
    assert parsed.message == "HTTP 400: context length exceeded"
    assert text.message.startswith('HTTP 400: {"error":{"message":')


def test_a_lone_surrogate_in_a_json_message_becomes_a_replacement() -> None:
    failure = classify(400, '{"error":{"message":"\\ud800 context length exceeded"}}')

    assert failure.message == "HTTP 400: ? context length exceeded"


# ---- the summarizer classifies through the table, over real HTTP ---------------------------


def _summarizer(server: OpenAICompatServer) -> OpenAISummarizer:
    retry = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.002)
    return OpenAISummarizer(base_url=server.base_url, retry=retry, rng=random.Random(0))


def _request(images: int = 0) -> SummaryRequest:
    pictures = [image_block(bytes([n]), "image/png") for n in range(images)]
    return SummaryRequest(
        messages=[system("You are a careful agent."), user("look", *pictures)],
        tools=[],
        config=events_pb2.RequestConfig(provider="loop", model="m"),
        instruction=prompts.compaction_instruction(None),
        max_tokens=256,
    )


@pytest.mark.parametrize("provider", pe.OVERFLOW_PROVIDERS)
async def test_the_summarizer_reports_each_providers_overflow_without_retrying(
    loopback: OpenAICompatServer, provider: str
) -> None:
    loopback.enqueue(pe.overflow(provider, window=4096, prompt_tokens=5000))

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback).summarize(_request())

    assert caught.value.reason == Reason.CONTEXT_WINDOW_EXCEEDED
    assert caught.value.metadata["rule"]
    assert len(loopback.requests) == 1


async def test_the_summarizer_derives_the_offload_count_from_its_own_images(
    loopback: OpenAICompatServer,
) -> None:
    loopback.enqueue(pe.vllm_image_limit(1))

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback).summarize(_request(images=3))

    assert (caught.value.reason, caught.value.offload_images) == (Reason.IMAGE_OFFLOAD_REQUIRED, 2)


async def test_an_unrecognized_provider_failure_is_summary_failed(
    loopback: OpenAICompatServer,
) -> None:
    loopback.enqueue(Reply.http_error(400, "temperature must be <= 2"))

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback).summarize(_request())

    assert caught.value.reason == Reason.SUMMARY_FAILED
