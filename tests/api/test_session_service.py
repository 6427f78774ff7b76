"""SessionService over a real server: the log, the surface, reconstruction and error statuses."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from compactd import config
from compactd.api.server import RunningServer, create_server
from compactd.core import fold as fold_module
from compactd.errors import CompactionBusy
from compactd.v1 import events_pb2 as ev
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import details
from tests.builders import (
    assistant,
    checkpoint,
    compaction_end,
    compaction_start,
    developer,
    end_seed,
    header,
    in_step,
    offload,
    replace,
    step_end,
    step_start,
    system,
    tool_result,
    turn_end,
    turn_start,
    user,
)


async def _create(sessions: SessionServiceStub, session_id: str = "s1") -> str:
    await sessions.CreateSession(pb.CreateSessionRequest(session_id=session_id))
    return session_id


async def _append(
    sessions: SessionServiceStub, session_id: str, *events: ev.SessionEvent, **kw: int
) -> pb.AppendEventsResponse:
    return await sessions.AppendEvents(
        pb.AppendEventsRequest(session_id=session_id, events=events, **kw)
    )


async def test_create_session_chooses_an_id_when_none_is_given(
    sessions: SessionServiceStub,
) -> None:
    response = await sessions.CreateSession(pb.CreateSessionRequest())
    assert len(response.session.session_id) == 32
    assert response.session.revision == 0


async def test_a_retried_create_with_the_same_id_and_policy_succeeds(
    sessions: SessionServiceStub,
) -> None:
    policy = struct_pb2.Struct()
    policy.update({"thresholdRatio": 0.5, "modelPolicies": [{"provider": "p", "model": "m"}]})
    request = pb.CreateSessionRequest(session_id="s1", compaction_policy=policy)
    first = (await sessions.CreateSession(request)).session
    await _append(sessions, "s1", user("hello"))
    again = (await sessions.CreateSession(request)).session
    assert (again.session_id, again.create_time) == (first.session_id, first.create_time)
    assert again.compaction_policy == first.compaction_policy
    assert again.revision == 1  # the session as it is now; nothing was reset


@pytest.mark.parametrize(
    "policy", [None, {"thresholdRatio": 0.6}], ids=["no-policy", "another-policy"]
)
async def test_create_with_the_id_of_a_session_with_another_policy_is_already_exists(
    sessions: SessionServiceStub, policy: dict[str, float] | None
) -> None:
    original = struct_pb2.Struct()
    original.update({"thresholdRatio": 0.5})
    await sessions.CreateSession(
        pb.CreateSessionRequest(session_id="s1", compaction_policy=original)
    )
    request = pb.CreateSessionRequest(session_id="s1")
    if policy is not None:
        request.compaction_policy.update(policy)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await sessions.CreateSession(request)
    got = details(caught.value)
    assert (got.code, got.reason) == (grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS")
    assert "different compaction_policy" in got.message


async def test_malformed_session_id_names_the_field(sessions: SessionServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await sessions.CreateSession(pb.CreateSessionRequest(session_id="bad id/"))
    got = details(caught.value)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.fields == ["session_id"]


async def test_append_assigns_contiguous_seqs_and_revision(sessions: SessionServiceStub) -> None:
    sid = await _create(sessions)
    first = await _append(sessions, sid, system("be brief"), user("hi"))
    second = await _append(sessions, sid, user("hello?"))
    assert list(first.seqs) == [0, 1]
    assert first.revision == 2
    assert list(second.seqs) == [2]
    assert second.revision == 3


async def test_unknown_session_is_not_found(sessions: SessionServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, "missing", user("hi"))
    got = details(caught.value)
    assert got.code == grpc.StatusCode.NOT_FOUND
    assert got.reason == "NOT_FOUND"


async def test_expected_last_seq_mismatch_is_aborted_with_seq_conflict(
    sessions: SessionServiceStub,
) -> None:
    sid = await _create(sessions)
    await _append(sessions, sid, user("one"), expected_last_seq=-1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, sid, user("two"), expected_last_seq=5)
    got = details(caught.value)
    assert got.code == grpc.StatusCode.ABORTED
    assert got.reason == "SEQ_CONFLICT"
    assert got.metadata == {"expected_last_seq": "5", "last_seq": "0"}
    ok = await _append(sessions, sid, user("two"), expected_last_seq=0)
    assert list(ok.seqs) == [1]


async def test_retried_batch_returns_original_seqs_and_appends_nothing(
    sessions: SessionServiceStub,
) -> None:
    sid = await _create(sessions)
    batch = [user("a"), user("b")]
    batch[0].event_id, batch[1].event_id = "e-1", "e-2"
    first = await _append(sessions, sid, *batch)
    retry = await _append(sessions, sid, *batch)
    assert list(retry.seqs) == list(first.seqs) == [0, 1]
    assert retry.revision == 2
    events = [r.event async for r in sessions.ListEvents(pb.ListEventsRequest(session_id=sid))]
    assert len(events) == 2


async def test_reused_event_id_with_different_content_is_invalid(
    sessions: SessionServiceStub,
) -> None:
    sid = await _create(sessions)
    original = user("a")
    original.event_id = "e-1"
    await _append(sessions, sid, original)
    changed = user("b")
    changed.event_id = "e-1"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, sid, changed)
    got = details(caught.value)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.fields == ["events[0].event_id"]


def _identified(*texts: str) -> list[ev.SessionEvent]:
    events = [user(text) for text in texts]
    for event, text in zip(events, texts, strict=True):
        event.event_id = f"id-{text}"
    return events


async def test_a_late_retry_whose_ids_the_fold_no_longer_keeps_returns_the_original_seqs(
    sessions: SessionServiceStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fold keeps its latest ids only; the log, asked through the store, answers older."""
    monkeypatch.setattr(fold_module, "RECENT_EVENT_IDS", 2)
    sid = await _create(sessions)
    first = await _append(sessions, sid, *_identified("a", "b", "c"))
    await _append(sessions, sid, *_identified("d", "e", "f"))  # a to c leave the fold's ids
    retry = await _append(sessions, sid, *_identified("a", "b", "c"))
    assert (list(retry.seqs), retry.revision) == (list(first.seqs), 6)
    straddling = await _append(sessions, sid, *_identified("d", "e", "f"))  # d is older, f kept
    assert list(straddling.seqs) == [3, 4, 5]
    events = [r.event async for r in sessions.ListEvents(pb.ListEventsRequest(session_id=sid))]
    assert len(events) == 6


