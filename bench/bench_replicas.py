"""Replicas: appends/s and CheckPressure latency, SQLite beside PostgreSQL, 1 and 3 replicas.

Every deployment runs as real `compactd serve` processes, all started before measuring and all
measured in the same run, round by round in a rotating order (so each sees the same machine load
over the run): SQLite with one replica, PostgreSQL with one replica, PostgreSQL with three
replicas behind a client-side round robin. SQLite with three replicas is not a deployment: the
second process is refused (``STORE_LOCKED``, one owner per file), and the bench shows that
refusal instead of a figure.

Per deployment and round:

- ``empty RPC``: a health check through replica 0 (p50): what any call costs on loopback here;
- ``appends/s, own sessions``: ``--clients`` clients, each appending single-event batches to its
  own session, the clients spread over the replicas; every call a real durable append;
- ``appends/s, one session``: the same clients all appending to one session through every
  replica at once (PostgreSQL: the session row lock orders them; a replica whose fold is stale
  catches up and retries);
- ``CheckPressure``: sequential checks on one session, round robin over the replicas (p50, p99);
  on PostgreSQL each check first compares the replica's fold with the log (one indexed read).

Figures are medians over rounds. The ratios compare deployments measured in the same run.

    python bench/bench_replicas.py [--rounds 3] [--clients 16] [--appends 40] [--checks 300]

PostgreSQL: ``COMPACTD_BENCH_POSTGRES`` (default ``postgresql://postgres@127.0.0.1:5432``); the
bench creates a database of its own and drops it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psycopg
from grpc_health.v1 import health_pb2, health_pb2_grpc

from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import compaction_service_pb2_grpc, events_pb2, session_service_pb2_grpc
from compactd.v1 import session_service_pb2 as spb

SERVER = os.environ.get("COMPACTD_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432")
_LISTENING = re.compile(r"compactd listening on (\S+)")


@dataclass
class Replica:
    proc: subprocess.Popen[str]
    address: str
    lines: list[str] = field(default_factory=list)


def start(store: str) -> Replica:
    """One `compactd serve` on a free port; waits until it listens."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPACTD_", "OTEL_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "compactd", "serve", "--listen", "127.0.0.1:0", "--store", store,
         "--log-format", "text", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if _LISTENING.search(line):
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + 60
    while not ready.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"compactd did not start: {''.join(lines)}")
    match = _LISTENING.search("".join(lines))
    assert match is not None
    return Replica(proc, match.group(1), lines)


