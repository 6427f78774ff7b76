"""SwitchModel, and PrepareStep with a changed route, over a real server.

History is fitted to the destination before its header is committed: compacted with the previous
routed model's summarizer until below the destination's trigger, then the destination header is
appended (reason CHANGE). Failures leave the previous header in force; a destination without a
valid pressure budget is refused even for short history.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from tests.api.rpc import ErrorDetails, details
from tests.builders import assistant, in_step, turn_end, turn_start, user
from tests.compaction_fixtures import (
    ABOVE,
    BELOW,
    MODEL,
    POLICY,
    PROVIDER,
    TOOLS,
    Harness,
    body,
    opening,
    started,
    summary_requests,
)
from tests.runtime import bulky_turn, closed_turns, of_type, overflow_error, recover, switch

SWITCH_FAILED = "MODEL_SWITCH_COMPACTION_FAILED"


def route(model: str) -> events_pb2.Route:
    return events_pb2.Route(provider=PROVIDER, model=model)


def loop_route(
    loop: OpenAICompatServer, model: str, window: int | None, **more: Any
) -> dict[str, Any]:
    table: dict[str, Any] = {"provider": PROVIDER, "model": model, "base_url": loop.base_url}
    if window is not None:
        table["context_window"] = window
    return {**table, **more}


@pytest.fixture
def small(loop: OpenAICompatServer) -> dict[str, Any]:
    """W=8000, O=500: trigger 2500 under the fixtures' policy (the previous route's is 5000)."""
    return loop_route(loop, "small", 8000, max_output_tokens=500)


async def refused(call: Any) -> ErrorDetails:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    got = details(caught.value)
    assert (got.code, got.reason) == (grpc.StatusCode.FAILED_PRECONDITION, SWITCH_FAILED)
    return got


async def logged_model(h: Harness) -> str:
    return (await h.build()).config.model


async def test_a_switch_compacts_with_the_previous_model_until_below_the_destination_trigger(
    tmp_path: Path, loop: OpenAICompatServer, small: dict[str, Any]
) -> None:
    async with started(tmp_path, loop, routes=[small]) as h:
        await h.create(*opening(), *closed_turns(12))
        assert (await h.pressure()).state == BELOW  # fine for the previous route

        run = await switch(h, route("small"))

        result = run.result
        assert (result.before.state, result.before.route.model) == (ABOVE, "small")
        assert result.before.trigger_tokens == 2500
        assert result.after.state == BELOW
        assert len(result.compactions) >= 1
        log = await h.events()
        assert result.header_seq == log[-1].seq
        switched = log[-1].request_header
        assert (switched.config.model, switched.reason) == (
            "small",
            events_pb2.HEADER_REASON_CHANGE,
        )
        assert list(switched.tools) == list(TOOLS)
        starts = of_type(log, "compaction_start")
        assert {s.compaction_start.trigger for s in starts} == {
            events_pb2.COMPACTION_TRIGGER_MODEL_SWITCH
        }
        assert {r["model"] for r in summary_requests(loop)} == {MODEL}  # the previous model
        assert run.progress[-1].step == cpb.COMPACTION_STEP_HEADER
        assert result.request == await h.build()
        assert result.request.config.model == "small"


async def test_a_short_history_switches_at_once_and_the_same_route_logs_nothing(
    tmp_path: Path, loop: OpenAICompatServer, small: dict[str, Any]
) -> None:
    async with started(tmp_path, loop, routes=[small]) as h:
        await h.create(*opening(), *closed_turns(1))

        result = (await switch(h, route("small"))).result

        assert list(result.compactions) == []
        assert result.HasField("header_seq")
        before = await h.events()
        again = (await switch(h, route("small"))).result
        assert not again.HasField("header_seq")
        assert await h.events() == before


async def test_a_failed_switch_keeps_the_previous_header_and_the_completed_prunes(
    tmp_path: Path, loop: OpenAICompatServer, small: dict[str, Any]
) -> None:
    loop.enqueue(Reply.http_error(400, "unsupported parameter: top_p"))
    async with started(tmp_path, loop, routes=[small]) as h:
        await h.create(*opening(), *bulky_turn(1), *closed_turns(10, start=2))

        got = await refused(switch(h, route("small")))

        assert (got.metadata["cause"], got.metadata["destination"]) == (
            "SUMMARY_FAILED",
            "loop/small",
        )
        assert "unsupported parameter" in got.message
        assert await logged_model(h) == MODEL
        log = await h.events()
        assert [e.request_header.config.model for e in of_type(log, "request_header")] == [MODEL]
        assert len(of_type(log, "compaction_prune")) == 1  # the prune stays
        assert body(log[-1]) == "compaction_end"


@pytest.mark.parametrize(
    ("destination", "cause", "words"),
    [
        ("w64k", "POLICY_INVALID", "set headroomTokens"),
        ("nocap", "CAPACITY_UNKNOWN", "declares no context window"),
        ("unknown", "CAPACITY_UNKNOWN", "declares no context window"),
    ],
)
async def test_a_destination_without_capacity_or_a_valid_budget_is_refused_even_for_short_history(
    tmp_path: Path, loop: OpenAICompatServer, destination: str, cause: str, words: str
) -> None:
    routes = [
        loop_route(loop, "w64k", 65536, max_output_tokens=4096),
        loop_route(loop, "nocap", None),
    ]
    async with started(tmp_path, loop, policy={}, routes=routes) as h:  # default headroom 65,536
        await h.create(*opening(), *closed_turns(1), turn_start(2))
        before = await h.events()

        got = await refused(switch(h, route(destination)))
        step = await refused(h.prepare(2, route(destination)))  # the pre-step check refuses too

        assert got.metadata["cause"] == step.metadata["cause"] == cause
        assert words in got.message
        assert await h.events() == before
        assert await logged_model(h) == MODEL


async def test_a_64k_route_with_its_own_headroom_accepts_the_switch(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    w64k = loop_route(loop, "w64k", 65536, max_output_tokens=4096)
    policy = {"modelPolicies": [{"provider": PROVIDER, "model": "w64k", "headroomTokens": 4096}]}
    async with started(tmp_path, loop, policy=policy, routes=[w64k]) as h:
        await h.create(*opening(), *closed_turns(1))

        result = (await switch(h, route("w64k"))).result

        assert result.before.trigger_tokens == 52428  # floor(min(0.8 W, W - O - B))
        assert await logged_model(h) == "w64k"


async def test_prepare_step_with_a_changed_route_switches_before_the_step(
    tmp_path: Path, loop: OpenAICompatServer, small: dict[str, Any]
) -> None:
    async with started(tmp_path, loop, routes=[small]) as h:
        await h.create(*opening(), *closed_turns(12), turn_start(13), user("Continue."))

        run = await h.prepare(13, route("small"))

        result = run.result
        assert (result.before.route.model, result.before.state) == ("small", ABOVE)
        assert result.after.state == BELOW
        assert result.compactions
        log = await h.events()
        assert result.header_seq == of_type(log, "request_header")[-1].seq
        assert result.request.config.model == "small"
        assert {s.compaction_start.turn for s in of_type(log, "compaction_start")} == {13}


async def test_prepare_step_with_auto_off_does_not_switch(
    tmp_path: Path, loop: OpenAICompatServer, small: dict[str, Any]
) -> None:
    async with started(tmp_path, loop, policy={**POLICY, "auto": False}, routes=[small]) as h:
        await h.create(*opening(), *closed_turns(12), turn_start(13))
        before = await h.events()

        result = (await h.prepare(13, route("small"))).result

        assert result.before.state == ABOVE
        assert not result.HasField("header_seq")
        assert await h.events() == before


def plots(count: int) -> list[events_pb2.SessionEvent]:
    """``count`` closed turns, each a user image and a short answer."""
    events: list[events_pb2.SessionEvent] = []
    for turn in range(1, count + 1):
        image = events_pb2.ImageBlock(
            media_type="image/png", name=f"p{turn}.png", data=b"\x89PNG" + bytes([turn])
        )
        events += [
            turn_start(turn),
            user(f"Plot {turn}.", blocks=[events_pb2.ContentBlock(image=image)]),
            *in_step(turn, 1, assistant(text=f"Noted plot {turn}.")),
            turn_end(turn),
        ]
    return events


async def test_cross_model_image_pricing_can_reject_a_summary_that_would_relieve_the_destination(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    """The seed's known limitation: selection prices images as the destination does (3000 each),
    the shrink check as the committed route does (structurally, a few dozen tokens), so a summary
    far smaller than the span at the destination is still "not smaller" and the switch fails."""
    pricey = loop_route(loop, "pricey", 32000, max_output_tokens=1000, image_tokens=3000)
    policy = {
        **POLICY,
        "modelPolicies": [{"provider": PROVIDER, "model": "pricey", "headroomTokens": 1000}],
    }
    loop.enqueue(Reply(text="- Six plots were shown and each was acknowledged. " * 30))
    async with started(tmp_path, loop, policy=policy, routes=[pricey]) as h:
        await h.create(*opening(), *plots(6))
        at_destination = (
            await h.compaction.CheckPressure(
                cpb.CheckPressureRequest(session_id=h.session_id, destination=route("pricey"))
            )
        ).report
        assert at_destination.state == ABOVE
        assert (await h.pressure()).state == BELOW

        got = await refused(switch(h, route("pricey")))

        assert got.metadata["cause"] == "SUMMARY_NOT_SMALLER"
        checkpoint = int(got.metadata["checkpoint_tokens"])
        assert checkpoint >= int(got.metadata["shadowed_tokens"])  # at the committed route
        assert (
            checkpoint < at_destination.breakdown.images_tokens
        )  # yet far below the destination's
        end = of_type(await h.events(), "compaction_end")[-1].compaction_end
        assert end.error_reason == "SUMMARY_NOT_SMALLER"
        assert await logged_model(h) == MODEL


async def test_an_explicit_summary_target_writes_the_switch_summaries(
    tmp_path: Path, loop: OpenAICompatServer, small: dict[str, Any]
) -> None:
    writer = loop_route(loop, "writer", 32000)
    policy = {**POLICY, "summarizationProvider": PROVIDER, "summarizationModel": "writer"}
    async with started(tmp_path, loop, policy=policy, routes=[small, writer]) as h:
        await h.create(*opening(), *closed_turns(12))

        result = (await switch(h, route("small"))).result

        assert result.compactions
        assert {r["model"] for r in summary_requests(loop)} == {"writer"}


async def test_recovery_and_switches_wait_for_a_live_bracket(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(delay_before=1.0))  # the pre-step summary is slow
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *closed_turns(20), turn_start(21), user("Go on."))
        step = asyncio.ensure_future(h.prepare(21))
        await h.wait_for_log(lambda log: body(log[-1]) == "compaction_start")

        for call in (recover(h, 21, overflow_error()), switch(h, route(MODEL), turn=21)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            got = details(caught.value)
            assert (got.code, got.reason) == (grpc.StatusCode.ABORTED, "COMPACTION_BUSY")
        assert (await step).result.compactions


async def test_a_switch_replaces_the_single_older_unit_the_retained_tail_reaches_into(
    tmp_path: Path, loop: OpenAICompatServer, small: dict[str, Any]
) -> None:
    # One unit before the last: a long request (~2400 tokens), then the answer (~500 tokens).
    # The destination's retained budget (1200) reaches back into the request, so a pressure
    # selection finds nothing older than it; the switch replaces the request all the same.
    request = "Review the design of the module and list every risk you see. " * 150
    async with started(tmp_path, loop, routes=[small]) as h:
        await h.create(
            *opening(),
            turn_start(1),
            user(request),
            *in_step(1, 1, assistant(text="The module holds three risks. " * 65)),
            turn_end(1),
        )
        before = (await h.surface()).nodes

        result = (await switch(h, route("small"))).result

        assert (result.before.state, result.after.state) == (ABOVE, BELOW)
        (outcome,) = result.compactions
        assert outcome.items_condensed == 1
        assert (outcome.range.start_seq, outcome.range.end_seq) == (before[1].seq, before[1].seq)
        assert await logged_model(h) == "small"


async def test_a_switch_retry_whose_summary_is_not_smaller_fails_with_summary_not_smaller(
    tmp_path: Path, loop: OpenAICompatServer, small: dict[str, Any]
) -> None:
    # The first checkpoint leaves history above the destination's trigger (its tail keeps 2400
    # of the 2500 tokens); the retry's summary is larger than its span. Spec §3.2: "The basic
    # backend rejects a summary that is not smaller than its source."
    loop.enqueue(Reply(), Reply(text="The same words again and again. " * 3000))
    policy = {**POLICY, "compactionRetries": 2, "retainTokens": 2400}
    async with started(tmp_path, loop, routes=[small], policy=policy) as h:
        await h.create(*opening(), *closed_turns(20))

        got = await refused(switch(h, route("small")))

        assert got.metadata["cause"] == "SUMMARY_NOT_SMALLER"
        log = await h.events()
        assert len(of_type(log, "compaction_summary")) == 1  # the first checkpoint stays
        ends = [e.compaction_end for e in of_type(log, "compaction_end")]
        assert [end.error_reason for end in ends] == ["", "SUMMARY_NOT_SMALLER"]
        assert await logged_model(h) == MODEL
