"""Restores against their physical references, each measured in the same run.

A SQLite file (``synchronous=FULL``, a temporary folder) is filled through the service itself
(``SessionManager`` + ``PressureService``, route ``openai/gpt-4-turbo``: cl100k_base) with the
repository's transcripts (``testdata/transcripts``), cycled, as a compacting runtime logs them
(each event with an ``event_id``, as a runtime that retries its appends sends them):
every 1,000 events the older part of the surface is REPLACEd by a summary, so a 100,000-event log
keeps a surface of a few thousand nodes, as a real long session does. Snapshots every 1,000
events (the default). Three comparisons (another session's calls during a restore are
``bench/bench_neighbours.py``'s: over gRPC from another process, at the largest surface the
limits admit):

1. Restart + first CheckPressure on the 100,000-event session (open the store, a new manager,
   restore from the latest snapshot and the log after it, price, report) against reading and
   parsing all its rows raw (``SELECT data ... ORDER BY seq`` + ``ParseFromString``), rounds
   interleaved. Goal: ≤ 2x. The same restore with the snapshot deleted (a full replay) is shown
   for scale.
2. Restart + first CheckPressure of ``flat``, an *uncompacted* session of as many events (its
   surface is its log), over gRPC: a server started in its own process on the file (nothing
   resident), its first CheckPressure timed from this process, against reading and parsing
   ``flat``'s rows raw, rounds interleaved. Goal: ≤ 2x. The same without its snapshot (a full
   replay) beside it.
3. RSS per resident session against its surface's bytes: a fresh interpreter restores
   ``--sessions`` sessions of ~300 transcript events each and reports its ``VmRSS`` growth per
   session after a collection, as ``/proc`` shows it (no heap trimmed first), and the process's
   ``VmRSS`` and ``VmHWM`` (its peak) at the end, next to the mean ``surface_bytes`` (and the
   log's bytes). Goal: ≤ 2x the surface. Their surface is their log; so the same for
   ``--compacting`` sessions of ``--compacting-events`` events compacted as ``big`` is, whose
   log is several times their surface: what grows with the log must not stay resident. Beside
   it, for information: the objects the cyclic collector tracks per resident surface node, and
   how long a full collection takes with those sessions resident (a pause of the event loop).

    python -m bench.bench_restore [--events 100000] [--rounds 3] [--sessions 100]
                                     [--compacting 4] [--compacting-events 32000]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import itertools
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from bench.children import served, until_stdin_closes
from bench.corpus import SessionEvent, header, summary, surface_events
from compactd import config
from compactd.api.server import create_server, settle_interpreter
from compactd.core.policy import PressurePolicy
from compactd.routes import RouteCatalog
from compactd.service.pressure import PressureService, warm_up
from compactd.service.sessions import SessionManager
from compactd.store.sqlite import SqliteEventStore
from compactd.v1 import compaction_service_pb2, compaction_service_pb2_grpc

PROVIDER, MODEL = "openai", "gpt-4-turbo"
BATCH = 1000
KEEP = 300  # nodes a compaction leaves after its summary


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _services(store: SqliteEventStore) -> tuple[SessionManager, PressureService]:
    manager = SessionManager(store, snapshot_interval=BATCH)
    service = PressureService(manager, RouteCatalog(), PressurePolicy.from_settings(None))
    return manager, service


# ---- building the sessions ------------------------------------------------------------------


async def build(path: Path, events: int, small: int, compacting: int = 0, length: int = 0) -> None:
    """The big compacting session ``big``, the uncompacted ``flat`` of as many events, ``small``
    sessions of ~300 events (``s0``...) and ``compacting`` sessions of ``length`` events
    compacted as ``big`` is (``c0``...)."""
    store = SqliteEventStore(str(path))
    await store.open()
    try:
        manager, service = _services(store)
        await compacting_session(manager, service, "big", events)
        await flat_session(manager, service, "flat", events)
        for index in range(small):
            await manager.create(f"s{index}", None)
            handle = await manager.get(f"s{index}")
            source = surface_events(f"s{index}.")
            await handle.append([header(PROVIDER, MODEL)])
            await handle.append(_identified(f"s{index}", [next(source) for _ in range(300)]))
            await service.check(f"s{index}")
            await manager.snapshot(handle)
        for index in range(compacting):
            await compacting_session(manager, service, f"c{index}", length)
            await manager.snapshot(await manager.get(f"c{index}"))
        await manager.close()
    finally:
        await store.close()


def _identified(name: str, events: list[SessionEvent]) -> list[SessionEvent]:
    """``events``, each with an ``event_id``, as a runtime that retries its appends sends them."""
    for event in events:
        event.event_id = f"{name}-{next(_ids)}"
    return events


_ids = itertools.count()


async def compacting_session(
    manager: SessionManager, service: PressureService, name: str, events: int
) -> None:
    """The session ``name``: ``events`` transcript events appended ``BATCH`` at a time, the
    older part of its surface REPLACEd by a summary after each batch (``KEEP`` nodes left)."""
    await manager.create(name, None)
    handle = await manager.get(name)
    await handle.append([header(PROVIDER, MODEL)])
    await service.check(name)
    source = surface_events(name)
    closed: list[int] = []  # seqs after which no tool call is open
    open_calls: set[str] = set()
    summaries = itertools.count()
    while handle.revision < events:
        batch = [next(source) for _ in range(min(BATCH, events - handle.revision))]
        result = await handle.append(_identified(name, batch))
        for event, seq in zip(batch, result.seqs, strict=True):
            _track(event, open_calls)
            if not open_calls:
                closed.append(seq)
        surface = [n.seq for n in handle.fold.surface]
        if len(surface) > 2 * KEEP and handle.revision < events:
            ends = [s for s in closed if s in set(surface[:-KEEP])]
            if ends:
                start, end = surface[0], ends[-1]
                span = surface[: surface.index(end) + 1]
                text = f"Summary {next(summaries)} of {len(span)} messages."
                await handle.append([summary(start, end, span, text)])
                closed = [s for s in closed if s > end]
        if handle.revision % 10_000 < BATCH:
            print(f"  built {handle.revision:,} events", file=sys.stderr, flush=True)


async def flat_session(
    manager: SessionManager, service: PressureService, name: str, events: int
) -> None:
    """The session ``name``: ``events`` transcript events appended ``BATCH`` at a time, never
    compacted (its surface is its log), priced after each batch, snapshotted at the end."""
    await manager.create(name, None)
    handle = await manager.get(name)
    await handle.append([header(PROVIDER, MODEL)])
    source = surface_events(name)
    while handle.revision < events:
        batch = [next(source) for _ in range(min(BATCH, events - handle.revision))]
        await handle.append(_identified(name, batch))
        await service.check(name)
    await manager.snapshot(handle)


def _track(event: SessionEvent, open_calls: set[str]) -> None:
    if event.HasField("assistant_message"):
        for block in event.assistant_message.content:
            if block.HasField("tool_call"):
                open_calls.add(block.tool_call.id)
    elif event.HasField("tool_result"):
        open_calls.discard(event.tool_result.tool_call_id)


# ---- 1. restart + first check ---------------------------------------------------------------


def read_raw(path: Path, name: str) -> int:
    """Read and parse every row of the session: the physical floor of any restore that reads
    its log."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT data FROM events WHERE session_id = ? ORDER BY seq", (name,)
        ).fetchall()
    finally:
        conn.close()
    for (data,) in rows:
        SessionEvent().ParseFromString(data)
    return len(rows)