def refused_second_owner(store: str) -> str:
    """What a second SQLite replica on the same file says (it must refuse to start)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPACTD_", "OTEL_"))}
    done = subprocess.run(
        [sys.executable, "-m", "compactd", "serve", "--listen", "127.0.0.1:0", "--store", store],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    if done.returncode == 0:
        return "started (unexpected)"
    return "refused: STORE_LOCKED" if "already owned" in done.stderr else done.stderr.strip()


@contextlib.contextmanager
def database() -> Iterator[str]:
    name = f"compactd_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{SERVER}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{SERVER}/{name}"
    finally:
        with psycopg.connect(f"{SERVER}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Deployment:
    name: str
    replicas: list[Replica]
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    figures: dict[str, list[float]] = field(default_factory=dict)

    def stub(self, i: int, kind: str) -> Any:
        channel = self.channels[i % len(self.channels)]
        if kind == "sessions":
            return session_service_pb2_grpc.SessionServiceStub(channel)
        if kind == "compaction":
            return compaction_service_pb2_grpc.CompactionServiceStub(channel)
        return health_pb2_grpc.HealthStub(channel)

    def record(self, key: str, value: float) -> None:
        self.figures.setdefault(key, []).append(value)

    def median(self, key: str) -> float:
        return statistics.median(self.figures[key])


def user(text: str) -> events_pb2.SessionEvent:
    event = events_pb2.SessionEvent()
    event.user_message.content.add().text.text = text
    return event


def pct(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def empty_rpc(d: Deployment, calls: int) -> None:
    health = d.stub(0, "health")
    samples = []
    for _ in range(calls):
        began = time.perf_counter()
        await health.Check(health_pb2.HealthCheckRequest())
        samples.append(time.perf_counter() - began)
    d.record("empty p50", pct(samples, 0.5))


async def appends(d: Deployment, round_: int, clients: int, count: int, shared: bool) -> None:
    """``clients`` concurrent appenders, spread over the replicas; events/s for them all."""
    ids = [f"r{round_}-{'shared' if shared else c}" for c in range(clients)]
    for session_id in set(ids):
        await d.stub(0, "sessions").CreateSession(spb.CreateSessionRequest(session_id=session_id))

    async def client(c: int) -> None:
        stub = d.stub(c, "sessions")
        for i in range(count):
            request = spb.AppendEventsRequest(session_id=ids[c], events=[user(f"{c}:{i}")])
            await stub.AppendEvents(request)

    began = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed = time.perf_counter() - began
    d.record("one session/s" if shared else "own sessions/s", clients * count / elapsed)


async def checks(d: Deployment, round_: int, calls: int) -> None:
    session_id = f"check-{round_}"
    await d.stub(0, "sessions").CreateSession(spb.CreateSessionRequest(session_id=session_id))
    header = events_pb2.SessionEvent(
        request_header=events_pb2.RequestHeader(
            config=events_pb2.RequestConfig(provider="openai", model="gpt-4-turbo")
        )
    )
    events = [header, *(user(f"message {i} " + "words " * 40) for i in range(50))]
    await d.stub(0, "sessions").AppendEvents(
        spb.AppendEventsRequest(session_id=session_id, events=events)
    )
    request = cpb.CheckPressureRequest(session_id=session_id)
    for i in range(len(d.channels)):  # every replica has the session cached before timing
        await d.stub(i, "compaction").CheckPressure(request)
    samples = []
    for i in range(calls):
        stub = d.stub(i, "compaction")
        began = time.perf_counter()
        await stub.CheckPressure(request)
        samples.append(time.perf_counter() - began)
    d.record("check p50", pct(samples, 0.5))
    d.record("check p99", pct(samples, 0.99))


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def report(deployments: list[Deployment], refusal: str, rounds: int) -> None:
    header = ["deployment", "own sessions", "one session", "check p50", "check p99", "empty p50"]
    rows = [
        [
            d.name,
            f"{d.median('own sessions/s'):,.0f}/s",
            f"{d.median('one session/s'):,.0f}/s",
            ms(d.median("check p50")),
            ms(d.median("check p99")),
            ms(d.median("empty p50")),
        ]
        for d in deployments
    ]
    rows.append(["sqlite x3", refusal, "", "", "", ""])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\nappends (single-event batches) and CheckPressure, medians of {rounds} rounds")
    for row in [header, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    by = {d.name: d for d in deployments}
    sqlite, pg1, pg3 = by["sqlite x1"], by["postgresql x1"], by["postgresql x3"]
    print("\nratios (same run)")
    for key in ("own sessions/s", "one session/s"):
        vs_sqlite = pg1.median(key) / sqlite.median(key)
        vs_one = pg3.median(key) / pg1.median(key)
        print(f"  {key:15} postgresql x1 / sqlite x1 = {vs_sqlite:.2f}x", end="")
        print(f"   postgresql x3 / postgresql x1 = {vs_one:.2f}x")
    for d in deployments:
        ratio = d.median("check p50") / d.median("empty p50")
        print(f"  CheckPressure p50 / empty RPC p50, {d.name}: {ratio:.2f}x")


async def measure(deployments: list[Deployment], args: argparse.Namespace) -> None:
    for d in deployments:
        d.channels = [grpc.aio.insecure_channel(r.address) for r in d.replicas]
    try:
        for round_ in range(args.rounds):
            shift = round_ % len(deployments)
            for d in deployments[shift:] + deployments[:shift]:
                await empty_rpc(d, 200)
                await appends(d, round_, args.clients, args.appends, shared=False)
                await appends(d, round_, args.clients, args.appends, shared=True)
                await checks(d, round_, args.checks)
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for d in deployments:
            for channel in d.channels:
                await channel.close(None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16, help="concurrent appenders")
    parser.add_argument("--appends", type=int, default=40, help="appends per client per round")
    parser.add_argument("--checks", type=int, default=300, help="CheckPressure calls per round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, database() as pg1_url, database() as pg3_url:
        sqlite_url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        started: list[Replica] = []
        try:
            sqlite = Deployment("sqlite x1", [start(sqlite_url)])
            started += sqlite.replicas
            refusal = refused_second_owner(sqlite_url)
            pg1 = Deployment("postgresql x1", [start(pg1_url)])
            started += pg1.replicas
            pg3 = Deployment("postgresql x3", [start(pg3_url) for _ in range(3)])
            started += pg3.replicas
            deployments = [sqlite, pg1, pg3]
            asyncio.run(measure(deployments, args))
        finally:
            for replica in started:
                replica.proc.terminate()
            for replica in started:
                replica.proc.wait(30)
    report(deployments, refusal, args.rounds)


if __name__ == "__main__":
    main()
