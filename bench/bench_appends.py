"""Appends over gRPC against their physical references, each measured in the same run.

One server (SQLite store, ``synchronous=FULL``, in a temporary folder) on loopback, in a child
process as in production; the clients and the references run in this process. Two comparisons,
each interleaved round by round with its reference:

1. Single-event ``AppendEvents``, one client, back to back, against an empty unary RPC (health
   ``Check``) on the same channel. Goal: ≥ 0.8x the empty-RPC rate. Beside it, what one
   client's append must add to an empty RPC (nothing shares its fsync): the same event's row
   committed alone by raw SQLite (``synchronous=FULL``, one fsync'd transaction, no thread, no
   service), back to back, in this process; the row prints the time an append adds over an
   empty RPC beside that commit's time. On a busy disk the commit alone exceeds 0.25x an empty
   RPC, which puts 0.8x out of reach. Beside them, the service's own writer per commit, from the
   server's ``/metrics`` scraped before and after the appends (``compactd.store.*``): how
   long an append waited for its transaction and how long the transaction took.
2. 64 concurrent clients appending single events (one session each) against the store alone:
   64 tasks appending the same events straight to a ``SqliteEventStore`` (group commit, no
   service, no gRPC). Goal: ≥ 0.5x the store's rate. Beside it, the ceiling any RPC meets: 64
   concurrent clients calling the empty unary RPC through the same server and interceptors;
   when half the store's rate is above that ceiling, the row says so.
The priced 1,000-event batch and CheckPressure beside batches are ``bench_batches``' rows.

Events are the repository's transcripts (``testdata/transcripts``), cycled. The machine is
shared: figures move from run to run; the ratios are the point.

    python -m bench.bench_appends [--rounds 4] [--singles 300] [--clients 64]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.bench_batches import raw_insert
from bench.children import served, until_stdin_closes
from bench.corpus import SessionEvent, header, in_steps, surface_events, turn_start
from compactd import config
from compactd.api.server import create_server, settle_interpreter
from compactd.store.sqlite import SqliteEventStore
from compactd.v1 import (
    compaction_service_pb2,
    compaction_service_pb2_grpc,
    session_service_pb2,
    session_service_pb2_grpc,
)


class Bench:
    """The server, its stubs and a source of transcript events."""

    def __init__(self, channel: grpc.aio.Channel, folder: Path, prefix: str = "s") -> None:
        self.folder = folder
        self.prefix = prefix
        self.sessions = session_service_pb2_grpc.SessionServiceStub(channel)
        self.compaction = compaction_service_pb2_grpc.CompactionServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.source = surface_events()
        self.names = itertools.count()
        self.steps: dict[str, int] = {}
        self.sources: dict[str, Iterator[SessionEvent]] = {}  # a session's own calls and results
        self.address = ""
        self.metrics_url = ""  # the server's /metrics

    async def store_figures(self) -> StoreFigures:
        """The server's store counters now (outside any timed call)."""
        return await asyncio.to_thread(scrape_store, self.metrics_url)

    async def session(self, route: tuple[str, str] | None = None) -> str:
        name = f"{self.prefix}{next(self.names)}"
        await self.sessions.CreateSession(session_service_pb2.CreateSessionRequest(session_id=name))
        opening = [turn_start()] + ([header(*route)] if route else [])
        await self.append(name, opening)
        self.steps[name] = 1
        return name

    async def append(self, name: str, events: list[SessionEvent]) -> None:
        request = session_service_pb2.AppendEventsRequest(session_id=name, events=events)
        await self.sessions.AppendEvents(request)

    def batch(self, name: str, size: int) -> list[SessionEvent]:
        source = self.sources.setdefault(name, surface_events(name))
        raw = [next(source) for _ in range(size)]
        events, self.steps[name] = in_steps(raw, self.steps.get(name, 1))
        return events

    def user_event(self) -> SessionEvent:
        """The next user message of the transcripts (appendable alone, outside any step)."""
        return next(e for e in self.source if e.HasField("user_message"))

    async def check(self, name: str) -> None:
        request = compaction_service_pb2.CheckPressureRequest(session_id=name)
        await self.compaction.CheckPressure(request)


