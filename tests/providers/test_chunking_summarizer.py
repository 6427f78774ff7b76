"""ChunkingSummarizer: spans larger than the summarizer's window are chunked and merged."""

from __future__ import annotations

import asyncio
import math
import threading
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
from compactd.testing import OpenAICompatServer, RecordedRequest, Reply
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


def _chunker(
    server: OpenAICompatServer | None, window: int, concurrency: int = 4
) -> ChunkingSummarizer:
    """A chunker over the loopback model (None: for its plan only, it sends nothing)."""
    inner = OpenAISummarizer(base_url=server.base_url if server else "http://127.0.0.1:9/v1")
    return ChunkingSummarizer(
        inner, window_tokens=window, count_tokens=count_tokens, concurrency=concurrency
    )


class ByChunk:
    """Answers each chunk request with ``partial N`` (N: its place in ``plan``), whatever order
    the requests arrive in, and any other request (the merge) with ``merged summary``."""

    def __init__(self, plan: Sequence[Sequence[Message]]) -> None:
        self._plan = [encode_messages(chunk) for chunk in plan]

    def index(self, request: RecordedRequest) -> int:
        """The place in the plan of the chunk ``request`` carries (-1: none, the merge)."""
        sent = request.json["messages"][:-1]  # the instruction is last
        return self._plan.index(sent) if sent in self._plan else -1

    def __call__(self, request: RecordedRequest) -> Reply:
        index = self.index(request)
        return Reply(text=f"partial {index}" if index >= 0 else "merged summary")


async def test_a_fitting_span_is_one_unchanged_call(loopback: OpenAICompatServer) -> None:
    request = _request(_span(2))

    await _chunker(loopback, window=100_000).summarize(request)
    await OpenAISummarizer(base_url=loopback.base_url).summarize(request)

    chunked, direct = loopback.requests
    assert chunked.body == direct.body


async def test_a_span_larger_than_the_window_is_chunked_then_merged() -> None:
    span = _span(12)
    window = _instruction_tokens() + 200 + 900
    request = _request(span)
    plan = _chunker(None, window).chunks(request)
    assert len(plan) >= 3
    answers = ByChunk(plan)  # chunks run concurrently: each answered by what it holds
    with OpenAICompatServer(responder=answers) as loopback:
        result = await _chunker(loopback, window).summarize(request)
        calls = loopback.requests

    assert result.text == "merged summary"
    *chunk_calls, merge_call = calls
    assert sorted(answers.index(call) for call in chunk_calls) == list(range(len(plan)))
    chunk_calls.sort(key=answers.index)
    replayed = [m for call in chunk_calls for m in call.json["messages"][:-1]]
    assert replayed == encode_messages(span)
    assert chunk_calls[0].json["messages"][0] == {
        "role": "system",
        "content": "You are a coding agent.",
    }
    assert all(call.json["messages"][0]["role"] != "system" for call in chunk_calls[1:])
    for call in calls:
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


async def test_a_request_refused_for_good_is_not_sent_again_as_a_grown_spans_first_chunk() -> None:
    # A span whose request the model refused (HTTP 400: sending it again cannot help) grows by
    # new history: its first chunk is that same request, and it fails again unsent.
    with OpenAICompatServer(responder=lambda _: Reply.http_error(400, "refused")) as refusing:
        window = _instruction_tokens() + 200 + 900
        chunker = _chunker(refusing, window)
        grown = _request(_span(12))
        first = _request(chunker.chunks(grown)[0])  # the span before it grew: one request
        assert chunker.fits(first.messages, first)
        with pytest.raises(SummaryError):
            await chunker.summarize(first)

        with pytest.raises(SummaryError) as again:
            await chunker.summarize(grown)
        bodies = [call.body for call in refusing.requests]

    assert len(bodies) == len(set(bodies))  # no identical request went out twice
    assert again.value.reason == Reason.SUMMARY_FAILED
    assert not again.value.retryable


