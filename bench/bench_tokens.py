"""Token truth: each pricing method's throughput against its raw tokenizer, and the error of every
method that is not exact, per content type.

1. Throughput. For each method (a route that prices with it), the same 100-event batches of the
   shared agent transcripts go through the raw tokenizer counting exactly the strings the meter
   reads (tiktoken's ``encode_ordinary``, HF tokenizers' ``encode``, the heuristic's
   ``ceil(UTF-16 units / 4)``) and through the meter's ``observe`` (projection, chat template or
   framing, caching: what a commit pays), back to back in an order that rotates from batch to
   batch (``bench_pressure._paired_pass``); each column sums the best of ``--repeat`` passes per
   batch. ``throughput ratio`` is the meter's MB/s over the raw tokenizer's (goal >= 0.9x). The
   template route renders more than the raw strings (role markers, tool-call JSON as the template
   writes it), so a last row compares it with the raw tokenizer counting the template's own
   rendering of the same messages: the token stream the server itself tokenizes.
2. Error per content type of the methods that are not exact: the heuristic (HEURISTIC, and the
   ESTIMATED routes of providers without a public tokenizer) before and after usage calibration,
   against each exact tokenizer as the stand-in for a provider's count. "calibrated" scales the
   heuristic by the ratio one mixed session's usage would teach it (the corpus-wide ratio, as
   ``core.calibration`` computes it), so the residual per content type is what an ESTIMATED route
   keeps after calibration.

    python bench/bench_tokens.py [--events 4000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository

from bench.bench_pressure import (
    _paired_pass,
    conversations,
    samples,
    surface_events,
    table,
    texts_of,
)
from compactd.core.chat_template import chat_message
from compactd.core.fold import SessionFold
from compactd.core.meter import SessionMeter
from compactd.core.pricing import quarter_tokens
from compactd.core.projection import project
from compactd.routes import Route, RouteCatalog
from compactd.tokenizers import QWEN3_TOKENIZER, load_tokenizer

QWEN3 = Route("vllm", "Qwen/Qwen3-8B", 10**9, tokenizer_file=QWEN3_TOKENIZER, sends_reasoning=False)


def _routes() -> list[tuple[str, Route]]:
    catalog = RouteCatalog()

    def route(provider: str, model: str) -> Route:
        declared = catalog.get(provider, model)
        assert declared is not None
        return declared

    return [
        ("TOKENIZER cl100k_base (openai/gpt-4-turbo)", route("openai", "gpt-4-turbo")),
        ("TOKENIZER o200k_base (openai/gpt-4o)", route("openai", "gpt-4o")),
        ("TOKENIZER deepseek-v4 (deepseek/deepseek-chat)", route("deepseek", "deepseek-chat")),
        ("EXACT Qwen3 template (vllm/Qwen/Qwen3-8B)", QWEN3),
        (
            "ESTIMATED heuristic (anthropic/claude-sonnet-4-5)",
            route("anthropic", "claude-sonnet-4-5"),
        ),
    ]


def raw_counter(route: Route) -> Callable[[str], int]:
    """The library's own count for the route's tokenizer (no begin/end tokens)."""
    tokenizer: Any = route.pricing.tokenizer
    if not tokenizer.exact:
        return quarter_tokens
    if hasattr(tokenizer, "_encoding"):
        encoding = tokenizer._encoding
        return lambda text: len(encoding.encode_ordinary(text))
    hf = tokenizer._tokenizer
    return lambda text: len(hf.encode(text, add_special_tokens=False))


def throughput(label: str, route: Route, events: list[Any], repeat: int) -> tuple[str, ...]:
    count = raw_counter(route)
    best = _paired_pass(events, count, (route,))
    for _ in range(repeat - 1):
        again = _paired_pass(events, count, (route,))
        best = [list(map(min, kept, new)) for kept, new in zip(best, again, strict=True)]
    raw, meter = (sum(column) for column in zip(*best, strict=True))
    megabytes = sum(len(t.encode()) for event in events for t in texts_of(event)) / 1e6
    return (label, f"{megabytes:.1f} MB", f"{megabytes / raw:6.2f} MB/s",
            f"{megabytes / meter:6.2f} MB/s", f"{raw / meter:5.2f}x")  # fmt: skip


def rendered_throughput(events: list[Any], repeat: int) -> tuple[str, ...]:
    """The template route against the raw tokenizer counting the template's own rendering of the
    same messages (what a serving stack tokenizes: role markers, tool-call JSON as the template
    writes it), rendered outside the timing; interleaved per 100-event batch, best of passes."""
    template = QWEN3.pricing.template
    assert template is not None
    hf: Any = QWEN3.pricing.tokenizer
    encode = hf._tokenizer.encode
    best: list[list[float]] | None = None
    megabytes = 0.0
    for _ in range(repeat):
        fold = SessionFold()
        meter = SessionMeter(fold)
        meter.measure(fold, QWEN3)
        spent, size = [], 0
        for index, start in enumerate(range(0, len(events), 100)):
            chunk = events[start : start + 100]
            chat = [chat_message(m, sends_reasoning=False) for e in chunk if (m := project(e))]
            text = template.template.render(chat, add_generation_prompt=False)
            size += len(text.encode())
            batch = fold.admit(chunk)
            steps = [
                functools.partial(encode, text, add_special_tokens=False),
                functools.partial(meter.observe, fold, batch),
            ]
            seconds = [0.0, 0.0]
            for k in range(2):
                step = (index + k) % 2
                began = time.perf_counter()
                steps[step]()
                seconds[step] = time.perf_counter() - began
            spent.append(seconds)
        megabytes = size / 1e6
        best = (
            spent
            if best is None
            else [list(map(min, a, b)) for a, b in zip(best, spent, strict=True)]
        )
    assert best is not None
    raw, metered = (sum(column) for column in zip(*best, strict=True))
    return ("EXACT Qwen3 template, vs the rendered prompt", f"{megabytes:.1f} MB",
            f"{megabytes / raw:6.2f} MB/s", f"{megabytes / metered:6.2f} MB/s",
            f"{raw / metered:5.2f}x")  # fmt: skip


# ---- 2. error of the methods that are not exact ----------------------------------------------

REFERENCES = ("cl100k_base", "o200k_base", "deepseek-v4", "qwen3")


def exact_count(name: str) -> Callable[[str], int]:
    if name == "qwen3":
        tokenizer = QWEN3.pricing.tokenizer
        return tokenizer.count
    return load_tokenizer(name).count


def error_rows(groups: dict[str, list[str]]) -> list[tuple[str, ...]]:
    counts = {name: exact_count(name) for name in REFERENCES}
    exact = {n: {g: [counts[n](t) for t in texts] for g, texts in groups.items()} for n in counts}
    heuristic = {g: [quarter_tokens(t) for t in texts] for g, texts in groups.items()}
    rows = []
    for group, texts in groups.items():
        row = [group, f"{len(texts):,}"]
        for name in REFERENCES:
            theirs = exact[name][group]
            ours = heuristic[group]
            # The ratio a mixed session teaches: all groups together.
            scale = sum(sum(v) for v in exact[name].values()) / sum(
                sum(v) for v in heuristic.values()
            )
            raw = (sum(ours) - sum(theirs)) / sum(theirs) * 100
            calibrated = (sum(ours) * scale - sum(theirs)) / sum(theirs) * 100
            worst = max(abs(h - e) / e * 100 for h, e in zip(ours, theirs, strict=True) if e)
            row += [f"{raw:+6.1f}%", f"{calibrated:+6.1f}%", f"{worst:5.1f}%"]
        rows.append(tuple(row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=5, help="passes (best kept per batch)")
    args = parser.parse_args()
    started = time.perf_counter()

    source = surface_events(conversations())
    events = [next(source) for _ in range(args.events)]
    rows = [throughput(label, route, events, args.repeat) for label, route in _routes()]
    rows.append(rendered_throughput(events, args.repeat))
    table(
        f"Throughput: meter observe vs the raw tokenizer, same texts ({args.events:,} events)",
        ["method (route)", "text", "raw tokenizer", "meter", "throughput ratio"],
        rows,
    )

    groups = samples()
    header = ["texts", "n"]
    for name in REFERENCES:
        header += [f"vs {name}", "calibrated", "worst text"]
    table(
        "Heuristic estimate vs exact counts (total error; + overcounts), raw and calibrated",
        header,
        error_rows(groups),
    )
    sizes = {g: statistics.median(map(len, t)) if t else 0 for g, t in groups.items()}
    print("\nmedian characters per text: " + ", ".join(f"{g} {s:,.0f}" for g, s in sizes.items()))
    print(f"\ndone in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
