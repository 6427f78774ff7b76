"""PlanCompaction, GetSurface detail and ListBrackets over a real server (interceptors on)."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from tests.api.rpc import details
from tests.builders import (
    assistant,
    compaction_start,
    header,
    in_step,
    system,
    turn_end,
    turn_start,
    user,
)
from tests.compaction_fixtures import (
    MODEL,
    PROVIDER,
    Harness,
    body,
    loopback,
    opening,
    route_table,
    started,
    unit,
    units,
)
from tests.runtime import overflow_error, recover, switch


async def _plan(h: Harness, mode: int = cpb.PLAN_MODE_AUTO, **route: str) -> cpb.CompactionPlan:
    request = cpb.PlanCompactionRequest(session_id=h.session_id, mode=mode)
    if route:
        request.route.CopyFrom(events_pb2.Route(**route))
    reply: cpb.PlanCompactionResponse = await h.compaction.PlanCompaction(request)
    return reply.plan


async def _brackets(h: Harness) -> cpb.ListBracketsResponse:
    reply: cpb.ListBracketsResponse = await h.compaction.ListBrackets(
        cpb.ListBracketsRequest(session_id=h.session_id)
    )
    return reply


def _starts(events: list[events_pb2.SessionEvent]) -> list[events_pb2.CompactionStart]:
    return [e.compaction_start for e in events if body(e) == "compaction_start"]


def _assert_same_span(plan: cpb.CompactionPlan, start: events_pb2.CompactionStart) -> None:
    assert plan.span.range == start.range
    assert list(plan.span.shadowed_seqs) == list(start.shadowed_seqs)
    assert plan.span.shadowed_count == len(start.shadowed_seqs)


# ---- PlanCompaction ------------------------------------------------------------------------


async def test_a_plan_appends_nothing_and_compact_then_replaces_the_planned_span(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(18))
        before = await h.events()
        plan = await _plan(h, cpb.PLAN_MODE_MANUAL)
        assert await h.events() == before  # side-effect free
        assert plan.revision == len(before)
        assert plan.trigger == events_pb2.COMPACTION_TRIGGER_MANUAL
        assert plan.blocked_code == ""
        assert plan.decline_code == ""
        assert plan.span.range.start_position == 1  # the system head is never replaced
        assert plan.expected_tokens_after < plan.pressure.measured_tokens
        assert plan.expected_tokens_after <= plan.expected_tokens_after_max
        run = await h.compact()
        assert run.result.outcome.compaction_id
        (start,) = _starts(await h.events())
        _assert_same_span(plan, start)


def _paths_unit(i: int) -> list[events_pb2.SessionEvent]:
    """A closed turn whose request names 30 files: an extractive checkpoint fills its share."""
    named = " ".join(f"pkg{i}/area{j}/module_{i}_{j}.py" for j in range(30))
    return [
        turn_start(1000 + i),
        user(f"Step {i}: review {named} and report."),
        *in_step(1000 + i, 1, assistant(text=f"Reviewed step {i}; every module passes.")),
        turn_end(1000 + i),
    ]


async def test_a_plans_largest_outcome_bounds_an_extractive_checkpoint_that_maxtokens_does_not(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # maxTokens caps a model's summary; the extractive checkpoint takes its share of the span
    # instead, and the plan's largest expected envelope says so.
    policy = {"thresholdRatio": 0.3125, "headroomTokens": 1000, "retainTokens": 1200,
              "maxTokens": 64}  # fmt: skip
    async with started(tmp_path, loop, kind="extractive", policy=policy) as h:
        await h.create(*opening(), *[e for i in range(24) for e in _paths_unit(i)])
        plan = await _plan(h, cpb.PLAN_MODE_MANUAL)
        await h.compact()
        (summary,) = [e.compaction_summary for e in await h.events()
                      if body(e) == "compaction_summary"]  # fmt: skip

    assert summary.tokens.checkpoint_route_tokens > 64 + 100
    assert summary.tokens.envelope_after <= plan.expected_tokens_after_max


async def test_an_auto_plan_predicts_the_prunes_and_the_span_prepare_step_makes(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        big = "line of build output\n" * 600  # > 8192 code points: the pruner cuts it
        await h.create(*opening(), *unit(0, result=big), *units(17, 1), turn_start(1))
        plan = await _plan(h)
        assert plan.blocked_code == ""
        assert plan.pressure.state == cpb.PRESSURE_STATE_ABOVE
        assert len(plan.prunes) == 1
        prune = plan.prunes[0]
        assert prune.original_code_points == len(big)
        assert prune.tokens_after < prune.tokens_before
        assert plan.tokens_after_prune == plan.pressure.measured_tokens - (
            prune.tokens_before - prune.tokens_after
        )
        await h.prepare(1)
        events = await h.events()
        pruned = [e.compaction_prune for e in events if body(e) == "compaction_prune"]
        assert [p.shadowed_seq for p in pruned] == [prune.seq]
        assert events[prune.replacement_seq].surface_op.start_seq == prune.seq
        _assert_same_span(plan, _starts(events)[0])


async def test_an_overflow_plan_predicts_what_recover_from_error_prunes_and_replaces(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        big = "line of build output\n" * 600
        await h.create(*opening(), *units(3), *unit(3, result=big), *units(3, 4), turn_start(1))
        plan = await _plan(h, cpb.PLAN_MODE_OVERFLOW)
        assert plan.blocked_code == ""
        assert plan.trigger == events_pb2.COMPACTION_TRIGGER_OVERFLOW
        assert plan.min_span_tokens == 0
        run = await recover(h, 1, overflow_error())
        assert run.result.retry
        events = await h.events()
        pruned = [e.compaction_prune.shadowed_seq for e in events if body(e) == "compaction_prune"]
        assert pruned == [p.seq for p in plan.prunes]
        _assert_same_span(plan, _starts(events)[0])


async def test_a_switch_plan_predicts_the_span_switch_model_replaces(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    small = {**route_table(loop), "model": "small", "context_window": 8000}
    small["max_output_tokens"] = 500
    async with started(tmp_path, loop, kind="extractive", routes=[small]) as h:
        await h.create(*opening(), *units(12))
        plan = await _plan(h, cpb.PLAN_MODE_SWITCH, provider=PROVIDER, model="small")
        assert plan.blocked_code == ""
        assert plan.pressure.trigger_tokens == 2500  # the destination's
        assert plan.route.model == "small"
        assert plan.summary_target.model == MODEL  # the previous model writes the summary
        await switch(h, events_pb2.Route(provider=PROVIDER, model="small"))
        _assert_same_span(plan, _starts(await h.events())[0])


async def test_a_switch_plan_reaches_past_the_retained_tail_as_switch_model_does(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    small = {**route_table(loop), "model": "small", "context_window": 8000}
    small["max_output_tokens"] = 500
    request = "Review the design of the module and list every risk you see. " * 150
    async with started(tmp_path, loop, kind="extractive", routes=[small]) as h:
        await h.create(
            *opening(),
            turn_start(1),
            user(request),  # the retained budget (1200) reaches back into it
            *in_step(1, 1, assistant(text="The module holds three risks. " * 65)),
            turn_end(1),
        )
        plan = await _plan(h, cpb.PLAN_MODE_SWITCH, provider=PROVIDER, model="small")
        assert (plan.decline_code, plan.span.shadowed_count) == ("", 1)
        await switch(h, events_pb2.Route(provider=PROVIDER, model="small"))
        _assert_same_span(plan, _starts(await h.events())[0])


async def test_the_plan_names_every_setting_with_its_origin(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    service = {
        "thresholdRatio": 0.3125, "headroomTokens": 1000, "retainTokens": 1200, "maxTokens": 1000,
        "modelPolicies": [{"provider": PROVIDER, "model": MODEL, "compactionRetries": 3}],
    }  # fmt: skip
    async with started(tmp_path, loop, kind="extractive", policy=service) as h:
        session = {"minReductionRatio": 0.2, "modelPolicies": [
            {"provider": PROVIDER, "model": MODEL, "auto": False}
        ]}  # fmt: skip
        await h.create(*opening(), *units(3), policy=session)
        plan = await _plan(h)
        origins = {s.name: s.origin for s in plan.settings}
        assert origins["thresholdRatio"] == cpb.POLICY_ORIGIN_SERVICE
        assert origins["compactionRetries"] == cpb.POLICY_ORIGIN_SERVICE_ROUTE
        assert origins["minReductionRatio"] == cpb.POLICY_ORIGIN_SESSION
        assert origins["auto"] == cpb.POLICY_ORIGIN_SESSION_ROUTE
        assert origins["summaryGate"] == cpb.POLICY_ORIGIN_DEFAULT
        assert origins["retainRatio"] == cpb.POLICY_ORIGIN_SERVICE  # retainTokens replaced it
        assert len(origins) == 20  # the policy table, the recall tool and prepare-ahead included
        assert plan.policy.compaction_retries == 3
        assert not plan.policy.auto
        assert not plan.policy.HasField("retain_ratio")
        assert plan.policy.retain_tokens == 1200
        assert plan.blocked_code == "AUTO_DISABLED"


async def test_a_plan_reports_what_blocks_the_real_path_and_why_selection_declines(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(2))
        below = await _plan(h)
        assert below.blocked_code == "BELOW_TRIGGER"
        await h.append(turn_start(1), user("go"))
        call = assistant(calls=[("c9", "run", "{}")])
        await h.append(*in_step(1, 1, call))
        manual = await _plan(h, cpb.PLAN_MODE_MANUAL)
        assert manual.blocked_code == "COMPACTION_BUSY"
        assert manual.decline_code == "OPEN_TAIL"
        assert "c9" in manual.decline_reason
        switch = await _plan(h, cpb.PLAN_MODE_SWITCH, provider="other", model="x")
        assert switch.blocked_code == "CAPACITY_UNKNOWN"
        assert switch.warnings


async def test_an_auto_plan_knows_failure_memory_and_pruning_that_suffices(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(18), turn_start(1))
        loop.enqueue(Reply(text="nothing useful"))  # the quality gate rejects it
        run = await h.prepare(1)
        assert any("SUMMARY_REJECTED" in w for w in run.result.warnings)
        held = await _plan(h)
        assert held.decline_code == "KNOWN_FAILURE"  # the same span waits for its backoff
        assert held.decline_reason.startswith("the same span")
    async with started(tmp_path, loop, db="other.db") as h:
        big = "line of build output\n" * 2000
        await h.create(*opening(), *units(5), *unit(5, result=big), *units(2, 6), turn_start(1))
        plan = await _plan(h)
        assert plan.pressure.state == cpb.PRESSURE_STATE_ABOVE
        assert plan.blocked_code == "RELIEVED_BY_PRUNING"
        assert plan.tokens_after_prune < plan.pressure.trigger_tokens
        run = await h.prepare(1)
        assert run.result.pruned_count == 1
        assert not run.result.compactions  # pruning alone was enough, as planned
        assert run.result.after.measured_tokens == plan.tokens_after_prune


async def test_an_auto_plan_to_another_route_plans_the_switch_prepare_step_makes(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    small = {**route_table(loop), "model": "small", "context_window": 8000}
    async with started(tmp_path, loop, kind="extractive", routes=[small]) as h:
        await h.create(*opening(), *units(12), turn_start(1))
        plan = await _plan(h, provider=PROVIDER, model="small")
        assert plan.mode == cpb.PLAN_MODE_SWITCH
        assert plan.trigger == events_pb2.COMPACTION_TRIGGER_MODEL_SWITCH


async def test_an_overflow_plan_says_when_the_envelope_alone_fills_the_window(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    tiny = {**route_table(loop), "model": "tiny", "context_window": 1100}
    policy = {"modelPolicies": [{"provider": PROVIDER, "model": "tiny", "headroomTokens": 10}]}
    async with started(tmp_path, loop, kind="extractive", routes=[tiny], policy=policy) as h:
        await h.create(system("x " * 2000), header(PROVIDER, "tiny"), *units(1), turn_start(1))
        plan = await _plan(h, cpb.PLAN_MODE_OVERFLOW)
        assert plan.blocked_code == "ENVELOPE_ONLY"
        run = await recover(h, 1, overflow_error())
        assert run.result.decline == cpb.RECOVERY_DECLINE_ENVELOPE_ONLY
        assert run.result.reason == plan.blocked


async def test_a_switch_plan_without_a_route_is_invalid_argument(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _plan(h, cpb.PLAN_MODE_SWITCH)
        got = details(caught.value)
        assert (got.code, got.fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["route"])
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.compaction.PlanCompaction(cpb.PlanCompactionRequest(session_id="nope"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


_RESULTS = st.sampled_from(["ok " * 20, "ok " * 200, "build output line\n" * 500, ""])


@st.composite
def _conversations(draw: st.DrawFn) -> list[events_pb2.SessionEvent]:
    count = draw(st.integers(0, 16))
    events: list[events_pb2.SessionEvent] = []
    for i in range(count):
        events.extend(unit(i, result=draw(_RESULTS)))
    return events


def test_the_plan_predicts_the_span_a_real_compact_replaces_on_random_conversations(
    tmp_path: Path,
) -> None:
    with asyncio.Runner() as runner, loopback() as provider:
        stack = AsyncExitStack()
        h = runner.run(stack.enter_async_context(started(tmp_path, provider, kind="extractive")))
        sessions = iter(range(10_000))
        try:

            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
            @given(_conversations())
            def one(conversation: list[events_pb2.SessionEvent]) -> None:
                h.session_id = f"p{next(sessions)}"
                runner.run(_plan_then_compact(h, conversation))

            one()
        finally:
            runner.run(stack.aclose())


async def _plan_then_compact(h: Harness, conversation: list[events_pb2.SessionEvent]) -> None:
    await h.create(*opening(), *conversation)
    plan = await _plan(h, cpb.PLAN_MODE_MANUAL)
    code, declined = grpc.StatusCode.OK, ""
    try:
        declined = (await h.compact()).result.declined_reason
    except grpc.aio.AioRpcError as error:  # the bracket opened on its span, then failed
        code = error.code()
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION)
    starts = _starts(await h.events())
    if plan.decline_code:
        assert not starts
        assert declined == plan.decline_reason
    else:
        (start,) = starts
        _assert_same_span(plan, start)


@st.composite
def _open_conversations(draw: st.DrawFn) -> list[events_pb2.SessionEvent]:
    count = draw(st.integers(0, 24))
    big = st.sampled_from(["ok " * 20, "build output line\n" * 500, "x" * 30_000])
    events: list[events_pb2.SessionEvent] = []
    for i in range(count):
        events.extend(unit(i, result=draw(big)))
    return [*events, turn_start(1)]


def test_the_plan_predicts_what_prepare_step_prunes_and_replaces_on_random_conversations(
    tmp_path: Path,
) -> None:
    with asyncio.Runner() as runner, loopback() as provider:
        stack = AsyncExitStack()
        h = runner.run(stack.enter_async_context(started(tmp_path, provider, kind="extractive")))
        sessions = iter(range(10_000))
        try:

            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
            @given(_open_conversations())
            def one(conversation: list[events_pb2.SessionEvent]) -> None:
                h.session_id = f"a{next(sessions)}"
                runner.run(_plan_then_prepare(h, conversation))

            one()
        finally:
            runner.run(stack.aclose())


async def _plan_then_prepare(h: Harness, conversation: list[events_pb2.SessionEvent]) -> None:
    await h.create(*opening(), *conversation)
    before = len(await h.events())
    plan = await _plan(h)
    await h.prepare(1)
    events = (await h.events())[before:]
    if plan.blocked_code == "BELOW_TRIGGER":
        assert events == []
        return
    pruned = [e.compaction_prune.shadowed_seq for e in events if body(e) == "compaction_prune"]
    assert pruned == [p.seq for p in plan.prunes]
    starts = _starts(events)
    if plan.blocked_code == "RELIEVED_BY_PRUNING" or plan.decline_code:
        assert starts == []
    else:
        assert plan.blocked_code == ""
        _assert_same_span(plan, starts[0])


# ---- GetSurface detail -----------------------------------------------------------------------


async def test_surface_detail_prices_every_node_and_names_what_shadowed_the_rest(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(18))
        plain = await h.surface()
        assert not plain.HasField("detail")
        run = await h.compact()
        checkpoint_seq = run.result.outcome.checkpoint_seq
        request = spb.GetSurfaceRequest(session_id=h.session_id, detail=True)
        surface: spb.GetSurfaceResponse = await h.sessions.GetSurface(request)
        detail = surface.detail
        assert (detail.route.provider, detail.route.model) == (PROVIDER, MODEL)
        assert detail.replacement_generation == 1
        assert detail.content_generation == 1
        report = await h.pressure()
        priced = sum(n.detail.route_tokens for n in surface.nodes)
        breakdown = report.breakdown
        assert (
            priced == breakdown.system_tokens + breakdown.messages_tokens + breakdown.images_tokens
        )
        assert all(n.detail.shadow_tokens > 0 for n in surface.nodes)
        shadowed = {n.seq: n for n in detail.shadowed}
        (start,) = _starts(await h.events())
        assert sorted(shadowed) == sorted(start.shadowed_seqs)
        first = shadowed[start.shadowed_seqs[0]]
        assert (first.shadowed_by_seq, first.type) == (checkpoint_seq, "user/message")
        assert first.compaction_id == run.result.outcome.compaction_id
        assert not detail.HasField("anchor")


async def test_surface_detail_shows_the_meter_anchor_of_reported_usage(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(2), turn_start(1), user("go on"))
        answer = assistant(text="done")
        answer.assistant_message.usage.CopyFrom(
            events_pb2.Usage(input_tokens=5000, output_tokens=7)
        )
        (_, seq, _) = await h.append(*in_step(1, 1, answer))
        await h.append(user("and then?"))
        request = spb.GetSurfaceRequest(session_id=h.session_id, detail=True)
        detail = (await h.sessions.GetSurface(request)).detail
        assert (detail.anchor.seq, detail.anchor.usage_tokens) == (seq, 5007)
        assert detail.anchor.delta_tokens > 0  # the user message after it


# ---- ListBrackets ----------------------------------------------------------------------------


async def test_list_brackets_shows_a_committed_a_failed_a_live_and_a_stale_bracket(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(18))
        loop.enqueue(Reply(text="nothing useful"))  # the quality gate rejects it
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.compact()
        assert details(caught.value).reason == "SUMMARY_REJECTED"
    async with started(tmp_path, loop) as h:  # a restart: the seed starts a new lifecycle
        await h.append_as_server(compaction_start("orphan-before-restart"))
    async with started(tmp_path, loop) as h:
        committed = await h.compact()
        assert committed.result.outcome.compaction_id
        await h.append_as_server(compaction_start("live-orphan"))
        history = await _brackets(h)
    outcomes = {b.compaction_id: b for b in history.brackets}
    assert history.last_end_seed > 0
    rejected = next(b for b in history.brackets if b.outcome == cpb.BRACKET_OUTCOME_FAILED)
    assert rejected.error_reason == "SUMMARY_REJECTED"
    assert rejected.gate.failures
    assert next(s.step for s in rejected.steps) == cpb.COMPACTION_STEP_START
    assert rejected.steps[-1].step == cpb.COMPACTION_STEP_END
    assert rejected.end_seq > rejected.start_seq
    assert rejected.duration_seconds >= 0
    assert outcomes["orphan-before-restart"].outcome == cpb.BRACKET_OUTCOME_STALE
    assert outcomes["live-orphan"].outcome == cpb.BRACKET_OUTCOME_LIVE
    done = outcomes[committed.result.outcome.compaction_id]
    assert done.outcome == cpb.BRACKET_OUTCOME_COMMITTED
    assert done.checkpoint_seq == committed.result.outcome.checkpoint_seq
    assert done.tokens.envelope_after < done.tokens.envelope_before
    assert (done.summary_target.provider, done.summary_target.model) == (PROVIDER, MODEL)
    assert done.summarizer == "openai"
    assert done.usage.output_tokens > 0
    assert done.shadowed_count == committed.result.outcome.items_condensed
    assert [s.step for s in done.steps] == [
        cpb.COMPACTION_STEP_START,
        cpb.COMPACTION_STEP_SUMMARY,
        cpb.COMPACTION_STEP_REPLACE,
        cpb.COMPACTION_STEP_END,
    ]
