"""Another session's calls while one session restores or answers a large read, over gRPC.

The server runs in a child process of its own (``bench/children.py``: ``create_server`` on a
SQLite file, default limits, the interpreter settled as ``compactd serve`` settles it); the
calls are timed from this process, on two channels, so nothing here shares the server's event
loop or its GIL. The sessions are built beforehand (through ``SessionManager``, snapshotted):

- ``wide``: transcript events (``testdata/transcripts``) cut short, appended until the surface
  reaches ``--fill`` of the default ``max_surface_bytes``: the largest surface the limits admit,
  with as many nodes as a surface of short messages has (the per-node costs are the point);
- ``long``: ``--long-events`` transcript events compacted as a runtime compacts them
  (``bench_restore.compacting_session``): a long log, a surface of a few hundred nodes;
- ``small``: ~300 transcript events, the neighbour.

Each round starts a fresh server (nothing resident) and, on one channel, calls ``CheckPressure``
on ``small`` every ``--period`` seconds (each call timed) through the phases, the work on the
other channel:

1. idle, ``--idle`` seconds: nothing else runs (the reference);
2. the first read of ``wide`` after the start (its ``CheckPressure``): the restore from its
   snapshot, its meter's prices, the new lifecycle's append; then the same for ``long``;
3. ``GetSurface``, ``GetSurface`` with detail and ``BuildRequest`` of the resident ``wide``,
   each ``--reads`` times one after another, then one ``ListEvents`` of its log, drained.
   Large replies are received as bytes: parsing them is this process's work, which would delay
   the neighbour's calls here, not the server's.

Each phase reports the neighbour's worst call, against the idle worst of the same rounds, and
the server's own view (``LoopPauses``, read after each phase through a bench-only method): the
longest its event loop paused, and its longest slice of CPU on the loop, which the machine's
load does not lengthen. Goal: the neighbour's worst ≤ 50 ms in every phase. On a shared
machine the worsts move with the load: the idle ones say by how much.

    python -m bench.bench_neighbours [--rounds 3] [--fill 0.97] [--long-events 100000]
                                     [--reads 3]

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from bench.bench_restore import compacting_session
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
_SESSIONS = "/compactd.v1.SessionService"
Row = tuple[str, str, str]  # a row of docs/benchmarks.md: goal, measured, reference


def fmt(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


# ---- building the sessions ------------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    """What the sessions came to: ``wide``'s events, nodes and surface bytes, ``long``'s
    events and nodes."""

    wide: tuple[int, int, int]
    long: tuple[int, int]


def _short(events: Iterator[SessionEvent]) -> Iterator[SessionEvent]:
    """``events`` with their texts cut to ``TEXT_CHARS`` and tool arguments emptied."""
    for event in events:
        for block in getattr(event, event.WhichOneof("body") or "").content:
            if block.HasField("text"):
                block.text.text = block.text.text[:TEXT_CHARS]
            elif block.HasField("tool_call"):
                block.tool_call.arguments_json = "{}"
        yield event


async def build(path: Path, fill: float, long_events: int) -> Built:
    """The sessions ``small``, ``wide`` and ``long`` in the SQLite file ``path``, snapshotted."""
    store = SqliteEventStore(str(path))
    await store.open()
    try:
        manager = SessionManager(store)
        service = PressureService(manager, RouteCatalog(), PressurePolicy.from_settings(None))
        source = _short(surface_events("n"))
        for name, until in (("small", 0), ("wide", int(fill * DEFAULT_LIMITS.max_surface_bytes))):
            await manager.create(name, None)
            handle = await manager.get(name)
            await handle.append([header(PROVIDER, MODEL)])
            await handle.append([next(source) for _ in range(300)])
            while handle.fold.surface_bytes < until:
                await handle.append([next(source) for _ in range(1000)])
            await manager.snapshot(handle)
        wide = handle.fold
        await compacting_session(manager, service, "long", long_events)
        long = (await manager.get("long")).fold
        await manager.snapshot(await manager.get("long"))
        await manager.close()
    finally:
        await store.close()
    return Built((wide.revision, len(wide.surface), wide.surface_bytes),
                 (long.revision, len(long.surface)))  # fmt: skip


# ---- the server (a child process) -----------------------------------------------------------


class LoopPauses:
    """The server's own view since it was last asked (``bench.Lag/Take``, bytes in and out):
    the longest its event loop went without running a 1 ms timer (beyond that 1 ms), and the
    most CPU time the loop's thread spent in one such stretch. The first also counts the time
    the process waited for a core or the loop for the GIL (a worker thread's long C call); the
    second only what ran on the loop itself, whatever the machine's load. It watches from the
    first ``Take`` on: its timer wakes the loop every millisecond, work production's loop does
    not do, so rows that do not read it (``bench_batches``' priced batches, timed before their
    server is first asked) run without it."""

    TICK_S = 0.001

    def __init__(self) -> None:
        self.longest = self.longest_cpu = 0.0
        self._watching: asyncio.Future[None] | None = None

    def stop(self) -> None:
        """Stop watching (if it started)."""
        if self._watching is not None:
            self._watching.cancel()

    async def watch(self) -> None:
        """Time the loop's turns until cancelled."""
        last, last_cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(self.TICK_S)
            now, cpu = time.perf_counter(), time.thread_time()
            self.longest = max(self.longest, now - last - self.TICK_S)
            self.longest_cpu = max(self.longest_cpu, cpu - last_cpu)
            last, last_cpu = now, cpu

    def handlers(self) -> grpc.GenericRpcHandler[Any, Any]:
        """``bench.Lag/Take``: both figures (seconds, as ``wall cpu`` text) since the last call."""

        async def take(request: bytes, context: object) -> bytes:
            if self._watching is None:  # the first call: the watch starts (0 0 so far)
                self._watching = asyncio.ensure_future(self.watch())
            taken = f"{self.longest!r} {self.longest_cpu!r}"
            self.longest = self.longest_cpu = 0.0
            return taken.encode()

        method = grpc.unary_unary_rpc_method_handler(
            take, request_deserializer=identity, response_serializer=identity
        )
        return grpc.method_handlers_generic_handler("bench.Lag", {"Take": method})


async def serve(path: str, **settings: object) -> None:
    """compactd on the SQLite file ``path``, default limits but ``settings``, and ``bench.Lag``;
    prints its address, serves until stdin closes."""
    overrides: dict[str, object] = {
        "listen": "127.0.0.1:0",
        "store": f"sqlite:///{path}",
        "log_level": "WARNING",
        **settings,
    }
    pauses = LoopPauses()
    running = await create_server(
        config.load(None, environ={}, overrides=overrides), extra_handlers=[pauses.handlers()]
    )
    settle_interpreter()  # as ``compactd serve`` does
    try:
        print(running.address, flush=True)
        await until_stdin_closes()
    finally:
        pauses.stop()
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
    samples = await _neighbour(stub, period, task.done)
    await task
    return samples, time.perf_counter() - started


#: A phase's figures: the neighbour's worst call, the server loop's longest pause and longest
#: slice of CPU, how long the phase's work took.
Phase = tuple[float, float, float, float]


async def one_round(path: Path, args: argparse.Namespace) -> dict[str, Phase]:
    """A fresh server: each phase's figures."""
    found: dict[str, Phase] = {}
    async with served("bench.bench_neighbours", 1, str(path)) as (address,):
        limit = [("grpc.max_receive_message_length", -1)]
        async with (
            grpc.aio.insecure_channel(address) as near,
            grpc.aio.insecure_channel(address, options=limit) as far,
        ):
            probe = CompactionServiceStub(near)
            take = near.unary_unary(
                "/bench.Lag/Take", request_serializer=identity, response_deserializer=identity
            )
            for _ in range(20):  # restores small, warms the channel
                await probe.CheckPressure(cpb.CheckPressureRequest(session_id="small"))
            await take(b"")
            ends = time.perf_counter() + args.idle
            idle = await _neighbour(probe, args.period, lambda: time.perf_counter() >= ends)
            wall, cpu = (float(x) for x in (await take(b"")).split())
            found["idle"] = (max(idle), wall, cpu, 0.0)
            for phase, call in phases(far, args.reads).items():
                samples, took = await _beside(probe, args.period, call())
                wall, cpu = (float(x) for x in (await take(b"")).split())
                found[phase] = (max(samples), wall, cpu, took)
    return found


def phases(channel: grpc.aio.Channel, reads: int) -> dict[str, Callable[[], Awaitable[None]]]:
    """Each phase's work on ``channel`` (large replies received as bytes), by its name."""
    compaction = CompactionServiceStub(channel)
    surface = _raw(channel, "GetSurface", spb.GetSurfaceRequest)
    request = _raw(channel, "BuildRequest", spb.BuildRequestRequest)
    events = channel.unary_stream(
        f"{_SESSIONS}/ListEvents",
        request_serializer=spb.ListEventsRequest.SerializeToString,
        response_deserializer=identity,
    )

    def first_read(name: str) -> Callable[[], Awaitable[None]]:
        async def read() -> None:
            await compaction.CheckPressure(cpb.CheckPressureRequest(session_id=name))

        return read

    def repeated(call: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[None]]:
        async def calls() -> None:
            for _ in range(reads):
                await call()

        return calls

    async def listed() -> None:
        async for _event in events(spb.ListEventsRequest(session_id="wide")):
            pass

    return {
        "its restore": first_read("wide"),
        "the restore of a long log": first_read("long"),
        "GetSurface": repeated(lambda: surface(spb.GetSurfaceRequest(session_id="wide"))),
        "GetSurface with detail": repeated(
            lambda: surface(spb.GetSurfaceRequest(session_id="wide", detail=True))
        ),
        "BuildRequest": repeated(lambda: request(spb.BuildRequestRequest(session_id="wide"))),
        "ListEvents": listed,
    }


def _raw(channel: grpc.aio.Channel, method: str, request: Any) -> Any:
    """A unary method of SessionService whose reply is received as bytes."""
    return channel.unary_unary(
        f"{_SESSIONS}/{method}",
        request_serializer=request.SerializeToString,
        response_deserializer=identity,
    )


# ---- running ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-neighbours-") as folder:
        path = Path(folder) / "neighbours.db"
        print("building the sessions ...", file=sys.stderr, flush=True)
        built = await build(path, args.fill, args.long_events)
        rounds = []
        for index in range(args.rounds):
            print(f"round {index + 1} ...", file=sys.stderr, flush=True)
            rounds.append(await one_round(path, args))
    return rows(rounds, built, args)


def rows(rounds: list[dict[str, Phase]], built: Built, args: argparse.Namespace) -> list[Row]:
    """The table's rows: each phase's worsts over the rounds beside the idle ones."""
    idle, idle_pause, idle_cpu = (max(r["idle"][i] for r in rounds) for i in (0, 1, 2))
    events, nodes, size = built.wide
    wide = (
        f"`wide`: {events:,} events, a surface of {nodes:,} nodes, {size / 2**20:.1f} MiB "
        f"({size / DEFAULT_LIMITS.max_surface_bytes:.0%} of max_surface_bytes)"
    )
    what = {
        "its restore": f"{wide}; its first CheckPressure after a start",
        "the restore of a long log": f"`long`: {built.long[0]:,} events, {built.long[1]:,} "
        "nodes on its surface; its first CheckPressure after a start",
        "ListEvents": f"{wide}; one ListEvents of its log, drained",
    }
    found = []
    for phase in [p for p in rounds[0] if p != "idle"]:
        worst, pause, cpu, took = (max(r[phase][i] for r in rounds) for i in (0, 1, 2, 3))
        work = what.get(phase, f"{wide}; {args.reads} {phase} of it, one after another")
        session = "a long session" if "long" in phase else "a session at max_surface_bytes"
        found.append(
            (
                f"another session's CheckPressure during {phase} of {session}: "
                f"worst ≤ {GOAL_S * 1e3:.0f} ms",
                f"worst {fmt(worst)} = {worst / idle:.1f}x idle; the server's event loop "
                f"paused at most {fmt(pause)}, its longest slice of CPU {fmt(cpu)}",
                f"while idle: the same calls' worst {fmt(idle)}, the loop's longest pause "
                f"{fmt(idle_pause)}, slice {fmt(idle_cpu)}; {work}: {fmt(took)} (slowest of "
                f"{len(rounds)} rounds, a server process of its own each)",
            )
        )
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fill", type=float, default=0.97, help="of max_surface_bytes")
    parser.add_argument("--long-events", type=int, default=100_000)
    parser.add_argument("--reads", type=int, default=3, help="each large unary read, per round")
    parser.add_argument("--period", type=float, default=0.020, help="between neighbour calls")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds of the idle phase")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the child: the SQLite file
    return parser.parse_args(argv)


def readme_rows() -> list[Row]:
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