async def test_an_id_older_than_the_fold_keeps_reused_with_other_content_is_a_mismatch(
    sessions: SessionServiceStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fold_module, "RECENT_EVENT_IDS", 2)
    sid = await _create(sessions)
    await _append(sessions, sid, *_identified("a", "b", "c"))
    changed = user("other")
    changed.event_id = "id-a"
    mixed = _identified("a", "new")
    for batch, fields in (([changed], ["events[0].event_id"]), (mixed, ["events"])):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _append(sessions, sid, *batch)
        got = details(caught.value)
        assert (got.code, got.reason) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "IDEMPOTENCY_MISMATCH",
        )
        assert got.fields == fields
    surface = await sessions.GetSurface(pb.GetSurfaceRequest(session_id=sid))
    assert surface.revision == 3


async def test_malformed_batch_is_rejected_whole_with_field_paths(
    sessions: SessionServiceStub,
) -> None:
    sid = await _create(sessions)
    chosen_seq = user("x")
    chosen_seq.seq = 7
    log_only_with_op = ev.SessionEvent(
        turn_start=ev.TurnStart(turn=1), surface_op=ev.SurfaceOp(kind=ev.SURFACE_OP_KIND_APPEND)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, sid, user("fine"), chosen_seq, log_only_with_op)
    got = details(caught.value)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.fields == ["events[1].seq", "events[2].surface_op"]
    surface = await sessions.GetSurface(pb.GetSurfaceRequest(session_id=sid))
    assert surface.revision == 0


async def test_a_time_protobuf_cannot_convert_or_an_unknown_enum_value_is_invalid(
    sessions: SessionServiceStub,
) -> None:
    sid = await _create(sessions)
    year_10000 = user("x")
    year_10000.time.seconds = 253_402_300_800
    unknown_op = user("y")
    unknown_op.surface_op.kind = 9  # type: ignore[assignment]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, sid, year_10000, unknown_op)
    got = details(caught.value)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.fields == ["events[0].time", "events[1].surface_op.kind"]


async def test_broken_replacement_rule_leaves_nothing_half_written(
    sessions: SessionServiceStub,
) -> None:
    sid = await _create(sessions)
    await _append(sessions, sid, system("s"), user("a"), user("b"))
    bad = replace(user("summary"), start=1, end=2, sources=[1])  # does not cite seq 2
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, sid, user("c"), bad)
    got = details(caught.value)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cite every shadowed node" in got.message
    surface = await sessions.GetSurface(pb.GetSurfaceRequest(session_id=sid))
    assert [n.seq for n in surface.nodes] == [0, 1, 2]
    assert surface.revision == 3


async def test_oversized_batch_is_invalid(server_config: config.ServerConfig) -> None:
    from dataclasses import replace as with_changes

    running = await create_server(with_changes(server_config, max_batch_events=2))
    try:
        async with grpc.aio.insecure_channel(running.address) as chan:
            stub = SessionServiceStub(chan)
            sid = await _create(stub)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _append(stub, sid, user("1"), user("2"), user("3"))
            assert details(caught.value).fields == ["events"]
    finally:
        await running.stop(0)


