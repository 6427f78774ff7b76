"""Strategies side by side: compactd's policy against observation masking, pruning and nothing.

Every shipped transcript (``testdata/transcripts/*.jsonl``, Anthropic-format files converted, and
the shared set ``shared/data/trajectories/conversations.jsonl`` beside the repository;
``COMPACTD_SHARED`` names another ``shared`` folder) is played step by step at several model
windows (``--windows``, default 4,000, 8,000 and 16,000 tokens) and two clocks:

- **agent time**: the server's guard clock (failure memory's backoffs, quotas) is a fake that
  advances 20 s per model step, as an agent whose model takes that long would see it;
- **compressed time**: the real monotonic clock, the whole replay taking seconds.

Before each model step every strategy decides what the model sees:

- **compactd (extractive)**: ``compactd replay``'s runtime against an embedded server, the request
  ``PrepareStep`` rebuilt (prunes and checkpoints included), extractive summaries;
- **compactd (loopback model)** with ``--loopback``: the same with summaries written by the
  OpenAI-compatible fake on loopback (``compactd.testing.openai_server``), whose recorded requests
  show whether an identical summary request was sent twice; **compactd (model ...)** when
  ``COMPACTD_BENCH_SUMMARY_URL`` / ``..._MODEL`` (``..._KEY_ENV``, ``..._WINDOW``) name a real one;
- **observation masking**: every message, tool outputs older than the last ``--keep-outputs``
  replaced by a placeholder (arXiv 2508.21433's baseline);
- **pruning only**: compactd's tool-result pruner alone (``core.pruner``), no summaries;
- **everything** (no management).

Every request is priced alike, with the route's tokenizer (``o200k_base``, the replay's
``openai/gpt-4o``) through ``core.pricing``. Columns:

- **over W**: steps whose request exceeds the window (a provider refuses it); in brackets those
  compactd could not reduce (irreducible: nothing left to compact);
- **untyped ABOVE**: steps that end above the trigger with no reason given (goal 0);
- **max brackets/step**: brackets (committed or failed) one ``PrepareStep`` opened (goal 1);
- **re-sent**: identical summary requests sent again (the loopback model's recorded bodies; for
  the extractive summarizer, a span bracketed again unchanged) (goal 0);
- **rejected**: brackets whose summary the quality gate rejected (goal 0 for the extractive one);
- **facts after 1 / 3**: every distinct path, command and error line of a compacted span
  (``bench.facts``: its own extractor, not the gate's probes; a path matched by its last two
  segments, a command by program and first argument, an error by its first 60 characters) that
  the model-visible request still shows right after that compaction and after two more
  compactions of the same session; a request over the window shows nothing. Every strategy is
  checked on compactd's spans at compactd's steps. "all" pools every fact (a span naming hundreds
  of paths weighs hundreds of times a small one); "span mean" averages each span's share;
- **pins 1x / 3x**, **open sub-agents 1x / 3x** (compactd only): task state planted in every
  compactd replay (``plant_task_state``: after the first user message, a ``goal`` pin holding
  that message's first 200 characters, a ``constraint/1`` pin and a sub-agent started and never
  ended), looked for at the same steps in the rebuilt request whatever its size (a step over the
  window is counted in "over W"): each pin's text verbatim, the sub-agent named by the
  checkpoint's "Open Handles" section (goal 100%);
- **present or recallable 1x / 3x** (compactd only): the facts ("all") the request shows or the
  recall tool can give back, i.e. the original events behind a handle of the request
  (``core.recall``), followed through the handles those events name (goal 100%);
- **checkpoint/span**: each committed checkpoint's route tokens over its span's, max and mean;
- **input tokens**: summed over every step of every session. The recall tool's envelope cost
  (its declaration's price with each transcript's tools declared first) is in the line above
  the table.

Token counts are exact and deterministic, not timed, so the machine's load does not move them.

    python bench/strategies.py                     # print the tables
    python bench/strategies.py --write             # and rewrite docs/benchmarks.md's section
    python bench/strategies.py --windows 4000 --clocks agent --transcripts FILE ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compactd_client import AsyncCompactdClient, anthropic, openai
from compactd_client.events import pin, subagent_start

from bench import facts as fx
from compactd import replay as rp
from compactd.core.pricing import PricingProfile, price_config, price_message, price_tools
from compactd.core.projection import project
from compactd.core.pruner import PrunerConfig, prune_content
from compactd.core.recall import covered_seqs, parse_handle, recall_tool
from compactd.tokenizers import pricing_profile
from compactd.v1 import events_pb2, session_service_pb2

Message = session_service_pb2.Message
ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("COMPACTD_SHARED", ROOT.parent / "shared"))
DEFAULT_FILES = (
    *sorted((ROOT / "testdata" / "transcripts").glob("*.jsonl")),
    SHARED / "data" / "trajectories" / "conversations.jsonl",
)
WINDOWS = (4000, 8000, 16000)
AGENT_STEP_SECONDS = 20.0
PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench:strategies:start -->", "<!-- bench:strategies:end -->"
PLACEHOLDER = "[old tool output omitted]"
HANDLE = re.compile(r"\[recall:([cp]\d+-[0-9a-f]{4})\]")
SURFACE = ("system_message", "developer_message", "user_message", "assistant_message",
           "tool_result")  # fmt: skip
GOALS = (
    "Goals: no step ABOVE without a typed reason; one bracket a step at most; no identical "
    "summary request sent twice; no extractive checkpoint rejected; >= 90% of paths, commands "
    "and errors after one compaction, >= 80% after three; each checkpoint <= 15% of its span; "
    "every planted pin and open sub-agent kept (100%)."
)


# ---- the transcripts ---------------------------------------------------------------------------


def read_transcripts(path: Path) -> list[rp.Transcript]:
    """The conversations of a JSONL file; Anthropic Messages transcripts converted to chat."""
    found = []
    for transcript in rp.read_transcripts(path):
        if _is_anthropic(transcript.messages):
            events = anthropic.events_from_messages(transcript.messages, model="replay")
            messages = openai.messages_from_events(events)
            transcript = rp.Transcript(transcript.source, list(messages))
        found.append(transcript)
    return found


def _is_anthropic(messages: Iterable[dict[str, Any]]) -> bool:
    blocks = ("tool_use", "tool_result", "thinking")
    return any(
        isinstance(m.get("content"), list)
        and any(isinstance(b, dict) and b.get("type") in blocks for b in m["content"])
        for m in messages
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
        parts.append("\n\n".join(b.text.text for b in message.content if b.HasField("text")))
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


Strategy = Everything | MaskObservations | PruneOnly


def envelope(talk: Conversation, shown: Shown, profile: PricingProfile) -> int:
    """Tokens of the request ``shown`` makes."""
    return talk.envelope + sum(talk.price(i, kind, profile) for i, kind in shown)


def chat(talk: Conversation, shown: Shown) -> list[dict[str, Any]]:
    """The chat messages of ``shown`` (tool ids as recorded), for counting broken pairs."""
    return [talk.transcript.messages[i] for i, _ in shown]


# ---- how a step ended -------------------------------------------------------------------------


@dataclass(frozen=True)
class StepEnd:
    """How one ``PrepareStep`` left the session."""

    over_window: bool
    irreducible: bool  # nothing more could be compacted
    untyped_above: bool  # above the trigger with no reason given


def step_end(step: rp.StepRecord) -> StepEnd:
    """How ``step`` ended, by the typed ``PrepareStepResult.outcome`` (``PressureOutcome``): sent
    over the window ``W - O`` (the request a provider would refuse), irreducible (the outcome says
    nothing reducible is left), or ABOVE the trigger without a typed outcome at all."""
    over = step.sent_tokens > (step.limit or step.window)
    irreducible = step.outcome == "OVER_WINDOW_IRREDUCIBLE"
    return StepEnd(over, irreducible, step.state == "above" and not step.outcome)


# ---- planted task state -----------------------------------------------------------------------

GOAL_CHARS = 200
CONSTRAINT = "Planted constraint: never edit files outside the repository; report in English."


def planted_pins(transcript: rp.Transcript) -> dict[str, str]:
    """The pins planted in ``transcript``'s replay: its goal and a constraint."""
    users = [m for m in transcript.messages if m.get("role") == "user"]
    first = openai.messages_from_events(openai.events_from_messages(users[:1]))
    goal = " ".join(str(first[0].get("content") or "").split())[:GOAL_CHARS] if first else ""
    return {"goal": goal or f"Finish the task of {transcript.source}", "constraint/1": CONSTRAINT}


