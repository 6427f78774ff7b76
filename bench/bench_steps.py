"""PrepareStep below pressure against session length, beside an empty RPC in the same run.

One server (``create_server`` on port 0, memory store, the interpreter settled as ``compactd
serve`` settles it), in a child process as in production (the client's gRPC work does not share
its event loop or its GIL), and one session that grows to 100, 1,000, 10,000 and 100,000 events
of the shared agent transcripts (as ``bench_pressure`` builds it: each assistant message inside
its own step of one open turn). The route ``bench/wide`` has a 10^9-token window, so every size
stays below pressure: PrepareStep has nothing to do but measure.

At each size, ``--calls`` rounds run call by call, each round in an order that alternates:

- an empty unary RPC (a health check): the goal's reference;
- ``PrepareStepUnary`` the way a runtime that holds its conversation calls it (``held_revision``
  set to the revision of the request it holds, so the result carries no full request when
  compactd changed nothing): the goal's call, PrepareStep answered in one message;
- ``PrepareStep``, the streamed step, with the same held revision;
- ``PrepareStep`` without ``held_revision`` (an old client: the full request every step, in the
  first ``--full-calls`` rounds only), to show what the held revision saves;
- the empty RPC of PrepareStep's own shape: a no-op server-streaming method served by the same
  server behind the same interceptors (named under ``compactd.v1.CompactionService`` so the
  per-session stream limit and the tenant's stream quota count it as they count PrepareStep; it
  decodes a ``PrepareStepRequest`` and writes one empty ``PrepareStepResponse``);
- the Python client's default step, ``prepare_step(session, turn)`` (asyncio and blocking
  clients, each on its own channel): the call a runtime makes, which holds the session's
  request, sends its revision and appends the answered messages to it (one PrepareStepUnary);
- the TypeScript and Go clients' default step (``prepareStep(session, turn)``,
  ``PrepareStep(ctx, session, turn, nil)``), each timed by a driver in its own language
  (``bench/step_drivers.py``) beside an empty unary RPC (a health check) sent from the same
  process, interleaved call by call, after the Python rounds of each size; with a progress
  callback too (the streamed step, as the examples call it);
- grpc.aio's own floor: one empty unary call and one server-streaming call of one empty message
  on a bare grpc.aio server (no interceptors). A server-streaming call costs 1.2 to 1.5x a unary one
  there (two batches on the server, message then status, and more reads on the client), up to
  more than the goal's 1.2x: so the goal is measured on the unary step, and the streamed step is
  compared with the empty RPC of its own shape.

Every call is timed from the client's side (this process, or the language's driver), its
stream drained; the bare server runs in the child process too. The drivers need node with
clients/typescript/node_modules and Debian's Go (``clients/setup``); ``--python-only`` leaves
them out.

    python -m bench.bench_steps [--sizes 100,1000,10000,100000] [--calls 400] [--full-calls 20]
                                [--python-only]

``readme_rows()`` returns rows of docs/benchmarks.md (goal, measured, reference):
``python -m bench.readme``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from compactd_client import AsyncCompactdClient, CompactdClient, PreparedStep
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.bench_pressure import BATCH, conversations, fmt, in_steps, surface_events, table
from bench.children import identity, served, until_stdin_closes
from bench.step_drivers import Driver, DriverTimings, drivers
from compactd import config
from compactd.api.server import create_server, settle_interpreter
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
class ClientRow:
    """Another language's default step at one session length: p50/p99 seconds, measured by its
    driver against an empty RPC from the same process, interleaved."""

    language: str
    empty: tuple[float, float]  # an empty unary RPC (health check) from the driver's process
    step: tuple[float, float]  # the client's default step (PrepareStepUnary, held revision)
    streamed: tuple[float, float]  # the same with a progress callback (streamed, held)
    unary: tuple[float, float]  # the client's bare PrepareStepUnary, held revision, nothing held
    reply_bytes: int  # the largest timed step's result, serialized

    @classmethod
    def of(cls, language: str, timings: DriverTimings) -> ClientRow:
        assert timings.unchanged  # every timed step answered from the held request
        return cls(
            language, _pcts(timings.empty), _pcts(timings.step), _pcts(timings.streamed),
            _pcts(timings.unary), timings.reply_bytes,
        )  # fmt: skip

    @property
    def ratio(self) -> float:
        """The default step's p50 / the same process's empty RPC p50: the goal."""
        return self.step[0] / self.empty[0]

    @property
    def unary_ratio(self) -> float:
        """The bare PrepareStepUnary's p50 / the empty RPC p50: the server's share."""
        return self.unary[0] / self.empty[0]

    @property
    def streamed_ratio(self) -> float:
        """The streamed (progress callback) step's p50 / the empty RPC p50."""
        return self.streamed[0] / self.empty[0]


