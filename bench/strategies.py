"""Strategies side by side: compactd's policy against trimming, observation masking and pruning.

The same transcripts (``testdata/transcripts``: the coding sessions and the shared set) are played
step by step with a small model window (``--window``, default 8,000 tokens, so each long session
compacts several times). Before each model step every strategy decides what the model sees:

- **compactd (extractive)**: ``compactd replay``'s runtime against an embedded server: the request
  ``PrepareStep`` rebuilt (prunes and checkpoints included), with the extractive summarizer;
- **compactd (model)**: the same with summaries written by the OpenAI-compatible model named by
  ``COMPACTD_BENCH_SUMMARY_URL`` (its ``/v1`` base URL) and ``COMPACTD_BENCH_SUMMARY_MODEL``
  (``COMPACTD_BENCH_SUMMARY_KEY_ENV``: the variable holding its key; ``..._WINDOW``: its window);
  left out when the URL is unset;
- **keep the last N messages**: the system message and the last ``--keep-messages`` messages;
- **observation masking**: every message, but tool outputs older than the last
  ``--keep-outputs`` replaced by a placeholder (arXiv 2508.21433's baseline);
- **pruning only**: compactd's tool-result pruner alone (``core.pruner``: oversized results cut
  to head and tail once the envelope reaches the trigger), no summaries;
- **everything** (no management): the reference the token figures are relative to.

Every request is priced the same way, with the route's tokenizer (``o200k_base``, the replay's
``openai/gpt-4o``) through ``core.pricing``. Per strategy: input tokens sent over the sessions
(and relative to sending everything), steps whose request exceeds the window, model-visible tool
pairs broken (a result whose call is not shown, a call shown without its result), summary calls.

The quality probe takes, for each compaction compactd committed, the quality gate's probes of the
span it shadowed (``core.probes``: the user's requests, file paths, commands and error strings of
the original events) and checks which of them the model-visible request still holds, with the
gate's own matching: right after that compaction ("after 1") and after two more compactions of the
same session ("after 3": the span's checkpoint folded into a summary of summaries twice). Every
strategy is probed with the same facts at the same steps; a request larger than the window counts
as showing nothing, since the provider refuses it. For compactd, "present or recallable" also
counts a fact the model can get back with the recall tool: one in the original events behind a
handle of the request (``core.recall``), followed through the handles those events name in turn.
The recall tool's envelope cost is its declaration's price (``core.pricing.price_tools``, with
the transcripts' own tools declared first) on every request. The checkpoint's share of its span is
the committed checkpoints' route tokens over their spans' route tokens.

Token counts are exact and deterministic, not timed, so the machine's load does not move them.

    python bench/strategies.py [--window 8000] [--keep-messages 20] [--keep-outputs 10]
                               [--transcripts FILE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compactd_client import AsyncCompactdClient, openai

from compactd import replay as rp
from compactd.core import probes
from compactd.core.pricing import PricingProfile, price_config, price_message, price_tools
from compactd.core.projection import project
from compactd.core.pruner import PrunerConfig, prune_content
from compactd.core.recall import covered_seqs, parse_handle, recall_tool
from compactd.tokenizers import pricing_profile
from compactd.v1 import events_pb2, session_service_pb2

Message = session_service_pb2.Message
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILES = (
    ROOT / "testdata" / "transcripts" / "coding.jsonl",
    ROOT / "testdata" / "transcripts" / "openai.jsonl",
)
PLACEHOLDER = "[old tool output omitted]"
HANDLE = re.compile(r"\[recall:([cp]\d+-[0-9a-f]{4})\]")
SURFACE = ("system_message", "developer_message", "user_message", "assistant_message",
           "tool_result")  # fmt: skip
PUBLISHED = (
    "Published figures to beat:",
    "- observation masking cut agent cost about 50% at an equal solve rate on SWE-bench Verified "
    "(arXiv 2508.21433);",
    "- probe studies of LLM summaries: planted facts fall from 80% after one compaction to 60% "
    "after repeated ones; exact artifacts (paths, commands) score 2.2-2.5 of 5 in every "
    "vendor's method.",
    "Goal for the extractive summarizer: >= 90% of paths, commands and errors after one "
    "compaction, >= 80% after three, checkpoint <= 15% of its span.",
)


# ---- a conversation, priced and probed the same way for every strategy -------------------------


@dataclass
class Conversation:
    """A transcript's messages as compactd projects them, with the steps a runtime takes."""

    transcript: rp.Transcript
    messages: list[Message | None]  # aligned with transcript.messages (None: projects to none)
    steps: list[int]  # index of each assistant message: the request is everything before it
    answered: set[str]
    envelope: int  # tokens of the tools and the request framing
    _prices: dict[tuple[int, str], int] = field(default_factory=dict)
    _texts: dict[tuple[int, str], str] = field(default_factory=dict)

    def variant(self, index: int, kind: str) -> Message | None:
        """Message ``index`` as a strategy shows it: ``full``, ``masked`` or ``pruned``."""
        message = self.messages[index]
        if message is None or kind == "full":
            return message
        shown = Message()
        shown.CopyFrom(message)
        del shown.content[:]
        if kind == "masked":
            shown.content.add().text.text = PLACEHOLDER
        else:
            pruned = prune_content(message.content, PrunerConfig())
            shown.content.extend(pruned.content if pruned else message.content)
        return shown

    def price(self, index: int, kind: str, profile: PricingProfile) -> int:
        """Tokens of message ``index`` shown as ``kind`` (cached)."""
        key = (index, kind)
        if key not in self._prices:
            shown = self.variant(index, kind)
            self._prices[key] = price_message(shown, profile).total if shown else 0
        return self._prices[key]

    def text(self, index: int, kind: str) -> str:
        """What message ``index`` shown as ``kind`` lets the model read (cached)."""
        key = (index, kind)
        if key not in self._texts:
            shown = self.variant(index, kind)
            self._texts[key] = visible_text([shown] if shown else [])
        return self._texts[key]


