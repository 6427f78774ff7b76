"""PrepareStep below pressure against session length, beside an empty RPC in the same run.

One server (``create_server`` on port 0, memory store) and one session that grows to 100, 1,000,
10,000 and 100,000 events of the shared agent transcripts (as ``bench_pressure`` builds it: each
assistant message inside its own step of one open turn). The route ``bench/wide`` has a
10^9-token window, so every size stays below pressure: PrepareStep has nothing to do but measure.

At each size, ``--calls`` rounds run call by call, each round in an order that alternates: an
empty unary RPC (a health check), and ``PrepareStep`` the way a runtime that holds its
conversation calls it (``held_revision`` set to the revision of the request it holds, so the
result carries no full request when compactd changed nothing). A third column,
``PrepareStep`` without ``held_revision`` (an old client: the full request every step, in the
first ``--full-calls`` rounds only), shows what the held revision saves. A fourth, one empty
message streamed by a bare grpc.aio server (no interceptors), is the floor of any
server-streaming call here. Every call is timed from the client's side, its stream drained.

    python -m bench.bench_steps [--sizes 100,1000,10000,100000] [--calls 400] [--full-calls 20]

``readme_rows()`` returns the README rows (goal, measured, reference): ``python -m bench.readme``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.bench_pressure import BATCH, conversations, fmt, in_steps, surface_events, table
from compactd import config
from compactd.api.server import create_server
from compactd.v1 import (
    compaction_service_pb2,
    compaction_service_pb2_grpc,
    events_pb2,
    session_service_pb2,
    session_service_pb2_grpc,
)

PROVIDER, MODEL = "bench", "wide"
SIZES = (100, 1_000, 10_000, 100_000)
WIDE_ROUTE = {
    "provider": PROVIDER,
    "model": MODEL,
    "context_window": 10**9,
    "max_output_tokens": 4096,
    "tokenizer": "cl100k_base",
}
OVERRIDES: dict[str, Any] = {
    "listen": "127.0.0.1:0",
    "store": "memory://",
    "log_level": "WARNING",
    "max_batch_events": 4 * BATCH,
    # 100,000 transcript events make a surface far over the default limits: this bench measures
    # how steps scale, so it lifts the read bound to the largest gRPC message.
    "max_message_bytes": 2**31 - 1,
    "max_surface_bytes": 2**31 - 1 - 2**20,
    "routes": [WIDE_ROUTE],
}


@dataclass(frozen=True)
class StepRow:
    """One session length: p50/p99 seconds of each call kind, measured interleaved."""

    events: int
    empty: tuple[float, float]
    held: tuple[float, float]
    full: tuple[float, float]
    bare_stream: tuple[float, float]  # one empty message on a bare grpc.aio server

    @property
    def ratio(self) -> float:
        """PrepareStep (held revision) p50 / empty RPC p50."""
        return self.held[0] / self.empty[0]


def _pcts(samples: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _timed(call: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


def _identity(data: bytes) -> bytes:
    return data


async def _bare_stream_server() -> tuple[grpc.aio.Server, str]:
    """A grpc.aio server with no interceptors whose one method streams one empty message: the
    floor of any server-streaming call on this stack (PrepareStep streams its result)."""

    async def one(request: bytes, context: object) -> AsyncIterator[bytes]:
        yield b""

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(
        one, request_deserializer=_identity, response_serializer=_identity
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Bare", {"Stream": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def measure(
    sizes: Sequence[int] = SIZES, calls: int = 400, full_calls: int = 20
) -> list[StepRow]:
    """PrepareStep (held revision and, in the first ``full_calls`` rounds, full), and an empty
    RPC, interleaved at each size."""
    running = await create_server(config.load(None, environ={}, overrides=OVERRIDES))
    bare, bare_address = await _bare_stream_server()
    bare_channel = grpc.aio.insecure_channel(bare_address)
    bare_call = bare_channel.unary_stream(
        "/bench.Bare/Stream", request_serializer=_identity, response_deserializer=_identity
    )

    async def bare_stream() -> object:
        return [message async for message in bare_call(b"")]

    rows: list[StepRow] = []
    try:
        unbounded = [("grpc.max_receive_message_length", -1)]  # the full request at 100k events
        async with grpc.aio.insecure_channel(running.address, options=unbounded) as channel:
            sessions = session_service_pb2_grpc.SessionServiceStub(channel)
            compaction = compaction_service_pb2_grpc.CompactionServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            await sessions.CreateSession(
                session_service_pb2.CreateSessionRequest(session_id="bench")
            )
            steps = itertools.count(1)

            async def append(batch: list[events_pb2.SessionEvent]) -> None:
                request = session_service_pb2.AppendEventsRequest(
                    session_id="bench", events=in_steps(batch, steps)
                )
                await sessions.AppendEvents(request)

            header = events_pb2.RequestHeader(
                config=events_pb2.RequestConfig(provider=PROVIDER, model=MODEL)
            )
            opening = events_pb2.SessionEvent(turn_start=events_pb2.TurnStart(turn=1))
            await append([opening, events_pb2.SessionEvent(request_header=header)])

            async def step(held: int | None) -> compaction_service_pb2.PrepareStepResult:
                request = compaction_service_pb2.PrepareStepRequest(session_id="bench", turn=1)
                if held is not None:
                    request.held_revision = held
                result = None
                async for response in compaction.PrepareStep(request):
                    if response.HasField("result"):
                        result = response.result
                assert result is not None
                return result

            async def empty() -> object:
                return await health.Check(health_pb2.HealthCheckRequest())

            source, have = surface_events(conversations()), 2
            for size in sizes:
                while have < size:
                    batch = [next(source) for _ in range(min(BATCH, size - have))]
                    await append(batch)
                    have += len(batch)
                first = await step(None)  # the runtime's request: it holds this revision now
                assert first.before.state == compaction_service_pb2.PRESSURE_STATE_BELOW
                held = first.request.revision
                again = await step(held)
                assert again.request_unchanged
                assert not again.HasField("request")
                kinds: list[Callable[[], Awaitable[object]]] = [
                    empty,
                    functools.partial(step, held),
                    functools.partial(step, None),
                    bare_stream,
                ]
                samples: list[list[float]] = [[], [], [], []]
                for round_ in range(calls):
                    order = [0, 1, 2, 3] if round_ % 2 == 0 else [3, 2, 1, 0]
                    if round_ >= full_calls:  # the full request costs seconds at 100k events
                        order.remove(2)
                    for kind in order:
                        samples[kind].append(await _timed(kinds[kind]))
                rows.append(StepRow(size, *(_pcts(s) for s in samples)))
    finally:
        await bare_channel.close(None)
        await bare.stop(0)
        await running.stop(0)
    return rows


def readme_rows(sizes: Sequence[int] = SIZES, calls: int = 400) -> list[tuple[str, str, str]]:
    """README rows (goal, measured, reference), from one run of ``measure``."""
    measured = asyncio.run(measure(sizes, calls))
    full = ", ".join(f"{row.full[0] / row.empty[0]:.0f}x" for row in measured)
    ratios = ", ".join(f"{row.ratio:.2f}x at {row.events:,}" for row in measured)
    empties = ", ".join(fmt(row.empty[0]).strip() for row in measured)
    return [
        (
            "PrepareStep below pressure ≤ 1.2x an empty RPC, flat from 100 to 100k events",
            f"p50 {ratios} events",
            f"an empty unary RPC (health check), interleaved call by call: p50 {empties} "
            f"(without held_revision, the full request every step: {full}); the floor of a "
            "server-streaming call, one empty message on a bare grpc.aio server: "
            + ", ".join(f"{row.bare_stream[0] / row.empty[0]:.2f}x" for row in measured),
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="session lengths")
    parser.add_argument("--calls", type=int, default=400, help="rounds per size")
    parser.add_argument("--full-calls", type=int, default=20, help="rounds with a full request")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    started = time.perf_counter()
    measured = asyncio.run(measure(sizes, args.calls, args.full_calls))
    table(
        "PrepareStep below pressure vs an empty RPC, interleaved call by call (p50 / p99)",
        ["events", "empty RPC", "PrepareStep held", "held/empty", "PrepareStep full",
         "full/empty", "bare stream", "bare/empty"],
        [
            (
                f"{row.events:,}",
                f"{fmt(row.empty[0])} / {fmt(row.empty[1])}",
                f"{fmt(row.held[0])} / {fmt(row.held[1])}",
                f"{row.ratio:5.2f}x",
                f"{fmt(row.full[0])} / {fmt(row.full[1])}",
                f"{row.full[0] / row.empty[0]:6.2f}x",
                f"{fmt(row.bare_stream[0])} / {fmt(row.bare_stream[1])}",
                f"{row.bare_stream[0] / row.empty[0]:5.2f}x",
            )
            for row in measured
        ],
    )  # fmt: skip
    print(f"\ndone in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
