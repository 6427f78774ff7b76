"""The agent keeps working: no request leaves PrepareStep over the window while anything can
still be reduced, every step says where it stands (a typed outcome), and no work is repeated.

Each test plays a hostile shape through a live server and checks every step of it: fixed
overhead above the trigger, one tool result larger than the window, a system prompt larger than
the window, a model that always fails, one that always truncates, one whose summaries the gate
always rejects.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from compactd.testing.openai_server import OpenAICompatServer, RecordedRequest, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from tests.builders import header, system, turn_start
from tests.compaction_fixtures import (
    PROVIDER,
    TOOLS,
    Harness,
    loopback,
    started,
    summary_requests,
    unit,
    units,
)

SMALL = "small"
WINDOW, MAX_OUTPUT = 4096, 256
LIMIT = WINDOW - MAX_OUTPUT  # W - O: what a request sent must fit
#: A 4,096-token route: trigger min(0.8 W, W - O - 256) = 3,276; the retained tail 600 tokens.
SMALL_POLICY: dict[str, Any] = {
    "thresholdRatio": 0.8,
    "headroomTokens": 256,
    "retainTokens": 600,
    "maxTokens": 400,
}
FITTING = (cpb.PRESSURE_OUTCOME_FITS, cpb.PRESSURE_OUTCOME_ABOVE_TRIGGER)


def small_route(loop: OpenAICompatServer) -> dict[str, Any]:
    return {
        "provider": PROVIDER,
        "model": SMALL,
        "context_window": WINDOW,
        "max_output_tokens": MAX_OUTPUT,
        "base_url": loop.base_url,
    }


def small_opening(system_text: str = "You are a careful coding agent.") -> list[Any]:
    return [system(system_text), header(PROVIDER, SMALL, tools=TOOLS)]


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


@contextmanager
def model(reply: Callable[[RecordedRequest], Reply]) -> Iterator[OpenAICompatServer]:
    """A loopback provider that answers every request with ``reply``."""
    with OpenAICompatServer(responder=reply) as server:
        yield server


def starts(events: list[events_pb2.SessionEvent]) -> int:
    return sum(1 for e in events if e.HasField("compaction_start"))


async def steps_of(h: Harness, count: int, first_unit: int = 0) -> list[cpb.PrepareStepResult]:
    """``count`` model steps, a unit of history appended before each (an open turn each)."""
    results = []
    for i in range(first_unit, first_unit + count):
        await h.append(*unit(i), turn_start(i + 1))
        results.append((await h.prepare(i + 1)).result)
    return results


def sent_tokens(result: cpb.PrepareStepResult) -> int:
    return result.after.measured_tokens


# ---- the floor ----------------------------------------------------------------------------------


async def test_fixed_overhead_above_the_trigger_opens_no_bracket_and_says_so_every_step(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # The system prompt alone is above the trigger (5,000) but the request fits the window
    # (15,000): no compaction can bring pressure below the trigger, so none is paid for.
    async with started(tmp_path, loop) as h:
        await h.create(system("Rules. " * 3300), header(PROVIDER, "m", tools=TOOLS))
        results = await steps_of(h, 4)
        events = await h.events()

    assert starts(events) == 0
    assert summary_requests(loop) == []
    for result in results:
        assert result.outcome == cpb.PRESSURE_OUTCOME_ABOVE_TRIGGER
        assert result.floor_tokens >= result.after.trigger_tokens
        assert "the floor (" in result.outcome_detail
        assert f"measured {result.after.measured_tokens}" in result.outcome_detail


async def test_a_system_prompt_larger_than_the_window_is_irreducible_on_every_step(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, routes=[small_route(loop)], policy=SMALL_POLICY) as h:
        await h.create(*small_opening("Rules. " * 2500))  # ~4,400 tokens: more than W - O
        results = await steps_of(h, 3)
        events = await h.events()

    assert starts(events) == 0  # nothing a bracket could do would make it fit
    assert summary_requests(loop) == []
    for result in results:
        assert result.outcome == cpb.PRESSURE_OUTCOME_OVER_WINDOW_IRREDUCIBLE
        assert result.floor_tokens > LIMIT
        assert "nothing reducible is left" in result.outcome_detail


# ---- one result larger than the window ----------------------------------------------------------


async def test_a_tool_result_larger_than_the_window_is_cut_and_the_request_fits(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, routes=[small_route(loop)], policy=SMALL_POLICY) as h:
        await h.create(*small_opening(), *unit(0, result="log line " * 5000), turn_start(1))
        result = (await h.prepare(1)).result
        events = await h.events()

    assert result.before.measured_tokens > WINDOW
    assert sent_tokens(result) <= LIMIT
    assert result.outcome in FITTING
    assert any(e.HasField("compaction_prune") for e in events)


# ---- models that never help ---------------------------------------------------------------------


def _failing(_: RecordedRequest) -> Reply:
    return Reply(status=400, error={"message": "invalid request", "type": "invalid_request"})


def _truncating(_: RecordedRequest) -> Reply:
    return Reply(text="## Primary Request and Intent\n- the user wants", finish_reason="length")


def _rejected(_: RecordedRequest) -> Reply:
    return Reply(text="Everything went fine.")  # no sections, no facts: the gate rejects it


async def _long_session_on(reply: Callable[[RecordedRequest], Reply], tmp_path: Path) -> None:
    """Thirty steps of growing history on a 4k window whose summarizer never helps: every step
    leaves PrepareStep with a request that fits, and no identical request goes to the model
    twice."""
    with model(reply) as loop:
        async with started(tmp_path, loop, routes=[small_route(loop)], policy=SMALL_POLICY) as h:
            await h.create(*small_opening())
            results = await steps_of(h, 30)
        sent = [json.dumps(r["messages"], sort_keys=True) for r in summary_requests(loop)]

    for result in results:
        assert sent_tokens(result) <= LIMIT, result.outcome_detail
        assert result.outcome in FITTING
    assert len(sent) == len(set(sent))  # never the same request again after a failure
    assert sent  # the model was asked


async def test_a_model_that_always_fails_never_leaves_a_request_over_the_window(
    tmp_path: Path,
) -> None:
    await _long_session_on(_failing, tmp_path)


async def test_a_model_that_always_truncates_never_leaves_a_request_over_the_window(
    tmp_path: Path,
) -> None:
    await _long_session_on(_truncating, tmp_path)


async def test_a_model_whose_summaries_are_always_rejected_never_leaves_a_request_over_the_window(
    tmp_path: Path,
) -> None:
    await _long_session_on(_rejected, tmp_path)


async def test_the_extractive_rung_writes_the_checkpoint_a_failed_model_could_not(
    tmp_path: Path,
) -> None:
    # With extractiveFallback, a failed summary is not the end of the bracket: the extractive
    # checkpoint of the same span commits in it, and the log says which rung wrote it.
    with model(_failing) as loop:
        policy = {**SMALL_POLICY, "extractiveFallback": True}
        async with started(tmp_path, loop, routes=[small_route(loop)], policy=policy) as h:
            await h.create(*small_opening())
            results = await steps_of(h, 16)
            events = await h.events()
            brackets = await h.compaction.ListBrackets(
                cpb.ListBracketsRequest(session_id=h.session_id)
            )

    summaries = [e.compaction_summary for e in events if e.HasField("compaction_summary")]
    assert summaries
    for summary in summaries:
        assert summary.rung == events_pb2.COMPACTION_RUNG_EXTRACTIVE
        assert summary.summarizer == "extractive"
        assert summary.fallback.failure_reason
    committed = [b for b in brackets.brackets if b.checkpoint_seq >= 0]
    assert {b.rung for b in committed} == {events_pb2.COMPACTION_RUNG_EXTRACTIVE}
    ends = [e.compaction_end for e in events if e.HasField("compaction_end")]
    assert any(end.rung == events_pb2.COMPACTION_RUNG_EXTRACTIVE for end in ends)
    assert all(sent_tokens(r) <= LIMIT for r in results)


# ---- one bracket a step -------------------------------------------------------------------------


def _large_unit(i: int) -> list[events_pb2.SessionEvent]:
    """A unit whose tool output alone is about 1,500 tokens: each step's request jumps over the
    4k window by what one unit adds."""
    return unit(i, result=f"line {i} of the build output, nothing failed\n" * 150)


async def test_a_step_over_the_window_opens_one_bracket_and_leaves_a_request_that_fits(
    tmp_path: Path,
) -> None:
    # A model that always fails and no extractiveFallback: the step's one bracket still writes
    # the extractive checkpoint of its span itself (no second, overflow bracket), and the
    # request it leaves fits the window.
    with model(_failing) as loop:
        async with started(tmp_path, loop, routes=[small_route(loop)], policy=SMALL_POLICY) as h:
            await h.create(*small_opening())
            per_step, results = [], []
            for i in range(12):
                await h.append(*_large_unit(i), turn_start(i + 1))
                before = len(await h.events())
                results.append((await h.prepare(i + 1)).result)
                per_step.append(starts((await h.events())[before:]))
            events = await h.events()

    assert max(per_step) == 1
    assert any(r.before.measured_tokens > LIMIT for r in results)  # steps did start over W
    for result in results:
        assert sent_tokens(result) <= LIMIT, result.outcome_detail
        assert result.outcome in FITTING
    summaries = [e.compaction_summary for e in events if e.HasField("compaction_summary")]
    assert summaries
    assert {s.rung for s in summaries} == {events_pb2.COMPACTION_RUNG_EXTRACTIVE}
    rejected = [
        e for e in events if e.HasField("compaction_end") and e.compaction_end.gate.failures
    ]
    assert rejected == []


async def test_a_room_too_small_for_a_model_summary_gets_the_extractive_checkpoint_unasked(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # The trigger sits near the window and the system prompt takes most of it: the step's
    # request is over the window, and the room the window leaves beside the floor is fewer
    # tokens than a model writes a summary in. The bracket writes the extractive checkpoint
    # without calling the model (a call bound to be cut off), and the request fits.
    policy = {**SMALL_POLICY, "thresholdRatio": 0.95, "retainTokens": 100}
    async with started(tmp_path, loop, routes=[small_route(loop)], policy=policy) as h:
        await h.create(*small_opening("Rules. " * SYSTEM_WORDS), *units(3), turn_start(1))
        result = (await h.prepare(1)).result
        events = await h.events()

    assert result.before.measured_tokens > LIMIT
    # The floor sits below the trigger (this is not the floor-above-trigger rung) ...
    assert result.floor_tokens < result.before.trigger_tokens
    # ... and leaves fewer than MODEL_SUMMARY_TOKENS beside the checkpoint's frame.
    assert summary_requests(loop) == []
    summaries = [e.compaction_summary for e in events if e.HasField("compaction_summary")]
    assert [s.summarizer for s in summaries] == ["extractive"]
    assert sent_tokens(result) <= LIMIT, result.outcome_detail
    assert result.outcome in FITTING


SYSTEM_WORDS = 1960  # "Rules. " this many times: a floor between W - O - 376 and the trigger


# ---- the checkpoint's share ---------------------------------------------------------------------


def _mid_unit(i: int) -> list[events_pb2.SessionEvent]:
    """A unit whose tool output alone is about 800 tokens."""
    return unit(i, result=f"row {i} of the listing, nothing failed\n" * 90)


async def test_a_checkpoint_cut_to_fit_the_window_takes_at_most_its_share_of_the_span(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # Over the window the step's bracket takes the maximal span and cuts its summary to the room
    # the window leaves. Such a checkpoint takes 15% of its span at most however small the span:
    # the smallest checkpoint's allowance (room for the gate's first probes) does not apply, the
    # gate not judging its probes.
    async with started(
        tmp_path, loop, kind="extractive", routes=[small_route(loop)], policy=SMALL_POLICY
    ) as h:
        await h.create(*small_opening("Rules. " * 1500))
        results = []
        for i in range(10):
            await h.append(*_mid_unit(i), turn_start(i + 1))
            results.append((await h.prepare(i + 1)).result)
        events = await h.events()

    summaries = [e.compaction_summary for e in events if e.HasField("compaction_summary")]
    shares = [s.tokens.checkpoint_route_tokens / s.tokens.shadowed_route_tokens for s in summaries]
    assert summaries
    assert max(shares) <= 0.15
    assert all(sent_tokens(r) <= LIMIT for r in results)


async def test_a_room_checkpoint_of_a_span_too_small_for_the_eight_headings_stays_within_15pct(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # Over the window beside a large system prompt the maximal span is some 800 tokens: 15% of
    # it cannot hold the preamble, the eight empty headings and the recall handle. The
    # checkpoint leaves the empty headings out (the gate judges neither its probes nor its
    # sections) and keeps the facts that fit, within 15% of its span; the request fits.
    policy = {**SMALL_POLICY, "thresholdRatio": 0.95, "retainTokens": 100}
    async with started(
        tmp_path, loop, kind="extractive", routes=[small_route(loop)], policy=policy
    ) as h:
        await h.create(*small_opening("Rules. " * SYSTEM_WORDS), *units(3), turn_start(1))
        result = (await h.prepare(1)).result
        events = await h.events()

    summaries = [e.compaction_summary for e in events if e.HasField("compaction_summary")]
    assert len(summaries) == 1
    tokens = summaries[0].tokens
    assert tokens.shadowed_route_tokens < 1000
    assert tokens.checkpoint_route_tokens <= 0.15 * tokens.shadowed_route_tokens
    assert "src/mod0.py" in summaries[0].summary
    assert "## Essential Context" not in summaries[0].summary  # an empty heading, left out
    assert sent_tokens(result) <= LIMIT
    assert result.outcome in FITTING
