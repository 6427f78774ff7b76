"""OpenAICompatServer: a real OpenAI-compatible HTTP server on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from compactd.core import prompts
from compactd.providers.openai_wire import SSEDecoder
from compactd.testing import (
    OpenAICompatServer,
    RecordedRequest,
    Reply,
    ScriptedToolCall,
    provider_errors,
)


@pytest.fixture
def provider() -> Iterator[OpenAICompatServer]:
    with OpenAICompatServer() as running:
        yield running


def _body(stream: bool, **extra: object) -> dict[str, object]:
    return {
        "model": "loop-1",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "stream": stream,
        **extra,
    }


def _events(response: httpx.Response) -> list[dict[str, object]]:
    decoder = SSEDecoder()
    payloads = [d for line in response.text.splitlines() if (d := decoder.feed_line(line))]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_it_binds_an_ephemeral_loopback_port(provider: OpenAICompatServer) -> None:
    assert provider.base_url == f"http://127.0.0.1:{provider.port}/v1"
    assert provider.port > 0


def test_a_streamed_reply_ends_with_a_usage_chunk_and_done(provider: OpenAICompatServer) -> None:
    provider.enqueue(Reply(text="Hello there", reasoning="hmm", chunk_chars=4))
    body = _body(True, stream_options={"include_usage": True})

    response = httpx.post(f"{provider.base_url}/chat/completions", json=body)

    assert response.headers["content-type"] == "text/event-stream"
    events = _events(response)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]  # type: ignore[index]
    assert "".join(d.get("content", "") for d in deltas) == "Hello there"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] > 0  # type: ignore[index]


def test_without_include_usage_no_usage_chunk_is_sent(provider: OpenAICompatServer) -> None:
    events = _events(httpx.post(f"{provider.base_url}/chat/completions", json=_body(True)))

    assert all("usage" not in event for event in events)


def test_a_non_streamed_reply_is_one_completion(provider: OpenAICompatServer) -> None:
    provider.enqueue(Reply(text="ok", tool_calls=(ScriptedToolCall("bash", '{"a":1}'),)))

    response = httpx.post(f"{provider.base_url}/chat/completions", json=_body(False)).json()

    message = response["choices"][0]["message"]
    assert message["content"] == "ok"
    assert message["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"a":1}'}
    assert response["choices"][0]["finish_reason"] == "tool_calls"
    assert response["usage"]["prompt_tokens"] > 0


def test_every_request_is_recorded_byte_for_byte(provider: OpenAICompatServer) -> None:
    raw = b'{"model":"m","messages":[{"role":"user","content":"\xc3\xa9"}],"stream":false}'

    httpx.post(f"{provider.base_url}/chat/completions", content=raw, headers={"X-Custom": "1"})

    [recorded] = provider.requests
    assert recorded.body == raw
    assert recorded.json["messages"][0]["content"] == "é"
    assert recorded.header("x-custom") == "1"
    assert recorded.path == "/v1/chat/completions"


def test_scripted_errors_carry_status_headers_and_a_provider_body(
    provider: OpenAICompatServer,
) -> None:
    provider.enqueue(Reply.rate_limited(retry_after=2), Reply.context_length_exceeded(8192, 9000))

    limited = httpx.post(f"{provider.base_url}/chat/completions", json=_body(True))
    too_long = httpx.post(f"{provider.base_url}/chat/completions", json=_body(True))

    assert limited.status_code == 429
    assert limited.headers["retry-after"] == "2"
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert "8192" in too_long.json()["error"]["message"]


def test_an_error_message_can_echo_the_authorization_header(provider: OpenAICompatServer) -> None:
    provider.enqueue(Reply.http_error(401, "Incorrect API key provided: {authorization}."))

    reply = httpx.post(
        f"{provider.base_url}/chat/completions",
        json=_body(False),
        headers={"Authorization": "Bearer sk-echoed-1234567890"},
    )

    assert reply.status_code == 401
    assert reply.json()["error"]["message"] == (
        "Incorrect API key provided: Bearer sk-echoed-1234567890."
    )


def test_provider_error_bodies_are_sent_byte_for_byte_with_their_status(
    provider: OpenAICompatServer,
) -> None:
    anthropic = provider_errors.overflow("anthropic", window=200000, prompt_tokens=210000)
    provider.enqueue(
        anthropic, provider_errors.overflow("llama.cpp", window=2048, prompt_tokens=3031)
    )

    first = httpx.post(f"{provider.base_url}/chat/completions", json=_body(True))
    second = httpx.post(f"{provider.base_url}/chat/completions", json=_body(False))

    assert (first.status_code, first.text) == (400, anthropic.body)
    assert first.json()["type"] == "error"
    assert second.status_code == 400
    error = second.json()["error"]
    assert (error["code"], error["type"], error["n_ctx"]) == (
        400,
        "exceed_context_size_error",
        2048,
    )


def test_replies_are_used_in_order_then_the_default(provider: OpenAICompatServer) -> None:
    provider.enqueue(Reply(text="one"), Reply(text="two"))
    url = f"{provider.base_url}/chat/completions"

    texts = [
        httpx.post(url, json=_body(False)).json()["choices"][0]["message"]["content"]
        for _ in range(3)
    ]

    assert texts[:2] == ["one", "two"]
    assert texts[2].startswith("Loopback reply to 2 messages")
    assert provider.pending == 0


def test_the_default_reply_is_deterministic(provider: OpenAICompatServer) -> None:
    url = f"{provider.base_url}/chat/completions"

    first, second = (httpx.post(url, json=_body(False)).json() for _ in range(2))

    assert first["choices"][0]["message"] == second["choices"][0]["message"]


def _summary(provider: OpenAICompatServer, messages: list[dict[str, object]]) -> str:
    """The loopback's unscripted answer to a compaction request with ``messages``."""
    body = _body(False)
    body["messages"] = messages
    response = httpx.post(
        f"{provider.base_url}/chat/completions",
        json=body,
        headers={"X-Compactd-Purpose": "compaction"},
    ).json()
    return str(response["choices"][0]["message"]["content"])


