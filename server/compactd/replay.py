"""``compactd replay``: recorded conversations played through compactd as an agent runtime would.

Each transcript (one JSON object a line, ``{"messages": [...]}`` in the common chat format, with
an optional ``source`` and ``tools``) becomes one session. The messages are converted to typed
events by the Python client's OpenAI converter (``compactd_client.openai``: turns, steps, tool
results, the ``request/header``), then appended in the order a runtime writes them: everything up
to a model step, then ``PrepareStep`` for that step's turn (which prunes and compacts when the
envelope is above the trigger and answers the request to send), then the step with the recorded
reply standing in for the model's answer. Nothing is sent to an agent model; the request
compactd rebuilt is encoded as a chat-completions body (``openai.request_body``), which is what a
runtime would post.

What a replay reports comes from two places: the steps (the envelope before ``PrepareStep`` and
the one it answered, that is what was sent) and the session's log (``ListEvents``): every bracket
with its span, shadowed count, token measurement, summary and timing, and every prune. The log is
the authority; the report only reads it.

The server is either a running one (``--target``) or an embedded one started here on a temporary
SQLite store, its route's window set by ``--window`` so that a short transcript compacts several
times. Summaries are extractive unless the configuration (``--config``) says otherwise.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from compactd_client import AsyncCompactdClient, openai
from compactd_client.v1 import compaction_service_pb2, events_pb2
from compactd_client.v1.events_pb2 import SessionEvent
from compactd_client.v1.session_service_pb2 import BuildRequestResponse

from compactd import config as settings
from compactd.errors import ConfigError

#: The route a replay routes its sessions to unless told otherwise (built in: o200k_base).
DEFAULT_ROUTE = ("openai", "gpt-4o")
#: Events per ``AppendEvents`` (well under the default ``max_batch_events``).
BATCH = 500


#: Rewrites a transcript's converted events before a replay plays them (``replay``'s ``plant``).
Plant = Callable[["Transcript", list[SessionEvent]], list[SessionEvent]]


@dataclass(frozen=True)
class Transcript:
    """One recorded conversation."""

    source: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


def read_transcripts(path: Path, *, match: str = "", limit: int | None = None) -> list[Transcript]:
    """The conversations of a JSONL file (``{"messages": [...]}`` a line), in file order.

    Args:
        path: The file.
        match: Keep only conversations whose ``source`` contains this text.
        limit: Keep at most this many.

    Raises:
        ConfigError: The file is missing, or a line is not a conversation (its number named).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ConfigError(f"{path}: {err.strerror}") from None
    found: list[Transcript] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            messages = record["messages"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f'{path}:{number}: not a {{"messages": [...]}} object') from None
        source = str(record.get("source") or f"{path.name}:{number}")
        if match in source:
            found.append(Transcript(source, list(messages), list(record.get("tools") or [])))
    return found[:limit] if limit is not None else found


