"""Pressure checks: latency against session length, meter throughput, heuristic error.

Three tables, from one run:

1. CheckPressure latency (p50/p99) on one session as it grows to 100, 1,000, 10,000 and 100,000
   events, in process (``PressureService.check``) and over gRPC on loopback when the server
   serves CheckPressure, next to a from-scratch recount of the same envelope
   (``core.meter.recount``) and an empty unary RPC (health check) for scale. The route is
   ``openai/gpt-4-turbo`` (cl100k_base, tiktoken). The meter prices each event when it is
   appended, so a check costs the same at every length; a recount grows with the session.
2. Meter throughput against the raw tokenizer counting the same texts. Per committed batch of
   100 events, three steps run back to back, in an order that rotates from batch to batch:
   ``len`` of tiktoken's ``encode_ordinary`` / HF tokenizers' ``encode`` on the batch's texts
   (the raw count), the meter's ``observe`` of the batch (projection, framing, caching
   included), and the same with a tokenizer that counts nothing (the meter's own cost, on a
   second fold). So all three see the same moment, heap and machine load; each column is the
   sum over batches of the best of ``--repeat`` passes. The raw column counts exactly the
   strings the meter tokenizes, read afresh from the events in every pass (outside its
   timing), as the meter reads them: a string counted before carries the UTF-8 view tiktoken
   cached in it, which the meter's fresh strings never have. (Timed as one uninterrupted loop
   apart from the fold's admissions, over the same string objects every pass, the raw count ran
   faster than the same counts inside the meter's pass: for deepseek-v4, whose meter costs 1%
   of the raw count, meter/raw read 1.07-1.16x; paired, it reads 1.01x.)
3. The reference heuristic's error against exact counts for English prose, Chinese, source code and
   JSON tool output.

Texts come from ``shared/data/trajectories/conversations.jsonl`` beside the repository (agent
transcripts; ``COMPACTD_SHARED`` names another ``shared`` folder), cycled
to reach the sizes; the Chinese sample is the Chinese chapter of the spec (the transcripts hold
almost no CJK).

    python bench/bench_pressure.py [--sizes 100,1000,10000,100000] [--checks 1000] [--no-grpc]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import itertools
import json
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compactd.core.fold import SessionFold
from compactd.core.meter import MeteredRoute, SessionMeter, recount
from compactd.core.policy import PressurePolicy
from compactd.core.pricing import PricingProfile, quarter_tokens
from compactd.routes import Route, RouteCatalog
from compactd.service.pressure import PressureService
from compactd.service.sessions import SessionManager
from compactd.store.memory import MemoryEventStore
from compactd.tokenizers import framing_for, load_tokenizer
from compactd.v1 import events_pb2

SHARED = Path(os.environ.get("COMPACTD_SHARED", Path(__file__).resolve().parents[2] / "shared"))
DATA = SHARED / "data" / "trajectories" / "conversations.jsonl"
CHINESE = next((SHARED / "seeds").glob("001_*.txt"), None)
PROVIDER, MODEL = "openai", "gpt-4-turbo"  # cl100k_base, 128k window
BATCH = 1000

SessionEvent = events_pb2.SessionEvent
ContentBlock = events_pb2.ContentBlock


# ---- the corpus ------------------------------------------------------------------------------


def conversations() -> list[dict[str, Any]]:
    with DATA.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def _blocks(content: object) -> list[ContentBlock]:
    if isinstance(content, str):
        return [ContentBlock(text=events_pb2.TextBlock(text=content))] if content else []
    blocks = []
    for part in content if isinstance(content, list) else []:
        if part.get("type") == "text":
            blocks.append(ContentBlock(text=events_pb2.TextBlock(text=part["text"])))
        elif part.get("type") == "image_url":
            blocks.append(ContentBlock(image=_image(str(part["image_url"]["url"]))))
    return blocks


def _image(url: str) -> events_pb2.ImageBlock:
    """The image a chat part carries: a ``data:`` URL inline, any other URL as its path (a
    block with a name only is refused by ``AppendEvents``: nothing could read it again)."""
    header, comma, payload = url.partition(",")
    if url.startswith("data:") and comma and header.endswith(";base64"):
        data = base64.b64decode(payload)
        media_type = header.removeprefix("data:").removesuffix(";base64")
        return events_pb2.ImageBlock(media_type=media_type, data=data, size_bytes=len(data))
    return events_pb2.ImageBlock(name=url.rsplit("/", 1)[-1], path=url)


def _event(message: dict[str, Any], prefix: str, calls: set[str]) -> SessionEvent | None:
    role, blocks = message["role"], _blocks(message.get("content"))
    if role == "system":
        return SessionEvent(system_message=events_pb2.SystemMessage(text=message["content"]))
    if role == "assistant":
        for call in message.get("tool_calls") or []:
            function = call["function"]
            block = events_pb2.ToolCallBlock(
                id=prefix + call["id"], name=function["name"], arguments_json=function["arguments"]
            )
            blocks.append(ContentBlock(tool_call=block))
            calls.add(block.id)
        body = events_pb2.AssistantMessage(content=blocks)
        return SessionEvent(assistant_message=body) if blocks else None
    call_id = prefix + str(message.get("tool_call_id", ""))
    if role == "tool" and call_id in calls:
        return SessionEvent(tool_result=events_pb2.ToolResult(tool_call_id=call_id, content=blocks))
    return SessionEvent(user_message=events_pb2.UserMessage(content=blocks)) if blocks else None


def in_steps(batch: Sequence[SessionEvent], steps: Iterator[int]) -> list[SessionEvent]:
    """``batch`` as a runtime appends it over the API: each assistant message in its own step of
    turn 1 (``AppendEvents`` refuses an assistant message outside an open step)."""
    out: list[SessionEvent] = []
    for event in batch:
        if event.HasField("assistant_message"):
            step = next(steps)
            out += [
                SessionEvent(step_start=events_pb2.StepStart(turn=1, step=step)),
                event,
                SessionEvent(step_end=events_pb2.StepEnd(turn=1, step=step)),
            ]
        else:
            out.append(event)
    return out


def surface_events(corpus: list[dict[str, Any]]) -> Iterator[SessionEvent]:
    """Surface events from the transcripts, cycled forever with fresh tool-call ids."""
    cycle = 0
    while True:
        calls: set[str] = set()
        for index, conversation in enumerate(corpus):
            for message in conversation["messages"]:
                event = _event(message, f"r{cycle}.{index}.", calls)
                if event is not None:
                    yield event
        cycle += 1


def texts_of(event: SessionEvent) -> list[str]:
    """The strings the meter tokenizes for one event."""
    body = event.WhichOneof("body")
    if body == "system_message":
        return [event.system_message.text]
    texts = []
    for block in getattr(event, body or "").content:
        kind = block.WhichOneof("block")
        if kind == "text":
            texts.append(block.text.text)
        elif kind == "reasoning":
            texts.append(block.reasoning.text)
        elif kind == "tool_call":
            texts += [block.tool_call.name, block.tool_call.arguments_json]
    return texts


# ---- timing helpers --------------------------------------------------------------------------


@dataclass
class Timing:
    samples: list[float]  # seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:7.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:7.2f} ms"
    return f"{seconds:7.2f} s "


def timed(call: Callable[[], object], times: int) -> Timing:
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return Timing(samples)


async def timed_async(call: Callable[[], Any], times: int) -> Timing:
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return Timing(samples)


def recounts_for(size: int) -> int:
    """Recount samples at ``size`` events: a 100,000-event recount takes seconds."""
    return max(1, min(20, 20_000 // size))


# ---- 1. CheckPressure latency ----------------------------------------------------------------


async def grow(append: Callable[[list[SessionEvent]], Any], source: Iterator[SessionEvent],
               have: int, size: int) -> int:  # fmt: skip
    while have < size:
        batch = [next(source) for _ in range(min(BATCH, size - have))]
        await append(batch)
        have += len(batch)
    return have


async def latency_in_process(sizes: Sequence[int], checks: int) -> list[tuple[str, ...]]:
    store = MemoryEventStore()
    await store.open()
    manager = SessionManager(store)
    service = PressureService(manager, RouteCatalog(), PressurePolicy.from_settings(None))
    route = service.route_for(PROVIDER, MODEL)
    await manager.create("bench", None)
    handle = await manager.get("bench")
    header = events_pb2.RequestHeader(
        config=events_pb2.RequestConfig(provider=PROVIDER, model=MODEL)
    )
    await handle.append([SessionEvent(request_header=header)])
    await service.check("bench")  # the route's ledger exists: every append is priced on arrival
    source, have, rows = surface_events(conversations()), 1, []
    for size in sizes:
        have = await grow(handle.append, source, have, size)
        check = await timed_async(lambda: service.check("bench"), checks)
        full = timed(lambda: recount(handle.fold, route), recounts_for(size))
        report = await service.check("bench")
        assert report.measured_tokens == recount(handle.fold, route).total
        timings = (check.pct(0.5), check.pct(0.99), full.pct(0.5), full.pct(0.99))
        rows.append((f"{size:,}", *map(fmt, timings), f"{report.measured_tokens:,}"))
    await manager.close()
    await store.close()
    return rows


async def latency_grpc(sizes: Sequence[int], checks: int) -> tuple[list[tuple[str, ...]], str]:
    """CheckPressure over loopback, or why it could not be measured."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from compactd import config
    from compactd.api.server import create_server
    from compactd.v1 import (
        compaction_service_pb2,
        compaction_service_pb2_grpc,
        session_service_pb2,
        session_service_pb2_grpc,
    )

    overrides = {
        "listen": "127.0.0.1:0",
        "store": "memory://",
        "log_level": "WARNING",
        "max_batch_events": 4 * BATCH,  # a batch of BATCH events with its assistant steps
        # 100,000 transcript events make a surface far over the default limits: this bench
        # measures how checks scale, so it lifts the read bound to the largest gRPC message.
        "max_message_bytes": 2**31 - 1,
        "max_surface_bytes": 2**31 - 1 - 2**20,
    }
    running = await create_server(config.load(None, environ={}, overrides=overrides))
    rows: list[tuple[str, ...]] = []
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            sessions = session_service_pb2_grpc.SessionServiceStub(channel)
            compaction = compaction_service_pb2_grpc.CompactionServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            empty = await timed_async(lambda: health.Check(health_pb2.HealthCheckRequest()), checks)
            p50, p99 = fmt(empty.pct(0.5)), fmt(empty.pct(0.99))
            note = f"empty unary RPC (health check) on loopback: p50 {p50}, p99 {p99}"
            await sessions.CreateSession(
                session_service_pb2.CreateSessionRequest(session_id="bench")
            )
            header = events_pb2.RequestHeader(
                config=events_pb2.RequestConfig(provider=PROVIDER, model=MODEL)
            )

            steps = itertools.count(1)

            async def append(batch: list[SessionEvent]) -> None:
                events = in_steps(batch, steps)
                request = session_service_pb2.AppendEventsRequest(session_id="bench", events=events)
                await sessions.AppendEvents(request)

            opening = SessionEvent(turn_start=events_pb2.TurnStart(turn=1))
            await append([opening, SessionEvent(request_header=header)])
            request = compaction_service_pb2.CheckPressureRequest(session_id="bench")
            try:
                await compaction.CheckPressure(request)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return [], note + "; CheckPressure is not served yet"
                raise
            source, have = surface_events(conversations()), 1
            for size in sizes:
                have = await grow(append, source, have, size)
                check = await timed_async(lambda: compaction.CheckPressure(request), checks)
                rows.append((f"{size:,}", fmt(check.pct(0.5)), fmt(check.pct(0.99))))
            return rows, note
    finally:
        await running.stop(0)


