"""CompactionService.Compact and PrepareStep over a real server: the RPC contract.

Statuses and reasons, who may compact when (open turns, live and orphan brackets, two clients at
once), what is declined without touching the log, warnings for routes without capacity, and
cancellation of a call whose summary is still being written.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from tests.api.rpc import details
from tests.builders import (
    assistant,
    compaction_end,
    compaction_start,
    end_seed,
    exchange,
    header,
    in_step,
    system,
    tool_result,
    turn_end,
    turn_start,
)
from tests.compaction_fixtures import (
    BELOW,
    PROVIDER,
    RELAXED,
    Harness,
    Run,
    body,
    loopback,
    opening,
    started,
    summary_requests,
    units,
)

STEP = cpb.CompactionStep


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


async def busy(call: object) -> dict[str, str]:
    """Await a call that must fail with ABORTED / COMPACTION_BUSY; its ErrorInfo metadata."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    got = details(caught.value)
    assert (got.code, got.reason) == (grpc.StatusCode.ABORTED, "COMPACTION_BUSY")
    return got.metadata


# ---- Compact -------------------------------------------------------------------------------------


async def test_compact_works_below_pressure(tmp_path: Path, loop: OpenAICompatServer) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(4))
        before = await h.pressure()
        assert before.state == BELOW
        run = await h.compact()

        outcome = run.result.outcome
        assert outcome.items_condensed == 15  # everything but the last unit (the final answer)
        assert outcome.tokens_freed > 0
        assert outcome.checkpoint_seq == (await h.events())[-2].seq
        assert run.result.declined_reason == ""
        assert run.result.after.measured_tokens < before.measured_tokens
        assert run.steps() == [
            STEP.COMPACTION_STEP_START,
            STEP.COMPACTION_STEP_SUMMARIZE,
            STEP.COMPACTION_STEP_GATE,
            STEP.COMPACTION_STEP_SUMMARY,
            STEP.COMPACTION_STEP_REPLACE,
            STEP.COMPACTION_STEP_END,
        ]
        start = (await h.events())[run.progress[0].seq].compaction_start
        assert start.trigger == events_pb2.COMPACTION_TRIGGER_MANUAL
        assert not start.HasField("turn")


async def test_compact_keeps_the_system_messages_right_after_the_head(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # The reference's range "starts at the first surface node that is not a system/message": a
    # prompt update right after the head stays, and the envelope keeps its 9 tokens
    # (ceil(18 / 4) + 4) over a session without it, the same checkpoint replacing the same units.
    summary = "The work so far: every module was checked and passes."
    loop.enqueue(Reply(text=summary), Reply(text=summary))
    policy = {**RELAXED, "summaryGate": False}
    async with started(tmp_path, loop, policy=policy) as h:
        head, tail = opening()
        await h.create(head, system("Answer in English."), tail, *units(4))
        plain = dataclasses.replace(h, session_id="s2")
        await plain.create(head, tail, *units(4))

        outcome = (await h.compact()).result.outcome
        await plain.compact()

        assert outcome.range.start_position == 2
        assert outcome.items_condensed == 15  # every unit but the last, not the update
        nodes = (await h.surface()).nodes
        assert [n.message.content[0].text.text for n in nodes[:2]] == [
            "You are a careful coding agent.",
            "Answer in English.",
        ]
        assert (await h.pressure()).measured_tokens - (await plain.pressure()).measured_tokens == 9


async def test_compact_focus_text_reaches_the_instruction(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(4))
        await h.compact(focus="Keep every detail of the database migration plan.")
        (request,) = summary_requests(loop)
        instruction = request["messages"][-1]
        assert instruction["role"] == "user"
        assert instruction["content"].endswith("Keep every detail of the database migration plan.")


async def test_compact_is_refused_while_a_turn_is_open(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(4), turn_start(1))
        before = await h.events()
        metadata = await busy(h.compact())
        assert metadata["open_turns"] == "1"
        assert await h.events() == before
        assert loop.requests == []

        await h.append(turn_end(1))
        assert (await h.compact()).result.outcome.compaction_id


async def test_concurrent_compact_calls_from_two_clients_let_exactly_one_proceed(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(delay_before=1.5))  # the summary is slow, so the calls overlap
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(6))
        async with grpc.aio.insecure_channel(h.address) as other:
            outcomes = await asyncio.gather(
                h.compact(), h.compact(channel=other), return_exceptions=True
            )
        refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        done = [o for o in outcomes if isinstance(o, Run)]
        assert len(refused) == len(done) == 1
        got = details(refused[0])
        assert (got.code, got.reason) == (grpc.StatusCode.ABORTED, "COMPACTION_BUSY")
        assert got.metadata["compaction_id"] == done[0].result.outcome.compaction_id
        log = [body(e) for e in await h.events()]
        assert log.count("compaction_start") == log.count("compaction_end") == 1
        assert len(summary_requests(loop)) == 1


