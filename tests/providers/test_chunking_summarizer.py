"""ChunkingSummarizer: spans larger than the summarizer's window are chunked and merged."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core import prompts
from compactd.providers.base import SummaryError, SummaryRequest
from compactd.providers.chunking import TRUNCATION_MARKER, ChunkingSummarizer, split_units
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.providers.openai import OpenAISummarizer
from compactd.providers.openai_wire import dumps, encode_messages, encode_tools
from compactd.reasons import Reason
from compactd.testing import OpenAICompatServer, Reply
from compactd.testing.messages import assistant, system, tool, tool_result, user
from compactd.v1 import events_pb2
from compactd.v1.events_pb2 import ToolDeclaration
from compactd.v1.session_service_pb2 import Message

INSTRUCTION = prompts.compaction_instruction(None)
TOOLS = [tool("bash")]


def count_tokens(messages: Sequence[Message], tools: Sequence[ToolDeclaration]) -> int:
    """Wire-size heuristic: 4 characters of the encoded request per token."""
    text = dumps(encode_messages(messages)) + dumps(encode_tools(tools))
    return math.ceil(len(text.decode()) / 4)


def _request(messages: Sequence[Message], max_tokens: int = 200) -> SummaryRequest:
    return SummaryRequest(
        messages=messages,
        tools=TOOLS,
        config=events_pb2.RequestConfig(provider="loopback", model="loop-1"),
        instruction=INSTRUCTION,
        max_tokens=max_tokens,
    )


def _span(turns: int) -> list[Message]:
    messages = [system("You are a coding agent.")]
    for n in range(turns):
        messages.append(user(f"Step {n}: " + "please look at the logs " * 12))
        messages.append(assistant(f"Checking {n}.", calls=[(f"c{n}", "bash", '{"command":"ls"}')]))
        messages.append(tool_result(f"c{n}", "line of output\n" * 20, name="bash"))
    return messages


def _instruction_tokens() -> int:
    return count_tokens([user(INSTRUCTION)], TOOLS)


def _chunker(server: OpenAICompatServer, window: int) -> ChunkingSummarizer:
    inner = OpenAISummarizer(base_url=server.base_url)
    return ChunkingSummarizer(inner, window_tokens=window, count_tokens=count_tokens)


async def test_a_fitting_span_is_one_unchanged_call(loopback: OpenAICompatServer) -> None:
    request = _request(_span(2))

    await _chunker(loopback, window=100_000).summarize(request)
    await OpenAISummarizer(base_url=loopback.base_url).summarize(request)

    chunked, direct = loopback.requests
    assert chunked.body == direct.body


async def test_a_span_larger_than_the_window_is_chunked_then_merged(
    loopback: OpenAICompatServer,
) -> None:
    span = _span(12)
    window = _instruction_tokens() + 200 + 900
    chunker = _chunker(loopback, window)
    request = _request(span)
    plan = chunker.chunks(request)
    assert len(plan) >= 3
    loopback.enqueue(*[Reply(text=f"partial {n}") for n in range(len(plan))])
    loopback.enqueue(Reply(text="merged summary"))

    result = await chunker.summarize(request)

    assert result.text == "merged summary"
    *chunk_calls, merge_call = loopback.requests
    assert len(chunk_calls) == len(plan)
    replayed = [m for call in chunk_calls for m in call.json["messages"][:-1]]
    assert replayed == encode_messages(span)
    assert chunk_calls[0].json["messages"][0] == {
        "role": "system",
        "content": "You are a coding agent.",
    }
    assert all(call.json["messages"][0]["role"] != "system" for call in chunk_calls[1:])
    for call in loopback.requests:
        assert call.json["messages"][-1] == {"role": "user", "content": INSTRUCTION}
        assert count_tokens(_decoded(call.json), TOOLS) + 200 <= window
    merged_inputs = [m["content"] for m in merge_call.json["messages"][:-1]]
    assert merged_inputs == [prompts.frame_checkpoint(f"partial {n}") for n in range(len(plan))]
    assert "tools" not in merge_call.json
    assert result.usage is not None
    assert result.usage.output_tokens == sum(
        math.ceil(len(text) / 4)
        for text in [*[f"partial {n}" for n in range(len(plan))], "merged summary"]
    )


async def test_a_chunk_summarized_before_is_not_sent_again_when_its_span_grew(
    loopback: OpenAICompatServer,
) -> None:
    # A bracket whose merged summary failed leaves its span to the next one, grown: its first
    # chunks are the same requests, and the model is not asked the same thing twice.
    window = _instruction_tokens() + 200 + 900
    chunker = _chunker(loopback, window)
    first = _request(_span(8))
    await chunker.summarize(first)
    sent = len(loopback.requests)

    await chunker.summarize(_request(_span(12)))  # the same first turns, then four more

    bodies = [call.body for call in loopback.requests]
    assert len(bodies) == len(set(bodies))  # no identical request went out twice
    assert len(loopback.requests) - sent < len(chunker.chunks(_request(_span(12)))) + 1


async def test_chunks_never_separate_a_tool_call_from_its_result(
    loopback: OpenAICompatServer,
) -> None:
    chunker = _chunker(loopback, _instruction_tokens() + 200 + 700)

    await chunker.summarize(_request(_span(10)))

    for call in loopback.requests:
        seen: set[str] = set()
        for message in call.json["messages"]:
            seen.update(c["id"] for c in message.get("tool_calls", []))
            if message["role"] == "tool":
                assert message["tool_call_id"] in seen


async def test_a_single_message_too_large_is_truncated_with_a_marker(
    loopback: OpenAICompatServer,
) -> None:
    huge = user("start " + "x" * 40_000 + " end")
    window = _instruction_tokens() + 200 + 600

    await _chunker(loopback, window).summarize(_request([system("head"), huge, user("after")]))

    contents = [m["content"] for call in loopback.requests for m in call.json["messages"]]
    truncated = [c for c in contents if isinstance(c, str) and c.endswith(TRUNCATION_MARKER)]
    assert len(truncated) == 1
    assert truncated[0].startswith("start ")
    for call in loopback.requests:
        assert count_tokens(_decoded(call.json), TOOLS) + 200 <= window


async def test_no_room_for_the_instruction_and_cap_fails_without_a_call(
    loopback: OpenAICompatServer,
) -> None:
    chunker = _chunker(loopback, window=_instruction_tokens() + 100)

    with pytest.raises(SummaryError) as caught:
        await chunker.summarize(_request(_span(3), max_tokens=500))

    assert caught.value.reason == Reason.CONTEXT_WINDOW_EXCEEDED
    assert loopback.requests == []


def test_units_group_a_call_with_its_results() -> None:
    span = _span(2)

    head, units = split_units(span)

    assert head == span[:1]
    assert [len(unit) for unit in units] == [1, 2, 1, 2]


_unit = st.tuples(st.integers(min_value=0, max_value=600), st.integers(min_value=0, max_value=3))


@settings(max_examples=50, deadline=None)
@given(st.lists(_unit, min_size=1, max_size=20), st.integers(min_value=700, max_value=2000))
def test_the_plan_covers_the_span_in_order_with_chunks_that_fit(
    units: list[tuple[int, int]], room: int
) -> None:
    span: list[Message] = [system("head")]
    for index, (size, results) in enumerate(units):
        if results == 0:
            span.append(user("u" * size))
            continue
        calls = [(f"c{index}-{r}", "bash", "{}") for r in range(results)]
        span.append(assistant("a" * size, calls=calls))
        span.extend(tool_result(call_id, "r", name="bash") for call_id, _, _ in calls)
    window = _instruction_tokens() + 200 + room
    chunker = ChunkingSummarizer(
        ExtractiveSummarizer(), window_tokens=window, count_tokens=count_tokens
    )
    request = _request(span)

    plan = chunker.chunks(request)

    assert [m for chunk in plan for m in chunk] == span
    assert all(chunker.fits(chunk, request) for chunk in plan)
    assert all(chunk[0].role != span[0].role for chunk in plan[1:])


def _decoded(body: dict[str, object]) -> list[Message]:
    """The request's messages back as projected messages (text only), for pricing."""
    messages = body["messages"]
    assert isinstance(messages, list)
    out: list[Message] = []
    for wire in messages:
        if wire["role"] == "assistant":
            calls = [
                (c["id"], c["function"]["name"], c["function"]["arguments"])
                for c in wire.get("tool_calls", [])
            ]
            out.append(assistant(wire["content"] or "", calls=calls))
        elif wire["role"] == "tool":
            out.append(tool_result(wire["tool_call_id"], wire["content"]))
        elif wire["role"] == "system":
            out.append(system(wire["content"]))
        else:
            out.append(user(wire["content"]))
    return out