# ---- 2. meter throughput ---------------------------------------------------------------------


def raw_counter(name: str) -> Callable[[str], int]:
    """Token count straight from the library: ``len`` of tiktoken's ``encode_ordinary`` or of HF
    tokenizers' ``encode`` (no begin/end tokens)."""
    tokenizer: Any = load_tokenizer(name)
    if name == "deepseek-v4":
        hf = tokenizer._tokenizer
        return lambda text: len(hf.encode(text, add_special_tokens=False))
    encoding = tokenizer._encoding
    return lambda text: len(encoding.encode_ordinary(text))


class _FreeTokenizer:
    """Counts nothing, instantly: what remains of a meter pass is the meter's own cost."""

    name = "free"
    exact = True

    def count(self, text: str) -> int:
        return 0


@dataclass(frozen=True)
class _PricedRoute:
    provider: str
    model: str
    pricing: PricingProfile


def throughput(name: str, events: list[SessionEvent], repeat: int) -> tuple[str, ...]:
    """The raw counter, the meter and the meter's own cost (a meter with a tokenizer that counts
    nothing) on the same batches: per batch the best of ``repeat`` paired passes, summed."""
    route = Route("bench", name, 10**9, tokenizer=name)
    free = _PricedRoute("bench", "free", PricingProfile(_FreeTokenizer(), framing_for(name)))
    count = raw_counter(name)
    best = _paired_pass(events, count, (route, free))
    for _ in range(repeat - 1):
        again = _paired_pass(events, count, (route, free))
        best = [list(map(min, kept, new)) for kept, new in zip(best, again, strict=True)]
    raw, meter, own = (sum(column) for column in zip(*best, strict=True))
    megabytes = sum(len(t.encode()) for event in events for t in texts_of(event)) / 1e6
    return (name, f"{len(events):,}", f"{megabytes:.1f} MB", f"{megabytes / raw:6.2f} MB/s",
            f"{megabytes / meter:6.2f} MB/s", f"{meter / raw:5.2f}x",
            f"{own / len(events) * 1e6:4.1f} us", f"{own / raw * 100:4.1f}%")  # fmt: skip


