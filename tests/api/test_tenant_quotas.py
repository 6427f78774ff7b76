"""Tenant quotas over a real server: each quota refuses its tenant with RESOURCE_EXHAUSTED,
``QUOTA_EXCEEDED``, a ``QuotaFailure`` (and ``RetryInfo`` for the rate), and never another tenant.

Tenants are bound by the ``MetadataTenants`` fake of the authentication seam.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from compactd_client.errors import QuotaExceededError, from_rpc_error
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from compactd import config
from compactd.api.auth import hash_token
from compactd.api.server import RunningServer, create_server
from compactd.testing.tenants import MetadataTenants, as_tenant
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import ErrorDetails, details
from tests.builders import user
from tests.test_metrics import labelled, scrape

Start = Callable[..., Any]


class Clock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def start(
    server_config: config.ServerConfig, clock: Clock
) -> AsyncIterator[Callable[[dict[str, Any]], Any]]:
    """Starts a server with the given ``[quotas]`` table (stopped after the test)."""
    running: list[RunningServer] = []

    async def started(quotas: dict[str, Any]) -> RunningServer:
        server = await create_server(
            dataclasses.replace(server_config, quotas=quotas),
            clock=clock,
            tenant_binding=[MetadataTenants()],
        )
        running.append(server)
        return server

    yield started
    for server in running:
        await server.stop(0)


@pytest.fixture
async def stubs_of(
    start: Callable[[dict[str, Any]], Any],
) -> AsyncIterator[Callable[[dict[str, Any]], Any]]:
    channels: list[grpc.aio.Channel] = []

    async def stubs(quotas: dict[str, Any]) -> tuple[SessionServiceStub, CompactionServiceStub]:
        server = await start(quotas)
        channel = grpc.aio.insecure_channel(server.address)
        channels.append(channel)
        return SessionServiceStub(channel), CompactionServiceStub(channel)

    yield stubs
    for channel in channels:
        await channel.close()


async def _create(sessions: SessionServiceStub, tenant: str, sid: str = "") -> str:
    request = pb.CreateSessionRequest(session_id=sid)
    response = await sessions.CreateSession(request, metadata=as_tenant(tenant))
    return response.session.session_id


async def _append(sessions: SessionServiceStub, tenant: str, sid: str, text: str = "hi") -> None:
    request = pb.AppendEventsRequest(session_id=sid, events=[user(text)])
    await sessions.AppendEvents(request, metadata=as_tenant(tenant))


async def _refusal(call: Any) -> ErrorDetails:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    got = details(caught.value)
    assert got.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert got.reason == "QUOTA_EXCEEDED"
    return got


async def test_appends_over_the_rate_are_refused_with_when_to_retry(
    stubs_of: Callable[[dict[str, Any]], Any], clock: Clock
) -> None:
    sessions, _ = await stubs_of({"appends_per_second": 10, "append_burst": 2})
    noisy, quiet = await _create(sessions, "noisy"), await _create(sessions, "quiet")
    await _append(sessions, "noisy", noisy)
    await _append(sessions, "noisy", noisy)
    got = await _refusal(_append(sessions, "noisy", noisy))
    assert got.quotas == ["appends_per_second"]
    assert got.subjects == ["tenant:noisy"]
    assert got.retry_delay == pytest.approx(0.1, abs=0.002)
    assert got.metadata == {"tenant": "noisy", "quota": "appends_per_second", "limit": "10"}
    await _append(sessions, "quiet", quiet)  # another tenant has its own bucket
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _append(sessions, "noisy", noisy)
    typed = from_rpc_error(caught.value)  # what the Python client raises
    assert isinstance(typed, QuotaExceededError)
    assert typed.retry_delay == pytest.approx(0.1, abs=0.002)
    assert [(v.subject, v.quota) for v in typed.quota_violations] == [
        ("tenant:noisy", "appends_per_second")
    ]
    clock.now += got.retry_delay
    await _append(sessions, "noisy", noisy)  # waiting as told is enough


async def test_a_refused_append_writes_nothing(
    stubs_of: Callable[[dict[str, Any]], Any],
) -> None:
    sessions, _ = await stubs_of({"appends_per_second": 1})
    sid = await _create(sessions, "a")
    await _append(sessions, "a", sid)
    await _refusal(_append(sessions, "a", sid, "refused"))
    events = [
        r.event
        async for r in sessions.ListEvents(
            pb.ListEventsRequest(session_id=sid), metadata=as_tenant("a")
        )
    ]
    assert [e.user_message.content[0].text.text for e in events] == ["hi"]


async def test_a_tenant_over_its_streams_is_refused_until_one_closes(
    stubs_of: Callable[[dict[str, Any]], Any],
) -> None:
    sessions, _ = await stubs_of({"max_streams": 2})
    sid, other = await _create(sessions, "a"), await _create(sessions, "b")
    await _append(sessions, "a", sid)
    await _append(sessions, "b", other)

    def watch(tenant: str, session_id: str) -> Any:
        request = pb.ListEventsRequest(session_id=session_id, follow=True)
        return sessions.ListEvents(request, metadata=as_tenant(tenant))

    open_ = [watch("a", sid), watch("a", sid)]
    for stream in open_:
        await stream.read()
    refused = watch("a", sid)
    got = await _refusal(refused.read())
    assert got.quotas == ["max_streams"]
    assert got.retry_delay is None
    assert (await watch("b", other).read()).event.seq == 0
    open_[0].cancel()
    codes = []
    for _ in range(100):  # the server sees the cancellation soon after
        stream = watch("a", sid)
        try:
            await stream.read()
            break
        except grpc.aio.AioRpcError as error:
            codes.append(error.code())
    else:
        pytest.fail("a closed stream never freed its place")
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED}


async def test_a_step_stream_holds_a_tenant_stream_only_while_it_runs(
    stubs_of: Callable[[dict[str, Any]], Any],
) -> None:
    sessions, compaction = await stubs_of({"max_streams": 1})
    sid = await _create(sessions, "a")
    await _append(sessions, "a", sid)

    async def step() -> ErrorDetails:
        call = compaction.PrepareStep(
            cpb.PrepareStepRequest(session_id=sid, turn=1), metadata=as_tenant("a")
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        return details(caught.value)

    for _ in range(3):  # each step ends (here refused by its handler) and frees its place
        assert (await step()).reason == "NO_OPEN_TURN"
    follow = sessions.ListEvents(
        pb.ListEventsRequest(session_id=sid, follow=True), metadata=as_tenant("a")
    )
    await follow.read()
    assert (await step()).reason == "QUOTA_EXCEEDED"
    follow.cancel()


async def test_a_tenant_at_its_sessions_is_refused_but_a_retried_create_is_not(
    stubs_of: Callable[[dict[str, Any]], Any],
) -> None:
    sessions, _ = await stubs_of({"max_sessions": 1, "tenants": {"big": {"max_sessions": 3}}})
    await _create(sessions, "a", "a-1")
    assert await _create(sessions, "a", "a-1") == "a-1"  # a retry creates nothing
    got = await _refusal(_create(sessions, "a", "a-2"))
    assert got.quotas == ["max_sessions"]
    assert got.subjects == ["tenant:a"]
    for index in range(3):
        await _create(sessions, "big", f"big-{index}")
    await _refusal(_create(sessions, "big", "big-3"))


async def test_a_tenant_over_its_bytes_is_refused_and_a_restart_remembers_them(
    start: Callable[[dict[str, Any]], Any],
) -> None:
    quotas = {"max_bytes": 600}
    server = await start(quotas)
    async with grpc.aio.insecure_channel(server.address) as channel:
        sessions = SessionServiceStub(channel)
        sid = await _create(sessions, "a")
        await _append(sessions, "a", sid, "x" * 200)
        await _append(sessions, "a", sid, "x" * 200)
        got = await _refusal(_append(sessions, "a", sid, "y" * 400))
        assert got.quotas == ["max_bytes"]
        other = await _create(sessions, "b")
        await _append(sessions, "b", other, "y" * 400)  # b's bytes are b's
    await server.stop(0)
    again = await start(quotas)  # the store's figures, per tenant
    async with grpc.aio.insecure_channel(again.address) as channel:
        sessions = SessionServiceStub(channel)
        await _refusal(_append(sessions, "a", sid, "y" * 400))
        await _append(sessions, "a", sid, "small")
        await _refusal(_append(sessions, "b", other, "y" * 400))


async def test_deleting_a_session_gives_back_its_place_and_its_bytes(
    stubs_of: Callable[[dict[str, Any]], Any],
) -> None:
    sessions, _ = await stubs_of({"max_sessions": 1, "max_bytes": 500})
    sid = await _create(sessions, "a", "a-1")
    await _append(sessions, "a", sid, "x" * 400)
    await _refusal(_create(sessions, "a", "a-2"))
    await _refusal(_append(sessions, "a", sid, "x" * 200))
    await sessions.DeleteSession(pb.DeleteSessionRequest(session_id=sid), metadata=as_tenant("a"))
    fresh = await _create(sessions, "a", "a-2")
    await _append(sessions, "a", fresh, "x" * 400)


async def test_without_quotas_nothing_is_refused(
    stubs_of: Callable[[dict[str, Any]], Any],
) -> None:
    sessions, _ = await stubs_of({})
    sid = await _create(sessions, "a")
    for index in range(50):
        await _append(sessions, "a", sid, f"m{index}")


async def test_a_refused_call_is_traced_with_its_status_and_no_exception_event(
    server_config: config.ServerConfig,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    server = await create_server(
        dataclasses.replace(server_config, quotas={"appends_per_second": 1}),
        tracer_provider=provider,
        tenant_binding=[MetadataTenants()],
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            sessions = SessionServiceStub(channel)
            sid = await _create(sessions, "a")
            await _append(sessions, "a", sid)
            await _refusal(_append(sessions, "a", sid))
            for _ in range(100):  # the span ends just after the reply is sent
                spans = [s for s in exporter.get_finished_spans() if s.name.endswith("Events")]
                if len(spans) == 2:
                    break
                await asyncio.sleep(0.01)
    finally:
        await server.stop(0)
    (refused,) = [s for s in spans if s.attributes and s.attributes["rpc.grpc.status_code"]]
    # OpenTelemetry's rule for server spans: a refusal is the client's error, not the span's.
    assert refused.status.status_code == StatusCode.UNSET
    assert refused.attributes is not None
    code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert refused.attributes["rpc.grpc.status_code"] == code
    assert [event.name for event in refused.events] == []


async def test_refusals_are_counted_by_tenant_and_quota_and_the_start_names_the_quotas(
    server_config: config.ServerConfig, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    quotas = {"appends_per_second": 1, "tenants": {"big": {"appends_per_second": 100}}}
    server = await create_server(
        dataclasses.replace(server_config, quotas=quotas, metrics_listen="127.0.0.1:0"),
        clock=clock,
        tenant_binding=[MetadataTenants()],
    )
    try:
        assert server.prometheus is not None
        async with grpc.aio.insecure_channel(server.address) as channel:
            sessions = SessionServiceStub(channel)
            sid = await _create(sessions, "a")
            await _append(sessions, "a", sid)
            await _refusal(_append(sessions, "a", sid))
            await _refusal(_append(sessions, "a", sid))
        samples = scrape(server.prometheus.url)["compactd_quota_refusals"]
    finally:
        await server.stop(0)
    counted = labelled(samples, "_total", tenant="a", quota="appends_per_second")
    assert [sample.value for sample in counted] == [2]
    (line,) = [r for r in caplog.records if r.getMessage() == "quotas"]
    assert line.__dict__["quotas"] == {"appends_per_second": 1}
    assert line.__dict__["tenants"] == ["big"]


async def test_the_tenant_a_bearer_token_authenticates_is_the_one_held_to_the_quota(
    server_config: config.ServerConfig, clock: Clock
) -> None:
    tokens = {"a": hash_token("token-of-a-0123456789"), "b": hash_token("token-of-b-0123456789")}
    server = await create_server(
        dataclasses.replace(server_config, auth_tokens=tokens, quotas={"max_sessions": 1}),
        clock=clock,
    )
    as_a = (("authorization", "Bearer token-of-a-0123456789"),)
    as_b = (("authorization", "Bearer token-of-b-0123456789"),)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            sessions = SessionServiceStub(channel)
            await sessions.CreateSession(pb.CreateSessionRequest(session_id="s"), metadata=as_a)
            got = await _refusal(
                sessions.CreateSession(pb.CreateSessionRequest(session_id="t"), metadata=as_a)
            )
            assert got.subjects == ["tenant:a"]
            await sessions.CreateSession(pb.CreateSessionRequest(session_id="s"), metadata=as_b)
    finally:
        await server.stop(0)