# ---- what a replay records ---------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One model step: ``PrepareStep``'s envelope before and after, and what it did.

    ``first_seq`` is the first seq compactd may have written for this step (the log's length when
    ``PrepareStep`` was called): the log's events from it to the next step's belong to it.
    """

    index: int
    turn: int
    before_tokens: int
    sent_tokens: int
    trigger_tokens: int
    window: int
    pruned: int
    compactions: int
    request_messages: int
    request_bytes: int
    seconds: float
    first_seq: int
    broken_pairs: int = 0
    state: str = ""  # the pressure after PrepareStep: "above" or "below"
    warnings: tuple[str, ...] = ()  # PrepareStep's warnings for this step
    #: ``PressureOutcome``'s name after PrepareStep (``FITS``, ``ABOVE_TRIGGER``,
    #: ``OVER_WINDOW_IRREDUCIBLE``, ``OVER_WINDOW``, ``UNPRICED``; "" from a server before it).
    outcome: str = ""
    limit: int = 0  # the window less the output reservation: what a request sent must fit
    #: Seconds the runtime then spent appending the step's events (its reply, tool results and
    #: whatever came before the next ``PrepareStep``): a step boundary compactd may act at.
    append_seconds: float = 0.0


@dataclass(frozen=True)
class CompactionRecord:
    """One bracket, as the log has it."""

    compaction_id: str
    step: int  # the step whose PrepareStep ran it (0 when no step did)
    trigger: str
    start_position: int
    end_position: int
    start_seq: int
    end_seq: int
    shadowed: int
    tokens_before: int
    tokens_after: int
    span_tokens: int
    checkpoint_tokens: int
    summary_chars: int
    summarizer: str
    seconds: float
    outcome: str  # "committed", or the failure's reason
    prepared_ahead: bool = False  # its summary was written before the trigger (issue 35)

    @property
    def committed(self) -> bool:
        """Whether the bracket replaced its span."""
        return self.outcome == "committed"


@dataclass(frozen=True)
class PruneRecord:
    """One pruned tool result, as the log has it."""

    step: int
    seq: int
    original_code_points: int
    retained_code_points: int


@dataclass
class SessionReplay:
    """One replayed conversation: its steps and what its log says."""

    source: str
    session_id: str
    messages: int
    steps: list[StepRecord] = field(default_factory=list)
    compactions: list[CompactionRecord] = field(default_factory=list)
    prunes: list[PruneRecord] = field(default_factory=list)
    events: int = 0
    final_tokens: int = 0
    seconds: float = 0.0
    requests: list[BuildRequestResponse] = field(default_factory=list)  # with keep_requests
    warnings: dict[str, None] = field(default_factory=dict)  # PrepareStep's, each once

    @property
    def tokens_sent(self) -> int:
        """Input tokens of every request sent, summed over the session."""
        return sum(step.sent_tokens for step in self.steps)

    @property
    def peak_tokens(self) -> int:
        """The largest envelope any step measured before ``PrepareStep`` relieved it."""
        return max((step.before_tokens for step in self.steps), default=0)

    @property
    def committed(self) -> list[CompactionRecord]:
        """The brackets that replaced their span."""
        return [c for c in self.compactions if c.committed]


# ---- the runtime ---------------------------------------------------------------------------------


Progress = Callable[[StepRecord], None]


async def replay(
    client: AsyncCompactdClient,
    transcript: Transcript,
    *,
    route: tuple[str, str] = DEFAULT_ROUTE,
    policy: Mapping[str, Any] | None = None,
    session_id: str = "",
    on_step: Progress | None = None,
    keep_requests: bool = False,
    plant: Plant | None = None,
    think: float = 0.0,
) -> SessionReplay:
    """Play ``transcript`` as one new session; returns its steps and what the log says.

    Args:
        client: A client of the server.
        transcript: The conversation.
        route: ``(provider, model)`` of the ``request/header``: the route pressure is priced for.
        policy: The session's compaction policy overrides (``CreateSession``).
        session_id: The session's id (default: ``replay-`` and a random suffix).
        on_step: Called after each step's ``PrepareStep``.
        keep_requests: Keep each step's rebuilt request (``SessionReplay.requests``).
        plant: Rewrites the converted events before they are played (a benchmark plants pins
            and sub-agent events this way); it must keep the log valid.
        think: Seconds the agent's model takes after each ``PrepareStep`` before its reply is
            logged (default 0: the recorded reply at once). A summary prepared ahead runs in
            that time, as beside a real agent.

    Raises:
        ValueError: The transcript holds a message the converter does not carry (named).
        CompactdError: The server refused a call.
    """
    started = time.perf_counter()
    provider, model = route
    events = openai.events_from_messages(
        transcript.messages, tools=transcript.tools, provider=provider, model=model
    )
    if plant is not None:
        events = plant(transcript, events)
    session = await client.create_session(
        session_id or f"replay-{uuid.uuid4().hex[:12]}", compaction_policy=dict(policy or {})
    )
    result = SessionReplay(transcript.source, session.session_id, len(transcript.messages))
    answered = {str(m.get("tool_call_id")) for m in transcript.messages if m.get("role") == "tool"}
    log_length, pending = 0, list[SessionEvent]()
    for event in events:
        if event.HasField("step_start"):
            log_length = await _timed_append(client, result, pending) or log_length
            pending = []
            step = await _prepare(
                client, result, event.step_start.turn, log_length, answered, keep_requests
            )
            if on_step is not None:
                on_step(step)
            if think > 0:
                await asyncio.sleep(think)  # the agent's model answering the request
        pending.append(event)
    await _timed_append(client, result, pending)
    await read_log(client, result)
    result.seconds = time.perf_counter() - started
    return result


async def _timed_append(
    client: AsyncCompactdClient, result: SessionReplay, events: list[SessionEvent]
) -> int:
    """``_append``, its duration recorded on the last step (the one these events follow)."""
    started = time.perf_counter()
    length = await _append(client, result.session_id, events)
    if result.steps:
        seconds = time.perf_counter() - started
        result.steps[-1] = dataclasses.replace(result.steps[-1], append_seconds=seconds)
    return length


async def _append(client: AsyncCompactdClient, session_id: str, events: list[SessionEvent]) -> int:
    """Append ``events`` in batches; returns the log's length after them (0 when none)."""
    length = 0
    for start in range(0, len(events), BATCH):
        response = await client.append_events(session_id, events[start : start + BATCH])
        length = response.seqs[-1] + 1
    return length


