"""Another session's calls while one session restores or answers a large read, over gRPC.

The server runs in a child process of its own (``bench/children.py``: ``create_server`` on a
SQLite file, default limits, the interpreter settled as ``compactd serve`` settles it); the
calls are timed from this process, on two channels, so nothing here shares the server's event
loop or its GIL. Two sessions are built beforehand (through ``SessionManager``, snapshotted):

- ``wide``: transcript events (``testdata/transcripts``) cut short, appended until the surface
  reaches ``--fill`` of the default ``max_surface_bytes``: the largest surface the limits admit,
  with as many nodes as a surface of short messages has (the per-node costs are the point);
- ``small``: ~300 transcript events, the neighbour.

Each round starts a fresh server (nothing resident) and, on one channel, calls ``CheckPressure``
on ``small`` every ``--period`` seconds (each call timed) through the phases:

1. idle, ``--idle`` seconds: nothing else runs (the reference);
2. restore: the first read of ``wide`` after the start (its ``CheckPressure``, on the other
   channel): the restore from its snapshot, its meter's prices, the new lifecycle's append;
3. ``GetSurface``, ``BuildRequest`` and ``ListEvents`` (drained) of the resident ``wide``, one
   after another, each ``--reads`` times.

Each phase reports the neighbour's worst call, against the idle worst of the same rounds. Goal:
the worst ≤ 50 ms in every phase.

    python -m bench.bench_neighbours [--rounds 3] [--fill 0.97] [--reads 3]

``readme_rows()`` returns rows of docs/benchmarks.md (goal, measured, reference):
``python -m bench.readme``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from bench.children import identity, served, until_stdin_closes
from bench.corpus import SessionEvent, header, surface_events
from compactd import config
from compactd.api.server import create_server, settle_interpreter
from compactd.core.limits import DEFAULT_LIMITS
from compactd.core.policy import PressurePolicy
from compactd.routes import RouteCatalog
from compactd.service.pressure import PressureService
from compactd.service.sessions import SessionManager
from compactd.store.sqlite import SqliteEventStore
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import session_service_pb2 as spb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub

if TYPE_CHECKING:  # the stubs' asyncio types are in their .pyi only
    from compactd.v1.compaction_service_pb2_grpc import CompactionServiceAsyncStub

PROVIDER, MODEL = "openai", "gpt-4-turbo"
TEXT_CHARS = 48  # a short message: many nodes per byte of surface
GOAL_S = 0.050
PHASES = ("restore", "GetSurface", "BuildRequest", "ListEvents")


def fmt(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


# ---- building the sessions ------------------------------------------------------------------


def _short(events: Iterator[SessionEvent]) -> Iterator[SessionEvent]:
    """``events`` with their texts cut to ``TEXT_CHARS`` and tool arguments emptied."""
    for event in events:
        for block in getattr(event, event.WhichOneof("body") or "").content:
            if block.HasField("text"):
                block.text.text = block.text.text[:TEXT_CHARS]
            elif block.HasField("tool_call"):
                block.tool_call.arguments_json = "{}"
        yield event


async def build(path: Path, fill: float) -> tuple[int, int, int]:
    """The sessions ``wide`` and ``small`` in the SQLite file ``path``, snapshotted; ``wide``'s
    events, surface nodes and surface bytes."""
    store = SqliteEventStore(str(path))
    await store.open()
    try:
        manager = SessionManager(store)
        PressureService(manager, RouteCatalog(), PressurePolicy.from_settings(None))
        source = _short(surface_events("n"))
        for name, until in (("small", 0), ("wide", int(fill * DEFAULT_LIMITS.max_surface_bytes))):
            await manager.create(name, None)
            handle = await manager.get(name)
            await handle.append([header(PROVIDER, MODEL)])
            await handle.append([next(source) for _ in range(300)])
            while handle.fold.surface_bytes < until:
                await handle.append([next(source) for _ in range(1000)])
            await manager.snapshot(handle)
        fold = handle.fold
        await manager.close()
    finally:
        await store.close()
    return fold.revision, len(fold.surface), fold.surface_bytes


# ---- the server (a child process) -----------------------------------------------------------


async def serve(path: str) -> None:
    """compactd on the SQLite file ``path``, default limits; prints its address, serves until
    stdin closes."""
    overrides = {"listen": "127.0.0.1:0", "store": f"sqlite:///{path}", "log_level": "WARNING"}
    running = await create_server(config.load(None, environ={}, overrides=overrides))
    settle_interpreter()  # as ``compactd serve`` does
    try:
        print(running.address, flush=True)
        await until_stdin_closes()
    finally:
        await running.stop(0)


# ---- the neighbour's calls --------------------------------------------------------------------


async def _neighbour(
    stub: CompactionServiceAsyncStub, period: float, until: Callable[[], bool]
) -> list[float]:
    """``CheckPressure`` on ``small`` every ``period`` until ``until()``: each call's time."""
    request, samples = cpb.CheckPressureRequest(session_id="small"), []
    while not until():
        started = time.perf_counter()
        await stub.CheckPressure(request)
        took = time.perf_counter() - started
        samples.append(took)
        await asyncio.sleep(max(0.0, period - took))
    return samples