def conversation(transcript: rp.Transcript, profile: PricingProfile) -> Conversation:
    """The transcript converted as ``compactd replay`` converts it, projected message by message."""
    events = openai.events_from_messages(transcript.messages, tools=transcript.tools)
    surface = [
        project(events_pb2.SessionEvent.FromString(event.SerializeToString()))
        for event in events
        if event.WhichOneof("body") in SURFACE
    ]
    assert len(surface) == len(transcript.messages), transcript.source
    steps = [i for i, m in enumerate(transcript.messages) if m.get("role") == "assistant"]
    answered = {str(m.get("tool_call_id")) for m in transcript.messages if m.get("role") == "tool"}
    declared = [
        events_pb2.ToolDeclaration.FromString(d.SerializeToString())
        for d in openai.declarations(transcript.tools)
    ]
    envelope = price_tools(declared, profile) + price_config(None, profile)
    return Conversation(transcript, surface, steps, answered, envelope)


def visible_text(messages: Sequence[Message]) -> str:
    """Every text the model reads in ``messages``: text blocks and tool calls' names and
    arguments (where paths and commands are)."""
    parts = []
    for message in messages:
        parts.append(probes.message_text(message))
        for block in message.content:
            if block.HasField("tool_call"):
                parts.append(f"{block.tool_call.name} {block.tool_call.arguments_json}")
    return "\n".join(parts)


# ---- the strategies --------------------------------------------------------------------------

Shown = list[tuple[int, str]]  # (message index, how it is shown)


class Everything:
    """No management: every message, as recorded."""

    name = "everything (no management)"

    def shown(self, talk: Conversation, end: int, trigger: int) -> Shown:
        return [(i, "full") for i in range(end)]


@dataclass
class KeepLast:
    """The system message and the last ``count`` messages."""

    count: int

    @property
    def name(self) -> str:
        return f"keep the last {self.count} messages"

    def shown(self, talk: Conversation, end: int, trigger: int) -> Shown:
        head = [0] if talk.transcript.messages[0].get("role") == "system" else []
        tail = [i for i in range(end) if i not in head][-self.count :]
        return [(i, "full") for i in [*head, *tail]]