async def _prepare(
    client: AsyncCompactdClient,
    result: SessionReplay,
    turn: int,
    log_length: int,
    answered: Container[str],
    keep_request: bool,
) -> StepRecord:
    """``PrepareStep`` for the next step of ``turn``; records it (and, with ``keep_request``,
    the request it rebuilt) and encodes what it rebuilt."""
    started = time.perf_counter()
    answer = await client.prepare_step(result.session_id, turn)  # the client holds the request
    seconds = time.perf_counter() - started
    prepared, request = answer.result, answer.request
    body = openai.request_body(request)
    encoded = json.dumps(body, ensure_ascii=False)
    before = prepared.before if prepared.HasField("before") else prepared.after
    after = prepared.after
    step = StepRecord(
        index=len(result.steps) + 1,
        turn=turn,
        before_tokens=before.measured_tokens,
        sent_tokens=after.measured_tokens,
        trigger_tokens=after.trigger_tokens,
        window=after.context_window,
        pruned=prepared.pruned_count,
        compactions=len(prepared.compactions),
        request_messages=len(request.messages),
        request_bytes=len(encoded.encode()),
        seconds=seconds,
        first_seq=log_length,
        broken_pairs=broken_tool_pairs(body["messages"], answered),
        state=_state_name(after.state),
        warnings=tuple(prepared.warnings),
        outcome=_outcome_name(prepared.outcome),
        limit=after.context_window - after.output_reservation,
    )
    result.steps.append(step)
    if keep_request:  # a copy: the session's next step extends the client's held request
        kept = BuildRequestResponse()
        kept.CopyFrom(request)
        result.requests.append(kept)
    result.warnings.update(dict.fromkeys(prepared.warnings))
    return step


def _outcome_name(outcome: compaction_service_pb2.PressureOutcome.ValueType) -> str:
    """``PressureOutcome``'s short name (``ABOVE_TRIGGER``), or "" when the server sent none."""
    if not outcome:
        return ""
    return compaction_service_pb2.PressureOutcome.Name(outcome).removeprefix("PRESSURE_OUTCOME_")


def broken_tool_pairs(messages: Sequence[Mapping[str, Any]], answered: Container[str]) -> int:
    """Tool pairs a chat request breaks: results whose call it does not show before them, and
    calls it shows whose result (one of ``answered``, the conversation's) it does not.

    A provider rejects the first kind outright; the second leaves the model a call it never saw
    answered. Calls the conversation never answered (an interrupted run) are not counted.
    """
    calls: set[str] = set()
    results: set[str] = set()
    broken = 0
    for message in messages:
        if message.get("role") == "assistant":
            calls.update(str(c.get("id")) for c in message.get("tool_calls") or [])
        elif message.get("role") == "tool":
            call_id = str(message.get("tool_call_id"))
            broken += call_id not in calls
            results.add(call_id)
    return broken + sum(1 for call in calls if call in answered and call not in results)


# ---- reading the log -----------------------------------------------------------------------------


async def read_log(client: AsyncCompactdClient, result: SessionReplay) -> None:
    """Fill ``result``'s brackets, prunes, event count and final pressure from the log."""
    log = [event async for event in client.list_events(result.session_id)]
    result.compactions, result.prunes = brackets(log, result.steps)
    result.events = len(log)
    result.final_tokens = (await client.check_pressure(result.session_id)).measured_tokens


def brackets(
    log: Sequence[SessionEvent], steps: Sequence[StepRecord]
) -> tuple[list[CompactionRecord], list[PruneRecord]]:
    """Every bracket (in log order) and every prune of ``log``, each tied to its step."""
    starts = [step.first_seq for step in steps]
    opened: dict[str, SessionEvent] = {}
    summaries: dict[str, SessionEvent] = {}
    records: list[CompactionRecord] = []
    prunes: list[PruneRecord] = []
    for event in log:
        kind = event.WhichOneof("body")
        if kind == "compaction_start":
            opened[event.compaction_start.compaction_id] = event
        elif kind == "compaction_summary":
            summaries[event.compaction_summary.compaction_id] = event
        elif kind == "compaction_prune":
            prune = event.compaction_prune
            prunes.append(PruneRecord(_step_of(starts, event.seq), prune.shadowed_seq,
                                      prune.original_code_points,
                                      prune.retained_code_points))  # fmt: skip
        elif kind == "compaction_end":
            start = opened.pop(event.compaction_end.compaction_id, None)
            if start is not None:
                summary = summaries.pop(event.compaction_end.compaction_id, None)
                records.append(_bracket(start, summary, event, _step_of(starts, start.seq)))
    return records, prunes


