"""Replay: what the summary quality gate and failure memory change when the summarizer fails.

The large transcripts of the shared set are replayed as agent sessions through a real server
(``create_server`` on port 0, SQLite, the loopback OpenAI-compatible provider), each twice in the
same run, interleaved conversation by conversation: once with the gate and failure memory off
(``summaryGate = false``, ``failureBackoffSeconds = 0``: compactd before issue 16) and once with
the defaults. The runtime loop is docs/clients.md's: a turn per user message, ``PrepareStep`` before
every model step, the step's ``assistant/message`` inside ``step/start`` ... ``step/end``, the tool
results after it. The route has a 16,000-token window (trigger 12,800, retained budget 2,400).

The summarizer fails a given fraction of the time (``--fail``, several rates in one run): a
summary request whose body hashes under the rate is answered, by the same hash, with an echo of
the span's last message, a summary without the sections, the empty skeleton (three kinds of
garbage the old "smaller than the span" check commits), a summary larger than its span, or an
HTTP 503. The same request always gets the same answer, like a model at temperature 0 that keeps
answering the same thing for the same span; any other request gets the loopback's diligent
default summary. A third mode adds the gate's extractive fallback.

Model time is modeled from each call's size (4 characters per token) at the rates the oai-server
README measured for llama.cpp serving SmolLM2-135M on this machine (``shared/tools/oai-server``):
``--prefill`` prompt tokens/s and ``--decode`` generated tokens/s. The server's clock (failure
memory's backoffs) is simulated too: each agent step takes ``--step-seconds`` plus the modeled
time of the summary calls its ``PrepareStep`` made, so a replay of hours runs in seconds.

Printed per failure rate and mode: steps, and how many sent their request above the trigger
(pressure left unrelieved); summary model calls; brackets that sent a span whose earlier
bracket had failed ("failed span again"); model time, all and wasted (calls whose
summary was not committed, plus calls whose committed summary the gate would have rejected);
brackets committed, rejected (closed without commit) and skipped (failure memory, crossing
budget); committed summaries the gate would reject ("garbage in history"); and the mean share of
their span's probes the committed summaries keep.

    python bench/bench_gate.py [--fail 0.1,0.3,0.5] [--conversations 12] [--step-seconds 20]
                               [--prefill 175] [--decode 85]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import trace

from compactd import config
from compactd.api.server import create_server
from compactd.core import gate, prompts
from compactd.core.probes import retention, select_probes, span_facts
from compactd.core.projection import project
from compactd.testing.openai_server import (
    OpenAICompatServer,
    RecordedRequest,
    Reply,
    default_reply_text,
)
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import compaction_service_pb2_grpc, events_pb2, session_service_pb2_grpc
from compactd.v1 import session_service_pb2 as spb

SHARED = Path(os.environ.get("COMPACTD_SHARED", Path(__file__).resolve().parents[2] / "shared"))
DATA = SHARED / "data" / "trajectories" / "conversations.jsonl"
PROVIDER, MODEL = "loop", "m"
ROUTE = {"context_window": 16_000, "max_output_tokens": 1_000}
POLICY = {"thresholdRatio": 0.8, "headroomTokens": 1_000, "retainRatio": 0.16, "maxTokens": 1_000}
MODES: dict[str, dict[str, Any]] = {
    "before (gate, memory off)": {"summaryGate": False, "failureBackoffSeconds": 0},
    "after": {},
    "after + extractiveFallback": {"extractiveFallback": True},
}
HEADER = (
    "fail", "mode", "steps", "sent above trigger", "summary calls", "failed span again",
    "model time", "wasted", "committed", "rejected", "skipped", "garbage in history",
    "probe retention",
)  # fmt: skip
#: How a failing summary request is answered: garbage the old shrink check accepts (an echo,
#: no sections, the empty skeleton), a summary larger than its span, or a provider error.
FAILURES = ("echo", "no sections", "skeleton", "rambles", "error")

SessionEvent = events_pb2.SessionEvent
ContentBlock = events_pb2.ContentBlock


# ---- the failing summarizer ------------------------------------------------------------------


@dataclass
class Call:
    """One summary request the loopback answered."""

    prompt_tokens: int
    completion_tokens: int
    failure: str  # "" for the diligent default


@dataclass
class FailingModel:
    """The loopback's responder: fails ``rate`` of the summary requests, deterministically."""

    rate: float
    speed: tuple[float, float]  # prompt and generated tokens per second
    calls: list[Call] = field(default_factory=list)

    def seconds(self, calls: Sequence[Call]) -> list[float]:
        """Each call's modeled model time."""
        prefill, decode = self.speed
        return [c.prompt_tokens / prefill + c.completion_tokens / decode for c in calls]

    def __call__(self, request: RecordedRequest) -> Reply | None:
        if request.header("x-compactd-purpose") != "compaction":
            return None
        body = request.json
        digest = hashlib.blake2b(request.body, digest_size=8).digest()
        draw = int.from_bytes(digest[:4], "big") / 2**32
        failure = FAILURES[digest[4] % len(FAILURES)] if draw < self.rate else ""
        prompt = len(json.dumps(body.get("messages", []), ensure_ascii=False)) // 4
        if failure == "error":
            self.calls.append(Call(prompt, 0, failure))
            return Reply.server_error(503)
        text = _answer(body, failure)
        self.calls.append(Call(prompt, len(text) // 4 + 1, failure))
        return Reply(text=text)


def _answer(body: dict[str, Any], failure: str) -> str:
    if failure == "echo":
        span = body["messages"][:-1]  # the last message is the instruction
        return next((str(m["content"]) for m in reversed(span) if m.get("content")), "ok")
    if failure == "skeleton":
        return prompts.summary_skeleton()
    if failure == "rambles":  # the whole span again, and more: not smaller
        return json.dumps(body["messages"][:-1], ensure_ascii=False) * 2
    text = default_reply_text(body, compaction=True)
    if failure == "no sections":
        return "\n".join(line for line in text.splitlines() if not line.startswith("## "))
    return text


# ---- replaying a transcript the way a runtime would -------------------------------------------


def conversations(limit: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """The ``limit`` largest transcripts with more than one turn's worth of messages."""
    found = []
    with DATA.open(encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            messages = record["messages"]
            size = sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)
            if len(messages) >= 10:
                found.append((size, record["source"], messages))
    found.sort(key=lambda item: -item[0])
    return [(source, messages) for _, source, messages in found[:limit]]


def _blocks(content: object) -> list[ContentBlock]:
    if isinstance(content, str):
        return [ContentBlock(text=events_pb2.TextBlock(text=content))] if content else []
    parts = content if isinstance(content, list) else []
    texts = [str(p.get("text", "")) for p in parts if isinstance(p, dict)]
    return [ContentBlock(text=events_pb2.TextBlock(text="\n".join(t for t in texts if t)))]


class Clock:
    """The server's clock: simulated agent time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Runtime:
    """Turns, steps and PrepareStep calls around a transcript's messages."""

    def __init__(
        self, channel: grpc.aio.Channel, session_id: str, clock: Clock, model: FailingModel,
        step_seconds: float,
    ) -> None:  # fmt: skip
        self.clock, self.model, self.step_seconds = clock, model, step_seconds
        self.sessions: Any = session_service_pb2_grpc.SessionServiceStub(channel)
        self.compaction: Any = compaction_service_pb2_grpc.CompactionServiceStub(channel)
        self.session_id = session_id
        self.pending: list[SessionEvent] = []
        self.turn = 0
        self.open = False
        self.calls: set[str] = set()
        self.steps = self.skips = self.above = 0
        self.bracket_calls: dict[str, list[Call]] = {}

    async def replay(self, messages: Sequence[dict[str, Any]], policy: dict[str, Any]) -> None:
        request = spb.CreateSessionRequest(session_id=self.session_id)
        request.compaction_policy.update(policy)
        await self.sessions.CreateSession(request)
        head = messages[0] if messages and messages[0].get("role") == "system" else None
        system = head["content"] if head and isinstance(head["content"], str) else "An agent."
        self.pending += [
            SessionEvent(system_message=events_pb2.SystemMessage(text=system)),
            SessionEvent(
                request_header=events_pb2.RequestHeader(
                    config=events_pb2.RequestConfig(provider=PROVIDER, model=MODEL)
                )
            ),
        ]
        for message in messages[1 if head else 0 :]:
            await self._message(message)
        if self.open:
            self.pending.append(SessionEvent(turn_end=events_pb2.TurnEnd(turn=self.turn)))
        await self._flush()

    async def _message(self, message: dict[str, Any]) -> None:
        role, blocks = message.get("role"), _blocks(message.get("content"))
        if role == "assistant":
            for call in message.get("tool_calls") or []:
                call_id = f"{self.session_id}.{call['id']}"
                self.calls.add(call_id)
                function = call["function"]
                block = events_pb2.ToolCallBlock(
                    id=call_id, name=function["name"], arguments_json=function["arguments"] or "{}"
                )
                blocks.append(ContentBlock(tool_call=block))
            if blocks:
                await self._step(
                    SessionEvent(assistant_message=events_pb2.AssistantMessage(content=blocks))
                )
            return
        call_id = f"{self.session_id}.{message.get('tool_call_id', '')}"
        if role == "tool" and call_id in self.calls:
            result = events_pb2.ToolResult(tool_call_id=call_id, content=blocks)
            self.pending.append(SessionEvent(tool_result=result))
            return
        if blocks:  # a user message (or a tool message answering no known call) opens a turn
            if self.open:
                self.pending.append(SessionEvent(turn_end=events_pb2.TurnEnd(turn=self.turn)))
            self.turn += 1
            self.open = True
            self.pending += [
                SessionEvent(turn_start=events_pb2.TurnStart(turn=self.turn)),
                SessionEvent(user_message=events_pb2.UserMessage(content=blocks)),
            ]

    async def _step(self, answer: SessionEvent) -> None:
        if not self.open:
            self.turn += 1
            self.open = True
            self.pending.append(SessionEvent(turn_start=events_pb2.TurnStart(turn=self.turn)))
        await self._flush()
        self.steps += 1
        prepare = cpb.PrepareStepRequest(session_id=self.session_id, turn=self.turn)
        first = attributed = len(self.model.calls)
        async for response in self.compaction.PrepareStep(prepare):
            if response.HasField("result"):
                self.above += response.result.after.state == cpb.PRESSURE_STATE_ABOVE
            step = response.progress.step if response.HasField("progress") else None
            if step == cpb.COMPACTION_STEP_SKIP:
                self.skips += 1
            elif step == cpb.COMPACTION_STEP_END:  # brackets run one at a time: the calls since
                calls = self.model.calls[attributed:]  # the previous one wrote this one
                self.bracket_calls[response.progress.compaction_id] = calls
                attributed += len(calls)
        spent = sum(self.model.seconds(self.model.calls[first:]))
        self.clock.now += self.step_seconds + spent
        self.pending += [
            SessionEvent(step_start=events_pb2.StepStart(turn=self.turn, step=self.steps)),
            answer,
            SessionEvent(step_end=events_pb2.StepEnd(turn=self.turn, step=self.steps)),
        ]

    async def _flush(self) -> None:
        if self.pending:
            await self.sessions.AppendEvents(
                spb.AppendEventsRequest(session_id=self.session_id, events=self.pending)
            )
            self.pending = []

    async def log(self) -> list[SessionEvent]:
        request = spb.ListEventsRequest(session_id=self.session_id)
        return [r.event async for r in self.sessions.ListEvents(request)]


# ---- what the log says -------------------------------------------------------------------------


@dataclass
class Tally:
    """One mode's figures over every replayed conversation."""

    calls: int = 0
    repeats: int = 0
    model_s: float = 0.0
    wasted_s: float = 0.0
    committed: int = 0
    rejected: int = 0
    skipped: int = 0
    garbage: int = 0
    retention: list[float] = field(default_factory=list)
    steps: int = 0
    above: int = 0  # steps whose request was sent above the trigger


def account(log: list[SessionEvent], runtime: Runtime, tally: Tally) -> None:
    """Add one session's log and summary calls to ``tally``."""
    by_seq = {event.seq: event for event in log}
    outcome: dict[str, bool] = {}  # compaction id -> committed a summary the gate accepts
    for event in log:
        if event.HasField("compaction_end"):
            end = event.compaction_end
            if end.error_reason:
                tally.rejected += 1
                outcome[end.compaction_id] = False
        elif event.HasField("compaction_summary"):
            summary = event.compaction_summary
            tally.committed += 1
            good = _acceptable(summary, by_seq, tally)
            tally.garbage += not good
            outcome[summary.compaction_id] = good
    failed: set[tuple[int, ...]] = set()  # spans of brackets that closed without a commit
    for event in log:
        if event.HasField("compaction_start"):
            span = tuple(event.compaction_start.shadowed_seqs)
            tally.repeats += span in failed
        elif event.HasField("compaction_end") and event.compaction_end.error_reason:
            failed.add(span)
    for compaction_id, calls in runtime.bracket_calls.items():
        spent = sum(runtime.model.seconds(calls))
        tally.calls += len(calls)
        tally.model_s += spent
        if not outcome.get(compaction_id, False):
            tally.wasted_s += spent


def _acceptable(
    summary: events_pb2.CompactionSummary, by_seq: dict[int, SessionEvent], tally: Tally
) -> bool:
    """Whether the gate (default settings) accepts a committed summary; records its retention."""
    messages = [m for seq in summary.shadowed_seqs if (m := project(by_seq[seq])) is not None]
    probes = select_probes(span_facts(messages))
    tally.retention.append(retention(probes, summary.summary).ratio)
    verdict = gate.judge(
        summary.summary,
        messages,
        probes,
        checkpoint_tokens=summary.tokens.checkpoint_route_tokens,
        span_tokens=summary.tokens.shadowed_route_tokens,
        settings=gate.GateSettings(),
    )
    return verdict.passed


# ---- the run -------------------------------------------------------------------------------------


async def run(
    fail_rates: Sequence[float], limit: int, speed: tuple[float, float], step_seconds: float
) -> None:
    corpus = conversations(limit)
    print(
        f"{len(corpus)} transcripts, {sum(len(m) for _, m in corpus)} messages; machine busy: "
        "figures as measured"
    )
    rows = []
    for rate in fail_rates:
        model, clock = FailingModel(rate, speed), Clock()
        with OpenAICompatServer(responder=model) as loop, tempfile.TemporaryDirectory() as tmp:
            base = config.load(
                None, environ={},
                overrides={"listen": "127.0.0.1:0", "store": f"sqlite:///{Path(tmp) / 'bench.db'}"},
            )  # fmt: skip
            settings = dataclasses.replace(
                base,
                routes=(
                    {"provider": PROVIDER, "model": MODEL, "base_url": loop.base_url, **ROUTE},
                ),
                summarizer={"kind": "openai", "max_attempts": 1},
                compaction=POLICY,
            )
            server = await create_server(
                settings, tracer_provider=trace.NoOpTracerProvider(), clock=clock
            )
            tallies = {mode: Tally() for mode in MODES}
            try:
                async with grpc.aio.insecure_channel(server.address) as channel:
                    for index, (_, messages) in enumerate(corpus):
                        modes = list(MODES.items())
                        shift = index % len(modes)  # each mode leads in turn
                        for number, (mode, policy) in enumerate(modes[shift:] + modes[:shift]):
                            name = f"c{index}-{number}"
                            runtime = Runtime(channel, name, clock, model, step_seconds)
                            await runtime.replay(messages, {**POLICY, **policy})
                            tally = tallies[mode]
                            tally.skipped += runtime.skips
                            tally.steps += runtime.steps
                            tally.above += runtime.above
                            account(await runtime.log(), runtime, tally)
            finally:
                await server.stop(0)
        for mode, tally in tallies.items():
            rows.append(_row(rate, mode, tally))
    table(
        "Replay of the shared transcripts; the summarizer fails a given fraction of the time",
        HEADER,
        rows,
    )


def _row(rate: float, mode: str, tally: Tally) -> tuple[str, ...]:
    kept = statistics.mean(tally.retention) if tally.retention else 0.0
    figures = (tally.steps, tally.above, tally.calls, tally.repeats)
    outcomes = (tally.committed, tally.rejected, tally.skipped, tally.garbage)
    return (
        f"{rate:.0%}", mode, *map(str, figures), f"{tally.model_s:,.0f} s",
        f"{tally.wasted_s:,.0f} s", *map(str, outcomes), f"{kept:.0%}",
    )  # fmt: skip


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` under ``header``: the first column left-aligned, the figures right."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    for cells in (header, *rows):
        first, *rest = (str(c) for c in cells)
        figures = (c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))
        print("  ".join((first.ljust(widths[0]), *figures)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail", default="0.1,0.3,0.5", help="failure rates, comma-separated")
    parser.add_argument("--conversations", type=int, default=12, help="largest transcripts")
    parser.add_argument("--prefill", type=float, default=175.0, help="prompt tokens per second")
    parser.add_argument("--decode", type=float, default=85.0, help="generated tokens per second")
    parser.add_argument("--step-seconds", type=float, default=20.0, help="agent time per step")
    args = parser.parse_args()
    rates = [float(rate) for rate in args.fail.split(",")]
    speed = (args.prefill, args.decode)
    asyncio.run(run(rates, args.conversations, speed, args.step_seconds))


if __name__ == "__main__":
    main()
