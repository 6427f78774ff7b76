"""compactd's per-call cost against bare servers doing the same work, in one run.

Three servers, each a process of its own on loopback, started side by side and driven in turn
from this one client process: 5 rounds, the servers' order rotating each round, and in a round
each measure taken in 5 slices, the servers taking turns slice by slice (the machine is shared:
each server meets the load of the same moments). A server's rate is the median of its rounds.

- compactd at its shipped defaults (SQLite store, ``synchronous=FULL``, in a temporary folder;
  no credentials: every call runs as the default tenant, as a sidecar does);
- ``bench.reference_server --mode aio``: a bare ``grpc.aio`` server that parses the request,
  serializes the rows and group-commits them (WAL, FULL) before answering;
- ``bench.reference_server --mode sync``: the same handler in a sync ``grpc.server`` with 64
  threads.

All three serve the same methods under the same names, so one set of stubs calls each. Two
calls: the empty call (health ``Check``, as every other bench's empty RPC) and a single-event
``AppendEvents`` of a transcript user message (the repository's transcripts, the same events
for each server), one session per caller. Two loads: 1 client calling back to back, and 64
clients over 8 connections (8 callers on each), each caller with its own session. Goals:
compactd's empty call ≥ 0.8x the bare aio server's rate, at 1 and at 64 clients; its one-event
appends ≥ 0.85x at 1 client and ≥ 0.8x at 64. The sync server's rate is printed beside: what
another server model reaches on the same cores.

    python -m bench.bench_percall [--rounds 5] [--singles 400] [--each 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.children import served, until_stdin_closes
from bench.corpus import SessionEvent, surface_events, turn_start
from compactd import config
from compactd.api.server import create_server, settle_interpreter
from compactd.v1 import session_service_pb2, session_service_pb2_grpc

SERVERS = ("compactd", "bare aio", "sync, 64 threads")
#: ``--experiment``: the bare aio handler appending through compactd's own store.
EXPERIMENT = "bare aio + compactd's store"
CONNECTIONS = 8
SLICES = 5  # turns each server takes per load and call in a round
#: (name, clients); the figures are per load and call.
LOADS = (("1 client", 1), ("64 clients", 64))
CALLS = ("empty", "append")
#: Goals against the bare aio server: (load, call) -> least ratio.
GOALS = {
    ("1 client", "empty"): 0.8,
    ("64 clients", "empty"): 0.8,
    ("1 client", "append"): 0.85,
    ("64 clients", "append"): 0.8,
}


@dataclass
class Target:
    """One server's channels (``CONNECTIONS`` connections) and stubs."""

    name: str
    channels: list[grpc.aio.Channel]
    names: Iterator[int] = field(default_factory=itertools.count)

    def sessions(self, index: int) -> session_service_pb2_grpc.SessionServiceAsyncStub:
        return session_service_pb2_grpc.SessionServiceStub(
            self.channels[index % len(self.channels)]
        )

    def health(self, index: int) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self.channels[index % len(self.channels)])

    async def session(self) -> str:
        """A fresh session, opened with a turn start (not timed)."""
        name = f"s{next(self.names)}"
        stub = self.sessions(0)
        await stub.CreateSession(session_service_pb2.CreateSessionRequest(session_id=name))
        await stub.AppendEvents(
            session_service_pb2.AppendEventsRequest(session_id=name, events=[turn_start()])
        )
        return name


@contextlib.asynccontextmanager
async def _target(name: str, address: str) -> AsyncIterator[Target]:
    # A local subchannel pool each: otherwise channels to one address share one connection.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(CONNECTIONS)]
    try:
        for channel in channels:
            await channel.channel_ready()
        yield Target(name, channels)
    finally:
        for channel in channels:
            await channel.close(None)


#: One call of a caller: ``call(caller, k)`` makes caller's ``k``-th call.
Call = Callable[[int, int], Awaitable[object]]


async def _elapsed(callers: int, calls: range, call: Call) -> float:
    """Seconds ``callers`` concurrent callers take to make ``call(caller, k)`` for each ``k`` in
    ``calls``, back to back."""

    async def caller(index: int) -> None:
        for k in calls:
            await call(index, k)

    start = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    return time.perf_counter() - start


def empties(target: Target, callers: int) -> Call:
    """The empty call (health ``Check``) of caller ``i``."""
    empty = health_pb2.HealthCheckRequest()
    stubs = [target.health(i) for i in range(callers)]
    return lambda i, _: stubs[i].Check(empty)


async def appends(target: Target, events: list[list[SessionEvent]]) -> Call:
    """The single-event append ``k`` of caller ``i``: ``events[i][k]``, to a session of the
    caller's own (its session and its requests made here, before any clock starts)."""
    names = [await target.session() for _ in events]
    stubs = [target.sessions(i) for i in range(len(events))]
    requests = [
        [session_service_pb2.AppendEventsRequest(session_id=n, events=[e]) for e in mine]
        for n, mine in zip(names, events, strict=True)
    ]
    return lambda i, k: stubs[i].AppendEvents(requests[i][k])


# ---- rounds ------------------------------------------------------------------------------------

#: (load, call) -> server -> rates, one per round.
Rates = dict[tuple[str, str], dict[str, list[float]]]


