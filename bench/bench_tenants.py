"""A noisy tenant against a quiet one: the quiet tenant's CheckPressure p99 while another floods.

One server (in this process, SQLite in a temporary folder, each tenant authenticated by its own
bearer token through the real ``auth_tokens`` setting) with ``[quotas] appends_per_second`` set
for every tenant but ``quiet`` and ``unlimited``. A flooder in a second process runs
``--flooders`` concurrent ``AppendEvents`` loops as fast as the server answers, ignoring
``RetryInfo`` (a hostile or broken client), as one of two tenants: ``noisy`` (held to the quota)
or ``unlimited`` (no quota: what the server would face without one). The quiet tenant times
``CheckPressure`` on its own session from this process.

The three phases (idle, noisy flood, unlimited flood) are interleaved batch by batch in one run,
in an order that rotates each round, so every figure sees the same machine, heap and store. The
table prints each phase's p50 and p99, the p99's ratio to the idle p99 (the goal for the
throttled flood: at most 2x), and how many of the flooder's appends per second were admitted
and refused.

    python bench/bench_tenants.py [--rounds 10] [--checks 200] [--flooders 8] [--rate 50]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from compactd import config
from compactd.api.auth import hash_token
from compactd.api.server import create_server
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.compaction_service_pb2_grpc import CompactionServiceStub
from compactd.v1.session_service_pb2_grpc import SessionServiceStub

if TYPE_CHECKING:  # the stubs' asyncio types are in their .pyi only
    from compactd.v1.compaction_service_pb2_grpc import CompactionServiceAsyncStub
    from compactd.v1.session_service_pb2_grpc import SessionServiceAsyncStub

ROUTE = {"provider": "local", "model": "w128k", "context_window": 128_000}
PAUSE, NOISY, UNLIMITED, STOP = 0, 1, 2, -1
PHASES = {"idle": PAUSE, "noisy flood (quota)": NOISY, "unlimited flood (no quota)": UNLIMITED}
TENANTS = {NOISY: "noisy", UNLIMITED: "unlimited"}


def token(tenant: str) -> str:
    """The bench's bearer token of ``tenant``."""
    return f"bench-{tenant}-token-5f3e8a1c"