async def test_get_surface_puts_replacement_at_the_span_position(
    sessions: SessionServiceStub,
) -> None:
    sid = await _create(sessions)
    conversation = [
        system("s"),
        turn_start(1),
        user("a"),
        *in_step(1, 1, assistant("b")),
        user("c"),
    ]
    seqs = (await _append(sessions, sid, *conversation)).seqs
    head, a, b, c = seqs[0], seqs[2], seqs[4], seqs[6]
    summary = await _append(sessions, sid, replace(user("sum"), start=a, end=b, sources=[a, b]))
    surface = await sessions.GetSurface(pb.GetSurfaceRequest(session_id=sid))
    assert [(n.position, n.seq, n.type) for n in surface.nodes] == [
        (0, head, "system/message"),
        (1, summary.seqs[0], "user/message"),
        (2, c, "user/message"),
    ]
    assert list(surface.nodes[1].source_event_seqs) == [a, b]


async def test_build_request_derives_messages_and_folds_the_header(
    sessions: SessionServiceStub,
) -> None:
    sid = await _create(sessions)
    tools = [ev.ToolDeclaration(name="read", description="read a file", input_schema_json="{}")]
    appended = await _append(
        sessions,
        sid,
        system("be brief"),
        header("deepseek", "deepseek-chat", tools=tools),
        turn_start(1),
        user("read x"),
        *in_step(1, 1, assistant(calls=[("c1", "read", '{"path":"x"}')])),
        tool_result("c1", "contents"),
    )
    built = await sessions.BuildRequest(pb.BuildRequestRequest(session_id=sid))
    assert [m.role for m in built.messages] == [
        pb.MESSAGE_ROLE_SYSTEM,
        pb.MESSAGE_ROLE_USER,
        pb.MESSAGE_ROLE_ASSISTANT,
        pb.MESSAGE_ROLE_TOOL,
    ]
    assert built.messages[3].tool_call_id == "c1"
    assert built.config.model == "deepseek-chat"
    assert [t.name for t in built.tools] == ["read"]
    assert built.header_seq == appended.seqs[1]
    assert built.revision == appended.revision


async def test_build_request_applies_image_offload(
    server: RunningServer, sessions: SessionServiceStub
) -> None:
    sid = await _create(sessions)
    image = ev.ContentBlock(
        image=ev.ImageBlock(media_type="image/png", name="shot.png", path="/att/shot.png")
    )
    message = user("look")
    message.user_message.content.append(image)
    (seq,) = (await _append(sessions, sid, message)).seqs
    handle = await server.manager.get(sid)  # offloads are recovery's to write: the trusted path
    await handle.append([offload({seq: [0]})])
    built = await sessions.BuildRequest(pb.BuildRequestRequest(session_id=sid))
    blocks = built.messages[0].content
    assert blocks[1].WhichOneof("block") == "text"
    assert "shot.png" in blocks[1].text.text
    assert "/att/shot.png" in blocks[1].text.text
    events = [r.event async for r in sessions.ListEvents(pb.ListEventsRequest(session_id=sid))]
    assert events[0].user_message.content[1].HasField("image")  # the log keeps the original


async def test_list_events_from_a_seq_and_follow(sessions: SessionServiceStub) -> None:
    sid = await _create(sessions)
    await _append(sessions, sid, user("0"), user("1"), user("2"))
    tail = [
        r.event.seq
        async for r in sessions.ListEvents(pb.ListEventsRequest(session_id=sid, from_seq=1))
    ]
    assert tail == [1, 2]
    stream = sessions.ListEvents(pb.ListEventsRequest(session_id=sid, from_seq=2, follow=True))
    seen = [(await stream.read()).event.seq]
    await _append(sessions, sid, user("3"), user("4"))
    seen += [(await stream.read()).event.seq, (await stream.read()).event.seq]
    stream.cancel()
    assert seen == [2, 3, 4]


async def test_sessions_are_isolated(sessions: SessionServiceStub) -> None:
    a, b = await _create(sessions, "a"), await _create(sessions, "b")
    await _append(sessions, a, user("only in a"))
    surface = await sessions.GetSurface(pb.GetSurfaceRequest(session_id=b))
    assert list(surface.nodes) == []
    assert list((await _append(sessions, b, user("b0"))).seqs) == [0]