async def _rate(call: Callable[[], Awaitable[Any]], times: int) -> float:
    start = time.perf_counter()
    for _ in range(times):
        await call()
    return times / (time.perf_counter() - start)


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


# ---- 1. one client ----------------------------------------------------------------------------


async def single_client(bench: Bench, rounds: int, singles: int) -> tuple[str, str, str]:
    name = await bench.session()
    empty = health_pb2.HealthCheckRequest()
    insert = raw_insert(bench.folder / "raw-1.db")
    empties, appends, commits = [], [], []
    # The server's store writes only for the appends here (the raw commits use their own file).
    before = await bench.store_figures()
    for _ in range(rounds):
        # Drawn before the clock starts (~0.1 ms each from the transcripts): not the call's work.
        drawn = iter([bench.user_event() for _ in range(singles)])
        empties.append(await _rate(lambda: bench.health.Check(empty), singles))
        appends.append(await _rate(functools.partial(_append_next, bench, name, drawn), singles))
        commits.append(_commit_rate(insert, bench, singles))
    writer = await bench.store_figures() - before  # its writer's queue and transactions
    e, a, c = statistics.median(empties), statistics.median(appends), statistics.median(commits)
    each = max(writer.commits, 1)
    return (
        "single-event AppendEvents, 1 client ≥ 0.8x empty RPC",
        f"{a:,.0f} appends/s = {a / e:.2f}x; an append adds {fmt(1 / a - 1 / e)} to an empty RPC",
        f"empty RPC {e:,.0f}/s; raw SQLite fsync'd commit of one event {fmt(1 / c)} "
        f"(0.8x needs the whole addition ≤ {fmt(0.25 / e)}); the service's writer, per commit "
        f"(its metrics): {fmt(writer.queued / each)} queued, {fmt(writer.commit / each)} in "
        "its transaction",
    )