async def restart_and_check(path: Path, name: str) -> float:
    start = time.perf_counter()
    store = SqliteEventStore(str(path))
    await store.open()
    try:
        manager, service = _services(store)
        await service.check(name)
        elapsed = time.perf_counter() - start
        await manager.close()
    finally:
        await store.close()
    return elapsed


async def restarts(path: Path, rounds: int) -> list[tuple[str, str, str]]:
    raw, restored = [], []
    rows = 0
    for round_ in range(rounds):
        steps: list[Callable[[], Awaitable[float | int]]] = [
            functools.partial(asyncio.to_thread, read_raw, path, "big"),
            functools.partial(restart_and_check, path, "big"),
        ]
        for step in steps if round_ % 2 == 0 else steps[::-1]:
            start = time.perf_counter()
            result = await step()
            if isinstance(result, int):
                rows = result
                raw.append(time.perf_counter() - start)
            else:
                restored.append(result)
    replay = await _without_snapshot(path)
    r, s = statistics.median(raw), statistics.median(restored)
    return [
        (
            f"restart + first CheckPressure, {rows:,}-event session ≤ 2x reading its rows",
            f"{fmt(s)} = {s / r:.2f}x",
            f"reading + parsing its rows raw {fmt(r)} (full replay without a snapshot: "
            f"{fmt(replay)})",
        )
    ]


