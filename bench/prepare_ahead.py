"""Prepare-ahead: the agent-visible wait compaction adds, with ``prepareAheadRatio`` off and on.

Issue 35: every compaction used to run inside the ``PrepareStep`` that crossed the trigger, so
the agent waited for the whole summary call. With ``prepareAheadRatio`` set, compactd starts the
summary once the envelope passes that share of the window and applies it at a step boundary.
This benchmark replays the shipped transcripts as agents would, with each option, and prints
side by side:

- **wait p50 / p95 / max / total**: the agent-visible wait compaction added, measured by the
  client (``replay.compaction_waits``): at every step that compacted (a bracket the log places in
  it, or ``PrepareStep`` reporting one), how much longer its ``PrepareStep`` and the appends
  that follow it (a step boundary) took than the session's median step that compacted nothing;
- **of them jumped**: steps that compacted although the step before had sent less than the
  "on" ratio of the window, their own envelope at the trigger or above: one step's appends
  crossed both, so nothing could be prepared for them in time (a large tool output, say);
- **compactions**: brackets committed;
- **summary input tokens / requests**: what the summary model received (every request, including
  those of candidates discarded or cancelled; 4 characters a token, as the model bills);
- **facts kept**: every path, command and error of each compacted span (``bench.facts``, as in
  ``bench.strategies``) that the request right after the compaction still shows;
- **agent input tokens**: the input tokens of every request ``PrepareStep`` answered.

Set-up, as in production: each arm's compactd runs in a child process of its own (``--serve``:
an embedded server on a SQLite store, the agent route's window ``--window``, summaries by an
``openai`` route) and the replays talk to it over gRPC. The summary model is the OpenAI-compatible
loopback server (``compactd.testing.openai_server``, real HTTP, streamed answers with its default
eight-section summary) running in the bench's process, one per arm, its answers delayed as a
model's would be: ``3s`` waits 3 s before every summary; ``smollm2`` waits as SmolLM2-135M on
llama.cpp was measured to (about 175 prompt tokens and 85 generated tokens a second: prompt/175 +
completion/85 seconds). Its route has an 8,192-token window (SmolLM2's), so a larger span is
chunked (``[summarizer] chunk_concurrency``, default 4). The agent: after each ``PrepareStep``
its model takes ``--think`` seconds (default 2 s, a fast agent model) before its recorded reply
is logged; ``--parallel`` sessions (default 12) run at once. The "off" and "on" arms of one summary
model run at the same time, on the same machine, each with its own server and model.

"on" sets ``prepareAheadRatio`` to the trigger's ratio (0.8, replay's policy) less ``--lead``
(default 0.15: 0.65). The transcripts: those of ``testdata/transcripts/*.jsonl`` (Anthropic-format
files converted) and of the shared set (``shared/data/trajectories/conversations.jsonl``;
``COMPACTD_SHARED`` names another ``shared``) whose text exceeds the window (the others never
compact: they would only add think time), each cut to its first ``--max-steps`` model steps
(default 30) to keep the run near ten minutes.

    python -m bench.prepare_ahead                  # print the table (both models, both arms)
    python -m bench.prepare_ahead --write          # and rewrite docs/benchmarks.md's section
    python -m bench.prepare_ahead --arms off --models 3s --max-steps 20   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compactd_client import AsyncCompactdClient

from bench import facts as fx
from bench import strategies as st
from bench.children import served, until_stdin_closes
from compactd import replay as rp
from compactd.core.policy import PressurePolicy
from compactd.errors import ConfigError
from compactd.replay_report import percentile
from compactd.testing.openai_server import (
    OpenAICompatServer,
    RecordedRequest,
    Reply,
    default_reply_text,
)
from compactd.v1 import session_service_pb2

Message = session_service_pb2.Message
ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench:prepare-ahead:start -->", "<!-- bench:prepare-ahead:end -->"
WINDOW = 8000
SUMMARY_WINDOW = 8192  # SmolLM2-135M's context
THRESHOLD_RATIO = 0.8  # replay's policy leaves thresholdRatio at its default
SUMMARY_ROUTE = {"provider": "bench-summary", "model": "loopback"}
PREPARE_AHEAD_KEY = rp.PREPARE_AHEAD
GOALS = (
    "Goals (issue 35): with prepare-ahead on, p95 added wait <= 50 ms and the total >= 95% lower "
    "than off, at equal facts kept and no more summary input tokens."
)


# ---- the summary model ----------------------------------------------------------------------


@dataclass(frozen=True)
class Pace:
    """How long the loopback model takes for a summary."""

    name: str
    label: str
    seconds: Callable[[int, int], float]  # (prompt tokens, completion tokens) -> seconds


PACES = {
    "3s": Pace("3s", "3 s a summary", lambda prompt, completion: 3.0),
    "smollm2": Pace(
        "smollm2",
        "SmolLM2-135M rates (175 prompt, 85 generated tokens/s)",
        lambda prompt, completion: prompt / 175 + completion / 85,
    ),
}


def tokens(text: str) -> int:
    """The loopback model's count: 4 characters a token."""
    return math.ceil(len(text) / 4)


