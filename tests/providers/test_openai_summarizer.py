"""OpenAISummarizer against a real OpenAI-compatible server on loopback."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from compactd.core import prompts
from compactd.providers.base import SummaryError, SummaryRequest
from compactd.providers.openai import OpenAISummarizer, RetryPolicy, Timeouts
from compactd.providers.openai_wire import (
    dumps,
    encode_messages,
    encode_request,
    encode_tools,
    user_text_message,
)
from compactd.reasons import Reason
from compactd.testing import OpenAICompatServer, Reply, ScriptedToolCall
from compactd.testing.messages import assistant, image_block, system, tool, tool_result, user
from compactd.v1 import events_pb2
from compactd.v1.session_service_pb2 import Message

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.005)
TOOLS = [tool("bash", '{"type":"object","properties":{"command":{"type":"string"}}}', "Run")]
CONVERSATION = [
    system("You are a careful coding agent."),
    user("Fix the failing test in tests/test_app.py"),
    assistant("Running it.", calls=[("call_1", "bash", '{"command": "pytest -q"}')]),
    tool_result("call_1", "E   AssertionError: 1 != 2\n1 failed", name="bash", is_error=True),
    assistant("The fixture returns 1; changing it to 2."),
    user("Thanks. Now update the changelog."),
]


def _request(
    messages: Sequence[Message] = CONVERSATION[:5],
    *,
    focus: str | None = None,
    max_tokens: int = 512,
) -> SummaryRequest:
    return SummaryRequest(
        messages=messages,
        tools=TOOLS,
        config=events_pb2.RequestConfig(provider="loopback", model="loop-1", temperature=0.0),
        instruction=prompts.compaction_instruction(focus),
        max_tokens=max_tokens,
    )


def _summarizer(server: OpenAICompatServer, **options: Any) -> OpenAISummarizer:
    options.setdefault("retry", FAST_RETRY)
    options.setdefault("rng", random.Random(0))
    return OpenAISummarizer(base_url=server.base_url, **options)


async def test_streamed_text_becomes_the_summary_with_usage(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply(text="## Goals and Requests\n- fix the test", chunk_chars=3))

    result = await _summarizer(loopback).summarize(_request())

    assert result.text == "## Goals and Requests\n- fix the test"
    assert (result.provider, result.model, result.finish_reason) == ("loopback", "loop-1", "stop")
    assert result.usage is not None
    assert result.usage.input_tokens > 0
    assert result.usage.output_tokens == 9
    body = loopback.requests[0].json
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 512


async def test_replaying_the_conversation_prefix_reads_the_cache(
    loopback: OpenAICompatServer,
) -> None:
    config = events_pb2.RequestConfig(model="loop-1")
    conversation = encode_request(
        encode_messages(CONVERSATION), encode_tools(TOOLS), config, stream=False
    )
    async with httpx.AsyncClient() as client:
        await client.post(f"{loopback.base_url}/chat/completions", content=dumps(conversation))

    result = await _summarizer(loopback).summarize(_request(CONVERSATION[:5]))

    # The simulated cache covers at least the tools and every replayed message.
    replayed = dumps(encode_tools(TOOLS)) + dumps(encode_messages(CONVERSATION[:5]))[:-1]
    assert result.usage is not None
    assert result.usage.cache_read_tokens >= len(replayed.decode()) // 4


async def test_reasoning_and_tool_calls_are_dropped(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(
        Reply(
            text="Only this.",
            reasoning="Private chain of thought.",
            tool_calls=(ScriptedToolCall("bash", '{"command": "rm -rf /"}'),),
            finish_reason="stop",
        )
    )

    result = await _summarizer(loopback).summarize(_request())

    assert result.text == "Only this."
    assert result.usage is not None
    assert result.usage.reasoning_tokens > 0


async def test_image_output_fails_with_unsupported_content(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply(text="Here is a picture.", image=True))

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback).summarize(_request())

    assert caught.value.reason == Reason.UNSUPPORTED_CONTENT
    assert len(loopback.requests) == 1


async def test_a_rate_limit_is_retried_then_succeeds(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply.rate_limited(retry_after=0), Reply(text="Done."))

    result = await _summarizer(loopback).summarize(_request())

    assert result.text == "Done."
    assert len(loopback.requests) == 2
    assert loopback.requests[0].body == loopback.requests[1].body


async def test_server_errors_exhaust_the_attempts(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(*[Reply.server_error(500)] * 3, Reply(text="too late"))

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback).summarize(_request())

    assert caught.value.reason == Reason.PROVIDER_UNAVAILABLE
    assert caught.value.retryable
    assert caught.value.status == 500
    assert "gave up after 3 attempts" in caught.value.message
    assert len(loopback.requests) == 3


async def test_a_retry_after_beyond_the_cap_fails_at_once(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply.rate_limited(retry_after=3600))
    retry = RetryPolicy(max_attempts=5, initial_backoff=0.001, max_retry_after=1)

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback, retry=retry).summarize(_request())

    assert caught.value.reason == Reason.RATE_LIMITED
    assert caught.value.retry_after == 3600
    assert len(loopback.requests) == 1


async def test_a_silent_provider_times_out(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply(text="late", delay_before=30))
    timeouts = Timeouts(connect=5, read=0.2, total=60)

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback, timeouts=timeouts, retry=RetryPolicy(max_attempts=1)).summarize(
            _request()
        )

    assert caught.value.reason == Reason.TIMEOUT
    assert caught.value.retryable


async def test_a_slow_stream_hits_the_total_timeout(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply(text="x" * 400, chunk_chars=1, delay_between=0.05))
    timeouts = Timeouts(connect=5, read=5, total=0.3)

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback, timeouts=timeouts, retry=RetryPolicy(max_attempts=1)).summarize(
            _request()
        )

    assert caught.value.reason == Reason.TIMEOUT
    assert "0.3s" in caught.value.message


async def test_a_context_length_error_is_classified_and_not_retried(
    loopback: OpenAICompatServer,
) -> None:
    loopback.enqueue(Reply.context_length_exceeded(window=8192, requested=9000))

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback).summarize(_request())

    assert caught.value.reason == Reason.CONTEXT_WINDOW_EXCEEDED
    assert not caught.value.retryable
    assert "8192" in caught.value.message
    assert len(loopback.requests) == 1


async def test_too_many_images_asks_for_offload(loopback: OpenAICompatServer) -> None:
    pictures = [image_block(bytes([n]), "image/png") for n in range(4)]
    loopback.enqueue(Reply.too_many_images(limit=1))

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback).summarize(_request([user("look", *pictures)]))

    assert caught.value.reason == Reason.IMAGE_OFFLOAD_REQUIRED
    assert caught.value.offload_images == 3


async def test_an_error_inside_the_stream_is_classified(loopback: OpenAICompatServer) -> None:
    error = {"message": "maximum context length exceeded", "type": "invalid_request_error"}
    loopback.enqueue(Reply(text="partial", stream_error=error))

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback).summarize(_request())

    assert caught.value.reason == Reason.CONTEXT_WINDOW_EXCEEDED


async def test_a_stream_cut_short_is_retried(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply(text="half", cut_stream=True), Reply(text="Whole summary."))

    result = await _summarizer(loopback).summarize(_request())

    assert result.text == "Whole summary."
    assert len(loopback.requests) == 2


async def test_a_summary_cut_at_max_tokens_fails(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply(text="## Goals and", finish_reason="length"))

    with pytest.raises(SummaryError) as caught:
        await _summarizer(loopback).summarize(_request())

    assert caught.value.reason == Reason.SUMMARY_TRUNCATED


async def test_tool_calls_without_text_fail_clearly(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply(text="", tool_calls=(ScriptedToolCall("bash"),)))

    with pytest.raises(SummaryError, match="called tools"):
        await _summarizer(loopback).summarize(_request())


async def test_the_api_key_comes_from_the_named_variable(
    loopback: OpenAICompatServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMPACTD_TEST_SUMMARY_KEY", "sk-loopback-123")

    await _summarizer(loopback, api_key_env="COMPACTD_TEST_SUMMARY_KEY").summarize(_request())

    assert loopback.requests[0].header("Authorization") == "Bearer sk-loopback-123"


async def test_a_missing_api_key_variable_fails_before_any_request(
    loopback: OpenAICompatServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COMPACTD_TEST_MISSING_KEY", raising=False)

    with pytest.raises(SummaryError, match="COMPACTD_TEST_MISSING_KEY") as caught:
        await _summarizer(loopback, api_key_env="COMPACTD_TEST_MISSING_KEY").summarize(_request())

    assert caught.value.reason == Reason.SUMMARIZER_MISCONFIGURED
    assert loopback.requests == []


async def test_no_key_variable_sends_no_authorization(loopback: OpenAICompatServer) -> None:
    await _summarizer(loopback).summarize(_request())

    assert loopback.requests[0].header("Authorization") is None


async def test_the_purpose_is_marked_and_metadata_only_when_allowed(
    loopback: OpenAICompatServer,
) -> None:
    await _summarizer(loopback).summarize(_request())
    await _summarizer(loopback, send_metadata=True).summarize(_request())

    plain, with_metadata = loopback.requests
    assert plain.header("X-Compactd-Purpose") == "compaction"
    assert "metadata" not in plain.json
    assert with_metadata.json["metadata"] == {"purpose": "compaction"}


async def test_summary_messages_are_the_conversation_prefix_byte_for_byte(
    loopback: OpenAICompatServer,
) -> None:
    config = events_pb2.RequestConfig(provider="loopback", model="loop-1", temperature=0.0)
    conversation_body = dumps(
        encode_request(encode_messages(CONVERSATION), encode_tools(TOOLS), config, stream=True)
    )
    span = CONVERSATION[:5]
    request = _request(span, focus="the changelog")

    await _summarizer(loopback).summarize(request)

    raw = loopback.requests[0].body
    expected = [*encode_messages(span), user_text_message(request.instruction)]
    assert b'"messages":' + dumps(expected) + b"," in raw
    replayed = dumps(encode_messages(span))[:-1]
    assert replayed in conversation_body
    assert raw.index(replayed) == conversation_body.index(replayed)
    assert json.loads(raw)["tools"] == json.loads(conversation_body)["tools"]
    assert json.loads(raw)["messages"][-1]["content"].endswith("the changelog")


async def test_non_streamed_mode_reads_one_body(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply(text="Summary.", reasoning="hidden"))

    result = await _summarizer(loopback, stream=False).summarize(_request())

    assert result.text == "Summary."
    assert result.usage is not None
    assert loopback.requests[0].json["stream"] is False


async def test_an_unreachable_provider_is_unavailable() -> None:
    server = OpenAICompatServer().start()
    base_url = server.base_url
    server.stop()

    with pytest.raises(SummaryError) as caught:
        await OpenAISummarizer(base_url=base_url, retry=FAST_RETRY).summarize(_request())

    assert caught.value.reason == Reason.PROVIDER_UNAVAILABLE
    assert "gave up after 3 attempts" in caught.value.message


async def test_a_request_without_a_model_says_what_to_configure() -> None:
    request = SummaryRequest(
        messages=[user("hi")],
        tools=[],
        config=events_pb2.RequestConfig(),
        instruction="summarize",
        max_tokens=10,
    )

    with pytest.raises(SummaryError, match="summarizationModel") as caught:
        await OpenAISummarizer(base_url="http://127.0.0.1:9/v1").summarize(request)

    assert caught.value.reason == Reason.SUMMARIZER_MISCONFIGURED


async def test_deepseek_style_usage_is_parsed() -> None:
    with OpenAICompatServer(usage_style="deepseek") as server:
        await _summarizer(server).summarize(_request())
        result = await _summarizer(server).summarize(_request())

    assert result.usage is not None
    assert result.usage.cache_read_tokens > 0


async def test_cancelling_a_summary_is_authoritative(loopback: OpenAICompatServer) -> None:
    loopback.enqueue(Reply(text="late", delay_before=600))
    task = asyncio.create_task(_summarizer(loopback).summarize(_request()))
    assert await asyncio.to_thread(loopback.wait_for_requests, 1)

    task.cancel()

    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(loopback.requests) == 1