def _paired_pass(
    events: list[SessionEvent], count: Callable[[str], int], routes: Sequence[MeteredRoute]
) -> list[list[float]]:
    """Seconds per 100-event batch: the raw count of the batch's texts, then one meter per route
    (each on its own fold) observing the committed batch; the steps run back to back, in an
    order that rotates from batch to batch."""
    folds = [SessionFold() for _ in routes]
    meters = [SessionMeter(fold) for fold in folds]
    for meter, fold, route in zip(meters, folds, routes, strict=True):
        meter.measure(fold, route)  # the route's ledger exists: observe prices each node
    spent = []
    for index, start in enumerate(range(0, len(events), 100)):
        chunk = events[start : start + 100]
        texts = [text for event in chunk for text in texts_of(event)]  # fresh str objects
        steps: list[Callable[[], object]] = [functools.partial(_count_all, count, texts)]
        for meter, fold in zip(meters, folds, strict=True):
            steps.append(functools.partial(meter.observe, fold, fold.admit(chunk)))
        seconds = [0.0] * len(steps)
        for k in range(len(steps)):
            step = (index + k) % len(steps)
            began = time.perf_counter()
            steps[step]()
            seconds[step] = time.perf_counter() - began
        spent.append(seconds)
    return spent


def _count_all(count: Callable[[str], int], texts: list[str]) -> list[int]:
    return [count(text) for text in texts]


