"""CheckPressure and WatchPressure over a real server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from compactd import config
from compactd.api.server import RunningServer, create_server
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2 as ev
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import details
from tests.builders import header, system, user

LOCAL = {"provider": "local", "model": "w128k", "context_window": 128000}


@pytest.fixture
async def routed(tmp_path: Path) -> AsyncIterator[RunningServer]:
    """A server whose config declares a 128k route and an undeclared one."""
    settings = config.load(
        None,
        environ={},
        overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{tmp_path / 'p.db'}"},
    )
    running = await create_server(replace(settings, routes=(LOCAL,)))
    try:
        yield running
    finally:
        await running.stop(0)


async def _session(channel: grpc.aio.Channel, *events: ev.SessionEvent) -> str:
    stub = SessionServiceStub(channel)
    sid = (await stub.CreateSession(pb.CreateSessionRequest())).session.session_id
    if events:
        await stub.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=events))
    return sid


async def test_check_pressure_reports_the_spec_figures(routed: RunningServer) -> None:
    async with grpc.aio.insecure_channel(routed.address) as channel:
        routed_header = header("local", "w128k")
        routed_header.request_header.config.max_output_tokens = 8192
        sid = await _session(channel, system("You are terse."), routed_header, user("abcd"))
        report = (
            await CompactionServiceStub(channel).CheckPressure(
                cpb.CheckPressureRequest(session_id=sid)
            )
        ).report
    assert (report.context_window, report.output_reservation) == (128000, 8192)
    assert (report.headroom_tokens, report.trigger_tokens) == (65536, 54272)
    assert report.retained_budget == int(0.16 * (128000 - 8192))
    assert report.state == cpb.PRESSURE_STATE_BELOW
    assert report.breakdown.method == cpb.MEASUREMENT_METHOD_HEURISTIC
    assert report.breakdown.system_tokens == 8  # "You are terse."
    assert report.measured_tokens == 8 + 9 + report.breakdown.config_tokens  # "abcd" prices 9


async def test_check_pressure_without_capacity_is_capacity_unknown(routed: RunningServer) -> None:
    async with grpc.aio.insecure_channel(routed.address) as channel:
        sid = await _session(channel, user("hi"))
        request = cpb.CheckPressureRequest(
            session_id=sid, destination=ev.Route(provider="nowhere", model="x")
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await CompactionServiceStub(channel).CheckPressure(request)
    got = details(caught.value)
    assert got.code == grpc.StatusCode.FAILED_PRECONDITION
    assert got.reason == "CAPACITY_UNKNOWN"
    assert "nowhere/x" in got.message


async def test_check_pressure_without_any_route_is_route_unknown(routed: RunningServer) -> None:
    async with grpc.aio.insecure_channel(routed.address) as channel:
        sid = await _session(channel, user("hi"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await CompactionServiceStub(channel).CheckPressure(
                cpb.CheckPressureRequest(session_id=sid)
            )
    assert details(caught.value).reason == "ROUTE_UNKNOWN"


async def test_check_pressure_of_a_missing_session_is_not_found(routed: RunningServer) -> None:
    async with grpc.aio.insecure_channel(routed.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await CompactionServiceStub(channel).CheckPressure(
                cpb.CheckPressureRequest(session_id="absent")
            )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_invalid_session_policy_is_rejected_naming_the_field(routed: RunningServer) -> None:
    from google.protobuf import struct_pb2

    policy = struct_pb2.Struct()
    policy.update({"thresholdRatio": 0.5, "retainRatio": 0.6})
    async with grpc.aio.insecure_channel(routed.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await SessionServiceStub(channel).CreateSession(
                pb.CreateSessionRequest(compaction_policy=policy)
            )
    got = details(caught.value)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "retainRatio" in got.message


async def test_session_policy_changes_the_trigger(routed: RunningServer) -> None:
    from google.protobuf import struct_pb2

    policy = struct_pb2.Struct()
    policy.update({"thresholdRatio": 0.25, "headroomTokens": 1000})
    async with grpc.aio.insecure_channel(routed.address) as channel:
        stub = SessionServiceStub(channel)
        sid = (
            await stub.CreateSession(pb.CreateSessionRequest(compaction_policy=policy))
        ).session.session_id
        await stub.AppendEvents(
            pb.AppendEventsRequest(session_id=sid, events=[header("local", "w128k")])
        )
        report = (
            await CompactionServiceStub(channel).CheckPressure(
                cpb.CheckPressureRequest(session_id=sid)
            )
        ).report
    assert report.trigger_tokens == 32000


async def test_watch_pressure_follows_concurrent_appends(routed: RunningServer) -> None:
    async with grpc.aio.insecure_channel(routed.address) as channel:
        sid = await _session(channel, header("local", "w128k"))
        sessions = SessionServiceStub(channel)
        watch = CompactionServiceStub(channel).WatchPressure(
            cpb.WatchPressureRequest(session_id=sid)
        )
        first = (await watch.read()).report
        assert first.revision == 1

        async def writer(n: int) -> None:
            for i in range(10):
                await sessions.AppendEvents(
                    pb.AppendEventsRequest(session_id=sid, events=[user(f"{n}-{i} " * 50)])
                )

        await asyncio.gather(*(writer(n) for n in range(4)))
        revisions = []
        while not revisions or revisions[-1] < 41:
            reply = await asyncio.wait_for(watch.read(), timeout=30)  # fail, never hang
            revisions.append(reply.report.revision)
        watch.cancel()
    assert revisions == sorted(revisions)  # coalesced, never out of order
    assert revisions[-1] == 41


async def test_many_watchers_all_see_the_latest_revision(routed: RunningServer) -> None:
    async with grpc.aio.insecure_channel(routed.address) as channel:
        sid = await _session(channel, header("local", "w128k"))
        stub = CompactionServiceStub(channel)
        watches = [stub.WatchPressure(cpb.WatchPressureRequest(session_id=sid)) for _ in range(5)]
        for watch in watches:
            await watch.read()
        await SessionServiceStub(channel).AppendEvents(
            pb.AppendEventsRequest(session_id=sid, events=[user("more")])
        )
        latest = [(await w.read()).report for w in watches]
        for watch in watches:
            watch.cancel()
    assert {r.revision for r in latest} == {2}
    assert len({r.measured_tokens for r in latest}) == 1
