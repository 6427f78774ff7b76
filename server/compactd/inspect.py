"""``compactd inspect SESSION``: what the model sees, what was shadowed, what compaction would do.

Against a running service it reads, over the public API only: the log (``ListEvents``) beside
the surface with per-node detail (``GetSurface`` with ``detail``), the bracket history
(``ListBrackets``), the current pressure (``CheckPressure``), the plan of the next compaction
(``PlanCompaction``) and the rebuilt request (``BuildRequest``). The text form fits an
80-column terminal; ``--json`` prints one JSON object with the same parts (each the RPC's
response in proto JSON); ``--follow`` then streams new events and pressure until interrupted.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TextIO

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from compactd.core import events as ev
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import compaction_service_pb2_grpc, events_pb2, session_service_pb2_grpc
from compactd.v1 import session_service_pb2 as spb

WIDTH = 80
_OUTCOMES = {
    cpb.BRACKET_OUTCOME_COMMITTED: "committed",
    cpb.BRACKET_OUTCOME_FAILED: "failed",
    cpb.BRACKET_OUTCOME_LIVE: "LIVE",
    cpb.BRACKET_OUTCOME_STALE: "stale",
}
_TRIGGERS = {
    events_pb2.COMPACTION_TRIGGER_PRESSURE: "pressure",
    events_pb2.COMPACTION_TRIGGER_MANUAL: "manual",
    events_pb2.COMPACTION_TRIGGER_OVERFLOW: "overflow",
    events_pb2.COMPACTION_TRIGGER_MODEL_SWITCH: "switch",
}
_MODES = {
    "auto": cpb.PLAN_MODE_AUTO,
    "manual": cpb.PLAN_MODE_MANUAL,
    "overflow": cpb.PLAN_MODE_OVERFLOW,
    "switch": cpb.PLAN_MODE_SWITCH,
}
MODES = tuple(_MODES)


@dataclass
class Snapshot:
    """Everything ``inspect`` shows, as the service answered it."""

    events: list[events_pb2.SessionEvent]
    surface: spb.GetSurfaceResponse
    brackets: cpb.ListBracketsResponse
    pressure: cpb.PressureReport | None
    pressure_error: str
    plan: cpb.CompactionPlan
    request: spb.BuildRequestResponse


def channel(address: str, *, tls_ca: bytes | None = None) -> grpc.aio.Channel:
    """A channel to the service: TLS verified against ``tls_ca`` when given, else plaintext."""
    if tls_ca is not None:
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(tls_ca))
    return grpc.aio.insecure_channel(address)


class Inspector:
    """A client of one service for one session (stubs on ``channel``); ``to`` is the
    ``(provider, model)`` the plan is for (required by ``switch``: the destination)."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        session_id: str,
        *,
        mode: str = "auto",
        to: tuple[str, str] | None = None,
        token: str = "",
    ) -> None:
        sessions = session_service_pb2_grpc.SessionServiceStub(channel)
        compaction = compaction_service_pb2_grpc.CompactionServiceStub(channel)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._sessions: Any = _Authorized(sessions, metadata)
        self._compaction: Any = _Authorized(compaction, metadata)
        self.session_id = session_id
        self.mode = _MODES[mode]
        self.to = to

    async def snapshot(self) -> Snapshot:
        """Read every part once (NOT_FOUND and other errors raise ``grpc.aio.AioRpcError``)."""
        sid = self.session_id
        surface = await self._sessions.GetSurface(
            spb.GetSurfaceRequest(session_id=sid, detail=True)
        )
        events = [
            r.event async for r in self._sessions.ListEvents(spb.ListEventsRequest(session_id=sid))
        ]
        brackets = await self._compaction.ListBrackets(cpb.ListBracketsRequest(session_id=sid))
        pressure, error = await self._pressure()
        plan = await self._compaction.PlanCompaction(self._plan_request())
        request = await self._sessions.BuildRequest(spb.BuildRequestRequest(session_id=sid))
        return Snapshot(events, surface, brackets, pressure, error, plan.plan, request)

    def _plan_request(self) -> cpb.PlanCompactionRequest:
        request = cpb.PlanCompactionRequest(session_id=self.session_id, mode=self.mode)
        if self.to is not None:
            request.route.provider, request.route.model = self.to
        return request

    async def _pressure(self) -> tuple[cpb.PressureReport | None, str]:
        try:
            reply = await self._compaction.CheckPressure(
                cpb.CheckPressureRequest(session_id=self.session_id)
            )
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return None, error.details() or ""
        return reply.report, ""

    async def follow(
        self, from_seq: int
    ) -> AsyncIterator[events_pb2.SessionEvent | cpb.PressureReport]:
        """New events from ``from_seq`` and pressure reports, as they come, until cancelled."""
        queue: asyncio.Queue[events_pb2.SessionEvent | cpb.PressureReport] = asyncio.Queue()

        async def events() -> None:
            request = spb.ListEventsRequest(
                session_id=self.session_id, from_seq=from_seq, follow=True
            )
            async for reply in self._sessions.ListEvents(request):
                queue.put_nowait(reply.event)

        async def pressure() -> None:
            request = cpb.WatchPressureRequest(session_id=self.session_id)
            try:
                async for reply in self._compaction.WatchPressure(request):
                    queue.put_nowait(reply.report)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise  # a session without a priced route streams events only

        tasks = [asyncio.ensure_future(events()), asyncio.ensure_future(pressure())]
        try:
            while True:
                yield await queue.get()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _Authorized:
    """A stub whose every call carries ``metadata`` (the bearer token, when there is one)."""

    def __init__(self, stub: object, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)

        def call(request: Message) -> Any:
            return method(request, metadata=self._metadata)

        return call


