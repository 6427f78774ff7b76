"""The Python client and the server in one process: shared descriptors, real typed errors."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from compactd_client import (
    AsyncCompactdClient,
    CompactionBusyError,
    InvalidArgumentError,
    NotFoundError,
    SeqConflictError,
)
from compactd_client.errors import UnauthenticatedError
from compactd_client.events import (
    assistant_message,
    request_header,
    step_end,
    step_start,
    tool_call_block,
    tool_result,
    turn_end,
    turn_start,
    user_message,
)
from compactd_client.v1 import events_pb2 as client_events
from compactd_client.v1.compaction_service_pb2 import BracketOutcome, PlanMode

from compactd import config
from compactd.api.auth import hash_token
from compactd.api.server import RunningServer, create_server
from compactd.v1 import events_pb2 as server_events


def test_client_and_server_stubs_share_one_descriptor_pool() -> None:
    # Both are generated from protos/compactd/v1 under different Python packages; the
    # serialized files are identical, so the default pool holds them once.
    assert client_events.DESCRIPTOR is server_events.DESCRIPTOR
    server_message = server_events.SessionEvent(user_message=server_events.UserMessage())
    assert client_events.SessionEvent.FromString(server_message.SerializeToString()).HasField(
        "user_message"
    )


async def test_append_conflict_from_the_real_server_is_typed(server: RunningServer) -> None:
    async with AsyncCompactdClient(server.address) as client:
        session = await client.create_session("co-installed")
        await client.append_events(session.session_id, [user_message("one")])
        with pytest.raises(SeqConflictError) as caught:
            await client.append_events(
                session.session_id, [user_message("two")], expected_last_seq=5
            )
    assert caught.value.code == grpc.StatusCode.ABORTED
    assert caught.value.reason == "SEQ_CONFLICT"
    assert caught.value.domain


async def test_field_violations_from_the_real_server(server: RunningServer) -> None:
    async with AsyncCompactdClient(server.address) as client:
        session = await client.create_session()
        orphan = tool_result("never-called", "output")
        with pytest.raises(InvalidArgumentError) as caught:
            await client.append_events(session.session_id, [orphan])
    assert caught.value.reason == "TOOL_RESULT_WITHOUT_CALL"
    assert [v.field for v in caught.value.violations if v.field.endswith("tool_call_id")]


async def test_compact_during_an_open_turn_is_busy(server: RunningServer) -> None:
    async with AsyncCompactdClient(server.address) as client:
        session = await client.create_session()
        events = [
            turn_start(1),
            user_message("look"),
            step_start(1, 1),
            assistant_message(tool_calls=[tool_call_block("c1", "ls", {})]),
            step_end(1, 1),
            tool_result("c1", "a\nb"),
        ]
        await client.append_events(session.session_id, events)
        with pytest.raises(CompactionBusyError) as caught:
            await client.compact(session.session_id).result()
    assert caught.value.reason == "COMPACTION_BUSY"


async def test_unknown_session_is_not_found(server: RunningServer) -> None:
    async with AsyncCompactdClient(server.address) as client:
        with pytest.raises(NotFoundError):
            await client.get_surface("no-such-session")


async def test_the_client_passes_a_token_and_lists_and_deletes_its_tenants_sessions(
    server_config: config.ServerConfig,
) -> None:
    tokens = {"a": hash_token("token-a"), "b": hash_token("token-b")}
    running = await create_server(replace(server_config, auth_tokens=tokens))
    try:
        async with (
            AsyncCompactdClient(running.address, token="token-a") as a,
            AsyncCompactdClient(running.address, token="token-b") as b,
            AsyncCompactdClient(running.address) as anonymous,
        ):
            await a.create_session("mine")
            with pytest.raises(UnauthenticatedError):
                await anonymous.list_sessions()
            with pytest.raises(NotFoundError):
                await b.get_surface("mine")
            assert [s.session_id for s in (await a.list_sessions()).sessions] == ["mine"]
            assert (await b.list_sessions()).sessions == []
            await a.delete_session("mine")
            assert (await a.list_sessions()).sessions == []
    finally:
        await running.stop(0)


async def test_the_client_plans_a_compaction_and_lists_the_bracket_it_made(
    server: RunningServer,
) -> None:
    async with AsyncCompactdClient(server.address) as client:
        session = (await client.create_session()).session_id
        await client.append_events(session, [request_header("openai", "gpt-4o")])
        for turn in range(1, 5):
            await client.append_events(
                session,
                [
                    turn_start(turn),
                    user_message(f"request {turn}: " + "details " * 200),
                    step_start(turn, 1),
                    assistant_message(f"answer {turn}: " + "reasoning " * 200),
                    step_end(turn, 1),
                    turn_end(turn),
                ],
            )
        plan = (await client.plan_compaction(session, mode=PlanMode.PLAN_MODE_MANUAL)).plan
        outcome = (await client.compact(session).result()).outcome
        brackets = (await client.list_brackets(session)).brackets

    assert outcome.range.end_seq > outcome.range.start_seq
    assert plan.span.range == outcome.range  # the plan names the span the compaction replaced
    assert [b.compaction_id for b in brackets] == [outcome.compaction_id]
    assert brackets[0].outcome == BracketOutcome.BRACKET_OUTCOME_COMMITTED
    assert brackets[0].range == outcome.range


async def test_the_unary_step_answers_what_the_step_stream_ends_with(
    server: RunningServer,
) -> None:
    async with AsyncCompactdClient(server.address) as client:
        session = (await client.create_session()).session_id
        opening = [request_header("openai", "gpt-4o"), turn_start(1), user_message("look")]
        await client.append_events(session, opening)
        streamed = await client.prepare_step_stream(session, 1).result()
        assert await client.prepare_step_unary(session, 1) == streamed
        held = streamed.request_revision
        held_step = await client.prepare_step_unary(session, 1, held_revision=held)
        streamed_held = client.prepare_step_stream(session, 1, held_revision=held)
        assert held_step == await streamed_held.result()
        assert held_step.request_unchanged
        with pytest.raises(NotFoundError):
            await client.prepare_step_unary("no-such-session", 1)


async def test_the_client_pins_forks_lists_children_and_logs_subagents(
    server: RunningServer,
) -> None:
    from compactd_client.events import clear_pin, pin, subagent_end, subagent_start, system_message

    async with AsyncCompactdClient(server.address) as client:
        await client.create_session("parent")
        await client.append_events(
            "parent",
            [system_message("be brief"), turn_start(1), user_message("go"), turn_end(1)],
        )
        await client.append_events("parent", [pin("goal", "ship it"), pin("plan", "1. test")])
        child = await client.create_session("parent.a", parent_session_id="parent", fork_at_seq=3)
        assert (child.parent_session_id, child.fork_at_seq) == ("parent", 3)
        await client.append_events(
            "parent",
            [subagent_start("parent.a", task="check it"), subagent_end("parent.a", "fine")],
        )
        await client.append_events("parent", [clear_pin("plan")])

        built = await client.build_request("parent")
        assert [(p.key, p.text) for p in built.pins] == [("goal", "ship it")]
        assert [m.pinned_state for m in built.messages] == [False, True, False]
        forked = await client.build_request("parent.a")
        assert [m.content[0].text.text for m in forked.messages] == ["be brief", "go"]
        children = await client.list_sessions(parent_session_id="parent")
        assert [s.session_id for s in children.sessions] == ["parent.a"]