@dataclass(frozen=True)
class StoreFigures:
    """The server's store counters, read from its ``/metrics`` (``compactd.store.*``)."""

    commits: float = 0.0
    commit: float = 0.0  # seconds in committed write transactions
    queued: float = 0.0  # seconds writes waited for theirs

    def __sub__(self, other: StoreFigures) -> StoreFigures:
        return StoreFigures(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


def scrape_store(url: str) -> StoreFigures:
    """The ``compactd_store_*`` counters of a Prometheus scrape."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return StoreFigures(
        values.get("compactd_store_commits_total", 0.0),
        values.get("compactd_store_commit_time_seconds_total", 0.0),
        values.get("compactd_store_queue_time_seconds_total", 0.0),
    )


async def _append_next(bench: Bench, name: str, drawn: Iterator[SessionEvent]) -> None:
    await bench.append(name, [next(drawn)])


def _commit_rate(insert: Callable[[list[SessionEvent]], None], bench: Bench, times: int) -> float:
    """Raw SQLite's rate of fsync'd single-event commits, back to back."""
    events = [bench.user_event() for _ in range(times)]
    start = time.perf_counter()
    for event in events:
        insert([event])
    return times / (time.perf_counter() - start)


# ---- 2. 64 clients ----------------------------------------------------------------------------


async def many_clients(bench: Bench, rounds: int, clients: int, each: int) -> tuple[str, str, str]:
    store = SqliteEventStore(str(bench.folder / "alone.db"))
    await store.open()
    alone_rates, empty_rates, service_rates = [], [], []
    try:
        for round_ in range(rounds):
            events = [bench.user_event() for _ in range(clients * each)]
            alone_rates.append(await _store_alone(store, round_, events, clients, each))
            empty_rates.append(await _empties(bench, clients, each))
            names = [await bench.session() for _ in range(clients)]
            service_rates.append(await _service(bench, names, events, each))
    finally:
        await store.close()
    s, r = statistics.median(alone_rates), statistics.median(service_rates)
    e = statistics.median(empty_rates)
    above = " (half the store's rate is above this ceiling)" if s / 2 > e else ""
    return (
        f"{clients} concurrent appenders ≥ 0.5x the store's group commit",
        f"{r:,.0f} appends/s = {r / s:.2f}x, {r / e:.2f}x the RPC ceiling",
        f"store alone {s:,.0f}/s; {clients} concurrent empty RPCs {e:,.0f}/s{above}",
    )


async def _store_alone(
    store: SqliteEventStore, round_: int, events: list[SessionEvent], clients: int, each: int
) -> float:
    names = [f"alone{round_}.{i}" for i in range(clients)]
    for name in names:
        await store.create_session(name, None)

    async def appender(index: int) -> None:
        for k in range(each):
            event = SessionEvent()
            event.CopyFrom(events[index * each + k])
            event.seq = k
            event.time.GetCurrentTime()
            await store.append(names[index], [event])

    start = time.perf_counter()
    await asyncio.gather(*(appender(i) for i in range(clients)))
    return clients * each / (time.perf_counter() - start)


async def _empties(bench: Bench, clients: int, each: int) -> float:
    """The rate of ``clients`` concurrent callers of the empty unary RPC (health ``Check``)."""
    empty = health_pb2.HealthCheckRequest()

    async def caller() -> None:
        for _ in range(each):
            await bench.health.Check(empty)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(clients)))
    return clients * each / (time.perf_counter() - start)


async def _service(bench: Bench, names: list[str], events: list[SessionEvent], each: int) -> float:
    async def appender(index: int) -> None:
        for k in range(each):
            await bench.append(names[index], [events[index * each + k]])

    start = time.perf_counter()
    await asyncio.gather(*(appender(i) for i in range(len(names))))
    return len(names) * each / (time.perf_counter() - start)


# ---- 3. batched priced appends ----------------------------------------------------------------


# ---- 4. pressure checks beside a large append -----------------------------------------------


# ---- running ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    with tempfile.TemporaryDirectory(prefix="bench-appends-") as folder:
        # The server runs in its own process, as in production: the clients' gRPC work here
        # does not share its event loop.
        async with (
            served("bench.bench_appends", 2, folder) as (address, metrics_url),
            grpc.aio.insecure_channel(address) as channel,
        ):
            bench = Bench(channel, Path(folder))
            bench.address = address
            bench.metrics_url = metrics_url
            rows = [await single_client(bench, args.rounds, args.singles)]
            rows.append(await many_clients(bench, args.rounds, args.clients, args.each))
            return rows


async def serve(folder: str) -> None:
    """The benchmarked server (a child process): prints its address, serves until stdin
    closes."""
    overrides = {
        "listen": "127.0.0.1:0",
        "store": f"sqlite:///{folder}/service.db",
        "log_level": "WARNING",
        "max_resident_sessions": 0,
        "metrics_listen": "127.0.0.1:0",  # its store's own figures, scraped between phases
    }
    running = await create_server(config.load(None, environ={}, overrides=overrides))
    settle_interpreter()  # as ``compactd serve`` does
    assert running.prometheus is not None
    print(running.address, running.prometheus.url, sep="\n", flush=True)
    await until_stdin_closes()
    await running.stop(0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--singles", type=int, default=300, help="calls per round, 1 client")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--each", type=int, default=20, help="appends per client per round")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the server child: its folder
    return parser.parse_args(argv)


def readme_rows() -> list[tuple[str, str, str]]:
    """This benchmark's rows of docs/benchmarks.md, (goal, measured, reference), at its defaults."""
    return asyncio.run(run(parse_args([])))


def _show(rows: list[tuple[str, str, str]]) -> None:
    print(f"machine: {os.cpu_count()} cores")
    for goal, measured, reference in rows:
        print(f"{goal}\n    measured: {measured}\n    reference (same run): {reference}")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.serve:
        asyncio.run(serve(arguments.serve))
    else:
        _show(asyncio.run(run(arguments)))