def _step_of(starts: Sequence[int], seq: int) -> int:
    """The number of the step whose ``PrepareStep`` wrote ``seq`` (0: before any step);
    ``starts`` is each step's ``first_seq``, ascending."""
    return bisect.bisect_right(starts, seq)


def _bracket(
    start: SessionEvent, summary: SessionEvent | None, end: SessionEvent, step: int
) -> CompactionRecord:
    opened, closed = start.compaction_start, end.compaction_end
    written = summary.compaction_summary if summary is not None else None
    tokens = written.tokens if written is not None else None
    seconds = (end.time.ToNanoseconds() - start.time.ToNanoseconds()) / 1e9
    committed = written is not None and not closed.error_reason
    return CompactionRecord(
        compaction_id=opened.compaction_id,
        step=step,
        trigger=_trigger_name(opened.trigger),
        start_position=opened.range.start_position,
        end_position=opened.range.end_position,
        start_seq=opened.range.start_seq,
        end_seq=opened.range.end_seq,
        shadowed=len(opened.shadowed_seqs),
        tokens_before=tokens.envelope_before if tokens else 0,
        tokens_after=tokens.envelope_after if tokens else 0,
        span_tokens=tokens.shadowed_route_tokens if tokens else 0,
        checkpoint_tokens=tokens.checkpoint_route_tokens if tokens else 0,
        summary_chars=len(written.summary) if written is not None else 0,
        summarizer=written.summarizer if written is not None else "",
        seconds=max(0.0, seconds),
        outcome="committed" if committed else (closed.error_reason or "not committed"),
        prepared_ahead=opened.HasField("prepared_ahead"),
    )


def _state_name(value: int) -> str:
    """``PRESSURE_STATE_ABOVE`` -> ``above``."""
    name: str = compaction_service_pb2.PressureState.Name(value)  # type: ignore[arg-type]
    return name.removeprefix("PRESSURE_STATE_").lower()


def _trigger_name(value: events_pb2.CompactionTrigger.ValueType) -> str:
    name: str = events_pb2.CompactionTrigger.Name(value)
    return name.removeprefix("COMPACTION_TRIGGER_").lower()


# ---- the embedded server -------------------------------------------------------------------------


#: Replay's checkpoints replace their span with at most 15% of it (the summary-quality goal).
CHECKPOINT_REDUCTION = 0.85


