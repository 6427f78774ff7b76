"""A real compactd server wired to a real OpenAI-compatible loopback provider, for compaction tests.

``started(tmp_path, loop, ...)`` runs ``create_server`` on port 0 over a fresh SQLite file, with one
``[[routes]]`` entry (``loop/m``) whose ``base_url`` is the loopback server's, and yields a
``Harness`` that speaks to it over gRPC like a runtime would. The default policy puts a
conversation of ``units(18)`` above the trigger and keeps about four units verbatim; tests change
it per session (``Harness.create(policy=...)``) or per server (``policy=``).

Conversations keep the step brackets a runtime must keep (each unit is a closed turn of two
steps). Events only compactd writes (an orphan ``compaction/start``, a ``session/end-seed``) are
set up with ``Harness.append_as_server``, the service's own trusted path, never through the API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2
from opentelemetry import metrics, trace

from compactd import config
from compactd.api.server import RunningServer, create_server
from compactd.core.validation import Origin
from compactd.service.bracket import SummaryErrorRecovery
from compactd.store.base import Clock, utc_now
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import compaction_service_pb2_grpc, events_pb2, session_service_pb2_grpc
from compactd.v1 import session_service_pb2 as spb
from tests.builders import (
    assistant,
    header,
    in_step,
    system,
    tool,
    tool_result,
    turn_end,
    turn_start,
    user,
)

PROVIDER, MODEL = "loop", "m"
WINDOW = 16_000
MAX_OUTPUT = 1_000

#: Trigger 5000 tokens (W=16000, O=1000, B=1000), retained budget 1200, summary cap 1000.
POLICY: dict[str, Any] = {
    "thresholdRatio": 0.3125,
    "headroomTokens": 1000,
    "retainTokens": 1200,
    "maxTokens": 1000,
}
#: A policy no conversation of these tests reaches: nothing is ever above its trigger.
RELAXED: dict[str, Any] = {"thresholdRatio": 0.875, "headroomTokens": 1000, "maxTokens": 1000}

ABOVE = cpb.PRESSURE_STATE_ABOVE
BELOW = cpb.PRESSURE_STATE_BELOW
TOOLS = (tool("run", '{"type":"object","properties":{"cmd":{"type":"string"}}}', "Run a command"),)


def route_table(loop: OpenAICompatServer, **overrides: Any) -> dict[str, Any]:
    """The ``[[routes]]`` table of the loopback model."""
    return {
        "provider": PROVIDER,
        "model": MODEL,
        "context_window": WINDOW,
        "max_output_tokens": MAX_OUTPUT,
        "base_url": loop.base_url,
        **overrides,
    }


def server_config(
    tmp_path: Path,
    loop: OpenAICompatServer,
    *,
    kind: str = "openai",
    policy: Mapping[str, Any] | None = None,
    routes: Sequence[Mapping[str, Any]] = (),
    summarizer: Mapping[str, Any] | None = None,
    db: str = "compactd.db",
) -> config.ServerConfig:
    """A configuration on port 0 over a SQLite file, routing ``loop/m`` to the loopback."""
    base = config.load(
        None,
        environ={},
        overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{tmp_path / db}"},
    )
    return dataclasses.replace(
        base,
        routes=(route_table(loop), *routes),
        summarizer={"kind": kind, "max_attempts": 3, **(summarizer or {})},
        compaction=dict(POLICY if policy is None else policy),
    )


@contextmanager
def loopback() -> Iterator[OpenAICompatServer]:
    """A started loopback provider (stopped, cutting any delayed reply, on exit)."""
    with OpenAICompatServer() as server:
        yield server


# ---- conversations ------------------------------------------------------------------------


#: Units are closed turns numbered from here on, so a test's own turns (1, 2, ...) never collide.
UNIT_TURNS = 1000


def unit(i: int, *, result: str | None = None) -> list[events_pb2.SessionEvent]:
    """One balanced unit (~250 tokens), a closed turn (``UNIT_TURNS + i``) of two steps.

    Four surface nodes: a request, a step's tool call, its result, a second step's answer.
    """
    turn = UNIT_TURNS + i
    call = assistant(text=f"Running step {i}.", calls=[(f"call-{i}", "run", '{"cmd":"ls"}')])
    answer = assistant(text=f"Step {i} is done; src/mod{i}.py passes. " + "Detail. " * 30)
    return [
        turn_start(turn),
        user(f"Step {i}: run the check for src/mod{i}.py and report. " + "Context. " * 40),
        *in_step(turn, 1, call),
        tool_result(f"call-{i}", result if result is not None else f"ok {i} " * 60, name="run"),
        *in_step(turn, 2, answer),
        turn_end(turn),
    ]


def units(count: int, start: int = 0) -> list[events_pb2.SessionEvent]:
    """``count`` consecutive units."""
    return [event for i in range(start, start + count) for event in unit(i)]


def opening(tools: Sequence[events_pb2.ToolDeclaration] = TOOLS) -> list[events_pb2.SessionEvent]:
    """The system head and the routed header every conversation starts with."""
    return [system("You are a careful coding agent."), header(PROVIDER, MODEL, tools=tools)]


def body(event: events_pb2.SessionEvent) -> str:
    """The event's type name (the ``body`` oneof)."""
    name = event.WhichOneof("body")
    assert name is not None
    return name


def summary_requests(loop: OpenAICompatServer) -> list[dict[str, Any]]:
    """Bodies of the requests the loopback received marked as compaction."""
    return [r.json for r in loop.requests if r.header("x-compactd-purpose") == "compaction"]


# ---- the harness ---------------------------------------------------------------------------