def test_an_unscripted_compaction_request_gets_an_eight_section_summary(
    provider: OpenAICompatServer,
) -> None:
    text = _summary(
        provider,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "user", "content": "summarize"},
        ],
    )

    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == list(
        prompts.SUMMARY_SECTIONS
    )
    assert "- Hi" in text


def test_a_repeated_prefix_is_reported_as_cached(provider: OpenAICompatServer) -> None:
    url = f"{provider.base_url}/chat/completions"

    cold = httpx.post(url, json=_body(False)).json()["usage"]
    warm = httpx.post(url, json=_body(False)).json()["usage"]

    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["prompt_tokens_details"]["cached_tokens"] == warm["prompt_tokens"]


def test_an_unknown_path_is_not_found(provider: OpenAICompatServer) -> None:
    assert httpx.post(f"{provider.base_url}/embeddings", json={}).status_code == 404


def test_stop_cuts_a_pending_delayed_reply(provider: OpenAICompatServer) -> None:
    provider.enqueue(Reply(text="never", delay_before=600))
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            httpx.post(f"{provider.base_url}/chat/completions", json=_body(True), timeout=600)
        except httpx.HTTPError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert provider.wait_for_requests(1)
    provider.stop()
    caller.join()

    assert len(outcome) == 1


def test_a_responder_answers_what_the_script_does_not() -> None:
    seen: list[str] = []

    def responder(request: RecordedRequest) -> Reply | None:
        seen.append(request.json["model"])
        return Reply(text="from the responder") if request.json["model"] == "loop-1" else None

    with OpenAICompatServer(responder=responder) as server:
        server.enqueue(Reply(text="scripted"))
        url = f"{server.base_url}/chat/completions"
        first, second = (httpx.post(url, json=_body(False)).json() for _ in range(2))
        other = httpx.post(url, json=_body(False, model="loop-2")).json()

    assert first["choices"][0]["message"]["content"] == "scripted"
    assert second["choices"][0]["message"]["content"] == "from the responder"
    assert other["choices"][0]["message"]["content"].startswith("Loopback reply to")
    assert seen == ["loop-1", "loop-2"]


def test_the_default_summary_quotes_the_requests_and_keeps_paths_commands_and_errors(
    provider: OpenAICompatServer,
) -> None:
    messages: list[dict[str, object]] = [
        {"role": "user", "content": "Please fix the crash in src/app/main.py when it starts."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "pytest -q tests/"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "E   ValueError: bad config value"},
        {"role": "user", "content": "summarize"},
    ]

    text = _summary(provider, messages)

    assert '- "Please fix the crash in src/app/main.py when it starts."' in text
    assert "- src/app/main.py" in text
    assert "- Ran: pytest -q tests/" in text
    assert "- ValueError: bad config value" in text
