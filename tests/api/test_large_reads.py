"""A large read over a real server lets the event loop run other calls while it is built.

Behaviour, not timing: a probe task on the server's loop looks, on every turn it gets, at the
session's lock, which GetSurface, BuildRequest and a step's full request hold for the whole of
their reply. A reply built in one slice of the loop takes and releases the lock within that
slice, so the probe never sees it held; a reply built in steps does. The replies are those the
message form gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from compactd.api.server import RunningServer
from compactd.service.requests import build_request, surface_response
from compactd.service.sessions import SessionHandle
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.builders import header, turn_start, user

NODES = 1280  # many chunks of a reply made in steps


async def _large(server: RunningServer, sessions: SessionServiceStub) -> SessionHandle:
    await sessions.CreateSession(pb.CreateSessionRequest(session_id="large"))
    events = [
        header("openai", "gpt-4o"),
        turn_start(1),
        *(user(f"message {i} " * 8) for i in range(NODES)),
    ]
    for start in range(0, len(events), 500):
        batch = events[start : start + 500]
        await sessions.AppendEvents(pb.AppendEventsRequest(session_id="large", events=batch))
    return await server.manager.get("large")


async def _turns_while_locked(handle: SessionHandle, read: Callable[[], Awaitable[object]]) -> int:
    """How many of a probe's loop turns, while ``read`` runs, saw the session's lock held."""
    seen = 0
    stop = False

    async def probe() -> None:
        nonlocal seen
        while not stop:
            seen += handle.lock.locked()
            await asyncio.sleep(0)

    task = asyncio.ensure_future(probe())
    try:
        await read()
    finally:
        stop = True
        await task
    return seen


async def test_get_surface_of_a_large_surface_lets_the_loop_run_while_it_is_built(
    server: RunningServer, sessions: SessionServiceStub
) -> None:
    handle = await _large(server, sessions)
    replies: list[pb.GetSurfaceResponse] = []

    async def read() -> None:
        replies.append(await sessions.GetSurface(pb.GetSurfaceRequest(session_id="large")))

    assert await _turns_while_locked(handle, read) > 0
    assert replies[0] == surface_response(handle)
    assert len(replies[0].nodes) == NODES


async def test_build_request_of_a_large_surface_lets_the_loop_run_while_it_is_built(
    server: RunningServer, sessions: SessionServiceStub
) -> None:
    handle = await _large(server, sessions)
    replies: list[pb.BuildRequestResponse] = []

    async def read() -> None:
        replies.append(await sessions.BuildRequest(pb.BuildRequestRequest(session_id="large")))

    assert await _turns_while_locked(handle, read) > 0
    assert replies[0] == build_request(handle)
    assert len(replies[0].messages) == NODES


async def test_get_surface_with_detail_of_a_large_surface_lets_the_loop_run_while_it_is_built(
    server: RunningServer, sessions: SessionServiceStub
) -> None:
    handle = await _large(server, sessions)
    replies: list[pb.GetSurfaceResponse] = []

    async def read() -> None:
        request = pb.GetSurfaceRequest(session_id="large", detail=True)
        replies.append(await sessions.GetSurface(request))

    assert await _turns_while_locked(handle, read) > 0
    (reply,) = replies
    assert [n.seq for n in reply.nodes] == [n.seq for n in handle.fold.surface]
    assert all(n.detail.route_tokens > 0 for n in reply.nodes)
    assert (reply.detail.route.provider, reply.detail.route.model) == ("openai", "gpt-4o")


async def test_a_step_s_full_request_of_a_large_surface_lets_the_loop_run_while_it_is_built(
    server: RunningServer, sessions: SessionServiceStub, compaction: CompactionServiceStub
) -> None:
    handle = await _large(server, sessions)
    request = cpb.PrepareStepUnaryRequest(session_id="large", turn=1)  # no held revision
    await compaction.PrepareStepUnary(request)  # the meter's ledger is built: nothing else waits
    replies: list[cpb.PrepareStepUnaryResponse] = []

    async def read() -> None:
        replies.append(await compaction.PrepareStepUnary(request))

    assert await _turns_while_locked(handle, read) > 0
    (reply,) = replies
    assert reply.result.request == build_request(handle)
    assert len(reply.result.request.messages) == NODES