def planted_child(transcript: rp.Transcript) -> str:
    """The id of the sub-agent planted (started, never ended) in ``transcript``'s replay."""
    return f"bench-sub-{abs(hash(transcript.source)) % 10**8:08d}"


def plant_task_state(transcript: rp.Transcript, events: list[Any]) -> list[Any]:
    """``events`` with the planted pins and open sub-agent after the first user message."""
    at = next((i + 1 for i, e in enumerate(events) if e.HasField("user_message")), 0)
    planted = [pin(key, text) for key, text in planted_pins(transcript).items()]
    planted.append(subagent_start(planted_child(transcript), task="re-run the failing check"))
    return [*events[:at], *planted, *events[at:]]


def handle_line(child: str) -> str:
    """How a checkpoint names an open sub-agent (``prompts.open_handles_section``)."""
    return f"sub-agent `{child}` still running"


# ---- the tally ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """One strategy's figures over every conversation at one window and clock."""

    sent: int = 0
    steps: int = 0
    over_window: int = 0
    irreducible: int = 0
    untyped_above: int = 0
    max_brackets: int = 0
    resent: int = 0
    rejected: int = 0
    compactions: int = 0
    shares: list[float] = field(default_factory=list)
    kept: dict[tuple[int, fx.FactKind], list[bool]] = field(default_factory=dict)
    managed: bool = False  # compactd: the bracket columns apply
    pins: dict[int, list[bool]] = field(default_factory=dict)  # 1|3 -> planted pins kept
    handles: dict[int, list[bool]] = field(default_factory=dict)  # 1|3 -> open sub-agent named
    recallable: dict[int, list[bool]] = field(default_factory=dict)  # 1|3 -> fact present/recall

    per_span: dict[int, list[float]] = field(default_factory=dict)  # after -> each span's share

    def see(self, after: int, found: Sequence[fx.Fact], text: str) -> None:
        """Record which of ``found`` a request's ``text`` shows, ``after`` 1 or 3 compactions."""
        hits = fx.kept(found, text)
        for fact, hit in zip(found, hits, strict=True):
            self.kept.setdefault((after, fact.kind), []).append(hit)
        if hits:
            self.per_span.setdefault(after, []).append(sum(hits) / len(hits))

    def span_mean(self, after: int) -> str:
        """The share of its facts a compacted span keeps, averaged over the spans."""
        shares = self.per_span.get(after, [])
        return f"{sum(shares) / len(shares):.0%}" if shares else "-"

    def share(self, after: int, kinds: Sequence[fx.FactKind] = tuple(fx.FactKind)) -> str:
        hits = [hit for kind in kinds for hit in self.kept.get((after, kind), [])]
        return f"{sum(hits) / len(hits):.0%}" if hits else "-"

    def counted(self, after: int) -> int:
        return sum(len(self.kept.get((after, kind), [])) for kind in fx.FactKind)

    def task_state(self, kept: dict[int, list[bool]], after: int) -> str:
        """The share of planted pins (or open sub-agents) kept ``after`` compactions."""
        hits = kept.get(after, [])
        return f"{sum(hits) / len(hits):.0%}" if hits else "-"