async def _without_snapshot(path: Path) -> float:
    _delete_snapshot(path, "big")
    return await restart_and_check(path, "big")


def _delete_snapshot(path: Path, name: str) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DELETE FROM snapshots WHERE session_id = ?", (name,))
    conn.close()


# ---- 1b. restart + first check of an uncompacted session, over gRPC ---------------------------


async def flat_restarts(path: Path, rounds: int) -> list[tuple[str, str, str]]:
    """The first CheckPressure of ``flat`` after a start of a server in its own process (its
    restore, its pricing, the report), over gRPC, against reading its rows raw, interleaved;
    then the same without its snapshot (a full replay)."""
    raw, restored = [], []
    rows = 0
    for round_ in range(rounds):
        for step in ("raw", "restore") if round_ % 2 == 0 else ("restore", "raw"):
            if step == "raw":
                start = time.perf_counter()
                rows = await asyncio.to_thread(read_raw, path, "flat")
                raw.append(time.perf_counter() - start)
            else:
                restored.append(await first_check_served(path, "flat"))
    replays = []
    for _ in range(max(1, rounds // 2)):
        _delete_snapshot(path, "flat")  # the replay's restore writes one again
        replays.append(await first_check_served(path, "flat"))
    r, s, p = statistics.median(raw), statistics.median(restored), statistics.median(replays)
    return [
        (
            f"restart + first CheckPressure of an uncompacted {rows:,}-event session, over gRPC "
            "(the server in its own process) ≤ 2x reading its rows",
            f"from its snapshot {fmt(s)} = {s / r:.2f}x; without a snapshot (a full replay) "
            f"{fmt(p)} = {p / r:.2f}x",
            f"reading + parsing its rows raw {fmt(r)}; its surface is its log (no compaction): "
            f"{rows:,} nodes",
        )
    ]


async def first_check_served(path: Path, name: str) -> float:
    """A server on ``path`` started in its own process (nothing resident): its first
    CheckPressure of ``name``, timed from this process."""
    async with (
        served("bench.bench_restore", 1, str(path)) as (address,),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = compaction_service_pb2_grpc.CompactionServiceStub(channel)
        await channel.channel_ready()
        start = time.perf_counter()
        await stub.CheckPressure(compaction_service_pb2.CheckPressureRequest(session_id=name))
        return time.perf_counter() - start


async def serve(path: str) -> None:
    """compactd on the SQLite file ``path`` (a child process): prints its address, serves until
    stdin closes."""
    overrides = {"listen": "127.0.0.1:0", "store": f"sqlite:///{path}", "log_level": "WARNING"}
    running = await create_server(config.load(None, environ={}, overrides=overrides))
    settle_interpreter()  # as ``compactd serve`` does
    print(running.address, flush=True)
    await until_stdin_closes()
    await running.stop(0)


# ---- 2. memory --------------------------------------------------------------------------------


def rss_bytes() -> tuple[int, int]:
    """The process's ``VmRSS`` and ``VmHWM`` (its peak RSS) after a collection, as ``/proc``
    shows them to an operator: freed heap pages that glibc keeps count, nothing is trimmed."""
    gc.collect()
    found: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                found[name] = int(value.split()[0]) * 1024
    return found["VmRSS"], found["VmHWM"]


async def resident(path: Path, sessions: int, compacting: int) -> dict[str, dict[str, float]]:
    """In a fresh interpreter: RSS growth per restored session, its surface and log bytes, for
    the small sessions (``s``) and the compacting ones (``c``)."""
    warm_up(RouteCatalog())
    settle_interpreter()
    store = SqliteEventStore(str(path))
    await store.open()
    manager, service = _services(store)
    await service.check("s0")  # the first restore's one-off costs (code, caches) are not its own
    found = {"s": await _grown(path, manager, service, [f"s{i}" for i in range(1, sessions)])}
    if compacting:
        found["c"] = await _grown(path, manager, service, [f"c{i}" for i in range(compacting)])
    await manager.close()
    await store.close()
    return found


async def _grown(
    path: Path, manager: SessionManager, service: PressureService, names: list[str]
) -> dict[str, float]:
    """RSS growth per session while ``names`` are restored and kept, their surfaces' and
    logs' mean bytes."""
    (before, _), tracked = rss_bytes(), len(gc.get_objects())
    handles = []
    for name in names:
        await service.check(name)
        handles.append(await manager.get(name))
    after, peak = rss_bytes()
    nodes = sum(len(h.fold.surface) for h in handles)
    tracked = len(gc.get_objects()) - tracked
    surface = statistics.mean(h.fold.surface_bytes for h in handles)
    conn = sqlite3.connect(path)
    marks = ",".join("?" * len(names))
    log = conn.execute(
        f"SELECT SUM(LENGTH(data)) FROM events WHERE session_id IN ({marks})", names
    ).fetchone()[0]
    conn.close()
    return {
        "per_session": (after - before) / len(handles),
        "rss": after,
        "peak": peak,
        "surface": surface,
        "log": log / len(names),
        "tracked_per_node": tracked / nodes,
        "collection": min(_timed_collection() for _ in range(3)),
        "nodes": nodes,
    }


def _timed_collection() -> float:
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


def memory(path: Path, sessions: int, compacting: int) -> list[tuple[str, str, str]]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_restore", "--rss", str(path), "--sessions",
         str(sessions), "--compacting", str(compacting)],
        check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
    ).stdout  # fmt: skip
    found = json.loads(out.strip().splitlines()[-1])
    goals = {
        "s": "RSS per resident session ≤ 2x its surface's bytes",
        "c": "RSS per resident compacting session ≤ 2x its surface's bytes",
    }
    rows = []
    for group, figures in found.items():
        per, surface, log = figures["per_session"], figures["surface"], figures["log"]
        rows.append(
            (
                goals[group],
                f"{per / 1024:,.0f} KiB = {per / surface:.2f}x (VmRSS as /proc shows it, no heap "
                f"trimmed; the process then: VmRSS {figures['rss'] / 2**20:,.0f} MiB, VmHWM "
                f"{figures['peak'] / 2**20:,.0f} MiB)",
                f"surface {surface / 1024:,.0f} KiB (its log: {log / 1024:,.0f} KiB); "
                f"objects the cyclic collector tracks: {figures['tracked_per_node']:.2f} per "
                f"resident node, a full collection {fmt(figures['collection'])} with "
                f"{figures['nodes']:,} nodes resident",
            )
        )
    return rows


# ---- running ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    warm_up(RouteCatalog())
    settle_interpreter()  # as ``compactd serve`` does
    with tempfile.TemporaryDirectory(prefix="bench-restore-") as folder:
        path = Path(folder) / "restore.db"
        print(f"building {args.events:,} events ...", file=sys.stderr, flush=True)
        await build(path, args.events, args.sessions, args.compacting, args.compacting_events)
        rows = await restarts(path, args.rounds)
        rows += await flat_restarts(path, args.rounds)
        rows += memory(path, args.sessions, args.compacting)
        return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--compacting", type=int, default=4)
    parser.add_argument("--compacting-events", type=int, default=32_000)
    parser.add_argument("--rss", type=Path, help=argparse.SUPPRESS)  # the memory child
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the server child: its SQLite file
    return parser.parse_args(argv)


def readme_rows() -> list[tuple[str, str, str]]:
    """This benchmark's rows of docs/benchmarks.md, (goal, measured, reference), at its defaults."""
    return asyncio.run(run(parse_args([])))


def main() -> None:
    args = parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    if args.rss is not None:
        print(json.dumps(asyncio.run(resident(args.rss, args.sessions, args.compacting))))
        return
    print(f"machine: {os.cpu_count()} cores")
    for goal, measured, reference in asyncio.run(run(args)):
        print(f"{goal}\n    measured: {measured}\n    reference (same run): {reference}")


if __name__ == "__main__":
    main()