@dataclass(frozen=True)
class StepRow:
    """One session length: p50/p99 seconds of each call kind, measured interleaved."""

    events: int
    empty: tuple[float, float]  # an empty unary RPC behind the interceptors (health check)
    unary: tuple[float, float]  # PrepareStepUnary, held revision
    held: tuple[float, float]  # PrepareStep (streamed), held revision
    full: tuple[float, float]  # PrepareStep (streamed), no held revision
    empty_stream: tuple[float, float]  # a no-op of PrepareStep's shape behind the interceptors
    bare_unary: tuple[float, float]  # one empty unary call on a bare grpc.aio server
    bare_stream: tuple[float, float]  # one empty message streamed by a bare grpc.aio server
    client: tuple[float, float]  # AsyncCompactdClient.prepare_step, the default (held) path
    sync_client: tuple[float, float]  # CompactdClient.prepare_step, the default (held) path
    # The TypeScript and Go clients' default step (keyword-only: the fields above are positional).
    clients: tuple[ClientRow, ...] = field(default=(), kw_only=True)

    @property
    def ratio(self) -> float:
        """PrepareStepUnary (held revision) p50 / empty unary RPC p50: the goal."""
        return self.unary[0] / self.empty[0]

    @property
    def held_ratio(self) -> float:
        """PrepareStep (streamed, held revision) p50 / empty unary RPC p50."""
        return self.held[0] / self.empty[0]

    @property
    def stream_ratio(self) -> float:
        """PrepareStep (streamed, held revision) p50 / empty server-streaming RPC p50."""
        return self.held[0] / self.empty_stream[0]

    @property
    def client_ratio(self) -> float:
        """The asyncio client's default ``prepare_step`` p50 / empty unary RPC p50."""
        return self.client[0] / self.empty[0]

    @property
    def sync_client_ratio(self) -> float:
        """The blocking client's default ``prepare_step`` p50 / empty unary RPC p50."""
        return self.sync_client[0] / self.empty[0]

    @property
    def floor(self) -> float:
        """grpc.aio's own cost of streaming: bare server-streaming p50 / bare unary p50."""
        return self.bare_stream[0] / self.bare_unary[0]


