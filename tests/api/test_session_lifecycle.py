"""ListSessions and DeleteSession over a real server with the interceptors on."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import replace
from typing import Any

import grpc
import pytest

from compactd import config
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.builders import header, user

LOCAL = {"provider": "local", "model": "w128k", "context_window": 128000}


@pytest.fixture
def server_config(server_config: config.ServerConfig) -> config.ServerConfig:
    """The shared test configuration with one declared route (for WatchPressure)."""
    return replace(server_config, routes=(LOCAL,))


def _token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


async def _create(sessions: SessionServiceStub, *ids: str) -> None:
    for session_id in ids:
        await sessions.CreateSession(pb.CreateSessionRequest(session_id=session_id))


async def test_list_sessions_pages_through_every_session_in_id_order(
    sessions: SessionServiceStub,
) -> None:
    await _create(sessions, "c", "a", "e", "b", "d")
    await sessions.AppendEvents(pb.AppendEventsRequest(session_id="b", events=[user("hi")]))

    seen: list[pb.Session] = []
    token = ""
    pages = 0
    while True:
        page = await sessions.ListSessions(pb.ListSessionsRequest(page_size=2, page_token=token))
        seen.extend(page.sessions)
        pages += 1
        token = page.next_page_token
        if not token:
            break

    assert [s.session_id for s in seen] == ["a", "b", "c", "d", "e"]
    assert pages == 3
    assert {s.session_id: s.revision for s in seen}["b"] == 1
    assert all(s.create_time.seconds > 0 for s in seen)


async def test_list_sessions_refuses_a_forged_page_token_and_a_negative_size(
    sessions: SessionServiceStub,
) -> None:
    for request in (
        pb.ListSessionsRequest(page_token="not-a-token"),
        pb.ListSessionsRequest(page_token=_token("after:' OR 1=1 --")),  # no session id
        pb.ListSessionsRequest(page_token=_token("after:")),
        pb.ListSessionsRequest(page_size=-1),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await sessions.ListSessions(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_deleted_session_is_not_found_and_its_id_starts_fresh(
    sessions: SessionServiceStub,
) -> None:
    await _create(sessions, "s")
    await sessions.AppendEvents(pb.AppendEventsRequest(session_id="s", events=[user("secret")]))

    await sessions.DeleteSession(pb.DeleteSessionRequest(session_id="s"))

    for call in (
        sessions.GetSurface(pb.GetSurfaceRequest(session_id="s")),
        sessions.DeleteSession(pb.DeleteSessionRequest(session_id="s")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert (await sessions.ListSessions(pb.ListSessionsRequest())).sessions == []
    created = await sessions.CreateSession(pb.CreateSessionRequest(session_id="s"))
    assert created.session.revision == 0
    surface = await sessions.GetSurface(pb.GetSurfaceRequest(session_id="s"))
    assert surface.nodes == []


async def _drain(stream: Any) -> None:
    while await stream.read() is not grpc.aio.EOF:
        pass


async def test_delete_session_ends_followers_with_not_found(
    sessions: SessionServiceStub, compaction: CompactionServiceStub
) -> None:
    await _create(sessions, "s")
    routed = pb.AppendEventsRequest(session_id="s", events=[header("local", "w128k")])
    await sessions.AppendEvents(routed)
    follow = sessions.ListEvents(pb.ListEventsRequest(session_id="s", follow=True))
    watch = compaction.WatchPressure(cpb.WatchPressureRequest(session_id="s"))
    await watch.read()  # the first report: the watcher is live
    await sessions.AppendEvents(pb.AppendEventsRequest(session_id="s", events=[user("x")]))
    await follow.read()

    await sessions.DeleteSession(pb.DeleteSessionRequest(session_id="s"))

    for stream in (follow, watch):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(_drain(stream), 10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_delete_session_without_an_id_is_invalid(sessions: SessionServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await sessions.DeleteSession(pb.DeleteSessionRequest())
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