# ---- 3. heuristic error ----------------------------------------------------------------------

_CODE_LINE = re.compile(
    r"\s*(\d+\S?\s*)?(def |class |import |from |return |if |for |#include|[{}]|//)"
)


def samples() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {"English prose": [], "Chinese": [], "source code": [],
                                    "JSON tool output": []}  # fmt: skip
    for conversation in conversations():
        source = conversation["source"].split("/")[0]
        for message in conversation["messages"]:
            text = message.get("content")
            if not isinstance(text, str) or len(text) < 50:
                continue
            if message["role"] == "tool" and _is_json(text):
                groups["JSON tool output"].append(text)
            elif _is_code(text):
                groups["source code"].append(text)
            elif source == "tau-bench" and message["role"] in ("user", "assistant"):
                groups["English prose"].append(text)
    if CHINESE is not None:
        paragraphs = CHINESE.read_text(encoding="utf-8").split("\n")
        groups["Chinese"] = [p for p in paragraphs if len(p) >= 50]
    return groups


def _is_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict | list)
    except ValueError:
        return False


def _is_code(text: str) -> bool:
    lines = text.splitlines()
    codey = sum(1 for line in lines if _CODE_LINE.match(line) or line.startswith("    "))
    return len(lines) >= 5 and codey / len(lines) >= 0.3


