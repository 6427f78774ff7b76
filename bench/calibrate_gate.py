"""Calibration of the quality gate's probe threshold (``minProbeRetention``) on real transcripts.

For each kind of summary, the share of its span's probes it keeps (``core.probes``), over the
shared agent transcripts, and how many of them a threshold of 0.3 ... 0.6 lets through:

- good: Claude Code's own compaction summaries of three real sessions (``tests/data``: the
  conversation before each ``isCompactSummary`` boundary and the summary that replaced it), and
  the extractive summarizer at ``maxTokens = 1000`` on a head span (60%) of every transcript of
  eight messages or more;
- bad, on the same head spans: an echo of the span's last message, the empty eight-section
  skeleton, and a "lazy" summary holding only the first and the latest request, clipped to 120
  characters (the loopback's default before this gate);
- with ``--model-url`` (an OpenAI-compatible endpoint, e.g. ``shared/tools/oai-server``'s
  SmolLM2-135M on llama.cpp): that model's summaries of spans of at most ``--model-chars``
  characters, through compactd's own summarizer and instruction. Slow on a CPU; never in CI.

The default threshold is the highest that passes every good summary: see docs/benchmarks.md.

    python bench/calibrate_gate.py [--model-url http://127.0.0.1:PORT/v1] [--model-spans 12]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository

from bench.bench_gate import table
from compactd.core import prompts
from compactd.core.gate import DEFAULT_MIN_PROBE_RETENTION
from compactd.core.probes import message_text, retention, select_probes, span_facts
from compactd.providers.base import SummaryError, SummaryRequest
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.providers.openai import OpenAISummarizer, RetryPolicy, Timeouts
from compactd.testing import messages as build
from compactd.v1 import events_pb2, session_service_pb2

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("COMPACTD_SHARED", ROOT.parent / "shared"))
DATA = SHARED / "data" / "trajectories" / "conversations.jsonl"
BOUNDARIES = ROOT / "tests" / "data" / "compaction_summaries.jsonl.gz"
THRESHOLDS = (0.3, 0.4, 0.5, 0.6)

Message = session_service_pb2.Message


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))


def message(raw: dict[str, Any]) -> Message:
    """A chat-completions message as a projected compactd message."""
    text = _text(raw.get("content"))
    if raw.get("role") == "assistant":
        calls = [
            (c.get("id", ""), c["function"]["name"], c["function"].get("arguments") or "{}")
            for c in raw.get("tool_calls") or []
        ]
        return build.assistant(text, calls=calls)
    if raw.get("role") == "tool":
        return build.tool_result(str(raw.get("tool_call_id", "")), text)
    if raw.get("role") == "system":
        return build.system(text)
    return build.user(text)


def head_spans() -> list[list[dict[str, Any]]]:
    """The first 60% of every transcript of eight messages or more."""
    spans = []
    with DATA.open(encoding="utf-8") as lines:
        for line in lines:
            messages = json.loads(line)["messages"]
            if len(messages) >= 8:
                spans.append(messages[: max(4, int(len(messages) * 0.6))])
    return spans


def lazy(span: Sequence[dict[str, Any]]) -> str:
    """The first and the latest request, clipped: what a careless summary keeps."""
    users = [" ".join(_text(m.get("content")).split()) for m in span if m.get("role") == "user"]
    clipped = [u if len(u) <= 120 else u[:117] + "..." for u in users]
    return f"- {clipped[0]}\n- {clipped[-1]}" if clipped else ""


def kept(span: Sequence[Message], summary: str) -> float | None:
    """The share of ``span``'s probes ``summary`` keeps (None for a span without probes)."""
    probes = select_probes(span_facts(span))
    return retention(probes, summary).ratio if probes else None


async def model_ratios(
    url: str, spans: Sequence[list[dict[str, Any]]], limit: int, chars: int
) -> list[float]:
    summarizer = OpenAISummarizer(
        base_url=url, provider="local", timeouts=Timeouts(read=600, total=600),
        retry=RetryPolicy(max_attempts=1),
    )  # fmt: skip
    ratios: list[float] = []
    for raw in spans:
        if len(ratios) >= limit:
            break
        short: list[dict[str, Any]] = []
        for item in raw:
            if sum(len(json.dumps(m)) for m in [*short, item]) > chars:
                break
            short.append(item)
        while short and short[-1].get("role") == "assistant" and short[-1].get("tool_calls"):
            short.pop()  # no unanswered call at the end
        span = [message(m) for m in short]
        request = SummaryRequest(
            messages=span, tools=[], config=events_pb2.RequestConfig(provider="local", model="m"),
            instruction=prompts.compaction_instruction(), max_tokens=768,
        )  # fmt: skip
        try:
            summary = (await summarizer.summarize(request)).text
        except SummaryError as error:
            print(f"  model failed ({error.reason}); span skipped")
            continue
        ratio = kept(span, summary)
        if ratio is not None:
            ratios.append(ratio)
    return ratios


def row(name: str, ratios: Sequence[float]) -> tuple[str, ...]:
    ordered = sorted(ratios)
    passing = [sum(r >= t for r in ordered) / len(ordered) for t in THRESHOLDS]
    return (
        name, str(len(ordered)), f"{ordered[0]:.2f}", f"{ordered[len(ordered) // 2]:.2f}",
        *(f"{share:.0%}" for share in passing),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-url", default="", help="an OpenAI-compatible endpoint")
    parser.add_argument("--model-spans", type=int, default=12, help="spans the model summarizes")
    parser.add_argument("--model-chars", type=int, default=7000, help="longest span, characters")
    args = parser.parse_args()

    groups: dict[str, list[float]] = {}
    with gzip.open(BOUNDARIES, "rt", encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            ratio = kept([message(m) for m in record["span"]], record["summary"])
            if ratio is not None:
                groups.setdefault("good: Claude Code's compaction summaries", []).append(ratio)
    extractive = ExtractiveSummarizer()
    spans = head_spans()
    for raw in spans:
        span = [message(m) for m in raw]
        candidates = {
            "good: extractive, maxTokens 1000": extractive.summary_text(span, 1000),
            "bad: echo of the last message": message_text(span[-1]),
            "bad: empty skeleton": prompts.summary_skeleton(),
            "bad: first and latest request only": lazy(raw),
        }
        for name, summary in candidates.items():
            ratio = kept(span, summary)
            if ratio is not None:
                groups.setdefault(name, []).append(ratio)
    if args.model_url:
        ratios = asyncio.run(
            model_ratios(args.model_url, spans, args.model_spans, args.model_chars)
        )
        if ratios:
            groups["model at --model-url"] = ratios
    header = ("summaries", "n", "min", "median", *(f"pass at {t}" for t in THRESHOLDS))
    rows = [row(name, ratios) for name, ratios in groups.items()]
    table(
        f"Probe retention by summary (default minProbeRetention {DEFAULT_MIN_PROBE_RETENTION})",
        header,
        rows,
    )


if __name__ == "__main__":
    main()
