"""A graceful stop ends the streams that would otherwise last the whole grace period."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import grpc

from compactd import config
from compactd.api.server import create_server
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import details
from tests.builders import header, user

LOCAL = {"provider": "local", "model": "w128k", "context_window": 128000}


async def _ended(call: grpc.aio.UnaryStreamCall[object, object]) -> grpc.aio.AioRpcError:
    """Read ``call`` to its end, which must be an error."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the stream ended without a status")


async def test_a_stop_ends_following_streams_at_once_telling_clients_to_reconnect(
    tmp_path: Path,
) -> None:
    settings = config.load(
        None,
        environ={},
        overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{tmp_path / 's.db'}"},
    )
    running = await create_server(replace(settings, routes=(LOCAL,), shutdown_grace_s=30.0))
    async with grpc.aio.insecure_channel(running.address) as channel:
        sessions = SessionServiceStub(channel)
        sid = (await sessions.CreateSession(pb.CreateSessionRequest())).session.session_id
        await sessions.AppendEvents(
            pb.AppendEventsRequest(session_id=sid, events=[header("local", "w128k"), user("hi")])
        )
        follow = sessions.ListEvents(pb.ListEventsRequest(session_id=sid, follow=True))
        watch = CompactionServiceStub(channel).WatchPressure(
            cpb.WatchPressureRequest(session_id=sid)
        )
        await follow.read()
        await watch.read()
        started = time.monotonic()
        stopping = asyncio.ensure_future(running.stop())  # the configured 30 s grace
        ends = await asyncio.wait_for(asyncio.gather(_ended(follow), _ended(watch)), timeout=10)
        await asyncio.wait_for(stopping, timeout=10)
    assert time.monotonic() - started < 10
    for error in ends:
        status = details(error)
        assert status.code == grpc.StatusCode.UNAVAILABLE
        assert status.reason == "SERVER_SHUTTING_DOWN"
        assert "shutting down" in status.message