@dataclass(frozen=True)
class Planned:
    """The facts of one committed compaction's span and the steps to look for them at."""

    found: tuple[fx.Fact, ...]
    after_one: int  # 0-based step index
    after_three: int | None


def fact_plan(log: Sequence[Any], steps: Sequence[rp.StepRecord]) -> list[Planned]:
    """Per committed compaction of a session, in order: every fact of its span's original events
    (prior checkpoints give none) and the steps right after it and two compactions later."""
    by_seq = {event.seq: event for event in log}
    records, _ = rp.brackets(log, steps)
    committed = [r for r in records if r.committed]
    spans = {e.compaction_summary.compaction_id: e.compaction_summary.shadowed_seqs for e in log
             if e.HasField("compaction_summary")}  # fmt: skip
    plan = []
    for number, record in enumerate(committed):
        if record.step == 0:  # not written by a step's PrepareStep: no request to look at
            continue
        messages = [
            m
            for seq in spans[record.compaction_id]
            if (m := project(events_pb2.SessionEvent.FromString(by_seq[seq].SerializeToString())))
        ]
        later = committed[number + 2].step - 1 if number + 2 < len(committed) else None
        plan.append(Planned(tuple(fx.span_facts(messages)), record.step - 1, later))
    return plan


def _look_for_task_state(
    tally: Tally, plan: Sequence[Planned], text: Callable[[int], str], transcript: rp.Transcript
) -> None:
    """Record whether the planted pins and the open sub-agent are in the rebuilt request at each
    step ``plan`` looks at (1 and 3 compactions after one)."""
    pins = planted_pins(transcript).values()
    child = handle_line(planted_child(transcript))
    for planned in plan:
        for after, step in ((1, planned.after_one), (3, planned.after_three)):
            if step is not None:
                seen = text(step)
                tally.pins.setdefault(after, []).extend(value in seen for value in pins)
                tally.handles.setdefault(after, []).append(child in seen)