async def test_an_orphan_compaction_start_blocks_within_its_lifecycle(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(18))
        await h.append_as_server(compaction_start("orphan"))  # a bracket its process never closed
        assert (await busy(h.compact()))["compaction_id"] == "orphan"
        await h.append(turn_start(1))
        before = await h.events()
        assert (await busy(h.prepare(1)))["compaction_id"] == "orphan"
        assert await h.events() == before

        await h.append_as_server(end_seed("a new lifecycle"))  # the orphan is stale evidence now
        run = await h.prepare(1)
        assert len(run.result.compactions) == 1
        log = [body(e) for e in await h.events()]
        assert log[-4:] == [
            "compaction_start",
            "compaction_summary",
            "user_message",
            "compaction_end",
        ]


async def test_a_closed_bracket_no_longer_blocks(tmp_path: Path, loop: OpenAICompatServer) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(4))
        await h.append_as_server(compaction_start("manual"))
        await busy(h.compact())
        await h.append_as_server(compaction_end("manual"))
        assert (await h.compact()).result.outcome.compaction_id


@pytest.mark.parametrize(
    ("history", "reason"),
    [
        (
            [*units(3), *exchange(1, "go on", assistant(calls=[("open-1", "run", "{}")]))],
            "open-1 still wait for results",
        ),
        (
            [
                turn_start(1),
                *in_step(1, 1, assistant(calls=[("c0", "run", "{}")])),
                tool_result("c0", "ok"),
                turn_end(1),
            ],
            "single indivisible unit",
        ),
        ([], "no history after the system head"),
    ],
    ids=["open-tool-call-tail", "system-and-one-tool-unit", "system-only"],
)
async def test_nothing_selectable_is_declined_without_writing_to_the_log(
    tmp_path: Path,
    loop: OpenAICompatServer,
    history: list[events_pb2.SessionEvent],
    reason: str,
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *history)
        before = await h.events()
        run = await h.compact()
        assert reason in run.result.declined_reason
        assert not run.result.HasField("outcome")
        assert run.progress == []
        assert await h.events() == before
        assert loop.requests == []