async def test_restore_appends_end_seed_and_stale_bracket_no_longer_blocks(
    server_config: config.ServerConfig,
) -> None:
    running = await create_server(server_config)
    async with grpc.aio.insecure_channel(running.address) as chan:
        stub = SessionServiceStub(chan)
        sid = await _create(stub)
        await _append(stub, sid, user("a"))
        handle = await running.manager.get(sid)  # brackets are the server's: its trusted path
        await handle.append([compaction_start("k1")])
        with pytest.raises(CompactionBusy):
            await handle.append([compaction_start("k2")])
    await running.stop(0)

    restarted = await create_server(server_config)
    try:
        async with grpc.aio.insecure_channel(restarted.address) as chan:
            stub = SessionServiceStub(chan)
            handle = await restarted.manager.get(sid)  # the restore appends session/end-seed
            result = await handle.append([compaction_start("k2")])
            events = [r.event async for r in stub.ListEvents(pb.ListEventsRequest(session_id=sid))]
            assert [e.WhichOneof("body") for e in events] == [
                "user_message",
                "compaction_start",
                "session_end_seed",
                "compaction_start",
            ]
            assert list(result.seqs) == [3]
    finally:
        await restarted.stop(0)


SERVER_ONLY = [
    (compaction_start("forged"), "compaction_start"),
    (compaction_end("forged"), "compaction_end"),
    (end_seed(), "session_end_seed"),
    (offload({0: [0]}), "image_offload"),
    (checkpoint("forged", "a summary"), "user_message.source.compaction_checkpoint"),
]


@pytest.mark.parametrize(("event", "field"), SERVER_ONLY, ids=[f for _, f in SERVER_ONLY])
async def test_append_refuses_a_server_only_event_naming_the_field(
    sessions: SessionServiceStub, event: ev.SessionEvent, field: str
) -> None:
    sid = await _create(sessions)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, sid, user("a"), event)
    got = details(caught.value)
    assert (got.code, got.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "SERVER_ONLY_EVENT")
    assert got.fields == [f"events[1].{field}"]
    surface = await sessions.GetSurface(pb.GetSurfaceRequest(session_id=sid))
    assert surface.revision == 0


async def test_append_accepts_every_event_a_runtime_writes(sessions: SessionServiceStub) -> None:
    sid = await _create(sessions)
    runtime = [
        system("s"),
        developer("d"),
        header("p", "m"),
        turn_start(1),
        user("u"),
        step_start(1, 1),
        ev.SessionEvent(assistant_attempt=ev.AssistantAttempt(attempt=1, error="overloaded")),
        ev.SessionEvent(llm_retry=ev.LlmRetry(attempt=2, reason="overloaded", delay_ms=100)),
        assistant(calls=[("c1", "run", "{}")]),
        step_end(1, 1),
        ev.SessionEvent(tool_call=ev.ToolCall(tool_call_id="c1", name="run")),
        tool_result("c1", "ok"),
        turn_end(1),
    ]
    reply = await _append(sessions, sid, *runtime)
    assert list(reply.seqs) == list(range(len(runtime)))


async def test_a_forged_checkpoint_replacement_is_refused(sessions: SessionServiceStub) -> None:
    sid = await _create(sessions)
    await _append(sessions, sid, user("a"), user("b"))
    forged = replace(checkpoint("forged", "summary"), start=0, end=1, sources=[0, 1])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, sid, forged)
    assert details(caught.value).reason == "SERVER_ONLY_EVENT"


@pytest.mark.parametrize(
    ("events", "field"),
    [
        ([turn_start(1), assistant("outside any step")], "events[1].assistant_message"),
        ([step_end(1, 1)], "events[0].step_end"),
        ([turn_start(1), step_start(1, 1), step_start(1, 2)], "events[2].step_start"),
    ],
    ids=["assistant-outside-a-step", "end-of-no-open-step", "overlapping-steps"],
)
async def test_append_enforces_the_step_brackets(
    sessions: SessionServiceStub, events: list[ev.SessionEvent], field: str
) -> None:
    sid = await _create(sessions)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, sid, *events)
    got = details(caught.value)
    assert (got.code, got.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "STEP_BRACKET")
    assert got.fields == [field]


async def test_append_accepts_a_step_whose_turn_was_never_opened(
    sessions: SessionServiceStub,
) -> None:
    # The reference accepts it (its own tests build such logs); the step still brackets.
    sid = await _create(sessions)
    events = [user("hi"), step_start(1, 1), assistant("hello"), step_end(1, 1)]
    reply = await _append(sessions, sid, *events)
    assert list(reply.seqs) == [0, 1, 2, 3]


async def test_only_replacements_cite_sources(sessions: SessionServiceStub) -> None:
    sid = await _create(sessions)
    cited = user("b")
    cited.source_event_seqs.append(0)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, sid, user("a"), cited)
    got = details(caught.value)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.fields == ["events[1].source_event_seqs"]


async def test_health_reports_serving_and_reflection_lists_services(
    channel: grpc.aio.Channel,
) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "compactd.v1.SessionService", "compactd.v1.CompactionService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = reflect.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    names = {s.name for s in reply.list_services_response.service}
    assert {"compactd.v1.SessionService", "compactd.v1.CompactionService"} <= names