def _look_recallable(tally: Tally, plan: Sequence[Planned], text: Callable[[int], str]) -> None:
    """Record which facts each looked-at request shows or the recall tool can give back."""
    for planned in plan:
        for after, step in ((1, planned.after_one), (3, planned.after_three)):
            if step is not None:
                hits = fx.kept(planned.found, text(step))
                tally.recallable.setdefault(after, []).extend(hits)


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


def _look(tally: Tally, plan: Sequence[Planned], text: Callable[[int], str]) -> None:
    for planned in plan:
        tally.see(1, planned.found, text(planned.after_one))
        if planned.after_three is not None:
            tally.see(3, planned.found, text(planned.after_three))


# ---- the runs ----------------------------------------------------------------------------------


class AgentClock:
    """A monotonic clock that moves only when told: ``advance`` per model step."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Run:
    """compactd's replays at one window and clock, with each session's log."""

    replays: list[tuple[rp.SessionReplay, list[Any]]]
    resent: int = 0  # identical summary requests the model received (loopback only)


async def compactd_run(
    transcripts: Sequence[rp.Transcript],
    window: int,
    agent_time: bool,
    summarizer: dict[str, Any] | None,
) -> Run:
    """Replay every transcript through an embedded server; each replay with its log."""
    clock = AgentClock() if agent_time else None
    async with rp.temporary_store() as folder:
        config = rp.embedded_config(None, folder, window=window, environ={})
        if summarizer is not None:
            config = dataclasses.replace(
                config, routes=(*config.routes, summarizer["route"]),
                summarizer=summarizer["summarizer"],
            )  # fmt: skip
        async with rp.embedded_server(config, clock=clock) as address:
            policy = rp.window_policy(window)
            if summarizer is not None:
                route = summarizer["route"]
                policy |= {"summarizationProvider": route["provider"],
                           "summarizationModel": route["model"]}  # fmt: skip

            def tick(_: int, __: rp.StepRecord) -> None:
                if clock is not None:
                    clock.advance(AGENT_STEP_SECONDS)

            results = await rp.replay_all(
                address, transcripts, policy=policy, keep_requests=True, on_step=tick,
                plant=plant_task_state,
            )  # fmt: skip
            logs = []
            async with AsyncCompactdClient(address) as client:
                for result in results:
                    logs.append([e async for e in client.list_events(result.session_id)])
    return Run(list(zip(results, logs, strict=True)))


def model_summarizer(url: str = "", model: str = "") -> dict[str, Any] | None:
    """A model route for summaries: ``url`` (a ``/v1`` base) or the environment's (None: unset)."""
    url = url or os.environ.get("COMPACTD_BENCH_SUMMARY_URL", "")
    if not url:
        return None
    route: dict[str, Any] = {
        "provider": "bench-summary",
        "model": model or os.environ.get("COMPACTD_BENCH_SUMMARY_MODEL", "smollm2"),
        "base_url": url,
        "context_window": int(os.environ.get("COMPACTD_BENCH_SUMMARY_WINDOW", "32768")),
        "max_output_tokens": 1024,
    }
    if os.environ.get("COMPACTD_BENCH_SUMMARY_KEY_ENV") and not model:
        route["api_key_env"] = os.environ["COMPACTD_BENCH_SUMMARY_KEY_ENV"]
    summarizer = {"kind": "openai", "provider": route["provider"], "model": route["model"]}
    return {"route": route, "summarizer": summarizer}


@contextlib.asynccontextmanager
async def loopback() -> AsyncIterator[tuple[dict[str, Any], Callable[[], int]]]:
    """The loopback fake model as a summarizer route, and a count of identical requests it got."""
    from compactd.testing.openai_server import OpenAICompatServer

    with OpenAICompatServer() as server:
        summarizer = model_summarizer(server.base_url, "loopback")
        assert summarizer is not None

        def resent() -> int:
            bodies = Counter(
                json.dumps(r.json, sort_keys=True)
                for r in server.requests
                if r.path.endswith("/chat/completions")
            )
            return sum(n - 1 for n in bodies.values())

        yield summarizer, resent