# ---- JSON -----------------------------------------------------------------------------------


def to_json(snapshot: Snapshot, session_id: str) -> dict[str, Any]:
    """The snapshot as one JSON object: each part in proto JSON."""
    return {
        "session_id": session_id,
        "revision": snapshot.surface.revision,
        "events": [_dict(e) for e in snapshot.events],
        "surface": _dict(snapshot.surface),
        "brackets": _dict(snapshot.brackets),
        "pressure": _dict(snapshot.pressure) if snapshot.pressure is not None else None,
        "pressure_error": snapshot.pressure_error,
        "plan": _dict(snapshot.plan),
        "request": _dict(snapshot.request),
    }


def _dict(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


# ---- text -----------------------------------------------------------------------------------


def render(snapshot: Snapshot, session_id: str) -> str:
    """The snapshot as text no wider than ``WIDTH`` columns."""
    parts = [
        _title(f"session {session_id} at revision {snapshot.surface.revision}"),
        _pressure_text(snapshot),
        "",
        _title("log and surface"),
        *_log_rows(snapshot),
        "",
        _title("brackets"),
        *_bracket_rows(snapshot.brackets),
        "",
        _title(f"plan ({cpb.PlanMode.Name(snapshot.plan.mode)[10:].lower()})"),
        *_plan_rows(snapshot.plan),
        "",
        _title(f"request ({len(snapshot.request.messages)} messages)"),
        *_request_rows(snapshot.request),
    ]
    return "\n".join(_clip(line).rstrip() for line in parts) + "\n"


def event_line(event: events_pb2.SessionEvent) -> str:
    """One followed event."""
    return _clip(f"+ {event.seq:>6} {ev.event_type(event):<22} {_gist(event)}")


def pressure_line(report: cpb.PressureReport) -> str:
    """One followed pressure report."""
    return _clip(f"~ pressure {_pressure_figures(report)}")


def _title(text: str) -> str:
    return f"== {text} " + "=" * max(0, WIDTH - len(text) - 4)


def _pressure_text(snapshot: Snapshot) -> str:
    if snapshot.pressure is None:
        return _clip(f"pressure: unknown ({snapshot.pressure_error})")
    return _clip(f"pressure: {_pressure_figures(snapshot.pressure)}")


def _pressure_figures(report: cpb.PressureReport) -> str:
    state = "ABOVE" if report.state == cpb.PRESSURE_STATE_ABOVE else "below"
    route = f"{report.route.provider}/{report.route.model}"
    method = cpb.MeasurementMethod.Name(report.breakdown.method)[19:].lower()
    return (
        f"{report.measured_tokens} / trigger {report.trigger_tokens} / window "
        f"{report.context_window} {state} ({route}, {method})"
    )


def _log_rows(snapshot: Snapshot) -> list[str]:
    """Every log event: its surface position and price, or what shadowed it."""
    on_surface = {node.seq: node for node in snapshot.surface.nodes}
    shadowed = {node.seq: node for node in snapshot.surface.detail.shadowed}
    rows = [f"{'seq':>6} {'pos':>4} {'type':<22} {'tokens':>7} {'shadowed by':<12} gist"]
    for event in snapshot.events:
        node = on_surface.get(event.seq)
        position = str(node.position) if node is not None else ""
        tokens = str(node.detail.route_tokens) if node is not None else ""
        hidden = shadowed.get(event.seq)
        by = f"seq {hidden.shadowed_by_seq}" if hidden is not None else ""
        rows.append(
            f"{event.seq:>6} {position:>4} {ev.event_type(event):<22} {tokens:>7} {by:<12} "
            f"{_gist(event)}"
        )
    detail = snapshot.surface.detail
    anchor = (
        f"; anchor seq {detail.anchor.seq} usage {detail.anchor.usage_tokens} + "
        f"{detail.anchor.delta_tokens}"
        if detail.HasField("anchor")
        else ""
    )
    rows.append(
        f"{len(snapshot.surface.nodes)} nodes on the surface, {len(detail.shadowed)} shadowed; "
        f"replacement gen {detail.replacement_generation}, content gen "
        f"{detail.content_generation}{anchor}"
    )
    return rows


def _bracket_rows(history: cpb.ListBracketsResponse) -> list[str]:
    if not history.brackets:
        return ["no brackets"]
    rows = [
        f"{'id':<8} {'trigger':<8} {'outcome':<9} {'span':<13} {'n':>3} {'before':>7} "
        f"{'after':>7} note"
    ]
    for b in history.brackets:
        span = f"{b.range.start_seq}..{b.range.end_seq}"
        before = str(b.tokens.envelope_before) if b.HasField("tokens") else ""
        after = str(b.tokens.envelope_after) if b.HasField("tokens") else ""
        note = b.error_reason or b.summarizer
        if b.HasField("prepared_ahead"):  # written before the trigger: the step's wait instead
            note += f" ahead {b.prepared_ahead.agent_wait_ms}ms"
        elif b.end_seq >= 0:
            note += f" {b.duration_seconds:.1f}s"
        rows.append(
            f"{b.compaction_id[:8]:<8} {_TRIGGERS.get(b.trigger, '?'):<8} "
            f"{_OUTCOMES.get(b.outcome, '?'):<9} {span:<13} {b.shadowed_count:>3} {before:>7} "
            f"{after:>7} {note}"
        )
    if history.prunes:
        rows.append(f"{len(history.prunes)} prune(s) outside brackets")
    return rows


def _plan_rows(plan: cpb.CompactionPlan) -> list[str]:
    blocked = f"no, {plan.blocked_code}: {plan.blocked}" if plan.blocked_code else "yes"
    rows = _wrapped(f"would run: {blocked}")
    for prune in plan.prunes:
        rows.append(
            f"prune seq {prune.seq} at {prune.position}: {prune.original_code_points} -> "
            f"{prune.retained_code_points} code points, {prune.tokens_before} -> "
            f"{prune.tokens_after} tokens"
        )
    if plan.prunes:
        rows.append(f"after pruning: {plan.tokens_after_prune} tokens")
    if plan.HasField("span"):
        span = plan.span
        rows.append(
            f"span: positions {span.range.start_position}..{span.range.end_position} (seqs "
            f"{span.range.start_seq}..{span.range.end_seq}), {span.shadowed_count} nodes, "
            f"{span.priced_tokens} tokens"
        )
        rows.append(
            f"expected after: {plan.expected_tokens_after}..{plan.expected_tokens_after_max} tokens"
        )
    else:
        rows.extend(_wrapped(f"declines: {plan.decline_code}: {plan.decline_reason}"))
    target = plan.summary_target
    rows.append(
        f"summary by: {target.provider}/{target.model}" if target.model else "summary by: ?"
    )
    for warning in plan.warnings:
        rows.extend(_wrapped(f"warning: {warning}"))
    return rows


def _wrapped(text: str) -> list[str]:
    """A sentence that must be read whole, over as many lines as it needs."""
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def _request_rows(request: spb.BuildRequestResponse) -> list[str]:
    rows = []
    if request.HasField("config"):
        config = request.config
        rows.append(f"route {config.provider}/{config.model}, {len(request.tools)} tool(s)")
    for message in request.messages:
        role = spb.MessageRole.Name(message.role)[13:].lower()
        rows.append(f"{role:<9} {_content_gist(message.content)}")
    return rows


def _gist(event: events_pb2.SessionEvent) -> str:
    kind = event.WhichOneof("body")
    if kind in ("user_message", "assistant_message"):
        return _content_gist(getattr(event, kind).content)
    if kind == "tool_result":
        return _content_gist(event.tool_result.content)
    if kind == "system_message":
        return event.system_message.text
    if kind == "compaction_start":
        start = event.compaction_start
        return f"{start.compaction_id[:8]} {len(start.shadowed_seqs)} nodes"
    if kind == "compaction_end":
        end = event.compaction_end
        return f"{end.compaction_id[:8]} {end.error_reason or 'ok'}"
    if kind == "request_header":
        return f"{event.request_header.config.provider}/{event.request_header.config.model}"
    return ""


def _content_gist(blocks: Any) -> str:
    parts = []
    for block in blocks:
        kind = block.WhichOneof("block")
        if kind == "text":
            parts.append(block.text.text)
        elif kind == "tool_call":
            parts.append(f"call {block.tool_call.name}")
        elif kind is not None:
            parts.append(f"[{kind}]")
    return " ".join(" ".join(parts).split())


def _clip(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 1] + "…"


# ---- the command ------------------------------------------------------------------------------


async def run(
    address: str,
    session_id: str,
    *,
    as_json: bool = False,
    follow: bool = False,
    mode: str = "auto",
    to: tuple[str, str] | None = None,
    token: str = "",
    tls_ca: bytes | None = None,
    out: TextIO,
    until: Callable[[list[str]], bool] | None = None,
) -> int:
    """Print the session once, then (``follow``) what comes, until cancelled or ``until``
    holds of the lines followed so far. Returns the exit code (1: the service refused)."""
    async with channel(address, tls_ca=tls_ca) as opened:
        inspector = Inspector(opened, session_id, mode=mode, to=to, token=token)
        try:
            snapshot = await inspector.snapshot()
        except grpc.aio.AioRpcError as error:
            print(f"compactd inspect: {error.code().name}: {error.details()}", file=out)
            return 1
        if as_json:
            print(json.dumps(to_json(snapshot, session_id)), file=out, flush=True)
        else:
            print(render(snapshot, session_id), end="", file=out, flush=True)
        if not follow:
            return 0
        lines: list[str] = []
        async for item in inspector.follow(snapshot.surface.revision):
            lines.append(_followed(item, as_json))
            print(lines[-1], file=out, flush=True)
            if until is not None and until(lines):
                break
    return 0


def _followed(item: events_pb2.SessionEvent | cpb.PressureReport, as_json: bool) -> str:
    if as_json:
        key = "event" if isinstance(item, events_pb2.SessionEvent) else "pressure"
        return json.dumps({key: _dict(item)})
    if isinstance(item, events_pb2.SessionEvent):
        return event_line(item)
    return pressure_line(item)