@dataclass
class MaskObservations:
    """Every message; tool outputs older than the last ``keep`` replaced by a placeholder."""

    keep: int

    @property
    def name(self) -> str:
        return f"observation masking (last {self.keep} outputs)"

    def shown(self, talk: Conversation, end: int, trigger: int) -> Shown:
        tools = [i for i in range(end) if talk.transcript.messages[i].get("role") == "tool"]
        masked = set(tools[: max(0, len(tools) - self.keep)])
        return [(i, "masked" if i in masked else "full") for i in range(end)]


@dataclass
class PruneOnly:
    """compactd's pruner alone: once the envelope reaches the trigger, oversized tool results
    are cut to head and tail (and stay cut, as a logged prune does)."""

    profile: PricingProfile
    pruned: dict[int, set[int]] = field(default_factory=dict)  # id(conversation) -> indexes
    name: str = "pruning only (compactd's pruner)"

    def shown(self, talk: Conversation, end: int, trigger: int) -> Shown:
        pruned = self.pruned.setdefault(id(talk), set())
        shown = [(i, "pruned" if i in pruned else "full") for i in range(end)]
        if envelope(talk, shown, self.profile) < trigger:
            return shown
        for i in range(end):
            message = talk.messages[i]
            is_tool = message is not None and message.role == session_service_pb2.MESSAGE_ROLE_TOOL
            if is_tool and message and prune_content(message.content, PrunerConfig()):
                pruned.add(i)
        return [(i, "pruned" if i in pruned else "full") for i in range(end)]


Strategy = Everything | KeepLast | MaskObservations | PruneOnly


def envelope(talk: Conversation, shown: Shown, profile: PricingProfile) -> int:
    """Tokens of the request ``shown`` makes."""
    return talk.envelope + sum(talk.price(i, kind, profile) for i, kind in shown)


def chat(talk: Conversation, shown: Shown) -> list[dict[str, Any]]:
    """The chat messages of ``shown`` (tool ids as recorded), for counting broken pairs."""
    return [talk.transcript.messages[i] for i, _ in shown]


# ---- the tally ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """One strategy's figures over every conversation."""

    sent: int = 0
    steps: int = 0
    over_window: int = 0
    broken: int = 0
    summary_calls: int = 0
    kept: dict[tuple[int, str], list[bool]] = field(default_factory=dict)  # (1|3, kind) -> hits
    recallable: dict[tuple[int, str], list[bool]] = field(default_factory=dict)  # present or not
    checkpoint: int = 0
    span: int = 0
    worst_share: float = 0.0
    checkpoints: int = 0
    over_share: int = 0  # checkpoints above 15% of their span

    def probe(self, after: int, retained: probes.Retention, *, recall: bool = False) -> None:
        """Record which probes one request kept, ``after`` 1 or 3 compactions (``recall``: kept
        or recallable)."""
        kept = self.recallable if recall else self.kept
        for probe, hit in zip(retained.probes, retained.kept, strict=True):
            kept.setdefault((after, probe.kind.value), []).append(hit)

    def share(self, after: int, kinds: Sequence[str], *, recall: bool = False) -> float | None:
        """The share of probes of ``kinds`` kept ``after`` compactions (None: no probe)."""
        kept = self.recallable if recall else self.kept
        hits = [hit for kind in kinds for hit in kept.get((after, kind), [])]
        return sum(hits) / len(hits) if hits else None

    def probes(self, after: int, kinds: Sequence[str]) -> int:
        return sum(len(self.kept.get((after, kind), [])) for kind in kinds)


@dataclass(frozen=True)
class Probed:
    """The probes of one committed compaction's span and the steps to check them at."""

    probes: tuple[probes.Probe, ...]
    after_one: int  # 0-based step index
    after_three: int | None


