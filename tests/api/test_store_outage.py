"""A PostgreSQL store that stops answering, over a real server: every call answers within its
deadline, ``UNAVAILABLE`` with reason ``STORE_UNAVAILABLE``, decided by the server before the
deadline (not held past it, not past the pool and statement timeouts without one)."""

from __future__ import annotations

import dataclasses
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace

from compactd.api.server import create_server
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import session_service_pb2 as spb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests import postgres
from tests.api.rpc import details
from tests.blackhole import BlackHoleRelay
from tests.builders import user
from tests.compaction_fixtures import server_config


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    yield from postgres.database()


async def test_calls_answer_store_unavailable_within_their_deadlines_when_the_database_goes_silent(
    tmp_path: Path, loop: OpenAICompatServer, database: str
) -> None:
    target = urllib.parse.urlsplit(database)
    async with BlackHoleRelay(target.hostname or "127.0.0.1", target.port or 5432) as relay:
        url = relay.url(postgres.fresh_schema(database))
        # An append rate, shared through the database: its token is taken before the handler.
        quotas = {"appends_per_second": 100}
        settings = dataclasses.replace(server_config(tmp_path, loop), store=url, quotas=quotas)
        running = await create_server(settings, tracer_provider=trace.NoOpTracerProvider())
        try:
            async with grpc.aio.insecure_channel(running.address) as channel:
                sessions = SessionServiceStub(channel)
                await sessions.CreateSession(spb.CreateSessionRequest(session_id="s"))
                relay.swallow()

                for call, request in (
                    (sessions.GetSurface, spb.GetSurfaceRequest(session_id="s")),
                    (
                        sessions.AppendEvents,
                        spb.AppendEventsRequest(session_id="s", events=[user("x")]),
                    ),
                    (sessions.CreateSession, spb.CreateSessionRequest(session_id="t")),
                ):
                    started = time.monotonic()
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call(request, timeout=1.5)  # type: ignore[operator]
                    took = time.monotonic() - started
                    got = details(caught.value)
                    assert (got.code, got.reason) == (
                        grpc.StatusCode.UNAVAILABLE,
                        "STORE_UNAVAILABLE",
                    ), (call, got)
                    assert took < 1.5
        finally:
            await running.stop(0)