@dataclass
class SummaryModel:
    """The loopback model's responder: its default summary, after the pace's delay; counts what
    it was sent (called from the server's handler threads)."""

    pace: Pace
    requests: int = 0
    prompt_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, request: RecordedRequest) -> Reply:
        body = request.json
        prompt = json.dumps(body.get("tools", []), separators=(",", ":")) + json.dumps(
            body.get("messages", []), ensure_ascii=False, separators=(",", ":")
        )
        compaction = request.header("x-compactd-purpose") == "compaction"
        text = default_reply_text(body, compaction=compaction)
        with self._lock:
            self.requests += 1
            self.prompt_tokens += tokens(prompt)
        return Reply(text=text, delay_before=self.pace.seconds(tokens(prompt), tokens(text)))


# ---- the server's side (a child process) ------------------------------------------------------


async def serve(window: int, summary_url: str) -> None:
    """compactd on a temporary store, summaries by the model at ``summary_url``; prints its
    address and serves until stdin closes."""
    async with rp.temporary_store() as folder:
        config = rp.embedded_config(None, folder, window=window, environ={})
        route = {**SUMMARY_ROUTE, "base_url": summary_url, "context_window": SUMMARY_WINDOW,
                 "max_output_tokens": 1024}  # fmt: skip
        summarizer = {"kind": "openai", **SUMMARY_ROUTE, "timeout_s": 600}
        config = dataclasses.replace(config, routes=(*config.routes, route), summarizer=summarizer)
        async with rp.embedded_server(config) as address:
            print(address, flush=True)
            await until_stdin_closes()


# ---- the agents' side -------------------------------------------------------------------------


@dataclass
class Arm:
    """One replay of every transcript: a summary pace, prepare-ahead off (None) or a ratio."""

    pace: Pace
    ratio: float | None
    replays: list[tuple[rp.SessionReplay, list[Any]]] = field(default_factory=list)
    model: SummaryModel | None = None
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return "off" if self.ratio is None else f"on ({self.ratio:g})"


def policy(window: int, ratio: float | None) -> dict[str, Any]:
    """The sessions' policy: replay's for ``window``, summaries by the loopback route."""
    base = rp.window_policy(window) | {
        "summarizationProvider": SUMMARY_ROUTE["provider"],
        "summarizationModel": SUMMARY_ROUTE["model"],
    }
    chosen = rp.prepare_ahead_policy(base, ratio)
    assert chosen is not None
    return chosen


async def run_arm(arm: Arm, transcripts: Sequence[rp.Transcript], args: argparse.Namespace) -> Arm:
    """Replay every transcript against a fresh server in a child process."""
    arm.model = SummaryModel(arm.pace)
    with OpenAICompatServer(responder=arm.model) as model:
        async with served("bench.prepare_ahead", 1, str(args.window), model.base_url) as lines:
            started = time.perf_counter()
            arm.replays = await play(lines[0], transcripts, policy(args.window, arm.ratio), args)
            arm.seconds = time.perf_counter() - started
    print(f"{arm.pace.name} {arm.name}: {arm.seconds:,.0f} s", file=sys.stderr, flush=True)
    return arm


