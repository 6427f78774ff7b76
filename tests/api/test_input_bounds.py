"""Odd input over a real server: each answers a precise status at append time, and every read of
a session that was accepted keeps working (no INTERNAL later, no read over the message limit)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import struct_pb2

from compactd import config
from compactd.api.server import RunningServer, components, create_server
from compactd.core.limits import MIB
from compactd.errors import ConfigError
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2 as ev
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import ErrorDetails, details
from tests.builders import assistant, header, in_step, system, tool, turn_start, user

ROUTE = {"provider": "local", "model": "w128k", "context_window": 128_000}


@pytest.fixture
async def routed(server_config: config.ServerConfig) -> AsyncIterator[RunningServer]:
    running = await create_server(dataclasses.replace(server_config, routes=(ROUTE,)))
    try:
        yield running
    finally:
        await running.stop(0)


@pytest.fixture
async def stubs(
    routed: RunningServer,
) -> AsyncIterator[tuple[SessionServiceStub, CompactionServiceStub]]:
    async with grpc.aio.insecure_channel(routed.address) as channel:
        yield SessionServiceStub(channel), CompactionServiceStub(channel)


async def _session(sessions: SessionServiceStub, *events: ev.SessionEvent) -> str:
    sid = (await sessions.CreateSession(pb.CreateSessionRequest())).session.session_id
    if events:
        await sessions.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=events))
    return sid


async def _refused(
    sessions: SessionServiceStub, sid: str, *events: ev.SessionEvent
) -> ErrorDetails:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await sessions.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=events))
    return details(caught.value)


async def test_usage_near_2_63_is_refused_at_append_and_pressure_keeps_working(
    stubs: tuple[SessionServiceStub, CompactionServiceStub],
) -> None:
    sessions, compaction = stubs
    sid = await _session(sessions, system("s"), header("local", "w128k"), turn_start(1))
    huge = assistant("ok")
    huge.assistant_message.usage.input_tokens = 2**63 - 10
    got = await _refused(sessions, sid, *in_step(1, 1, huge))
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.fields == ["events[1].assistant_message.usage.input_tokens"]
    report = (await compaction.CheckPressure(cpb.CheckPressureRequest(session_id=sid))).report
    assert report.state == cpb.PRESSURE_STATE_BELOW
    watch = compaction.WatchPressure(cpb.WatchPressureRequest(session_id=sid))
    assert (await watch.read()).report.revision == report.revision
    watch.cancel()


async def test_an_output_reservation_near_2_63_is_refused(
    stubs: tuple[SessionServiceStub, CompactionServiceStub],
) -> None:
    sessions, _ = stubs
    sid = await _session(sessions)
    routed_header = header("local", "w128k")
    routed_header.request_header.config.max_output_tokens = 2**63 - 1
    got = await _refused(sessions, sid, routed_header)
    assert got.fields == ["events[0].request_header.config.max_output_tokens"]


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (
            header("local", "w128k", tools=[tool("deep", '{"a":' * 5000 + "1" + "}" * 5000)]),
            "events[0].request_header.tools[0].input_schema_json",
        ),
        (
            header("local", "w128k", tools=[tool("deeper", "[" * 200_000 + "]" * 200_000)]),
            "events[0].request_header.tools[0].input_schema_json",
        ),
    ],
    ids=["deep-object", "deeper-than-the-parser"],
)
async def test_deeply_nested_json_is_invalid_argument_naming_the_field(
    stubs: tuple[SessionServiceStub, CompactionServiceStub], event: ev.SessionEvent, field: str
) -> None:
    sessions, _ = stubs
    got = await _refused(sessions, await _session(sessions), event)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.fields == [field]


async def test_deeply_nested_tool_call_arguments_are_invalid_argument(
    stubs: tuple[SessionServiceStub, CompactionServiceStub],
) -> None:
    sessions, _ = stubs
    sid = await _session(sessions, turn_start(1))
    call = assistant(calls=[("c1", "run", "[" * 100_000)])
    got = await _refused(sessions, sid, *in_step(1, 1, call))
    assert got.fields == ["events[1].assistant_message.content[0].tool_call.arguments_json"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
async def test_non_finite_numbers_in_a_session_policy_are_policy_invalid(
    stubs: tuple[SessionServiceStub, CompactionServiceStub], value: float
) -> None:
    sessions, _ = stubs
    policy = struct_pb2.Struct()
    policy.update({"thresholdRatio": value, "modelPolicies": [{"headroomTokens": value}]})
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await sessions.CreateSession(pb.CreateSessionRequest(compaction_policy=policy))
    got = details(caught.value)
    assert (got.code, got.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "POLICY_INVALID")
    assert got.fields == [
        "compaction_policy.modelPolicies[0].headroomTokens",
        "compaction_policy.thresholdRatio",
    ]


async def test_a_nan_temperature_is_refused_before_a_summary_could_trip_on_it(
    stubs: tuple[SessionServiceStub, CompactionServiceStub],
) -> None:
    sessions, _ = stubs
    routed_header = header("local", "w128k")
    routed_header.request_header.config.temperature = float("nan")
    got = await _refused(sessions, await _session(sessions), routed_header)
    assert got.fields == ["events[0].request_header.config.temperature"]


async def test_an_overlong_compaction_focus_is_invalid_argument(
    stubs: tuple[SessionServiceStub, CompactionServiceStub],
) -> None:
    sessions, compaction = stubs
    sid = await _session(sessions, user("a"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in compaction.Compact(cpb.CompactRequest(session_id=sid, focus="f" * 5000)):
            pass
    assert details(caught.value).fields == ["focus"]


# ---- size limits --------------------------------------------------------------------------------


async def test_an_event_of_nine_mebibytes_is_event_too_large(
    stubs: tuple[SessionServiceStub, CompactionServiceStub],
) -> None:
    sessions, _ = stubs
    sid = await _session(sessions)
    got = await _refused(sessions, sid, user("x" * (9 * MIB)))
    assert (got.code, got.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "EVENT_TOO_LARGE")
    assert got.fields == ["events[0]", "events[0].user_message.content[0]"]


@pytest.fixture
async def small(server_config: config.ServerConfig) -> AsyncIterator[RunningServer]:
    settings = dataclasses.replace(
        server_config,
        max_message_bytes=3 * MIB,
        max_surface_bytes=2 * MIB,
        max_event_bytes=MIB,
        max_block_bytes=MIB // 2,
    )
    config.check_limits(settings)
    running = await create_server(settings)
    try:
        yield running
    finally:
        await running.stop(0)


async def test_a_full_surface_refuses_growth_and_stays_readable(small: RunningServer) -> None:
    async with grpc.aio.insecure_channel(small.address) as channel:
        sessions = SessionServiceStub(channel)
        sid = await _session(sessions, system("s"))
        chunk = "y" * (MIB // 2 - 64)
        accepted = 0
        for _ in range(8):
            try:
                await sessions.AppendEvents(
                    pb.AppendEventsRequest(session_id=sid, events=[user(chunk)])
                )
                accepted += 1
            except grpc.aio.AioRpcError as error:
                got = details(error)
                break
        assert accepted == 3
        assert (got.code, got.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "SURFACE_FULL")
        assert got.metadata["limit"] == str(2 * MIB)

        surface = await sessions.GetSurface(pb.GetSurfaceRequest(session_id=sid))
        assert len(surface.nodes) == 1 + accepted
        built = await sessions.BuildRequest(pb.BuildRequestRequest(session_id=sid))
        assert len(built.messages) == 1 + accepted
        listed = [r async for r in sessions.ListEvents(pb.ListEventsRequest(session_id=sid))]
        assert len(listed) == 1 + accepted
        await sessions.AppendEvents(  # a small event still fits
            pb.AppendEventsRequest(session_id=sid, events=[user("short")])
        )


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"max_block_bytes": 3 * MIB}, "max_block_bytes"),
        ({"max_event_bytes": 13 * MIB}, "max_event_bytes"),
        ({"max_surface_bytes": 16 * MIB}, "max_surface_bytes"),
        ({"max_json_depth": 0}, "max_json_depth"),
        ({"max_streams": 0}, "max_streams"),
    ],
)
def test_limits_that_could_not_hold_are_configuration_errors(
    changes: dict[str, int], key: str
) -> None:
    with pytest.raises(ConfigError, match=key.replace("_", "[-_]")):  # a flag: --max-streams
        config.load(None, environ={}, overrides=changes)


def test_a_server_config_built_by_hand_has_its_limits_checked_at_start(
    server_config: config.ServerConfig,
) -> None:
    with pytest.raises(ConfigError, match="max_surface_bytes"):
        components(dataclasses.replace(server_config, max_surface_bytes=16 * MIB))