def as_tenant(tenant: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates as ``tenant``."""
    return (("authorization", f"Bearer {token(tenant)}"),)


def _user(text: str) -> events_pb2.SessionEvent:
    block = events_pb2.ContentBlock(text=events_pb2.TextBlock(text=text))
    return events_pb2.SessionEvent(user_message=events_pb2.UserMessage(content=[block]))


def _setup_events() -> list[events_pb2.SessionEvent]:
    header = events_pb2.RequestHeader(
        config=events_pb2.RequestConfig(provider="local", model="w128k")
    )
    return [
        events_pb2.SessionEvent(system_message=events_pb2.SystemMessage(text="You help.")),
        events_pb2.SessionEvent(request_header=header),
        *(_user(f"question {index}: " + "words " * 40) for index in range(50)),
    ]


# ---- the flooder (its own process) -------------------------------------------------------------


def flood(address: str, sessions: dict[int, str], mode: Synchronized[int],
          counts: Any, flooders: int, ready: Any) -> None:  # fmt: skip
    """Run ``flooders`` append loops as the tenant ``mode`` names until ``mode`` is STOP."""
    asyncio.run(_flood(address, sessions, mode, counts, flooders, ready))


async def _flood(address: str, sessions: dict[int, str], mode: Synchronized[int],
                 counts: Any, flooders: int, ready: Any) -> None:  # fmt: skip
    async with grpc.aio.insecure_channel(address) as channel:
        stub = SessionServiceStub(channel)
        await channel.channel_ready()
        ready.set()  # the phases may start
        await asyncio.gather(*(_loop(stub, sessions, mode, counts) for _ in range(flooders)))


async def _loop(stub: SessionServiceAsyncStub, sessions: dict[int, str], mode: Synchronized[int],
                counts: Any) -> None:  # fmt: skip
    index = 0
    while (current := mode.value) != STOP:
        if current == PAUSE:
            await asyncio.sleep(0.005)
            continue
        index += 1
        request = pb.AppendEventsRequest(session_id=sessions[current], events=[_user(f"f{index}")])
        try:
            await stub.AppendEvents(request, metadata=as_tenant(TENANTS[current]))
            counts[current * 2] += 1
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            counts[current * 2 + 1] += 1


# ---- the quiet tenant (this process, with the server) ------------------------------------------


async def _session(stub: SessionServiceAsyncStub, tenant: str) -> str:
    metadata = as_tenant(tenant)
    created = await stub.CreateSession(pb.CreateSessionRequest(), metadata=metadata)
    sid = created.session.session_id
    request = pb.AppendEventsRequest(session_id=sid, events=_setup_events())
    await stub.AppendEvents(request, metadata=metadata)
    return sid


async def _checks(compaction: CompactionServiceAsyncStub, sid: str, count: int) -> list[float]:
    request, metadata, times = cpb.CheckPressureRequest(session_id=sid), as_tenant("quiet"), []
    for _ in range(count):
        started = time.perf_counter()
        await compaction.CheckPressure(request, metadata=metadata)
        times.append(time.perf_counter() - started)
    return times


def _p(samples: Sequence[float], q: float) -> float:
    return statistics.quantiles(samples, n=1000, method="inclusive")[int(q * 1000) - 1]


async def run(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    quotas = {
        "appends_per_second": args.rate,
        "append_burst": max(1, int(args.rate // 5)),
        "tenants": {"quiet": {"appends_per_second": 0}, "unlimited": {"appends_per_second": 0}},
    }
    server_config = config.load(
        None,
        environ={},
        overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{folder / 'bench.db'}"},
    )
    tokens = {tenant: hash_token(token(tenant)) for tenant in ("quiet", *TENANTS.values())}
    server = await create_server(
        dataclasses.replace(server_config, routes=(ROUTE,), quotas=quotas, auth_tokens=tokens)
    )
    context = multiprocessing.get_context("spawn")
    mode = context.Value("i", PAUSE)
    counts = context.Array("l", 6)  # admitted and refused, by tenant
    ready = context.Event()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            sessions, compaction = SessionServiceStub(channel), CompactionServiceStub(channel)
            quiet = await _session(sessions, "quiet")
            targets = {NOISY: await _session(sessions, "noisy"),
                       UNLIMITED: await _session(sessions, "unlimited")}  # fmt: skip
            flooder = context.Process(
                target=flood, args=(server.address, targets, mode, counts, args.flooders, ready)
            )
            flooder.start()
            # The child imports compactd and connects before the first phase.
            await asyncio.to_thread(ready.wait, 120)
            samples, seconds = await _interleaved(compaction, quiet, mode, args)
            mode.value = STOP
            await asyncio.to_thread(flooder.join, 30)
    finally:
        await server.stop(0)
    _report(samples, seconds, counts, args)


async def _interleaved(
    compaction: CompactionServiceAsyncStub,
    sid: str,
    mode: Synchronized[int],
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    await _checks(compaction, sid, 50)  # warm the session and the channel
    names = list(PHASES)
    samples: dict[str, list[float]] = {name: [] for name in names}
    seconds = dict.fromkeys(names, 0.0)
    for round_ in range(args.rounds):
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            mode.value = PHASES[name]
            await asyncio.sleep(args.settle)  # the flood (or its end) reaches the server
            started = time.perf_counter()
            samples[name] += await _checks(compaction, sid, args.checks)
            seconds[name] += time.perf_counter() - started + args.settle
    mode.value = PAUSE
    return samples, seconds


def _report(
    samples: dict[str, list[float]], seconds: dict[str, float], counts: Any,
    args: argparse.Namespace,
) -> None:  # fmt: skip
    idle = _p(samples["idle"], 0.99)
    print(
        f"\nQuiet tenant's CheckPressure while another floods AppendEvents ({args.flooders} "
        f"loops, quota {args.rate:g}/s), {args.rounds} interleaved rounds of {args.checks}"
    )
    print("| phase | checks | p50 | p99 | p99 / idle p99 | flooder admitted/s | refused/s |")
    print("|---|---|---|---|---|---|---|")
    for name, phase in PHASES.items():
        times = samples[name]
        p50, p99 = statistics.median(times), _p(times, 0.99)
        admitted = refused = "-"
        if phase != PAUSE:
            admitted = f"{counts[phase * 2] / seconds[name]:.0f}"
            refused = f"{counts[phase * 2 + 1] / seconds[name]:.0f}"
        print(f"| {name} | {len(times)} | {p50 * 1e3:.2f} ms | {p99 * 1e3:.2f} ms | "
              f"{p99 / idle:.2f}x | {admitted} | {refused} |")  # fmt: skip
    print("\ngoal: the noisy flood's p99 at most 2x the idle p99")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--checks", type=int, default=200, help="CheckPressure calls per phase")
    parser.add_argument("--flooders", type=int, default=8, help="concurrent append loops")
    parser.add_argument("--rate", type=float, default=50.0, help="the noisy tenant's appends/s")
    parser.add_argument("--settle", type=float, default=0.2, help="seconds before timing a phase")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
