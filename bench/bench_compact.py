"""Compaction cost against log length with a fixed span, and a declined Compact, in one run.

**Engine time.** Two servers (``create_server`` on port 0, memory store, route ``bench/wide``,
the interpreter settled as ``compactd serve`` settles it) run in a child process, as in
production: the client's gRPC work (reading the seven progress messages of each compaction
among it) does not share their event loop or their GIL. Sessions grow as a long agent session
does: batches of the shared transcripts, each in its own closed turn, each followed by a
``Compact`` that condenses it, so the log grows while the surface stays short: one such session
per length (1,000 and 100,000 logged events). Then ``--repeat`` rounds, each compacting in every
session, in a rotating order: the same fixed span (``--span`` events of the transcripts, fresh
tool-call ids) is appended and condensed by ``Compact``. Engine time is the call's whole time
seen by the client minus the summarizer's own time (the default extractive summarizer, timed
around its call in the server's process, which reports it after each compaction through a bench
method of its own, ``bench.Figures/Take``). Interleaved after each compaction, in the server's
process, the reference: serializing the summary request that compaction sent, as the OpenAI wire
sends it (``encode_messages`` + ``encode_request`` + ``dumps``). Beside it, for information (in
no ratio): extracting the span's facts (``probes.span_facts``), which the gate reuses from the
extractive summarizer and extracts itself, in steps, while a model writes its summary.

**A model's summary.** The second server summarizes with ``ModelSummarizer``: the extractive
text, handed back ``MODEL_LATENCY_S`` later without the span's facts, through a model's path (its
GenAI span and metrics). Each round also compacts the same span in a session of the first length
there; its engine time (call minus the summarizer's whole call) against its own request's
serialization.

**Declined Compact.** A second session of ``--declined-events`` surface nodes ends with a tool
call still waiting for its result; ``Compact`` declines (``OPEN_TAIL``) without writing. It is
timed call by call, interleaved with an empty unary RPC (a health check).

    python -m bench.bench_compact [--sizes 1000,100000] [--span 300] [--repeat 11]
                                  [--declined-events 10000] [--calls 200]

``readme_rows()`` returns rows of docs/benchmarks.md (goal, measured, reference):
``python -m bench.readme``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.bench_pressure import BATCH, _event, conversations, fmt, table
from bench.bench_steps import MODEL, OVERRIDES, PROVIDER, _pcts, _timed
from bench.children import identity, served, until_stdin_closes
from compactd import config
from compactd.api.server import create_server, settle_interpreter
from compactd.core.probes import span_facts
from compactd.providers import openai_wire
from compactd.providers.base import SummaryRequest, SummaryResult
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.v1 import (
    compaction_service_pb2,
    compaction_service_pb2_grpc,
    events_pb2,
    session_service_pb2,
    session_service_pb2_grpc,
)

SessionEvent = events_pb2.SessionEvent
SIZES = (1_000, 100_000)
#: Compactions per length. One compaction's engine time moves by up to twice its neighbour's on a
#: shared machine (1.3x to 3.0x its own request's serialization within one run), so the medians
#: rest on more than a handful.
REPEAT = 11


class TimedSummarizer(ExtractiveSummarizer):
    """The extractive summarizer, timed: what the engine's time excludes. An extractive
    summarizer itself, so that the engine takes the path it takes for the default one (no
    model call: no GenAI client span, no model-call metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.last: SummaryRequest | None = None

    async def summarize(self, request: SummaryRequest) -> SummaryResult:
        started = time.perf_counter()
        try:
            return await super().summarize(request)
        finally:
            self.seconds += time.perf_counter() - started
            self.last = request


#: A model's own time to answer in ``ModelSummarizer``: far below any real model's (seconds).
MODEL_LATENCY_S = 0.05


class ModelSummarizer:
    """A model's summarizer as the engine meets one: the extractive summary's text, handed back
    ``latency`` seconds later (the model's own time) without the span's facts, and not an
    extractive summarizer, so the engine takes a model's path (its GenAI client span and
    metrics) and the gate extracts the facts while the model writes. Timed as
    ``TimedSummarizer`` is: its whole call is what the engine's time excludes."""

    name = "bench-model"

    def __init__(self, latency: float = MODEL_LATENCY_S) -> None:
        self._writer = ExtractiveSummarizer()
        self.latency = latency
        self.seconds = 0.0
        self.last: SummaryRequest | None = None

    async def summarize(self, request: SummaryRequest) -> SummaryResult:
        started = time.perf_counter()
        try:
            written = await self._writer.summarize(request)
            await asyncio.sleep(self.latency)
            return dataclasses.replace(written, span_facts=None, provider=PROVIDER, model=MODEL)
        finally:
            self.seconds += time.perf_counter() - started
            self.last = request


#: One compaction's (engine, gate, summarizer, serialize, facts seconds, span nodes).
Sample = tuple[float, float, float, float, float, int]


class _Timed(Protocol):
    seconds: float
    last: SummaryRequest | None


def serialize(request: SummaryRequest) -> bytes:
    """The summary request's body as a chat-completions summarizer sends it."""
    # The transcripts' images carry names only: a deployment resolves them to a URL.
    messages = openai_wire.encode_messages(
        request.messages, resolve_image=lambda image: f"https://attachments.invalid/{image.name}"
    )
    messages.append(openai_wire.user_text_message(request.instruction))
    body = openai_wire.encode_request(
        messages, openai_wire.encode_tools(request.tools), request.config, stream=True,
        max_tokens=request.max_tokens,
    )  # fmt: skip
    return openai_wire.dumps(body)


@dataclass(frozen=True)
class EngineRow:
    """Medians over the repeats at one log length."""

    events: int  # logged events when the first measured compaction ran
    span_nodes: int
    engine: float
    gate: float  # of ``engine``: the summary quality gate (its ``compaction.gate`` span)
    summarizer: float
    serialize: float
    facts: float  # extracting the span's facts (after a model's summary: while it writes)
    model: EngineRow | None = None  # the same span summarized by a model (the first length's)

    @property
    def ratio(self) -> float:
        """Engine time / serializing the summary request."""
        return self.engine / self.serialize

    @property
    def ungated_ratio(self) -> float:
        """Engine time without the quality gate / serializing the summary request."""
        return (self.engine - self.gate) / self.serialize


@dataclass(frozen=True)
class DeclinedRow:
    """Declined Compact vs an empty RPC, p50/p99, at one surface length."""

    nodes: int
    declined: tuple[float, float]
    empty: tuple[float, float]


def _retagged(events: Sequence[SessionEvent], tag: str) -> list[SessionEvent]:
    """Copies of ``events`` whose tool-call ids end with ``tag`` (ids are unique per session)."""
    out = []
    for source in events:
        event = SessionEvent()
        event.CopyFrom(source)
        if event.HasField("assistant_message"):
            for block in event.assistant_message.content:
                if block.HasField("tool_call"):
                    block.tool_call.id += tag
        elif event.HasField("tool_result"):
            event.tool_result.tool_call_id += tag
        out.append(event)
    return out


def answered_events() -> Iterator[SessionEvent]:
    """``bench_pressure.surface_events`` without the tool calls the transcripts never answer (an
    unanswered call declines every compaction), cycled forever with fresh ids."""
    corpus = conversations()
    for cycle in itertools.count():
        for index, conversation in enumerate(corpus):
            calls: set[str] = set()
            prefix = f"r{cycle}.{index}."
            events = [e for m in conversation["messages"] if (e := _event(m, prefix, calls))]
            answered = {e.tool_result.tool_call_id for e in events if e.HasField("tool_result")}
            for event in events:
                if event.HasField("assistant_message"):
                    content = event.assistant_message.content
                    kept = [b for b in content if b.tool_call.id in answered or not b.tool_call.id]
                    if not kept:
                        continue
                    del content[:]
                    content.extend(kept)
                yield event


def _balanced(source: Iterator[SessionEvent], count: int) -> list[SessionEvent]:
    """At least ``count`` events of ``source`` that answer every call they make and no other."""
    events: list[SessionEvent] = []
    pending: set[str] = set()
    while len(events) < count or pending:
        event = next(source)
        if event.HasField("tool_result"):
            if event.tool_result.tool_call_id not in pending:
                continue
            pending.discard(event.tool_result.tool_call_id)
        elif event.HasField("assistant_message"):
            pending |= {b.tool_call.id for b in event.assistant_message.content
                        if b.HasField("tool_call")}  # fmt: skip
        events.append(event)
    return events


def _in_turn(batch: Sequence[SessionEvent], turn: int) -> list[SessionEvent]:
    """``batch`` as one closed turn, each assistant message in its own step."""
    out = [SessionEvent(turn_start=events_pb2.TurnStart(turn=turn))]
    for step, event in enumerate(batch, 1):
        if event.HasField("assistant_message"):
            out += [
                SessionEvent(step_start=events_pb2.StepStart(turn=turn, step=step)),
                event,
                SessionEvent(step_end=events_pb2.StepEnd(turn=turn, step=step)),
            ]
        else:
            out.append(event)
    return [*out, SessionEvent(turn_end=events_pb2.TurnEnd(turn=turn))]


class _Session:
    def __init__(self, channel: grpc.aio.Channel, session_id: str) -> None:
        self.sessions = session_service_pb2_grpc.SessionServiceStub(channel)
        self.compaction = compaction_service_pb2_grpc.CompactionServiceStub(channel)
        self.session_id = session_id
        self.turns = itertools.count(1)
        self.revision = 0

    async def create(self) -> None:
        request = session_service_pb2.CreateSessionRequest(session_id=self.session_id)
        await self.sessions.CreateSession(request)
        header = events_pb2.RequestHeader(
            config=events_pb2.RequestConfig(provider=PROVIDER, model=MODEL)
        )
        system = events_pb2.SystemMessage(text="You are a careful coding agent.")
        await self.append(
            [SessionEvent(system_message=system), SessionEvent(request_header=header)], turn=False
        )

    async def append(self, events: Sequence[SessionEvent], *, turn: bool = True) -> None:
        sent = _in_turn(events, next(self.turns)) if turn else list(events)
        request = session_service_pb2.AppendEventsRequest(session_id=self.session_id, events=sent)
        response = await self.sessions.AppendEvents(request)
        self.revision = response.seqs[-1] + 1

    async def compact(self) -> compaction_service_pb2.CompactResult:
        request = compaction_service_pb2.CompactRequest(session_id=self.session_id)
        result = None
        async for response in self.compaction.Compact(request):
            if response.HasField("result"):
                result = response.result
        assert result is not None
        return result


async def _grow(session: _Session, source: Iterator[SessionEvent], size: int) -> None:
    """Grow the log to ``size`` events, condensing each batch so the surface stays short."""
    while session.revision < size:
        await session.append(_balanced(source, min(BATCH, size - session.revision)))
        await session.compact()


async def measure_engine(
    channels: tuple[grpc.aio.Channel, grpc.aio.Channel], sizes: Sequence[int], span: int,
    repeat: int,
) -> list[EngineRow]:  # fmt: skip
    """One session per log length, grown first; then ``repeat`` rounds that each compact the
    same span in every session, in an order that rotates from round to round (so every length
    sees the same machine load). Each round also compacts the span in a session of the first
    length on the model's server (``channels[1]``), which summarizes with ``ModelSummarizer``."""
    source = answered_events()
    template = _balanced(source, span)
    sessions: list[tuple[_Session, Figures]] = []
    for index, size in enumerate(sizes):
        session = _Session(channels[0], f"engine{index}")
        await session.create()
        await _grow(session, source, size)
        sessions.append((session, Figures(channels[0])))
    session = _Session(channels[1], "model")
    await session.create()
    await _grow(session, source, sizes[0])
    sessions.append((session, Figures(channels[1])))
    for index, (session, figures) in enumerate(sessions):  # unrecorded: checkpoints reach the cap
        await _compaction(session, template, f".w{index}", figures)
    logged = [session.revision for session, _ in sessions]
    samples: list[list[Sample]] = [[] for _ in sessions]
    tags = itertools.count()
    for round_ in range(repeat):
        order = list(range(len(sessions)))
        order = order[round_ % len(order) :] + order[: round_ % len(order)]
        for index in order:
            session, figures = sessions[index]
            samples[index].append(await _compaction(session, template, f".s{next(tags)}", figures))
    rows = [_row(events, measured) for events, measured in zip(logged, samples, strict=True)]
    *engines, modelled = rows  # the model's session is the last one
    engines[0] = dataclasses.replace(engines[0], model=modelled)
    return engines


def _row(events: int, measured: Sequence[Sample]) -> EngineRow:
    """Medians of one session's compactions."""
    engine, gate, summarizing, serializing, facts, nodes = zip(*measured, strict=True)
    median = statistics.median
    return EngineRow(events, int(median(nodes)), median(engine), median(gate),
                     median(summarizing), median(serializing), median(facts))  # fmt: skip


async def _compaction(
    session: _Session, template: Sequence[SessionEvent], tag: str, figures: Figures
) -> Sample:
    """Append the span, compact it: (engine, gate, summarizer, serialize, facts seconds, nodes)."""
    await session.append(_retagged(template, tag))
    await figures.take()  # from here on: this compaction's
    started = time.perf_counter()
    result = await session.compact()
    elapsed = time.perf_counter() - started
    assert result.HasField("outcome"), result.declined_reason
    taken = await figures.take()
    summarizing, nodes = taken["summarizer"], result.outcome.items_condensed
    engine = elapsed - summarizing
    return engine, taken["gate"], summarizing, taken["serialize"], taken["facts"], nodes


class Figures:
    """The server process's figures of its last compaction (``bench.Figures/Take``)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._take = channel.unary_unary(
            f"/{FIGURES}/Take", request_serializer=identity, response_deserializer=json.loads
        )

    async def take(self) -> dict[str, float]:
        """The figures since the last take (then reset)."""
        taken: dict[str, float] = await self._take(b"")
        return taken


FIGURES = "bench.Figures"


def _figures_handler(
    summarizer: _Timed, spans: InMemorySpanExporter
) -> grpc.GenericRpcHandler[Any, Any]:
    """``bench.Figures/Take``, in the server's process: the summarizer's time and the gate's
    (its ``compaction.gate`` spans) since the last take, then serializing the last summary
    request and extracting its span's facts, timed there (all zero before any summary)."""

    async def take(request: bytes, context: object) -> bytes:
        gate = sum((s.end_time or 0) - (s.start_time or 0) for s in spans.get_finished_spans()
                   if s.name == "compaction.gate") / 1e9  # fmt: skip
        figures = {"summarizer": summarizer.seconds, "gate": gate, "serialize": 0.0, "facts": 0.0}
        summarizer.seconds = 0.0
        spans.clear()
        last, summarizer.last = summarizer.last, None
        if last is not None:
            encode = functools.partial(serialize, last)
            figures["serialize"] = min(_timed_sync(encode) for _ in range(3))
            span = last.messages  # the gate's span: the request without its system head
            if span and span[0].role == session_service_pb2.MESSAGE_ROLE_SYSTEM:
                span = span[1:]
            figures["facts"] = _timed_sync(functools.partial(span_facts, span))
        return json.dumps(figures).encode()

    handler = grpc.unary_unary_rpc_method_handler(
        take, request_deserializer=identity, response_serializer=identity
    )
    return grpc.method_handlers_generic_handler(FIGURES, {"Take": handler})


def _timed_sync(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


async def measure_declined(channel: grpc.aio.Channel, nodes: int, calls: int) -> DeclinedRow:
    session = _Session(channel, "declined")
    await session.create()
    source = answered_events()
    while session.revision < nodes:
        await session.append(_balanced(source, min(BATCH, nodes - session.revision)))
    call = events_pb2.ToolCallBlock(id="open", name="run", arguments_json="{}")
    waiting = events_pb2.AssistantMessage(content=[events_pb2.ContentBlock(tool_call=call)])
    await session.append([SessionEvent(assistant_message=waiting)])
    health = health_pb2_grpc.HealthStub(channel)

    async def empty() -> object:
        return await health.Check(health_pb2.HealthCheckRequest())

    async def declined() -> object:
        result = await session.compact()
        assert result.declined_reason, result
        return result

    kinds = [declined, empty]
    samples: list[list[float]] = [[], []]
    for round_ in range(calls):
        for kind in (0, 1) if round_ % 2 == 0 else (1, 0):
            samples[kind].append(await _timed(kinds[kind]))
    return DeclinedRow(nodes, _pcts(samples[0]), _pcts(samples[1]))


async def measure(
    sizes: Sequence[int] = SIZES, span: int = 300, repeat: int = REPEAT,
    declined_events: int = 10_000, calls: int = 200,
) -> tuple[list[EngineRow], DeclinedRow]:  # fmt: skip
    """Both measurements, against the servers of one child process (``serve``)."""
    async with (
        served("bench.bench_compact", 2) as addresses,
        grpc.aio.insecure_channel(addresses[0]) as channel,
        grpc.aio.insecure_channel(addresses[1]) as model_channel,
    ):
        engine = await measure_engine((channel, model_channel), sizes, span, repeat)
        declined = await measure_declined(channel, declined_events, calls)
    return engine, declined


async def serve() -> None:
    """The benchmarked servers (a child process): the extractive one and the model's, each with
    ``bench.Figures``; prints both addresses, serves until stdin closes."""
    tracing, spans = TracerProvider(), InMemorySpanExporter()
    tracing.add_span_processor(SimpleSpanProcessor(spans))
    # A summary cap the checkpoint reaches within the first batches: the span it opens every
    # measured compaction with is then the same size at every log length.
    overrides: dict[str, Any] = dict(OVERRIDES, compaction={"maxTokens": 2000})
    settings = config.load(None, environ={}, overrides=overrides)
    servers = []
    for summarizer in (TimedSummarizer(), ModelSummarizer()):
        figures = _figures_handler(summarizer, spans)
        servers.append(
            await create_server(
                settings, summarizer=summarizer, tracer_provider=tracing, extra_handlers=[figures]
            )
        )
    settle_interpreter()  # as ``compactd serve`` does
    try:
        print(*(running.address for running in servers), sep="\n", flush=True)
        await until_stdin_closes()
    finally:
        for running in servers:
            await running.stop(0)


#: What the engine rows leave out of production's work, said in each of them.
LEAVES_OUT = (
    "leaves out: the SQLite store (a memory store: the bracket's events are committed to no "
    "disk) and a long surface (the session's surface is about one span when it compacts)"
)


def readme_rows(sizes: Sequence[int] = SIZES, **options: Any) -> list[tuple[str, str, str]]:
    """docs/benchmarks.md rows (goal, measured, reference), from one run of ``measure``."""
    engine, declined = asyncio.run(measure(sizes, **options))
    first, last = engine[0], engine[-1]
    return [
        (
            "Compaction engine time (summarizer excluded), fixed span: 1k vs 100k logged "
            f"events ≤ 1.2x ({LEAVES_OUT})",
            f"{last.engine / first.engine:.2f}x ({fmt(first.engine).strip()} at "
            f"{first.events:,}, {fmt(last.engine).strip()} at {last.events:,})",
            f"the same {first.span_nodes}-node span at both lengths, in one run",
        ),
        (
            f"Compaction engine time ≤ 2x serializing the summary request it sends ({LEAVES_OUT})",
            ", ".join(f"{row.ratio:.2f}x at {row.events:,}" for row in engine)
            + "; without the quality gate "
            + ", ".join(f"{row.ungated_ratio:.2f}x" for row in engine)
            + _modelled(first),
            "serializing that request (OpenAI wire JSON), after each compaction: "
            + ", ".join(fmt(row.serialize).strip() for row in engine),
        ),
        (
            "A declined Compact (open tool call) ≤ 2x an empty RPC",
            f"p50 {declined.declined[0] / declined.empty[0]:.2f}x at {declined.nodes:,} nodes",
            f"an empty unary RPC (health check), interleaved: p50 {fmt(declined.empty[0]).strip()}",
        ),
    ]


def _modelled(row: EngineRow) -> str:
    assert row.model is not None, "measure_engine measures a model's summary at the first length"
    return (
        f"; a model's summary ({MODEL_LATENCY_S * 1e3:.0f} ms, the gate's span facts extracted "
        f"meanwhile) {row.model.ratio:.2f}x at {row.events:,}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="log lengths")
    parser.add_argument("--span", type=int, default=300, help="events in the fixed span")
    parser.add_argument("--repeat", type=int, default=REPEAT, help="compactions per size")
    parser.add_argument("--declined-events", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=200, help="declined rounds")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve())
        return
    started = time.perf_counter()
    engine, declined = asyncio.run(
        measure([int(s) for s in args.sizes.split(",")], args.span, args.repeat,
                args.declined_events, args.calls)
    )  # fmt: skip
    table(
        "Compact with a fixed span: engine time (call minus summarizer) vs serializing its "
        "summary request (medians)",
        ["logged events", "span nodes", "engine", "of it: gate", "summarizer", "serialize",
         "engine/serialize", "without gate", "span facts*"],
        [
            (f"{r.events:,}", str(r.span_nodes), fmt(r.engine), fmt(r.gate), fmt(r.summarizer),
             fmt(r.serialize), f"{r.ratio:5.2f}x", f"{r.ungated_ratio:5.2f}x", fmt(r.facts))
            for r in engine
        ],
    )  # fmt: skip
    print("* extracting the span's facts: the extractive summarizer hands them to the gate; "
          "while a model writes, the gate extracts them itself (in no ratio above)")  # fmt: skip
    first, last = engine[0], engine[-1]
    m = first.model
    assert m is not None
    print(f"\na model's summary ({MODEL_LATENCY_S * 1e3:.0f} ms; a server of its own) at "
          f"{first.events:,}: engine {fmt(m.engine).strip()} (of it: gate "
          f"{fmt(m.gate).strip()}), serialize {fmt(m.serialize).strip()}: "
          f"{m.ratio:.2f}x")  # fmt: skip
    print(f"\nengine time at {last.events:,} / at {first.events:,}: "
          f"{last.engine / first.engine:.2f}x")  # fmt: skip
    d = declined
    table(
        "A declined Compact (open tool call) vs an empty RPC, interleaved (p50 / p99)",
        ["surface nodes", "declined Compact", "empty RPC", "ratio p50"],
        [(f"{d.nodes:,}", f"{fmt(d.declined[0])} / {fmt(d.declined[1])}",
          f"{fmt(d.empty[0])} / {fmt(d.empty[1])}", f"{d.declined[0] / d.empty[0]:5.2f}x")],
    )  # fmt: skip
    print(f"\ndone in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