async def play(
    address: str, transcripts: Sequence[rp.Transcript], chosen: dict[str, Any], args: Any
) -> list[tuple[rp.SessionReplay, list[Any]]]:
    """``args.parallel`` agents at a time, each replaying a transcript with ``args.think``
    seconds of model time a step; each replay with its log."""
    gate = asyncio.Semaphore(args.parallel)
    async with AsyncCompactdClient(address, timeout=900.0) as client:

        async def one(transcript: rp.Transcript) -> tuple[rp.SessionReplay, list[Any]]:
            async with gate:
                result = await rp.replay(
                    client, transcript, policy=chosen, keep_requests=True, think=args.think
                )
                return result, [e async for e in client.list_events(result.session_id)]

        return list(await asyncio.gather(*(one(t) for t in transcripts)))


# ---- the transcripts ----------------------------------------------------------------------------


def selected(args: argparse.Namespace) -> list[rp.Transcript]:
    """The transcripts whose text exceeds the window (the others never compact), each cut to
    its first ``args.max_steps`` model steps; the longest first (the agents finish together)."""
    shipped = [t for path in args.transcripts for t in st.read_transcripts(path)]
    shared = st.read_transcripts(args.shared)[: args.shared_limit]
    large = [t for t in [*shipped, *shared] if _chars(t) / 4 > args.window]
    return sorted((_first_steps(t, args.max_steps) for t in large), key=lambda t: -_steps(t))


def _chars(transcript: rp.Transcript) -> int:
    return len(json.dumps(transcript.messages))


def _steps(transcript: rp.Transcript) -> int:
    return sum(1 for m in transcript.messages if m.get("role") == "assistant")


def _first_steps(transcript: rp.Transcript, steps: int) -> rp.Transcript:
    """``transcript`` up to (not including) its ``steps + 1``-th assistant message (the cut
    falls before a model reply, so every call before it keeps its results)."""
    seen, end = 0, len(transcript.messages)
    for index, message in enumerate(transcript.messages):
        if message.get("role") == "assistant":
            seen += 1
            if seen > steps:
                end = index
                break
    return dataclasses.replace(transcript, messages=transcript.messages[:end])


# ---- the figures --------------------------------------------------------------------------------


def facts_kept(arm: Arm) -> tuple[int, int]:
    """(facts the request right after each compaction shows, facts of the compacted spans)."""
    hits = total = 0
    for result, log in arm.replays:
        for planned in st.fact_plan(log, result.steps):
            request = result.requests[planned.after_one]
            text = st.visible_text([Message.FromString(m.SerializeToString())
                                    for m in request.messages])  # fmt: skip
            kept = fx.kept(planned.found, text)
            hits, total = hits + sum(kept), total + len(kept)
    return hits, total


def jumped(arm: Arm, ratio: float) -> int:
    """Steps that compacted although the step before them had sent less than ``ratio`` x W and
    they measured the trigger or more: one step's appends crossed both, so nothing could have
    been prepared ahead for them."""
    count = 0
    for result, _ in arm.replays:
        busy = rp.compacted_steps(result)
        for before, step in zip(result.steps, result.steps[1:], strict=False):
            low = before.sent_tokens < ratio * step.window
            count += step.index in busy and low and step.before_tokens >= step.trigger_tokens
    return count


HEADER = ("summary model", "prepare-ahead", "wait p50", "p95", "max", "total",
          "steps that compacted", "of them jumped", "compactions", "summary input tokens",
          "summary requests", "facts kept", "agent input tokens", "run")  # fmt: skip