async def test_an_open_tail_above_pressure_declines_with_a_warning(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(
            *opening(),
            *units(18),
            *exchange(1, "again", assistant(calls=[("open-2", "run", "{}")]), close=False),
        )
        before = await h.events()
        run = await h.prepare(1)
        assert run.result.compactions == []
        (warning,) = run.result.warnings
        assert "nothing to compact" in warning
        assert "open-2" in warning
        assert await h.events() == before


# ---- PrepareStep ---------------------------------------------------------------------------------


async def test_prepare_step_without_an_open_turn_is_failed_precondition(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(18), turn_start(1), turn_end(1))
        before = await h.events()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.prepare(1)
        got = details(caught.value)
        assert (got.code, got.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NO_OPEN_TURN")
        assert got.metadata["turn"] == "1"
        assert await h.events() == before


async def test_a_route_without_capacity_warns_once_per_target_and_continues(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    nocap = {"provider": PROVIDER, "model": "nocap", "base_url": loop.base_url}
    async with started(tmp_path, loop, routes=[nocap]) as h:
        await h.create(*opening(), *units(18), header(PROVIDER, "nocap"), turn_start(1))
        before = await h.events()
        full = await h.build()
        route = events_pb2.Route(provider=PROVIDER, model="nocap")

        first = (await h.prepare(1)).result
        (warning,) = first.warnings
        assert "the logged route" in warning
        assert "loop/nocap" in warning
        assert "context window" in warning
        assert not first.HasField("before")
        assert list(first.request.messages) == list(full.messages)

        again = (await h.prepare(1)).result
        assert list(again.warnings) == []
        assert list(again.request.messages) == list(full.messages)

        (named,) = (await h.prepare(1, route)).result.warnings  # the same route, named: no switch
        assert "loop/nocap" in named
        assert list((await h.prepare(1, route)).result.warnings) == []
        assert await h.events() == before


async def test_prepare_step_streams_each_step_then_the_rebuilt_request(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(18), turn_start(1))
        request = cpb.PrepareStepRequest(session_id=h.session_id, turn=1)
        responses = [r async for r in h.compaction.PrepareStep(request)]
        kinds = [r.WhichOneof("update") for r in responses]
        assert kinds == ["progress"] * (len(kinds) - 1) + ["result"]
        result = responses[-1].result
        assert result.request == await h.build()


async def test_a_held_request_comes_back_as_the_messages_appended_since(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(2), turn_start(1))
        first = (await h.prepare(1)).result  # an old client: no held revision, the full request
        built = await h.build()
        assert first.request == built
        assert not first.request_unchanged
        assert first.request_revision == built.revision

        same = (await h.prepare(1, held=built.revision)).result
        assert same.request_unchanged
        assert not same.HasField("request")
        assert list(same.appended_messages) == []
        assert same.request_revision == built.revision
        assert same.before.state == BELOW

        await h.append(*in_step(1, 1, assistant("Looking at src/mod1.py now.")))
        grown = (await h.prepare(1, held=built.revision)).result
        now = await h.build()
        assert grown.request_unchanged
        assert [*built.messages, *grown.appended_messages] == list(now.messages)
        assert grown.request_revision == now.revision

        await h.append(header(PROVIDER, "other"))  # the request's config changed: all of it back
        changed = (await h.prepare(1, held=now.revision)).result
        assert not changed.request_unchanged
        assert changed.request == await h.build()


async def test_a_request_held_of_a_session_deleted_and_created_again_comes_back_whole(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(2), turn_start(1))
        held = (await h.prepare(1)).result.request  # what a client holds
        assert held.incarnation
        # Another process deletes the session and creates it again: revisions restart, and the
        # new log reaches the held revision with other messages.
        await h.sessions.DeleteSession(spb.DeleteSessionRequest(session_id=h.session_id))
        await h.create(*opening(), *units(3, start=7), turn_start(1))
        await h.append(*in_step(1, 1, assistant("Looking at src/mod9.py now.")))
        now = await h.build()
        assert now.revision >= held.revision
        assert now.incarnation != held.incarnation

        # A client that sends its held request's incarnation gets the new session's request.
        result = (await h.prepare(1, held=held.revision, incarnation=held.incarnation)).result
        assert not result.request_unchanged
        assert result.request == now
        assert result.request_revision == now.revision
        # Even for a held revision beyond the new log: of a session that is gone, not invalid.
        await h.sessions.DeleteSession(spb.DeleteSessionRequest(session_id=h.session_id))
        await h.create(*opening(), turn_start(1))
        fresh = await h.build()
        beyond = (await h.prepare(1, held=now.revision, incarnation=now.incarnation)).result
        assert beyond.request == fresh
        # The same incarnation is the session's own: its held answer as before.
        same = (await h.prepare(1, held=fresh.revision, incarnation=fresh.incarnation)).result
        assert same.request_unchanged


async def test_an_old_client_holding_a_request_of_a_session_created_again_is_answered_as_before(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    # Without an incarnation the server cannot tell the sessions apart: the held revision is
    # taken to be of the session as it is now (why clients send the incarnation).
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(2), turn_start(1))
        held = (await h.prepare(1)).result.request
        await h.sessions.DeleteSession(spb.DeleteSessionRequest(session_id=h.session_id))
        await h.create(*opening(), *units(3, start=7), turn_start(1))
        now = await h.build()
        result = (await h.prepare(1, held=held.revision)).result
        assert result.request_unchanged
        assert [*held.messages, *result.appended_messages] != list(now.messages)


async def test_a_held_step_during_a_write_answers_once_the_write_commits(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(2), turn_start(1))
        built = await h.build()
        assert h.server is not None
        handle = await h.server.manager.get(h.session_id)
        request = cpb.PrepareStepUnaryRequest(
            session_id=h.session_id, turn=1, held_revision=built.revision
        )
        async with handle.lock:  # a write between its admission and its commit
            step = asyncio.ensure_future(h.compaction.PrepareStepUnary(request))
            await asyncio.sleep(0.2)
            assert not step.done()  # the held answer waits: the fold holds uncommitted events
            await handle.append_locked(in_step(1, 1, assistant("Looking at src/mod1.py now.")))
        result = (await step).result
        now = await h.build()
        assert result.request_unchanged
        assert [*built.messages, *result.appended_messages] == list(now.messages)
        assert result.request_revision == now.revision


async def test_a_step_that_compacts_returns_the_full_request_whatever_was_held(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(18), turn_start(1))
        held = (await h.build()).revision
        result = (await h.prepare(1, held=held)).result
        assert len(result.compactions) == 1
        assert not result.request_unchanged
        assert result.request == await h.build()
        assert result.request_revision == result.request.revision


async def test_a_held_revision_outside_the_log_is_invalid(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(1), turn_start(1))
        revision = (await h.build()).revision
        for held in (-1, revision + 1):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await h.prepare(1, held=held)
            got = details(caught.value)
            assert got.code == grpc.StatusCode.INVALID_ARGUMENT
            assert got.fields == ["held_revision"]


# ---- errors and cancellation ---------------------------------------------------------------------


async def test_unknown_sessions_and_missing_ids_are_rejected(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        stub = h.compaction
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await dataclasses.replace(h, session_id="missing").compact()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Compact(cpb.CompactRequest()):
                pass
        assert details(caught.value).fields == ["session_id"]


async def test_a_cancelled_compact_still_closes_its_bracket_and_releases_the_lock(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    loop.enqueue(Reply(delay_before=60))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(6))
        surface = await h.surface()
        call = h.compaction.Compact(cpb.CompactRequest(session_id=h.session_id))
        first = await call.read()
        assert first.progress.step == STEP.COMPACTION_STEP_START
        assert await asyncio.to_thread(loop.wait_for_requests, 1)  # the summary is in flight
        call.cancel()

        log = await h.wait_for_log(lambda events: body(events[-1]) == "compaction_end")
        end = log[-1].compaction_end
        assert (end.error, end.error_reason) == ("cancelled by the caller", "CANCELLED")
        assert [body(e) for e in log[-2:]] == ["compaction_start", "compaction_end"]
        assert (await h.surface()).nodes == surface.nodes

        later = await h.compact()  # the lock is free again
        assert later.result.outcome.compaction_id


# ---- PrepareStepUnary ------------------------------------------------------------------------


async def _prepare_unary(
    h: Harness, turn: int, *, held: int | None = None, session_id: str | None = None
) -> cpb.PrepareStepResult:
    request = cpb.PrepareStepUnaryRequest(
        session_id=h.session_id if session_id is None else session_id, turn=turn
    )
    if held is not None:
        request.held_revision = held
    response = await h.compaction.PrepareStepUnary(request)
    return response.result


async def test_prepare_step_unary_answers_the_result_prepare_step_streams(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(2), turn_start(1))
        streamed = (await h.prepare(1)).result
        assert await _prepare_unary(h, 1) == streamed
        held = streamed.request_revision
        await h.append(*in_step(1, 1, assistant("Looking at src/mod1.py now.")))
        grown = await _prepare_unary(h, 1, held=held)
        assert grown == (await h.prepare(1, held=held)).result
        assert grown.request_unchanged
        assert grown.before.state == BELOW
        now = await h.build()
        assert [*streamed.request.messages, *grown.appended_messages] == list(now.messages)


async def test_prepare_step_unary_compacts_above_pressure_and_returns_the_full_request(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), *units(18), turn_start(1))
        held = (await h.build()).revision
        result = await _prepare_unary(h, 1, held=held)
        assert len(result.compactions) == 1
        assert not result.request_unchanged
        assert result.request == await h.build()
        assert result.after.measured_tokens < result.before.measured_tokens


async def test_prepare_step_unary_refuses_what_prepare_step_refuses(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *units(1), turn_start(1))
        revision = (await h.build()).revision
        refusals = [
            (_prepare_unary(h, 2), grpc.StatusCode.FAILED_PRECONDITION, "NO_OPEN_TURN"),
            (_prepare_unary(h, 1, session_id="missing"), grpc.StatusCode.NOT_FOUND, ""),
            (_prepare_unary(h, 1, session_id=""), grpc.StatusCode.INVALID_ARGUMENT, ""),
            (_prepare_unary(h, 1, held=revision + 1), grpc.StatusCode.INVALID_ARGUMENT, ""),
        ]
        for call, code, reason in refusals:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            got = details(caught.value)
            assert got.code == code
            assert got.reason == reason or not reason