def probe_plan(log: Sequence[Any], steps: Sequence[rp.StepRecord]) -> list[Probed]:
    """Per committed compaction of a session, in order: its span's probes (original events only;
    prior checkpoints give none) and the steps right after it and two compactions later."""
    by_seq = {event.seq: event for event in log}
    records, _ = rp.brackets(log, steps)
    committed = [r for r in records if r.committed]
    spans = {e.compaction_summary.compaction_id: e.compaction_summary.shadowed_seqs for e in log
             if e.HasField("compaction_summary")}  # fmt: skip
    plan = []
    for number, record in enumerate(committed):
        if record.step == 0:  # not written by a step's PrepareStep: no request to probe
            continue
        messages = [
            m
            for seq in spans[record.compaction_id]
            if (m := project(events_pb2.SessionEvent.FromString(by_seq[seq].SerializeToString())))
        ]
        later = committed[number + 2].step - 1 if number + 2 < len(committed) else None
        plan.append(Probed(probes.select_probes(probes.span_facts(messages)), record.step - 1,
                           later))  # fmt: skip
    return plan


# ---- the run -----------------------------------------------------------------------------------


async def compactd_runs(
    transcripts: Sequence[rp.Transcript], window: int, summarizer: dict[str, Any] | None
) -> list[tuple[rp.SessionReplay, list[Any]]]:
    """Replay every transcript through an embedded server; each replay with its log."""
    async with rp.temporary_store() as folder:
        config = rp.embedded_config(None, folder, window=window, environ={})
        if summarizer is not None:
            config = dataclasses.replace(
                config, routes=(*config.routes, summarizer["route"]),
                summarizer=summarizer["summarizer"],
            )  # fmt: skip
        async with rp.embedded_server(config) as address:
            policy = rp.window_policy(window)
            if summarizer is not None:
                route = summarizer["route"]
                policy |= {"summarizationProvider": route["provider"],
                           "summarizationModel": route["model"]}  # fmt: skip
            results = await rp.replay_all(address, transcripts, policy=policy, keep_requests=True)
            logs = []
            async with AsyncCompactdClient(address) as client:
                for result in results:
                    logs.append([e async for e in client.list_events(result.session_id)])
    return list(zip(results, logs, strict=True))


def model_summarizer() -> dict[str, Any] | None:
    """The configured model route for summaries, from the environment (None when unset)."""
    url = os.environ.get("COMPACTD_BENCH_SUMMARY_URL", "")
    if not url:
        return None
    route: dict[str, Any] = {
        "provider": "bench-summary",
        "model": os.environ.get("COMPACTD_BENCH_SUMMARY_MODEL", "smollm2"),
        "base_url": url,
        "context_window": int(os.environ.get("COMPACTD_BENCH_SUMMARY_WINDOW", "32768")),
        "max_output_tokens": 1024,
    }
    if os.environ.get("COMPACTD_BENCH_SUMMARY_KEY_ENV"):
        route["api_key_env"] = os.environ["COMPACTD_BENCH_SUMMARY_KEY_ENV"]
    summarizer = {"kind": "openai", "provider": route["provider"], "model": route["model"]}
    return {"route": route, "summarizer": summarizer}


def tally_compactd(
    runs: Sequence[tuple[rp.SessionReplay, list[Any]]],
    talks: Sequence[Conversation],
    profile: PricingProfile,
) -> Tally:
    """compactd's figures: its rebuilt requests priced like every other strategy's."""
    tally = Tally()
    for (result, log), talk in zip(runs, talks, strict=True):
        by_seq = {event.seq: event for event in log}
        texts: dict[int, str] = {}
        recalled: dict[int, str] = {}
        for index, (step, request) in enumerate(zip(result.steps, result.requests, strict=True)):
            messages = [Message.FromString(m.SerializeToString()) for m in request.messages]
            tokens = talk.envelope + sum(price_message(m, profile).total for m in messages)
            tally.sent += tokens
            tally.steps += 1
            tally.over_window += tokens > step.window
            tally.broken += step.broken_pairs
            # A request over the window is refused by the provider: the model sees nothing.
            texts[index] = visible_text(messages) if tokens <= step.window else ""
            recalled[index] = recallable_text(texts[index], by_seq)
        tally.summary_calls += sum(
            e.HasField("compaction_summary") or e.HasField("compaction_summary_error") for e in log
        )
        for record in result.committed:
            tally.checkpoint += record.checkpoint_tokens
            tally.span += record.span_tokens
            if record.span_tokens:
                share = record.checkpoint_tokens / record.span_tokens
                tally.worst_share = max(tally.worst_share, share)
                tally.checkpoints += 1
                tally.over_share += share > 0.15
        plan = probe_plan(log, result.steps)
        _probe(tally, plan, texts.__getitem__)
        present_or_recallable = {i: f"{texts[i]}\n{recalled[i]}" for i in texts}
        _probe(tally, plan, present_or_recallable.__getitem__, recall=True)
    return tally


