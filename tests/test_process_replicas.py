"""Three `compactd serve` replicas on one PostgreSQL database, driven at once, then broken.

Part one drives the same sessions through all three replicas at the same time: appenders on
every replica, followers (``ListEvents(follow)``) and pressure watchers on every replica,
``Compact`` and ``PrepareStep`` from several clients. The logs must come out the same through
every replica, gapless, each batch exactly once and in its appender's order; every follower sees
every event once, in order; no two brackets are ever live at once, and every bracket is closed.

Part two breaks replicas with a short lease (1 s): one is SIGKILLed while its summary is in
flight, another is SIGSTOPped past its lease. The survivors take the sessions over (the orphan
becomes stale evidence behind a ``session/end-seed``), and the paused one, continued, is fenced:
its late summary never lands and its caller hears ``LEASE_LOST``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from compactd.testing.openai_server import OpenAICompatServer, Reply
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from tests import postgres
from tests.api.rpc import details
from tests.compaction_fixtures import (
    POLICY,
    Harness,
    body,
    loopback,
    opening,
    route_table,
    summary_requests,
    units,
)
from tests.processes import Output, serving_store

LEASE_S = 1.0
APPENDERS_PER_REPLICA = 2
BATCHES_PER_APPENDER = 4

Served = tuple[subprocess.Popen[str], str, Output]


def write_config(path: Path, loop: OpenAICompatServer) -> Path:
    """The loopback route, the test policy and a short bracket lease."""
    route = "\n".join(f"{key} = {json.dumps(value)}" for key, value in route_table(loop).items())
    policy = "\n".join(f"{key} = {json.dumps(value)}" for key, value in POLICY.items())
    path.write_text(
        f"bracket_lease_s = {LEASE_S}\n\n"
        f'[summarizer]\nkind = "openai"\n\n[compaction]\n{policy}\n\n[[routes]]\n{route}\n',
        encoding="utf-8",
    )
    return path


@contextlib.contextmanager
def three_replicas(url: str, config: Path) -> Iterator[list[Served]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serving_store(url, "--config", str(config))) for _ in range(3)]


@pytest.fixture
def database() -> Iterator[str]:
    yield from postgres.database()


def harness(channel: grpc.aio.Channel, loop: OpenAICompatServer, session_id: str) -> Harness:
    return Harness(channel, loop, session_id=session_id)


def _batch(session_id: str, appender: int, i: int) -> list[events_pb2.SessionEvent]:
    """One closed turn, its first event carrying an id that names its appender and index."""
    events = units(1, start=100 * (appender + 1) + i)
    events[0].event_id = f"{session_id}/{appender}/{i}"
    return events


async def _appender(h: Harness, appender: int) -> list[int]:
    """Append this appender's batches in order; the first seq of each."""
    firsts = []
    for i in range(BATCHES_PER_APPENDER):
        firsts.append((await h.append(*_batch(h.session_id, appender, i)))[0])
    return firsts


async def _follow(h: Harness, seen: list[int]) -> None:
    request = spb.ListEventsRequest(session_id=h.session_id, follow=True)
    async for response in h.sessions.ListEvents(request):
        seen.append(response.event.seq)


async def _watch(h: Harness, revisions: list[int]) -> None:
    request = cpb.WatchPressureRequest(session_id=h.session_id)
    async for response in h.compaction.WatchPressure(request):
        revisions.append(response.report.revision)


def busy(error: grpc.aio.AioRpcError) -> str:
    """``"busy"`` for a COMPACTION_BUSY refusal; any other error fails the test."""
    if details(error).reason != "COMPACTION_BUSY":
        raise error
    return "busy"


async def _compact_or_busy(h: Harness) -> str:
    try:
        await h.compact()
    except grpc.aio.AioRpcError as error:
        return busy(error)
    return "compacted"


def check_brackets(log: Sequence[events_pb2.SessionEvent]) -> None:
    """Never two live brackets in one lifecycle; every bracket of it closed."""
    live: str | None = None
    for event in log:
        kind = body(event)
        if kind == "session_end_seed":
            live = None
        elif kind == "compaction_start":
            assert live is None, f"two live brackets at seq {event.seq}"
            live = event.compaction_start.compaction_id
        elif kind == "compaction_end" and event.compaction_end.compaction_id == live:
            live = None
    assert live is None, "a bracket was left open"


async def drive_all_at_once(addresses: list[str], loop: OpenAICompatServer) -> None:
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        sessions = ["a", "b"]
        for name in sessions:
            await harness(channels[0], loop, name).create(*opening(), *units(6))
        followers: dict[tuple[str, int], list[int]] = {}
        watchers: dict[tuple[str, int], list[int]] = {}
        streams = []
        for name in sessions:
            for r, channel in enumerate(channels):
                followers[name, r], watchers[name, r] = [], []
                h = harness(channel, loop, name)
                streams.append(asyncio.create_task(_follow(h, followers[name, r])))
                streams.append(asyncio.create_task(_watch(h, watchers[name, r])))
        appenders = {
            (name, r * APPENDERS_PER_REPLICA + k): harness(channel, loop, name)
            for name in sessions
            for r, channel in enumerate(channels)
            for k in range(APPENDERS_PER_REPLICA)
        }
        work = [_appender(h, appender) for (_, appender), h in appenders.items()]
        compacts = [_compact_or_busy(harness(c, loop, name)) for name in sessions for c in channels]
        # PrepareStep on its own session (a turn open), from every replica at once.
        p = harness(channels[1], loop, "p")
        await p.create(*opening(), *units(18), events_pb2.SessionEvent(turn_start={"turn": 1}))
        prepares = [_prepare_or_busy(harness(c, loop, "p")) for c in channels]
        results = await asyncio.gather(*work, *compacts, *prepares)

        firsts = dict(zip(appenders, results[: len(work)], strict=True))
        outcomes = results[len(work) :]
        assert "compacted" in outcomes[: len(compacts)]
        assert any(o == "prepared" for o in outcomes[len(compacts) :])
        for name in sessions:
            logs = [await harness(c, loop, name).events() for c in channels]
            assert logs[0] == logs[1] == logs[2]  # every replica answers the same log
            log = logs[0]
            assert [e.seq for e in log] == list(range(len(log)))
            ids = [e.event_id for e in log if e.event_id]
            assert sorted(ids) == sorted(
                f"{name}/{a}/{i}"
                for a in range(3 * APPENDERS_PER_REPLICA)
                for i in range(BATCHES_PER_APPENDER)
            )
            for (session, _), seqs in firsts.items():
                if session == name:
                    assert seqs == sorted(seqs)  # each appender's batches in its order
            check_brackets(log)
            await _until(partial(_caught_up, followers, watchers, name, len(log)))
            for r in range(3):
                assert followers[name, r] == list(range(len(log)))  # none missed, none twice
                assert watchers[name, r] == sorted(set(watchers[name, r]))
        check_brackets(await p.events())
        for stream in streams:
            stream.cancel()
    finally:
        for channel in channels:
            await channel.close()