@dataclass
class Run:
    """What a streamed compaction RPC sent: its progress updates, then its result."""

    progress: list[cpb.CompactionProgress] = field(default_factory=list)
    result: Any = None

    def steps(self) -> list[int]:
        """The progress steps, in order."""
        return [p.step for p in self.progress]


@dataclass
class Harness:
    """A running server, a client of it, and the loopback provider it summarizes with."""

    channel: grpc.aio.Channel
    loop: OpenAICompatServer
    server: RunningServer | None = None  # None for a server in another process
    session_id: str = "s1"

    @property
    def address(self) -> str:
        """The in-process server's address."""
        assert self.server is not None
        return self.server.address

    # The generated stubs are typed for the blocking API; over an aio channel every call is
    # awaitable (or async-iterable), so the stubs are handed out untyped.

    @property
    def sessions(self) -> Any:
        """A SessionService stub on the harness channel."""
        return session_service_pb2_grpc.SessionServiceStub(self.channel)

    @property
    def compaction(self) -> Any:
        """A CompactionService stub on the harness channel."""
        return compaction_service_pb2_grpc.CompactionServiceStub(self.channel)

    async def create(
        self, *events: events_pb2.SessionEvent, policy: Mapping[str, Any] | None = None
    ) -> None:
        """Create the session (with policy overrides) and append ``events``."""
        request = spb.CreateSessionRequest(session_id=self.session_id)
        if policy is not None:
            request.compaction_policy.CopyFrom(_struct(policy))
        await self.sessions.CreateSession(request)
        if events:
            await self.append(*events)

    async def append(self, *events: events_pb2.SessionEvent) -> list[int]:
        """Append a batch; its seqs."""
        reply = await self.sessions.AppendEvents(
            spb.AppendEventsRequest(session_id=self.session_id, events=events)
        )
        return list(reply.seqs)

    async def append_as_server(self, *events: events_pb2.SessionEvent) -> list[int]:
        """Append through the service's own trusted path (``Origin.SERVER``), as compactd's code
        does: for states only the server writes (an orphan ``compaction/start``, say)."""
        assert self.server is not None, "the trusted path needs the in-process server"
        handle = await self.server.manager.get(self.session_id)
        return (await handle.append(events, origin=Origin.SERVER)).seqs

    async def events(self) -> list[events_pb2.SessionEvent]:
        """The whole log."""
        request = spb.ListEventsRequest(session_id=self.session_id)
        return [r.event async for r in self.sessions.ListEvents(request)]

    async def surface(self) -> spb.GetSurfaceResponse:
        """The current surface."""
        reply: spb.GetSurfaceResponse = await self.sessions.GetSurface(
            spb.GetSurfaceRequest(session_id=self.session_id)
        )
        return reply

    async def build(self) -> spb.BuildRequestResponse:
        """The reconstructed request."""
        reply: spb.BuildRequestResponse = await self.sessions.BuildRequest(
            spb.BuildRequestRequest(session_id=self.session_id)
        )
        return reply

    async def pressure(self) -> cpb.PressureReport:
        """The pressure against the logged route."""
        reply: cpb.CheckPressureResponse = await self.compaction.CheckPressure(
            cpb.CheckPressureRequest(session_id=self.session_id)
        )
        return reply.report

    async def compact(self, focus: str = "", *, channel: grpc.aio.Channel | None = None) -> Run:
        """Run Compact to its end."""
        stub: Any = compaction_service_pb2_grpc.CompactionServiceStub(channel or self.channel)
        call = stub.Compact(cpb.CompactRequest(session_id=self.session_id, focus=focus))
        return await _collect(call)

    async def prepare(
        self,
        turn: int,
        route: events_pb2.Route | None = None,
        *,
        held: int | None = None,
        incarnation: str = "",
    ) -> Run:
        """Run PrepareStep to its end (``held``: the revision of the request the caller holds;
        ``incarnation``: that request's incarnation)."""
        request = cpb.PrepareStepRequest(
            session_id=self.session_id, turn=turn, held_incarnation=incarnation
        )
        if route is not None:
            request.intended_route.CopyFrom(route)
        if held is not None:
            request.held_revision = held
        return await _collect(self.compaction.PrepareStep(request))

    async def wait_for_log(
        self, predicate: Callable[[list[events_pb2.SessionEvent]], bool]
    ) -> list[events_pb2.SessionEvent]:
        """Poll the log until ``predicate(events)`` holds (30 s at most); the log then."""
        async with asyncio.timeout(30):
            while True:
                events = await self.events()
                if predicate(events):
                    return events
                await asyncio.sleep(0.02)


async def _collect(call: Any) -> Run:
    run = Run()
    async for response in call:
        if response.HasField("progress"):
            run.progress.append(response.progress)
        else:
            run.result = response.result
    return run


def _struct(values: Mapping[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(json.loads(json.dumps(values)))
    return struct


@asynccontextmanager
async def started(
    tmp_path: Path,
    loop: OpenAICompatServer,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    recoveries: Sequence[SummaryErrorRecovery] = (),
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Clock = utc_now,
    meter_provider: metrics.MeterProvider | None = None,
    **options: Any,
) -> AsyncIterator[Harness]:
    """A server (see ``server_config`` for ``options``) and a channel to it."""
    settings = server_config(tmp_path, loop, **options)
    provider = tracer_provider or trace.NoOpTracerProvider()
    running = await create_server(
        settings,
        tracer_provider=provider,
        summary_recoveries=recoveries,
        clock=clock,
        wall_clock=wall_clock,
        meter_provider=meter_provider,
    )
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            yield Harness(channel, loop, running)
    finally:
        await running.stop(0)