def recallable_text(visible: str, by_seq: dict[int, Any]) -> str:
    """The text of the original events behind the recall handles in ``visible``, and behind
    the handles those events name in turn (what the recall tool can give back)."""
    pending, seen, parts = list(HANDLE.findall(visible)), set(), []
    while pending:
        handle = parse_handle(pending.pop())
        if handle is None or str(handle) in seen or handle.seq not in by_seq:
            continue
        seen.add(str(handle))
        for seq in covered_seqs(handle, by_seq[handle.seq]) or ():
            event = events_pb2.SessionEvent.FromString(by_seq[seq].SerializeToString())
            message = project(event)
            if message is not None:
                text = visible_text([message])
                parts.append(text)
                pending.extend(HANDLE.findall(text))
    return "\n".join(parts)


def tally_strategy(
    strategy: Strategy,
    runs: Sequence[tuple[rp.SessionReplay, list[Any]]],
    talks: Sequence[Conversation],
    profile: PricingProfile,
) -> Tally:
    """A baseline's figures at the same steps, with compactd's trigger and window."""
    tally = Tally()
    for (result, log), talk in zip(runs, talks, strict=True):
        shown_at: dict[int, Shown] = {}
        for index, (end, step) in enumerate(zip(talk.steps, result.steps, strict=True)):
            shown = strategy.shown(talk, end, step.trigger_tokens)
            tokens = envelope(talk, shown, profile)
            tally.sent += tokens
            tally.steps += 1
            tally.over_window += tokens > step.window
            tally.broken += rp.broken_tool_pairs(chat(talk, shown), talk.answered)
            shown_at[index] = shown if tokens <= step.window else []  # refused: nothing seen

        def text(
            index: int, talk: Conversation = talk, shown_at: dict[int, Shown] = shown_at
        ) -> str:
            return "\n".join(talk.text(i, kind) for i, kind in shown_at[index])

        _probe(tally, probe_plan(log, result.steps), text)
    return tally


def _probe(
    tally: Tally, plan: Sequence[Probed], text: Callable[[int], str], *, recall: bool = False
) -> None:
    for probed in plan:
        tally.probe(1, probes.retention(probed.probes, text(probed.after_one)), recall=recall)
        if probed.after_three is not None:
            retained = probes.retention(probed.probes, text(probed.after_three))
            tally.probe(3, retained, recall=recall)


# ---- the tables ----------------------------------------------------------------------------------

PCE = ("path", "command", "error")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def cost_rows(tallies: dict[str, Tally], reference: Tally) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for name, t in tallies.items():
        checkpoint = "-"
        if t.span:
            checkpoint = (f"{t.checkpoint / t.span:.1%} (max {t.worst_share:.0%}, "
                          f"{t.over_share}/{t.checkpoints} > 15%)")  # fmt: skip
        rows.append((name, f"{t.sent:,}", f"{t.sent / reference.sent:.0%}",
                     f"{t.over_window}/{t.steps}", str(t.broken), str(t.summary_calls),
                     checkpoint))  # fmt: skip
    return rows


def quality_rows(tallies: dict[str, Tally]) -> list[tuple[str, ...]]:
    rows = []
    for name, t in tallies.items():
        cells = [name]
        for after in (1, 3):
            cells.append(_pct(t.share(after, PCE)))
            cells += [_pct(t.share(after, (kind,))) for kind in ("request", *PCE)]
        for after in (1, 3):  # requests, paths, commands, errors: present or recallable
            cells.append(_pct(t.share(after, ("request", *PCE), recall=True)))
        rows.append(tuple(cells))
    return rows


