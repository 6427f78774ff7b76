"""Retention: idle sessions of a tenant with a period are deleted; active ones and others stay."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import grpc
import pytest

from compactd import config
from compactd.api.server import RunningServer, create_server
from compactd.errors import ConfigError
from compactd.service.retention import periods_from
from compactd.tenancy import Tenant
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.builders import user


class FakeClock:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = datetime(2026, 6, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def kept_an_hour(
    server_config: config.ServerConfig, clock: FakeClock
) -> AsyncIterator[RunningServer]:
    settings = replace(server_config, session_retention_s={"default": 3600})
    running = await create_server(settings, wall_clock=clock)
    try:
        yield running
    finally:
        await running.stop(0)


async def _surface(sessions: SessionServiceStub, sid: str) -> grpc.StatusCode:
    try:
        await sessions.GetSurface(pb.GetSurfaceRequest(session_id=sid))
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_a_session_idle_past_the_period_is_swept_and_an_active_one_stays(
    kept_an_hour: RunningServer, clock: FakeClock
) -> None:
    assert kept_an_hour.retention is not None
    async with grpc.aio.insecure_channel(kept_an_hour.address) as channel:
        sessions = SessionServiceStub(channel)
        for sid in ("idle", "active"):
            await sessions.CreateSession(pb.CreateSessionRequest(session_id=sid))
        clock.now += timedelta(minutes=50)
        await sessions.AppendEvents(pb.AppendEventsRequest(session_id="active", events=[user()]))
        clock.now += timedelta(minutes=20)  # idle: 70 minutes; active: 20

        assert await kept_an_hour.retention.sweep() == 1

        assert await _surface(sessions, "idle") == grpc.StatusCode.NOT_FOUND
        assert await _surface(sessions, "active") == grpc.StatusCode.OK
        clock.now += timedelta(minutes=39)  # active: idle 59 minutes
        assert await kept_an_hour.retention.sweep() == 0
        clock.now += timedelta(minutes=2)
        assert await kept_an_hour.retention.sweep() == 1
        listed = await sessions.ListSessions(pb.ListSessionsRequest())
        assert listed.sessions == []


async def test_a_tenant_without_a_period_keeps_its_sessions(
    kept_an_hour: RunningServer, clock: FakeClock
) -> None:
    assert kept_an_hour.retention is not None
    await kept_an_hour.manager.create("forever", None, tenant=Tenant("other"))
    clock.now += timedelta(days=365)

    assert await kept_an_hour.retention.sweep() == 0
    assert [r.session_id for r in await kept_an_hour.manager.list(tenant=Tenant("other"))] == [
        "forever"
    ]


def test_the_retention_table_needs_positive_seconds() -> None:
    assert periods_from({"a": 60}) == {Tenant("a"): timedelta(seconds=60)}
    for bad in (0, -1, "1d", True):
        with pytest.raises(ConfigError, match=r"session_retention_s\.a"):
            periods_from({"a": bad})