def _pcts(samples: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _timed(call: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


async def _bare_server() -> tuple[grpc.aio.Server, str]:
    """A grpc.aio server with no interceptors: ``Unary`` answers an empty message, ``Stream``
    streams one; grpc.aio's own floor of each call shape (PrepareStep streams its result)."""

    async def unary(request: bytes, context: object) -> bytes:
        return b""

    async def one(request: bytes, context: object) -> AsyncIterator[bytes]:
        yield b""

    server = grpc.aio.server()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=identity, response_serializer=identity
        ),
        "Stream": grpc.unary_stream_rpc_method_handler(
            one, request_deserializer=identity, response_serializer=identity
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bare", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


FULL = 3  # the kind without a held revision, in ``measure``
EMPTY_STREAM = "EmptyStep"  # the no-op's method, under compactd.v1.CompactionService


def _empty_stream_handlers() -> grpc.GenericRpcHandler[Any, Any]:
    """A server-streaming no-op of PrepareStep's shape: decodes its request, writes one empty
    response through ``context.write`` (as PrepareStep does), and returns."""

    async def empty_step(
        request: compaction_service_pb2.PrepareStepRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        await context.write(compaction_service_pb2.PrepareStepResponse())

    handler = grpc.unary_stream_rpc_method_handler(
        empty_step,
        request_deserializer=compaction_service_pb2.PrepareStepRequest.FromString,
        response_serializer=compaction_service_pb2.PrepareStepResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(
        "compactd.v1.CompactionService", {EMPTY_STREAM: handler}
    )


async def measure(
    sizes: Sequence[int] = SIZES, calls: int = 400, full_calls: int = 20, languages: bool = True
) -> list[StepRow]:
    """PrepareStepUnary and PrepareStep (held revision and, in the first ``full_calls`` rounds,
    full), and the empty RPCs, interleaved at each size, against the servers of one child
    process (``serve``); then, with ``languages``, the TypeScript and Go drivers' rounds."""
    async with served("bench.bench_steps", 2) as (address, bare_address):
        if not languages:
            return await _measured(address, bare_address, sizes, calls, full_calls, [])
        async with drivers(address, "bench", 1) as started:
            return await _measured(address, bare_address, sizes, calls, full_calls, started)


async def serve() -> None:
    """The benchmarked servers (a child process, as in production: the client's gRPC work does
    not share their event loop or their GIL): compactd's, with the no-op of PrepareStep's
    shape, and the bare one; prints both addresses, serves until stdin closes."""
    running = await create_server(
        config.load(None, environ={}, overrides=OVERRIDES),
        extra_handlers=[_empty_stream_handlers()],
    )
    bare, bare_address = await _bare_server()
    settle_interpreter()  # as ``compactd serve`` does
    try:
        print(running.address, bare_address, sep="\n", flush=True)
        await until_stdin_closes()
    finally:
        await bare.stop(0)
        await running.stop(0)


async def _measured(
    address: str,
    bare_address: str,
    sizes: Sequence[int],
    calls: int,
    full_calls: int,
    languages: Sequence[Driver],
) -> list[StepRow]:
    bare_channel = grpc.aio.insecure_channel(bare_address)
    bare_unary_call = bare_channel.unary_unary(
        "/bench.Bare/Unary", request_serializer=identity, response_deserializer=identity
    )
    bare_call = bare_channel.unary_stream(
        "/bench.Bare/Stream", request_serializer=identity, response_deserializer=identity
    )

    async def bare_unary() -> object:
        return await bare_unary_call(b"")

    async def bare_stream() -> object:
        return [message async for message in bare_call(b"")]

    rows: list[StepRow] = []
    unbounded = [("grpc.max_receive_message_length", -1)]  # the full request at 100k events
    # The clients' first step receives the full request (68.9 MB at 100k events, over their
    # 64 MiB default): the options lift it as the bench's own channel does.
    sync_client = CompactdClient(address, options=unbounded)
    try:
        async with (
            grpc.aio.insecure_channel(address, options=unbounded) as channel,
            AsyncCompactdClient(address, options=unbounded) as client,
        ):
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

            async def unary_step(held: int) -> compaction_service_pb2.PrepareStepResult:
                request = compaction_service_pb2.PrepareStepUnaryRequest(
                    session_id="bench", turn=1, held_revision=held
                )
                return (await compaction.PrepareStepUnary(request)).result

            async def empty() -> object:
                return await health.Check(health_pb2.HealthCheckRequest())

            async def client_step() -> PreparedStep:
                return await client.prepare_step("bench", 1)

            async def sync_client_step() -> PreparedStep:
                return sync_client.prepare_step("bench", 1)  # blocks: nothing else runs here

            empty_step = channel.unary_stream(
                f"/compactd.v1.CompactionService/{EMPTY_STREAM}",
                request_serializer=compaction_service_pb2.PrepareStepRequest.SerializeToString,
                response_deserializer=compaction_service_pb2.PrepareStepResponse.FromString,
            )

            async def empty_stream(held: int) -> object:
                request = compaction_service_pb2.PrepareStepRequest(
                    session_id="bench", turn=1, held_revision=held
                )
                return [message async for message in empty_step(request)]

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
                assert await unary_step(held) == again  # the same step, answered in one message
                for default_step in (client_step, sync_client_step):
                    await default_step()  # holds the request (the full one the first time)
                    prepared = await default_step()
                    assert prepared.result.request_unchanged  # a reply the size of the step
                    assert prepared.request.revision == held
                kinds: list[Callable[[], Awaitable[object]]] = [
                    empty,
                    functools.partial(unary_step, held),
                    functools.partial(step, held),
                    functools.partial(step, None),
                    functools.partial(empty_stream, held),
                    bare_unary,
                    bare_stream,
                    client_step,
                    sync_client_step,
                ]
                samples: list[list[float]] = [[] for _ in kinds]
                forward = list(range(len(kinds)))
                for round_ in range(calls):
                    order = forward if round_ % 2 == 0 else forward[::-1]
                    if round_ >= full_calls:  # the full request costs seconds at 100k events
                        order = [kind for kind in order if kind != FULL]
                    for kind in order:
                        samples[kind].append(await _timed(kinds[kind]))
                others = []
                for driver in languages:
                    timings = await driver.measure(calls)
                    assert timings.revision == held  # the request the Python clients hold
                    others.append(ClientRow.of(driver.language, timings))
                rows.append(StepRow(size, *(_pcts(s) for s in samples), clients=tuple(others)))
    finally:
        sync_client.close()
        await bare_channel.close(None)
    return rows


def readme_rows(sizes: Sequence[int] = SIZES, calls: int = 400) -> list[tuple[str, str, str]]:
    """docs/benchmarks.md rows (goal, measured, reference), from one run of ``measure``."""
    measured = asyncio.run(measure(sizes, calls))

    def each(ratio: Callable[[StepRow], float]) -> str:
        return ", ".join(f"{ratio(row):.2f}x" for row in measured)

    full = ", ".join(f"{row.full[0] / row.empty[0]:.0f}x" for row in measured)
    ratios = ", ".join(f"{row.ratio:.2f}x at {row.events:,}" for row in measured)
    empties = ", ".join(fmt(row.empty[0]).strip() for row in measured)
    return [
        (
            "PrepareStep below pressure ≤ 1.2x an empty RPC, flat from 100 to 100k events",
            f"PrepareStepUnary (held revision): p50 {ratios} events; the streamed PrepareStep: "
            f"{each(lambda r: r.held_ratio)} (and {each(lambda r: r.stream_ratio)} an empty "
            "RPC of its own shape)",
            f"an empty unary RPC (health check), interleaved call by call: p50 {empties} "
            f"(without held_revision, the full request every step: {full}); an empty "
            "server-streaming RPC (one empty message) behind the same interceptors: "
            f"{each(lambda r: r.empty_stream[0] / r.empty[0])}; grpc.aio's floor, a bare "
            f"server-streaming call / a bare unary one: {each(lambda r: r.floor)}",
        ),
        (
            "The Python client's default prepare_step(session, turn) ≤ 1.3x an empty RPC at "
            "100 and 100k events, its reply the size of the step",
            f"AsyncCompactdClient.prepare_step: p50 {each(lambda r: r.client_ratio)}; "
            f"CompactdClient.prepare_step: {each(lambda r: r.sync_client_ratio)} (at "
            f"{', '.join(f'{row.events:,}' for row in measured)} events)",
            f"the same empty unary RPC, interleaved call by call: p50 {empties}",
        ),
        *_language_rows(measured),
    ]


NAMES = {"typescript": "TypeScript", "go": "Go"}
CALLS = {"typescript": "prepareStep(sessionId, turn)", "go": "PrepareStep(ctx, id, turn, nil)"}


def _language_rows(measured: Sequence[StepRow]) -> list[tuple[str, str, str]]:
    """The TypeScript and Go clients' row, when their drivers ran."""
    languages = [client.language for client in measured[0].clients] if measured else []
    if not languages:
        return []

    def each(language: str, value: Callable[[ClientRow], str]) -> str:
        return ", ".join(
            value(client) for row in measured for client in row.clients
            if client.language == language
        )  # fmt: skip

    at = ", ".join(f"{row.events:,}" for row in measured)
    steps = "; ".join(
        f"{NAMES[lang]} {CALLS[lang]}: p50 {each(lang, lambda c: f'{c.ratio:.2f}x')}"
        for lang in languages
    )
    streamed = "; ".join(
        f"{NAMES[lang]} {each(lang, lambda c: f'{c.streamed_ratio:.2f}x')}" for lang in languages
    )
    bare = "; ".join(
        f"{NAMES[lang]} {each(lang, lambda c: f'{c.unary_ratio:.2f}x')}" for lang in languages
    )
    replies = "; ".join(
        f"{NAMES[lang]} {each(lang, lambda c: f'{c.reply_bytes:,}')} bytes" for lang in languages
    )
    empties = "; ".join(
        f"{NAMES[lang]} {each(lang, lambda c: fmt(c.empty[0]).strip())}" for lang in languages
    )
    return [
        (
            "The TypeScript and Go clients' default step ≤ 1.3x an empty RPC at 100 and 100k "
            "events, its reply the size of the step",
            f"{steps} (at {at} events); with a progress callback (the streamed PrepareStep, as "
            f"the examples call it): {streamed}; the bare PrepareStepUnary with the held revision "
            f"(nothing held: the server's share): {bare}; the largest step reply: {replies}",
            "an empty unary RPC (health check) from the same client process, interleaved call "
            f"by call: p50 {empties}",
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="session lengths")
    parser.add_argument("--calls", type=int, default=400, help="rounds per size")
    parser.add_argument("--full-calls", type=int, default=20, help="rounds with a full request")
    parser.add_argument(
        "--python-only", action="store_true", help="leave out the TypeScript and Go drivers"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve())
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    started = time.perf_counter()
    measured = asyncio.run(measure(sizes, args.calls, args.full_calls, not args.python_only))
    table(
        "PrepareStep below pressure vs an empty RPC, interleaved call by call (p50 / p99)",
        ["events", "empty RPC", "StepUnary held", "unary/empty", "PrepareStep held",
         "held/empty", "PrepareStep full", "full/empty", "empty stream", "held/empty stream",
         "bare unary", "bare stream", "bare stream/unary", "client step", "client/empty",
         "sync client step", "sync/empty"],
        [
            (
                f"{row.events:,}",
                f"{fmt(row.empty[0])} / {fmt(row.empty[1])}",
                f"{fmt(row.unary[0])} / {fmt(row.unary[1])}",
                f"{row.ratio:5.2f}x",
                f"{fmt(row.held[0])} / {fmt(row.held[1])}",
                f"{row.held_ratio:5.2f}x",
                f"{fmt(row.full[0])} / {fmt(row.full[1])}",
                f"{row.full[0] / row.empty[0]:6.2f}x",
                f"{fmt(row.empty_stream[0])} / {fmt(row.empty_stream[1])}",
                f"{row.stream_ratio:5.2f}x",
                f"{fmt(row.bare_unary[0])} / {fmt(row.bare_unary[1])}",
                f"{fmt(row.bare_stream[0])} / {fmt(row.bare_stream[1])}",
                f"{row.floor:5.2f}x",
                f"{fmt(row.client[0])} / {fmt(row.client[1])}",
                f"{row.client_ratio:5.2f}x",
                f"{fmt(row.sync_client[0])} / {fmt(row.sync_client[1])}",
                f"{row.sync_client_ratio:5.2f}x",
            )
            for row in measured
        ],
    )  # fmt: skip
    print(
        "\nunary/empty: PrepareStepUnary (held revision) / an empty unary RPC (health check), "
        "both behind compactd's interceptors: the goal (<= 1.2x). held/empty stream: the streamed "
        "PrepareStep / a no-op server-streaming RPC behind the same interceptors. bare stream/"
        "unary: grpc.aio's own cost of a server-streaming call over a unary one, no interceptors. "
        "client/empty, sync/empty: the Python clients' default prepare_step (the held request: "
        "one PrepareStepUnary with held_revision, the answered messages appended) / the empty "
        "unary RPC: the goal (<= 1.3x)."
    )
    if measured and measured[0].clients:
        table(
            "The TypeScript and Go clients' default step vs an empty RPC from the same process, "
            "interleaved call by call (p50 / p99)",
            ["events", "client", "empty RPC", "default step", "step/empty", "streamed step",
             "streamed/empty", "bare StepUnary", "bare/empty", "largest reply"],
            [
                (
                    f"{row.events:,}",
                    NAMES[client.language],
                    f"{fmt(client.empty[0])} / {fmt(client.empty[1])}",
                    f"{fmt(client.step[0])} / {fmt(client.step[1])}",
                    f"{client.ratio:5.2f}x",
                    f"{fmt(client.streamed[0])} / {fmt(client.streamed[1])}",
                    f"{client.streamed_ratio:5.2f}x",
                    f"{fmt(client.unary[0])} / {fmt(client.unary[1])}",
                    f"{client.unary_ratio:5.2f}x",
                    f"{client.reply_bytes:,} B",
                )
                for row in measured
                for client in row.clients
            ],
        )  # fmt: skip
    print(f"\ndone in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