def recall_tool_cost(talks: Sequence[Conversation], profile: PricingProfile) -> tuple[int, int]:
    """The recall tool's price per request: (least, most) over the transcripts' tool sets."""
    costs = []
    for talk in talks:
        declared = [
            events_pb2.ToolDeclaration.FromString(d.SerializeToString())
            for d in openai.declarations(talk.transcript.tools)
        ]
        with_tool = price_tools([*declared, recall_tool("recall")], profile)
        costs.append(with_tool - price_tools(declared, profile))
    return min(costs), max(costs)


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` under ``header``: the first column left-aligned, the figures right."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    for cells in (header, *rows):
        first, *rest = (str(c) for c in cells)
        figures = (c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))
        print("  ".join((first.ljust(widths[0]), *figures)))


async def run(args: argparse.Namespace) -> None:
    transcripts = [t for path in args.transcripts for t in rp.read_transcripts(path)]
    profile = pricing_profile("o200k_base")
    talks = [conversation(t, profile) for t in transcripts]
    runs = {"compactd (extractive)": await compactd_runs(transcripts, args.window, None)}
    summarizer = model_summarizer()
    if summarizer is not None:
        runs[f"compactd (model {summarizer['route']['model']})"] = await compactd_runs(
            transcripts, args.window, summarizer
        )
    baseline = next(iter(runs.values()))
    tallies = {name: tally_compactd(r, talks, profile) for name, r in runs.items()}
    strategies: list[Strategy] = [
        KeepLast(args.keep_messages), MaskObservations(args.keep_outputs), PruneOnly(profile),
        Everything(),
    ]  # fmt: skip
    for strategy in strategies:
        tallies[strategy.name] = tally_strategy(strategy, baseline, talks, profile)
    compactions = sum(len(result.committed) for result, _ in baseline)
    print(
        f"{len(transcripts)} transcripts, {sum(len(t.messages) for t in transcripts):,} messages, "
        f"{sum(len(t.steps) for t in talks):,} model steps; window {args.window:,} tokens "
        f"(o200k_base); compactd committed {compactions} compactions"
        + ("" if summarizer else "; no model route configured (COMPACTD_BENCH_SUMMARY_URL unset)")
    )
    reference = tallies[Everything().name]
    table("Cost", ("strategy", "input tokens sent", "vs everything", "steps over window",
                   "broken tool pairs", "summary calls", "checkpoint/span"),
          cost_rows(tallies, reference))  # fmt: skip
    kinds = ("P/C/E", "requests", "paths", "commands", "errors")
    table("Facts of shadowed spans the model still sees (after 1 compaction | after 3; a "
          "request over the window shows nothing; 'present or recallable': all kinds, counting "
          "what the recall tool gives back)",
          ("strategy", *(f"{k} 1x" for k in kinds), *(f"{k} 3x" for k in kinds),
           "present or recallable 1x", "3x"),
          quality_rows(tallies))  # fmt: skip
    least, most = recall_tool_cost(talks, profile)
    extractive = tallies["compactd (extractive)"]
    steps, sent = extractive.steps, extractive.sent
    print(
        f"\nrecall tool (recallTool): {least}-{most} tokens per request (o200k_base); over the "
        f"{steps} steps at most {most * steps:,} tokens, {most * steps / sent:.1%} of compactd's "
        "input tokens sent"
    )
    counts = [extractive.probes(after, ("request", *PCE)) for after in (1, 3)]
    print(
        f"\nprobes: {counts[0]} after 1 compaction, {counts[1]} after 3 (P/C/E: paths, commands, "
        "errors)"
    )
    print("\n".join(("", *PUBLISHED)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=8000, help="the route's window, in tokens")
    parser.add_argument("--keep-messages", type=int, default=20, help="the trim's N")
    parser.add_argument("--keep-outputs", type=int, default=10, help="masking keeps this many")
    parser.add_argument("--transcripts", type=Path, nargs="+", default=list(DEFAULT_FILES))
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