async def _beside(
    stub: CompactionServiceAsyncStub, period: float, work: Awaitable[object]
) -> tuple[list[float], float]:
    """The neighbour's call times while ``work`` runs, and how long it ran."""
    task = asyncio.ensure_future(work)
    started = time.perf_counter()
    task.add_done_callback(lambda _: None)
    samples = await _neighbour(stub, period, task.done)
    await task
    return samples, time.perf_counter() - started


async def one_round(path: Path, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """A fresh server: each phase's (neighbour's worst, the phase's own longest call)."""
    found: dict[str, tuple[float, float]] = {}
    async with served("bench.bench_neighbours", 1, str(path)) as (address,):
        limit = [("grpc.max_receive_message_length", -1)]
        async with (
            grpc.aio.insecure_channel(address) as near,
            grpc.aio.insecure_channel(address, options=limit) as far,
        ):
            probe = CompactionServiceStub(near)
            for _ in range(20):  # restores small, warms the channel
                await probe.CheckPressure(cpb.CheckPressureRequest(session_id="small"))
            ends = time.perf_counter() + args.idle
            idle = await _neighbour(probe, args.period, lambda: time.perf_counter() >= ends)
            found["idle"] = (max(idle), 0.0)
            for phase, call in _phases(far, args.reads):
                samples, took = await _beside(probe, args.period, call())
                found[phase] = (max(samples), took)
    return found


def _phases(
    channel: grpc.aio.Channel, reads: int
) -> list[tuple[str, Callable[[], Awaitable[object]]]]:
    """Each phase's work on ``channel``. Large replies are received as bytes: parsing them is
    this process's work, which would delay the neighbour's calls here, not the server's."""
    compaction = CompactionServiceStub(channel)
    surface = _raw(channel, "GetSurface", spb.GetSurfaceRequest)
    request = _raw(channel, "BuildRequest", spb.BuildRequestRequest)
    events = channel.unary_stream(
        f"{_SESSIONS}/ListEvents",
        request_serializer=spb.ListEventsRequest.SerializeToString,
        response_deserializer=identity,
    )

    async def restore() -> None:
        await compaction.CheckPressure(cpb.CheckPressureRequest(session_id="wide"))

    async def reads_of(call: Callable[[], Awaitable[object]]) -> None:
        for _ in range(reads):
            await call()

    async def listed() -> None:
        async for _event in events(spb.ListEventsRequest(session_id="wide")):
            pass

    return [
        ("restore", restore),
        ("GetSurface", lambda: reads_of(lambda: surface(spb.GetSurfaceRequest(session_id="wide")))),
        ("BuildRequest", lambda: reads_of(
            lambda: request(spb.BuildRequestRequest(session_id="wide")))),
        ("ListEvents", lambda: reads_of(listed)),
    ]  # fmt: skip


_SESSIONS = "/compactd.v1.SessionService"


def _raw(channel: grpc.aio.Channel, method: str, request: Any) -> Any:
    """A unary method of SessionService whose reply is received as bytes."""
    return channel.unary_unary(
        f"{_SESSIONS}/{method}",
        request_serializer=request.SerializeToString,
        response_deserializer=identity,
    )


# ---- running ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    with tempfile.TemporaryDirectory(prefix="bench-neighbours-") as folder:
        path = Path(folder) / "neighbours.db"
        print("building the sessions ...", file=sys.stderr, flush=True)
        events, nodes, size = await build(path, args.fill)
        rounds = []
        for index in range(args.rounds):
            print(f"round {index + 1} ...", file=sys.stderr, flush=True)
            rounds.append(await one_round(path, args))
    idle = max(r["idle"][0] for r in rounds)
    wide = (
        f"{events:,} events, a surface of {nodes:,} nodes, {size / 2**20:.1f} MiB "
        f"({size / DEFAULT_LIMITS.max_surface_bytes:.0%} of max_surface_bytes)"
    )
    rows = []
    for phase in PHASES:
        worst = max(r[phase][0] for r in rounds)
        took = max(r[phase][1] for r in rounds)
        what = "its restore (first CheckPressure after a start)" if phase == "restore" else (
            f"{args.reads} {phase} of it, one after another"
        )  # fmt: skip
        rows.append(
            (
                f"another session's CheckPressure during {phase} of a session at "
                f"max_surface_bytes: worst ≤ {GOAL_S * 1e3:.0f} ms",
                f"worst {fmt(worst)} = {worst / idle:.1f}x idle",
                f"the same calls' worst while idle {fmt(idle)}; {wide}; {what}: {fmt(took)} "
                f"(slowest of {args.rounds} rounds, a server process of its own each)",
            )
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fill", type=float, default=0.97, help="of max_surface_bytes")
    parser.add_argument("--reads", type=int, default=3, help="each large read, per round")
    parser.add_argument("--period", type=float, default=0.020, help="between neighbour calls")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds of the idle phase")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the child: the SQLite file
    return parser.parse_args(argv)


def readme_rows() -> list[tuple[str, str, str]]:
    """This benchmark's rows of docs/benchmarks.md, (goal, measured, reference), at its defaults."""
    return asyncio.run(run(parse_args([])))


def main() -> None:
    args = parse_args()
    if args.serve is not None:
        asyncio.run(serve(args.serve))
        return
    for goal, measured, reference in asyncio.run(run(args)):
        print(f"{goal}\n    measured: {measured}\n    reference (same run): {reference}")


if __name__ == "__main__":
    main()