async def measure(targets: list[Target], args: argparse.Namespace) -> Rates:
    source = (e for e in surface_events() if e.HasField("user_message"))
    rates: Rates = {
        (load, call): {t.name: [] for t in targets} for load, _ in LOADS for call in CALLS
    }
    warmup = (args.warmup, max(SLICES, args.warmup // 10))
    await _round(targets, source, args, {}, warmup)  # connections, code paths
    for round_ in range(args.rounds):
        order = targets[round_ % len(targets) :] + targets[: round_ % len(targets)]
        await _round(order, source, args, rates, (args.singles, args.each))
    return rates


async def _round(
    targets: list[Target],
    source: Iterator[SessionEvent],
    args: argparse.Namespace,
    rates: Rates,
    calls: tuple[int, int],
) -> None:
    """One round: every load and call on every server, the servers taking turns slice by slice
    (``SLICES`` per round) so that each meets the machine's load of the same moments; the same
    events for each server."""
    for load, callers in LOADS:
        count = calls[0] if callers == 1 else calls[1]
        events = [[next(source) for _ in range(count)] for _ in range(callers)]
        for call in CALLS:
            made = {
                t.name: await appends(t, events) if call == "append" else empties(t, callers)
                for t in targets
            }
            spent = dict.fromkeys(made, 0.0)
            for part in range(SLICES):
                ks = range(part * count // SLICES, (part + 1) * count // SLICES)
                for target in targets:
                    spent[target.name] += await _elapsed(callers, ks, made[target.name])
            for name, seconds in spent.items():
                rates.get((load, call), {}).setdefault(name, []).append(callers * count / seconds)


async def run(args: argparse.Namespace) -> Rates:
    with tempfile.TemporaryDirectory(prefix="bench-percall-") as folder:
        async with contextlib.AsyncExitStack() as stack:
            compactd = await stack.enter_async_context(served("bench.bench_percall", 1, folder))
            aio = await stack.enter_async_context(
                served("bench.reference_server", 1, folder, "--mode", "aio")
            )
            sync = await stack.enter_async_context(
                served("bench.reference_server", 1, folder, "--mode", "sync")
            )
            servers = [(SERVERS[0], compactd), (SERVERS[1], aio), (SERVERS[2], sync)]
            if args.experiment:
                store = await stack.enter_async_context(
                    served("bench.reference_server", 1, folder, "--mode", "store")
                )
                servers.append((EXPERIMENT, store))
            targets = [
                await stack.enter_async_context(_target(name, address[0]))
                for name, address in servers
            ]
            return await measure(targets, args)


async def serve(folder: str) -> None:
    """compactd at its shipped defaults (a child process): prints its address, serves until
    stdin closes."""
    overrides = {
        "listen": "127.0.0.1:0",
        "store": f"sqlite:///{folder}/compactd.db",
        "log_level": "WARNING",
    }
    running = await create_server(config.load(None, environ={}, overrides=overrides))
    settle_interpreter()  # as ``compactd serve`` does
    print(running.address, flush=True)
    await until_stdin_closes()
    await running.stop(0)


# ---- reporting ---------------------------------------------------------------------------------


def medians(rates: Rates) -> dict[tuple[str, str], dict[str, float]]:
    return {key: {s: statistics.median(r) for s, r in by.items()} for key, by in rates.items()}


def table(rates: Rates) -> str:
    """The rates side by side, and compactd's ratios to each reference."""
    m = medians(rates)
    keys = [(load, call) for load, _ in LOADS for call in CALLS]
    head = " | ".join(f"{load}: {call} calls/s" for load, call in keys)
    lines = [f"| server | {head} |", "|---|" + "---|" * len(keys)]
    for server in m[keys[0]]:
        lines.append(f"| {server} | " + " | ".join(f"{m[k][server]:,.0f}" for k in keys) + " |")
    for reference in list(m[keys[0]])[1:]:
        ratios = " | ".join(f"{m[k][SERVERS[0]] / m[k][reference]:.2f}x" for k in keys)
        lines.append(f"| compactd / {reference} | {ratios} |")
    return "\n".join(lines)


def rows(rates: Rates) -> list[tuple[str, str, str]]:
    m = medians(rates)
    out = []
    for (load, call), least in GOALS.items():
        c, a, s = (m[(load, call)][server] for server in SERVERS)
        what = "the empty call (health Check)" if call == "empty" else "single-event AppendEvents"
        out.append(
            (
                f"{what}, {load}{' over 8 connections' if load != '1 client' else ''}: "
                f"compactd ≥ {least}x a bare grpc.aio server",
                f"{c:,.0f}/s = {c / a:.2f}x the bare aio server, {c / s:.2f}x the sync one",
                f"bare grpc.aio server {a:,.0f}/s; the same handler in a sync grpc.server with 64 "
                f"threads {s:,.0f}/s (each in its own process, SQLite FULL group commit)",
            )
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--singles", type=int, default=400, help="calls per round, 1 client")
    parser.add_argument("--each", type=int, default=30, help="calls per caller, 64 clients")
    parser.add_argument("--warmup", type=int, default=200, help="calls of the untimed round")
    parser.add_argument(
        "--experiment", action="store_true", help="also the bare handler over compactd's store"
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # compactd's child: its folder
    return parser.parse_args(argv)


def readme_rows() -> list[tuple[str, str, str]]:
    """This benchmark's rows of docs/benchmarks.md, (goal, measured, reference), at its defaults."""
    return rows(asyncio.run(run(parse_args([]))))


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.serve:
        asyncio.run(serve(arguments.serve))
    else:
        measured = asyncio.run(run(arguments))
        print(table(measured))
        for goal, figure, reference in rows(measured):
            print(f"{goal}\n    measured: {figure}\n    reference (same run): {reference}")
        sys.stdout.flush()
