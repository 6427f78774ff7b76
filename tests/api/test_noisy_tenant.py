"""A noisy tenant does not get in the others' way: while one tenant floods appends past its rate,
it is throttled (RESOURCE_EXHAUSTED with ``RetryInfo``) and another tenant, checking pressure and
appending at the same time, is never refused.

How fast the quiet tenant is served is measured by ``bench/bench_tenants.py`` (p99 idle against
flooded, interleaved in one run), never asserted here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest

from compactd import config
from compactd.api.server import RunningServer, create_server
from compactd.testing.tenants import MetadataTenants, as_tenant
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import ErrorDetails, details
from tests.builders import header, system, user

ROUTE = {"provider": "local", "model": "w128k", "context_window": 128_000}
QUOTAS = {
    "appends_per_second": 20,
    "append_burst": 5,
    "tenants": {"quiet": {"appends_per_second": 0}},  # the quiet tenant has no rate limit
}


@pytest.fixture
async def server(server_config: config.ServerConfig) -> AsyncIterator[RunningServer]:
    running = await create_server(
        dataclasses.replace(server_config, routes=(ROUTE,), quotas=QUOTAS),
        tenant_binding=[MetadataTenants()],
    )
    try:
        yield running
    finally:
        await running.stop(0)


async def _session(sessions: SessionServiceStub, tenant: str) -> str:
    metadata = as_tenant(tenant)
    sid = (await sessions.CreateSession(pb.CreateSessionRequest(), metadata=metadata)).session
    events = [system("s"), header("local", "w128k")]
    request = pb.AppendEventsRequest(session_id=sid.session_id, events=events)
    await sessions.AppendEvents(request, metadata=metadata)
    return sid.session_id


async def _flood(sessions: SessionServiceStub, sid: str, calls: int) -> list[ErrorDetails]:
    refusals = []
    for index in range(calls):
        request = pb.AppendEventsRequest(session_id=sid, events=[user(f"flood {index}")])
        try:
            await sessions.AppendEvents(request, metadata=as_tenant("noisy"))
        except grpc.aio.AioRpcError as error:
            refusals.append(details(error))
    return refusals


async def _quiet(
    sessions: SessionServiceStub, compaction: CompactionServiceStub, sid: str, done: asyncio.Event
) -> int:
    """Checks pressure (and appends now and then) until the flood is over; the calls made."""
    metadata, calls = as_tenant("quiet"), 0
    while not done.is_set() or calls < 20:
        await compaction.CheckPressure(cpb.CheckPressureRequest(session_id=sid), metadata=metadata)
        if calls % 5 == 0:
            request = pb.AppendEventsRequest(session_id=sid, events=[user(f"quiet {calls}")])
            await sessions.AppendEvents(request, metadata=metadata)
        calls += 1
    return calls


async def test_a_flooding_tenant_is_throttled_and_the_quiet_one_is_never_refused(
    server: RunningServer,
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        sessions, compaction = SessionServiceStub(channel), CompactionServiceStub(channel)
        noisy, quiet = await _session(sessions, "noisy"), await _session(sessions, "quiet")
        done = asyncio.Event()
        quiet_task = asyncio.ensure_future(_quiet(sessions, compaction, quiet, done))
        floods = [asyncio.ensure_future(_flood(sessions, noisy, 60)) for _ in range(6)]
        refusals = [r for flood in await asyncio.gather(*floods) for r in flood]
        done.set()
        quiet_calls = await quiet_task  # raises if the quiet tenant was refused anything
    assert quiet_calls >= 20
    assert refusals, "360 appends at once never passed a rate of 20/s with a burst of 5"
    assert {r.code for r in refusals} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert {r.reason for r in refusals} == {"QUOTA_EXCEEDED"}
    assert all(r.retry_delay is not None and r.retry_delay > 0 for r in refusals)
    assert {s for r in refusals for s in r.subjects} == {"tenant:noisy"}
