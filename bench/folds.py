"""Repeated compaction without a server: the extractive summarizer and the quality gate on spans
of the shipped transcripts, each span starting with the previous span's checkpoint.

A transcript's messages (projected as ``compactd replay`` projects them) are cut, after the system
head, into consecutive chunks of at least ``span_tokens`` (route tokens, o200k_base); each span is
the previous checkpoint followed by the next chunk, summarized by the extractive summarizer
(15% of the span, the checkpoint counted by o200k_base as a bracket hands the count over) and
judged by the gate (``core.gate.judge``: the span's probes, the framed
checkpoint's and the span's route prices) with replay's thresholds (a checkpoint at most 15% of
its span, half the probes kept). Every fact of each chunk (``bench.facts``) is looked for in its
own checkpoint ("after 1") and in the checkpoint two folds later ("after 3").

It isolates the summarizer from selection and the step loop: fast enough to run over every
shipped transcript while tuning, and the ground for the test that the gate never rejects the
extractive checkpoint (``tests/providers/test_extractive_gate.py``).

    python -m bench.folds [--windows 4000 8000 16000] [--transcripts FILE ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from bench import facts as fx
from bench.strategies import DEFAULT_FILES, conversation, read_transcripts
from compactd import replay as rp
from compactd.core import gate, probes, prompts
from compactd.core.pricing import PricingProfile, heuristic_price, price_message
from compactd.providers.extractive import ExtractiveSummarizer, minimum_span_tokens
from compactd.tokenizers import pricing_profile
from compactd.v1 import session_service_pb2

Message = session_service_pb2.Message
#: Replay's thresholds (``replay.window_policy``): a checkpoint at most 15% of its span.
SETTINGS = gate.GateSettings(min_reduction_ratio=rp.CHECKPOINT_REDUCTION)


@dataclass(frozen=True)
class Fold:
    """One simulated compaction: the span, its own facts, the summary and the gate's verdict."""

    span: list[Message]
    found: list[fx.Fact]
    summary: str
    verdict: gate.Verdict


def checkpoint_message(summary: str) -> Message:
    """The user message a bracket commits for ``summary``."""
    message = Message(role=session_service_pb2.MESSAGE_ROLE_USER)
    message.content.add().text.text = prompts.frame_checkpoint(summary)
    return message


def folds(
    messages: Sequence[Message | None],
    span_tokens: int,
    max_tokens: int,
    profile: PricingProfile,
    summarizer: ExtractiveSummarizer | None = None,
) -> Iterator[Fold]:
    """Each compaction of ``messages`` cut in chunks of at least ``span_tokens``."""
    summarizer = summarizer or ExtractiveSummarizer()
    shown = [m for m in messages if m is not None]
    head = shown[:1] if shown and shown[0].role == session_service_pb2.MESSAGE_ROLE_SYSTEM else []
    prior: list[Message] = []
    chunk: list[Message] = []
    size = 0
    # Selection declines a span whose checkpoint could not be 15% of it (``SPAN_TOO_SMALL``).
    least = minimum_span_tokens(rp.CHECKPOINT_REDUCTION)
    for message in shown[len(head) :]:
        chunk.append(message)
        size += price_message(message, profile).total
        if size < span_tokens or sum(map(heuristic_price, [*prior, *chunk])) < least:
            continue
        span = [*prior, *chunk]
        priced = sum(price_message(m, profile).total for m in span)
        summary = summarizer.summary_text(
            [*head, *span], max_tokens, span_tokens=priced,
            checkpoint_tokens=lambda text: price_message(checkpoint_message(text), profile).total,
        )  # fmt: skip
        framed = checkpoint_message(summary)
        verdict = gate.judge(
            summary, span, probes.select_probes(probes.span_facts(span)),
            checkpoint_tokens=price_message(framed, profile).total, span_tokens=priced,
            settings=SETTINGS,
        )  # fmt: skip
        yield Fold(span, fx.span_facts(chunk), summary, verdict)
        prior, chunk, size = [framed], [], 0


@dataclass
class FoldTally:
    """Facts kept and verdicts over many folds."""

    kept: dict[tuple[int, fx.FactKind], list[bool]] = field(default_factory=dict)
    rejected: list[tuple[str, Fold]] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)
    spans: int = 0

    def add(self, source: str, chain: Sequence[Fold]) -> None:
        for number, fold in enumerate(chain):
            self.spans += 1
            self.shares.append(fold.verdict.checkpoint_tokens / fold.verdict.span_tokens)
            if not fold.verdict.passed:
                self.rejected.append((source, fold))
            for after, later in ((1, number), (3, number + 2)):
                if later < len(chain):
                    hits = fx.kept(fold.found, chain[later].summary)
                    for fact, hit in zip(fold.found, hits, strict=True):
                        self.kept.setdefault((after, fact.kind), []).append(hit)

    def share(self, after: int, kinds: Sequence[fx.FactKind] = tuple(fx.FactKind)) -> str:
        hits = [hit for kind in kinds for hit in self.kept.get((after, kind), [])]
        return f"{sum(hits) / len(hits):.0%} of {len(hits)}" if hits else "-"


def measure(paths: Sequence[str], window: int) -> FoldTally:
    """Every shipped transcript folded at ``window``'s span size and summary cap."""
    from pathlib import Path

    profile = pricing_profile("o200k_base")
    tally = FoldTally()
    policy = rp.window_policy(window)
    for path in paths:
        for transcript in read_transcripts(Path(path)):
            talk = conversation(transcript, profile)
            chain = list(folds(talk.messages, window // 2, int(policy["maxTokens"]), profile))
            tally.add(transcript.source, chain)
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[4000, 8000, 16000])
    parser.add_argument("--transcripts", nargs="+", default=[str(p) for p in DEFAULT_FILES])
    parser.add_argument("--show", type=int, default=0, help="print this many rejections")
    args = parser.parse_args()
    for window in args.windows:
        t = measure(args.transcripts, window)
        kinds = " ".join(f"{k.value} {t.share(a, (k,))}" for a in (1, 3) for k in fx.FactKind)
        print(
            f"{window:,}: {t.spans} spans, {len(t.rejected)} rejected; after 1: {t.share(1)}, "
            f"after 3: {t.share(3)}; {kinds}; checkpoint/span max {max(t.shares):.1%} "
            f"mean {sum(t.shares) / len(t.shares):.1%}"
        )
        for source, fold in t.rejected[: args.show]:
            print(f"  {source}: {fold.verdict.describe()[:300]}")


if __name__ == "__main__":
    main()