def tally_compactd(run: Run, talks: Sequence[Conversation], profile: PricingProfile) -> Tally:
    """compactd's figures: its rebuilt requests priced like every other strategy's."""
    tally = Tally(managed=True, resent=run.resent)
    for (result, log), talk in zip(run.replays, talks, strict=True):
        by_seq = {event.seq: event for event in log}
        texts: dict[int, str] = {}
        recalled: dict[int, str] = {}  # what the request shows and the recall tool gives back
        rebuilt: dict[int, str] = {}  # every request's text, over the window or not
        for index, (step, request) in enumerate(zip(result.steps, result.requests, strict=True)):
            messages = [Message.FromString(m.SerializeToString()) for m in request.messages]
            tokens = talk.envelope + sum(price_message(m, profile).total for m in messages)
            ended = step_end(step)
            tally.sent += tokens
            tally.steps += 1
            tally.over_window += tokens > step.window
            tally.irreducible += tokens > step.window and ended.irreducible
            tally.untyped_above += ended.untyped_above
            # A request over the window is refused by the provider: the model sees nothing.
            rebuilt[index] = visible_text(messages)
            texts[index] = rebuilt[index] if tokens <= step.window else ""
            recalled[index] = f"{texts[index]}\n{recallable_text(texts[index], by_seq)}"
        per_step = Counter(record.step for record in result.compactions if record.step)
        tally.max_brackets = max(tally.max_brackets, *per_step.values(), 0)
        spans = Counter((r.start_seq, r.end_seq) for r in result.compactions)
        if run.resent == 0 and not _model_written(result):
            tally.resent += sum(n - 1 for n in spans.values())
        tally.rejected += sum(r.outcome == "SUMMARY_REJECTED" for r in result.compactions)
        for record in result.committed:
            tally.compactions += 1
            if record.span_tokens:
                tally.shares.append(record.checkpoint_tokens / record.span_tokens)
        plan = fact_plan(log, result.steps)
        _look(tally, plan, texts.__getitem__)
        _look_for_task_state(tally, plan, rebuilt.__getitem__, talk.transcript)
        _look_recallable(tally, plan, recalled.__getitem__)
    return tally


def _model_written(result: rp.SessionReplay) -> bool:
    return any(r.summarizer not in ("", "extractive") for r in result.compactions)


def tally_strategy(
    strategy: Strategy, run: Run, talks: Sequence[Conversation], profile: PricingProfile
) -> Tally:
    """A baseline's figures at the same steps, with compactd's trigger and window."""
    tally = Tally()
    for (result, log), talk in zip(run.replays, talks, strict=True):
        shown_at: dict[int, Shown] = {}
        for index, (end, step) in enumerate(zip(talk.steps, result.steps, strict=True)):
            shown = strategy.shown(talk, end, step.trigger_tokens)
            tokens = envelope(talk, shown, profile)
            tally.sent += tokens
            tally.steps += 1
            tally.over_window += tokens > step.window
            shown_at[index] = shown if tokens <= step.window else []  # refused: nothing seen

        def text(
            index: int, talk: Conversation = talk, shown_at: dict[int, Shown] = shown_at
        ) -> str:
            return "\n".join(talk.text(i, kind) for i, kind in shown_at[index])

        _look(tally, fact_plan(log, result.steps), text)
    return tally


# ---- the tables ----------------------------------------------------------------------------------

KINDS = (fx.FactKind.PATH, fx.FactKind.COMMAND, fx.FactKind.ERROR)
HEADER = ("window", "clock", "strategy", "over W (irreducible)", "untyped ABOVE",
          "max brackets/step", "re-sent", "rejected", "facts 1x: all", "span mean", "paths",
          "commands", "errors", "facts 3x: all", "span mean", "paths", "commands", "errors",
          "pins 1x / 3x", "open sub-agents 1x / 3x", "present or recallable 1x / 3x",
          "checkpoint/span max",
          "mean", "input tokens")  # fmt: skip


