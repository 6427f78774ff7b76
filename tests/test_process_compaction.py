"""Compaction across a crash: `compactd serve` killed with SIGKILL while a summary is in flight.

The dead process leaves an open ``compaction/start`` in the log. A restarted server appends
``session/end-seed`` when it restores the session, which turns that start into stale evidence of
the previous lifecycle, and compaction works again.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import grpc

from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import compaction_service_pb2_grpc
from tests.compaction_fixtures import POLICY, Harness, body, loopback, opening, route_table, units
from tests.processes import serving


def write_config(path: Path, loop: OpenAICompatServer) -> Path:
    """A TOML file routing ``loop/m`` to the loopback provider with the test policy."""
    route = "\n".join(f"{key} = {json.dumps(value)}" for key, value in route_table(loop).items())
    policy = "\n".join(f"{key} = {json.dumps(value)}" for key, value in POLICY.items())
    path.write_text(
        f'[summarizer]\nkind = "openai"\n\n[compaction]\n{policy}\n\n[[routes]]\n{route}\n',
        encoding="utf-8",
    )
    return path


async def _kill_during_summary(
    address: str, proc: subprocess.Popen[str], loop: OpenAICompatServer
) -> str:
    """Start a Compact, SIGKILL the server once the summary request arrived; the bracket id."""
    async with grpc.aio.insecure_channel(address) as channel:
        harness = Harness(channel, loop)
        await harness.create(*opening(), *units(6))
        stub: Any = compaction_service_pb2_grpc.CompactionServiceStub(channel)
        call = stub.Compact(cpb.CompactRequest(session_id=harness.session_id))
        first = await call.read()
        assert first.progress.step == cpb.COMPACTION_STEP_START
        assert await asyncio.to_thread(loop.wait_for_requests, 1)
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 30)
        call.cancel()
        compaction_id: str = first.progress.compaction_id
        return compaction_id


async def test_sigkill_during_the_summary_then_restart_makes_the_orphan_stale(
    tmp_path: Path,
) -> None:
    db = tmp_path / "crash.db"
    with loopback() as loop:
        config = write_config(tmp_path / "compactd.toml", loop)
        loop.enqueue(Reply(delay_before=120))  # the summary the process dies waiting for
        with serving(db, "--config", str(config)) as (proc, address, _):
            orphan = await _kill_during_summary(address, proc, loop)

        with serving(db, "--config", str(config)) as (_, address, _):
            async with grpc.aio.insecure_channel(address) as channel:
                harness = Harness(channel, loop)
                restored = await harness.events()
                run = await harness.compact()
                log = await harness.events()

    start, seed = restored[-2:]
    assert body(start) == "compaction_start"
    assert start.compaction_start.compaction_id == orphan
    assert body(seed) == "session_end_seed"
    assert not any(body(e) == "compaction_end" for e in restored)

    committed = run.result.outcome.compaction_id
    assert committed
    assert committed != orphan
    assert [body(e) for e in log[len(restored) :]] == [
        "compaction_start",
        "compaction_summary",
        "user_message",
        "compaction_end",
    ]
    assert log[-1].compaction_end.compaction_id == committed
    assert log[-1].compaction_end.error == ""
    assert len(loop.requests) == 2