class Overlap:
    """A loopback model that holds each request until ``together`` requests are held at once,
    every one of ``total`` has arrived, or ``grace`` seconds pass with no newcomer; it records
    the most requests it held at once (requests in flight together), then answers by chunk.

    ``grace`` only ends a wait that a correct chunker makes by design (its bound stops the next
    request); nothing is asserted about time.
    """

    def __init__(self, answers: ByChunk, together: int, total: int, grace: float) -> None:
        self._answers = answers
        self._together, self._total, self._grace = together, total, grace
        self._turn = threading.Condition()
        self._arrived = self._held = self._released = 0
        self.peak = 0
        self.passed = 0  # requests let go (answered)
        self.fail: set[int] = set()  # chunk indexes answered with an HTTP 400 at once

    def __call__(self, request: RecordedRequest) -> Reply:
        if self._answers.index(request) in self.fail:
            return Reply.http_error(400, "chunk refused")
        with self._turn:
            self._arrived += 1
            number = self._arrived
            self._held += 1
            self.peak = max(self.peak, self._held)
            if self._held >= self._together or self._arrived >= self._total:
                self._released = self._arrived
                self._turn.notify_all()
            while self._released < number:
                if not self._turn.wait(self._grace) and self._released < number:
                    self._released = self._arrived  # no newcomer: let the held ones go
                    self._turn.notify_all()
            self._held -= 1
            self.passed += 1
        return self._answers(request)

    def release(self) -> None:
        """Let every held request go."""
        with self._turn:
            self._released = self._total + 10**6
            self._turn.notify_all()


async def test_the_chunks_of_a_span_are_summarized_concurrently_and_merged_in_order() -> None:
    span = _span(12)
    window = _instruction_tokens() + 200 + 900
    request = _request(span)
    plan = _chunker(None, window).chunks(request)
    # Every chunk held until all are in flight at once: one after another, the first would be
    # held alone (until the 60 s guard) and the peak would be 1.
    model = Overlap(ByChunk(plan), together=len(plan), total=len(plan) + 1, grace=60)
    with OpenAICompatServer(responder=model) as loopback:
        result = await _chunker(loopback, window, concurrency=len(plan)).summarize(request)
        calls = loopback.requests

    assert model.peak == len(plan) >= 3
    assert result.text == "merged summary"
    merged = [m["content"] for m in calls[-1].json["messages"][:-1]]
    assert merged == [prompts.frame_checkpoint(f"partial {n}") for n in range(len(plan))]
    assert len({call.body for call in calls}) == len(calls)


async def test_no_more_chunks_than_the_bound_are_in_flight_at_once() -> None:
    span = _span(24)
    window = _instruction_tokens() + 200 + 900
    request = _request(span)
    plan = _chunker(None, window).chunks(request)
    assert len(plan) >= 5
    # Held until a third arrives: an unbounded chunker sends it at once, a bound of 2 does not
    # (each pair goes after a short grace).
    model = Overlap(ByChunk(plan), together=3, total=len(plan) + 1, grace=0.3)
    with OpenAICompatServer(responder=model) as loopback:
        result = await _chunker(loopback, window, concurrency=2).summarize(request)
        calls = loopback.requests

    assert model.peak == 2
    assert result.text == "merged summary"
    assert len(calls) == len(plan) + 1


async def test_a_failed_chunk_cancels_the_others_and_its_error_is_raised() -> None:
    span = _span(12)
    window = _instruction_tokens() + 200 + 900
    request = _request(span)
    plan = _chunker(None, window).chunks(request)
    model = Overlap(ByChunk(plan), together=len(plan) + 1, total=len(plan) + 1, grace=60)
    model.fail = {1}
    with OpenAICompatServer(responder=model) as loopback:
        chunker = _chunker(loopback, window, concurrency=len(plan))
        try:
            with pytest.raises(SummaryError) as caught:
                await chunker.summarize(request)
            answered = model.passed  # the other chunks are still held: none was waited for
            leaked = asyncio.all_tasks() - {asyncio.current_task()}
        finally:
            model.release()
        assert loopback.wait_for_requests(len(plan))

    assert "chunk refused" in str(caught.value)
    assert answered == 0
    assert leaked == set()


async def test_cancelling_a_chunked_summary_cancels_every_chunk_request() -> None:
    span = _span(12)
    window = _instruction_tokens() + 200 + 900
    request = _request(span)
    plan = _chunker(None, window).chunks(request)
    model = Overlap(ByChunk(plan), together=len(plan) + 1, total=len(plan) + 1, grace=60)
    with OpenAICompatServer(responder=model) as loopback:
        chunker = _chunker(loopback, window, concurrency=len(plan))
        summary = asyncio.create_task(chunker.summarize(request))
        try:
            assert await asyncio.to_thread(loopback.wait_for_requests, len(plan))
            summary.cancel()
            with pytest.raises(asyncio.CancelledError):
                await summary
            leaked = asyncio.all_tasks() - {asyncio.current_task()}
        finally:
            model.release()

    assert leaked == set()


def test_the_bound_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        ChunkingSummarizer(
            ExtractiveSummarizer(), window_tokens=1000, count_tokens=count_tokens, concurrency=0
        )


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