def heuristic_error(groups: dict[str, list[str]], names: Sequence[str]) -> list[tuple[str, ...]]:
    rows = []
    for group, texts in groups.items():
        heuristic = [quarter_tokens(t) for t in texts]
        row = [group, f"{len(texts):,}", f"{sum(map(len, texts)) / 1e3:,.0f}k"]
        for name in names:
            exact = [load_tokenizer(name).count(t) for t in texts]
            total = (sum(heuristic) - sum(exact)) / sum(exact) * 100
            per_text = statistics.median(
                abs(h - e) / e * 100 for h, e in zip(heuristic, exact, strict=True) if e
            )
            row += [f"{total:+6.1f}%", f"{per_text:5.1f}%"]
        rows.append(tuple(row))
    return rows


# ---- output ----------------------------------------------------------------------------------


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100,1000,10000,100000", help="session lengths (events)")
    parser.add_argument("--checks", type=int, default=1000, help="CheckPressure samples per size")
    parser.add_argument("--throughput-events", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=5, help="throughput passes (best kept)")
    parser.add_argument("--no-grpc", action="store_true", help="skip the loopback column")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    started = time.perf_counter()

    rows = asyncio.run(latency_in_process(sizes, args.checks))
    columns = ["events", "check p50", "check p99", "recount p50", "recount p99", "tokens"]
    table(
        "CheckPressure in process (PressureService.check) vs a from-scratch recount", columns, rows
    )
    if not args.no_grpc:
        try:
            grpc_rows, note = asyncio.run(latency_grpc(sizes, args.checks))
        except Exception as err:  # the server is wired by another part; report, do not fail
            grpc_rows, note = [], f"gRPC loopback not measured: {type(err).__name__}: {err}"
        if grpc_rows:
            table("CheckPressure over gRPC on loopback", ["events", "p50", "p99"], grpc_rows)
        print(f"\n{note}")

    source = surface_events(conversations())
    events = [next(source) for _ in range(args.throughput_events)]
    rows = [throughput(name, events, args.repeat) for name in ("cl100k_base", "deepseek-v4")]
    table("Meter throughput (observe per 100-event batch) vs the raw tokenizer on the same texts",
          ["tokenizer", "events", "text", "raw count", "meter", "meter/raw", "own cost/event",
           "own/raw"], rows)  # fmt: skip

    names = ("cl100k_base", "deepseek-v4")
    header = ["texts", "n", "chars"]
    for name in names:
        header += [f"{name} total", "median |err|"]
    table("Heuristic (ceil(UTF-16 units / 4)) vs exact counts; + means the heuristic overcounts",
          header, heuristic_error(samples(), names))  # fmt: skip
    print(f"\ndone in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