def row(arm: Arm, ratio: float) -> tuple[str, ...]:
    """One arm's cells (``ratio``: the "on" arms' prepareAheadRatio)."""
    waits = [w for result, _ in arm.replays for w in rp.compaction_waits(result)]

    def ms(q: float) -> str:
        return f"{percentile(waits, q) * 1000:,.0f} ms" if waits else "-"

    hits, total = facts_kept(arm)
    committed = sum(len(result.committed) for result, _ in arm.replays)
    assert arm.model is not None
    return (
        arm.pace.label, arm.name, ms(0.5), ms(0.95), ms(1.0), f"{sum(waits):,.1f} s",
        str(len(waits)), str(jumped(arm, ratio)), str(committed),
        f"{arm.model.prompt_tokens:,}", str(arm.model.requests),
        f"{hits / total:.1%} of {total:,}" if total else "-",
        f"{sum(result.tokens_sent for result, _ in arm.replays):,}", f"{arm.seconds:,.0f} s",
    )  # fmt: skip


def markdown(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join([*lines, *("| " + " | ".join(cells) + " |" for cells in rows)])


def plain(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(c) for c in column) for column in zip(HEADER, *rows, strict=True)]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                  for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        for cells in (HEADER, *rows)
    )  # fmt: skip


async def measure(args: argparse.Namespace) -> tuple[list[tuple[str, ...]], str]:
    """Every arm's row, and a line saying what was played."""
    transcripts = selected(args)
    ratio = round(THRESHOLD_RATIO - args.lead, 4)
    if "on" in args.arms:
        try:
            PressurePolicy.from_settings({PREPARE_AHEAD_KEY: ratio})
        except ConfigError as err:  # a --lead that leaves no valid ratio
            raise SystemExit(f"--lead {args.lead}: {err.message}") from None
    rows = []
    for name in args.models:
        arms = [Arm(PACES[name], None if arm == "off" else ratio) for arm in args.arms]
        done = await asyncio.gather(*(run_arm(arm, transcripts, args) for arm in arms))
        rows += [row(arm, ratio) for arm in done]
    steps = sum(_steps(t) for t in transcripts)
    played = (
        f"{len(transcripts)} transcripts (those of {', '.join(p.name for p in args.transcripts)} "
        f"and {args.shared.name} whose text exceeds the window), each cut to its first "
        f"{args.max_steps} model steps: {steps:,} steps. Agent route window {args.window:,} "
        f'tokens (replay\'s policy: trigger at {THRESHOLD_RATIO:g} W); "on" = prepareAheadRatio '
        f"{ratio:g}. The "
        f"agent's model takes {args.think:g} s after each PrepareStep; {args.parallel} agents at "
        f"once; the summary route's window {SUMMARY_WINDOW:,} tokens."
    )
    return rows, played


def write(rows: Sequence[Sequence[str]], played: str, note: str) -> None:
    """Rewrite docs/benchmarks.md's section between the markers."""
    text = PAGE.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{PAGE.relative_to(ROOT)} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    body = "\n\n".join(part for part in (note, played, markdown(rows), GOALS) if part)
    PAGE.write_text(f"{head}{START}\n{body}\n{END}{tail}", encoding="utf-8")


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        asyncio.run(serve(int(sys.argv[2]), sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=tuple(PACES), default=list(PACES))
    parser.add_argument("--arms", nargs="+", choices=("off", "on"), default=["off", "on"])
    parser.add_argument("--lead", type=float, default=0.15,
                        help="prepareAheadRatio = 0.8 (the trigger's ratio) less this")  # fmt: skip
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--think", type=float, default=2.0, help="agent model seconds a step")
    parser.add_argument("--parallel", type=int, default=12, help="agents at once")
    parser.add_argument("--max-steps", type=int, default=30, help="model steps a transcript")
    shipped = sorted((ROOT / "testdata" / "transcripts").glob("*.jsonl"))
    parser.add_argument("--transcripts", type=Path, nargs="+", default=shipped)
    parser.add_argument("--shared", type=Path, default=st.DEFAULT_FILES[-1])
    parser.add_argument("--shared-limit", type=int, default=None,
                        help="only the shared set's first conversations")  # fmt: skip
    parser.add_argument("--write", action="store_true", help="rewrite docs/benchmarks.md's section")
    parser.add_argument("--note", default="", help="a line written above the table")
    args = parser.parse_args()
    rows, played = asyncio.run(measure(args))
    print(played)
    print(plain(rows))
    print(GOALS)
    if args.write:
        write(rows, played, args.note)


if __name__ == "__main__":
    main()