def row(window: int, clock: str, name: str, t: Tally) -> tuple[str, ...]:
    """One strategy's cells."""
    managed = (str(t.untyped_above), str(t.max_brackets), str(t.resent), str(t.rejected))
    over = f"{t.over_window}/{t.steps}" + (f" ({t.irreducible})" if t.managed else "")
    facts = [t.share(1), t.span_mean(1), *(t.share(1, (k,)) for k in KINDS)]
    facts += [t.share(3), t.span_mean(3), *(t.share(3, (k,)) for k in KINDS)]
    planted = [
        f"{t.task_state(kept, 1)} / {t.task_state(kept, 3)}"
        for kept in (t.pins, t.handles, t.recallable)
    ]
    facts += planted if t.managed else ["-", "-", "-"]
    shares = (
        (f"{max(t.shares):.1%}", f"{sum(t.shares) / len(t.shares):.1%}") if t.shares else ("-", "-")
    )
    return (f"{window:,}", clock, name, over, *(managed if t.managed else ("-",) * 4), *facts,
            *shares, f"{t.sent:,}")  # fmt: skip


def markdown(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def plain(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(HEADER, *rows, strict=True)]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        for cells in (HEADER, *rows)
    )


async def measure(args: argparse.Namespace) -> tuple[list[tuple[str, ...]], str]:
    """Every row, and a line saying what was played."""
    transcripts = [t for path in args.transcripts for t in read_transcripts(path)]
    profile = pricing_profile("o200k_base")
    talks = [conversation(t, profile) for t in transcripts]
    rows: list[tuple[str, ...]] = []
    counted: list[str] = []
    for window in args.windows:
        for clock in args.clocks:
            agent = clock == "agent"
            runs = {"compactd (extractive)": await compactd_run(transcripts, window, agent, None)}
            if args.loopback:
                async with loopback() as (summarizer, resent):
                    run = await compactd_run(transcripts, window, agent, summarizer)
                    run.resent = resent()
                runs["compactd (loopback model)"] = run
            if (configured := model_summarizer()) is not None:
                name = f"compactd (model {configured['route']['model']})"
                runs[name] = await compactd_run(transcripts, window, agent, configured)
            baseline = runs["compactd (extractive)"]
            tallies = {name: tally_compactd(r, talks, profile) for name, r in runs.items()}
            strategies: list[Strategy] = [MaskObservations(args.keep_outputs), PruneOnly(profile),
                                          Everything()]  # fmt: skip
            for strategy in strategies:
                tallies[strategy.name] = tally_strategy(strategy, baseline, talks, profile)
            rows += [row(window, clock, name, t) for name, t in tallies.items()]
            ex = tallies["compactd (extractive)"]
            counted.append(
                f"{window:,}/{clock}: {ex.compactions} compactions, "
                f"{ex.counted(1):,} facts after 1, {ex.counted(3):,} after 3"
            )
    least, most = recall_tool_cost(talks, profile)
    played = (
        f"{len(transcripts)} transcripts ({', '.join(p.name for p in args.transcripts)}), "
        f"{sum(len(t.messages) for t in transcripts):,} messages, "
        f"{sum(len(t.steps) for t in talks):,} model steps; o200k_base; agent time = the guard's "
        f"clock advanced {AGENT_STEP_SECONDS:.0f} s per step. Facts counted (compactd extractive): "
        + "; ".join(counted)
        + f". The recall tool (`recallTool`) adds {least}-{most} tokens to every request."
    )
    return rows, played


def write(rows: Sequence[Sequence[str]], played: str) -> None:
    """Rewrite docs/benchmarks.md's section between the markers."""
    text = PAGE.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{PAGE.relative_to(ROOT)} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    body = f"{played}\n\n{markdown(rows)}\n\n{GOALS}"
    PAGE.write_text(f"{head}{START}\n{body}\n{END}{tail}", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS))
    parser.add_argument("--clocks", nargs="+", choices=("agent", "compressed"),
                        default=["agent", "compressed"])  # fmt: skip
    parser.add_argument("--keep-outputs", type=int, default=10, help="masking keeps this many")
    parser.add_argument("--loopback", action="store_true", help="also the loopback fake model")
    parser.add_argument("--transcripts", type=Path, nargs="+", default=list(DEFAULT_FILES))
    parser.add_argument("--write", action="store_true", help="rewrite docs/benchmarks.md's section")
    args = parser.parse_args()
    rows, played = asyncio.run(measure(args))
    print(played)
    print(plain(rows))
    print(GOALS)
    if args.write:
        write(rows, played)


if __name__ == "__main__":
    main()