def window_policy(window: int) -> dict[str, int | float]:
    """Session policy overrides that suit a ``window``-token route: an output reservation and a
    headroom of a sixteenth each (the defaults, 65,536 headroom, fit only large windows), so the
    trigger is 80% of the window and the retained budget 16% of what is left; summaries may take
    a tenth of the window, and a checkpoint at most 15% of its span (``minReductionRatio``: the
    quality gate rejects a larger one, and selection declines a span too small for that)."""
    share = max(64, window // 16)
    return {
        "headroomTokens": share,
        "maxTokens": max(64, window // 10),
        "minReductionRatio": CHECKPOINT_REDUCTION,
    }


#: The policy key that makes compactd prepare a summary before the trigger (issue 35).
PREPARE_AHEAD = "prepareAheadRatio"


def prepare_ahead_policy(
    policy: Mapping[str, Any] | None, ratio: float | None
) -> dict[str, Any] | None:
    """``policy`` with ``prepareAheadRatio`` set to ``ratio`` (None: ``policy`` unchanged).

    Raises:
        ConfigError: ``ratio`` is not in (0, 1) (the server also wants it below
            ``thresholdRatio``, and says so when the session is created).
    """
    if ratio is None:
        return dict(policy) if policy is not None else None
    if not 0 < ratio < 1:
        raise ConfigError(f"--prepare-ahead: expected a ratio in (0, 1), got {ratio:g}")
    return {**(policy or {}), PREPARE_AHEAD: ratio}


def compaction_waits(result: SessionReplay) -> list[float]:
    """The agent-visible wait compaction added to each step that compacted, in seconds.

    A step compacted when its ``PrepareStep`` reported a compaction or the log places a bracket
    in it (between its ``PrepareStep`` and the next: a bracket applied at a step boundary is the
    step's too). Its wait is how much longer its ``PrepareStep`` and the appends that follow it
    took than the session's typical step that compacted nothing (their median), measured by the
    client; 0 when not longer.
    """
    busy = compacted_steps(result)
    quiet = [_blocked(step) for step in result.steps if step.index not in busy]
    typical = statistics.median(quiet) if quiet else 0.0
    return [max(0.0, _blocked(step) - typical) for step in result.steps if step.index in busy]


def compacted_steps(result: SessionReplay) -> set[int]:
    """The (1-based) steps that compacted: a bracket the log places in the step, or
    ``PrepareStep`` reporting one."""
    busy = {record.step for record in result.compactions if record.step}
    return busy | {step.index for step in result.steps if step.compactions}


def _blocked(step: StepRecord) -> float:
    """Seconds compactd kept the runtime waiting for ``step``: its ``PrepareStep``, then the
    appends until the next."""
    return step.seconds + step.append_seconds


def embedded_config(
    config_path: str | None,
    store_dir: Path,
    *,
    route: tuple[str, str] = DEFAULT_ROUTE,
    window: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> settings.ServerConfig:
    """The embedded server's configuration: the file's (if any) on a port-0 listener and a SQLite
    store in ``store_dir``, with ``route``'s window set to ``window`` when given. Without a
    ``[summarizer]`` table summaries are extractive.

    Raises:
        ConfigError: A setting is invalid (named).
    """
    overrides = {"listen": "127.0.0.1:0", "store": f"sqlite:///{store_dir / 'replay.db'}",
                 "log_level": "WARNING"}  # fmt: skip
    base = settings.load(config_path, environ=environ, overrides=overrides)
    if not base.summarizer:  # naming the route below must not send its conversations anywhere
        base = dataclasses.replace(base, summarizer={"kind": "extractive"})
    if window is None:
        return base
    if window < 256:
        raise ConfigError(f"--window: expected at least 256 tokens, got {window}")
    routes: list[dict[str, Any]] = [dict(table) for table in base.routes]
    named = [t for t in routes if (t.get("provider"), t.get("model")) == route]
    table: dict[str, Any] = named[0] if named else {"provider": route[0], "model": route[1]}
    if not named:
        routes.append(table)
    table.update(context_window=window, max_output_tokens=max(64, window // 16))
    return dataclasses.replace(base, routes=tuple(routes))


@contextlib.asynccontextmanager
async def embedded_server(
    config: settings.ServerConfig, *, clock: Callable[[], float] | None = None
) -> AsyncIterator[str]:
    """A compactd started in this process on ``config``; yields its address, stops it after.

    ``clock`` (monotonic seconds) replaces ``time.monotonic`` as the server's guard clock (the
    failure memory's backoffs, the quotas' buckets): a benchmark replays agent time with it.
    """
    from opentelemetry import trace
    from opentelemetry.metrics import NoOpMeterProvider

    from compactd.api.server import create_server

    running = await create_server(
        config, tracer_provider=trace.NoOpTracerProvider(), meter_provider=NoOpMeterProvider(),
        clock=clock or time.monotonic,
    )  # fmt: skip
    try:
        yield running.address
    finally:
        await running.stop(0)


@contextlib.asynccontextmanager
async def temporary_store() -> AsyncIterator[Path]:
    """A folder for the embedded server's store, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="compactd-replay-") as folder:
        yield Path(folder)


async def replay_all(
    address: str,
    transcripts: Iterable[Transcript],
    *,
    route: tuple[str, str] = DEFAULT_ROUTE,
    policy: Mapping[str, Any] | None = None,
    on_step: Callable[[int, StepRecord], None] | None = None,
    keep_requests: bool = False,
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
    plant: Plant | None = None,
    think: float = 0.0,
) -> list[SessionReplay]:
    """Replay every transcript against ``address``, one session each, in order.

    ``on_step(conversation index, step)`` is called after each step's ``PrepareStep``;
    ``credentials`` (TLS, a client certificate for mutual TLS) and ``token`` (a bearer token) are
    the client's (``AsyncCompactdClient``); ``think`` is ``replay``'s.
    """
    results = []
    client = AsyncCompactdClient(address, timeout=120.0, credentials=credentials, token=token)
    async with client:
        for index, transcript in enumerate(transcripts):
            step = partial(on_step, index) if on_step is not None else None
            results.append(
                await replay(
                    client,
                    transcript,
                    route=route,
                    policy=policy,
                    on_step=step,
                    keep_requests=keep_requests,
                    plant=plant,
                    think=think,
                )
            )
    return results