def _caught_up(
    followers: dict[tuple[str, int], list[int]],
    watchers: dict[tuple[str, int], list[int]],
    name: str,
    size: int,
) -> bool:
    """Whether every replica's follower and watcher of ``name`` reached revision ``size``."""
    return all(
        len(followers[name, r]) >= size and watchers[name, r][-1:] == [size] for r in range(3)
    )


async def _prepare_or_busy(h: Harness) -> str:
    try:
        await h.prepare(1)
    except grpc.aio.AioRpcError as error:
        return busy(error)
    return "prepared"


async def _until(condition: Callable[[], bool]) -> None:
    """Wait (20 s at most) until ``condition()`` holds."""
    for _ in range(400):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in 20 s")


async def _compact_until_done(h: Harness) -> Any:
    """Compact, retrying COMPACTION_BUSY until the lease of a dead owner lapses."""
    for _ in range(150):
        try:
            return await h.compact()
        except grpc.aio.AioRpcError as error:
            busy(error)
        await asyncio.sleep(0.2)
    raise AssertionError("the session was never taken over")


async def kill_mid_bracket(replicas: list[Served], loop: OpenAICompatServer) -> None:
    """SIGKILL replica 0 while its summary is in flight; replica 1 takes the session over."""
    (victim, address, _), (_, survivor, _) = replicas[0], replicas[1]
    async with grpc.aio.insecure_channel(address) as a, grpc.aio.insecure_channel(survivor) as b:
        await harness(a, loop, "k").create(*opening(), *units(6))
        asked = len(summary_requests(loop))
        loop.enqueue(Reply(delay_before=120))  # the reply the killed replica dies waiting for
        call = harness(a, loop, "k").compaction.Compact(cpb.CompactRequest(session_id="k"))
        first = await call.read()
        await _until(lambda: len(summary_requests(loop)) > asked)
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 30)
        call.cancel()

        run = await _compact_until_done(harness(b, loop, "k"))
        log = await harness(b, loop, "k").events()
    orphan = first.progress.compaction_id
    kinds = [body(e) for e in log]
    seed = kinds.index("session_end_seed")
    assert log[seed - 1].compaction_start.compaction_id == orphan  # stale evidence now
    assert log[seed].session_end_seed.reason == "lease-expired"
    assert run.result.outcome.compaction_id != orphan
    assert kinds[seed + 1 :].count("compaction_end") == 1
    check_brackets(log)


async def pause_past_lease(replicas: list[Served], loop: OpenAICompatServer) -> None:
    """SIGSTOP replica 1 mid-summary past its lease; replica 2 takes over; replica 1, continued,
    is fenced."""
    (paused, address, _), (_, survivor, _) = replicas[1], replicas[2]
    async with grpc.aio.insecure_channel(address) as a, grpc.aio.insecure_channel(survivor) as b:
        await harness(a, loop, "z").create(*opening(), *units(6))
        asked = len(summary_requests(loop))
        loop.enqueue(Reply(delay_before=1.5))  # answered while the replica is stopped
        late = asyncio.create_task(harness(a, loop, "z").compact())
        await _until(lambda: len(summary_requests(loop)) > asked)
        paused.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(LEASE_S * 2.5)
            run = await _compact_until_done(harness(b, loop, "z"))
        finally:
            paused.send_signal(signal.SIGCONT)
        with pytest.raises(grpc.aio.AioRpcError) as fenced:
            await asyncio.wait_for(late, 30)
        log = await harness(b, loop, "z").events()
    assert (details(fenced.value).code, details(fenced.value).reason) == (
        grpc.StatusCode.ABORTED,
        "LEASE_LOST",
    )
    kinds = [body(e) for e in log]
    assert kinds.count("compaction_summary") == 1  # only the survivor's
    assert log[kinds.index("compaction_summary")].compaction_summary.compaction_id == (
        run.result.outcome.compaction_id
    )
    check_brackets(log)


async def test_three_replicas_serve_the_same_sessions_and_survive_kill_and_pause(
    tmp_path: Path, database: str
) -> None:
    with loopback() as loop:
        config = write_config(tmp_path / "compactd.toml", loop)
        with three_replicas(database, config) as replicas:
            await drive_all_at_once([address for _, address, _ in replicas], loop)
            await kill_mid_bracket(replicas, loop)
            await pause_past_lease(replicas, loop)
