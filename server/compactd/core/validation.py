"""Shape rules for one event, checked before any state is consulted.

Each violation names the field (``events[3].surface_op``) so the API can return a
``google.rpc.BadRequest`` that points at it.

Who appends matters (``Origin``). A runtime (``Origin.CLIENT``, the ``AppendEvents`` boundary)
writes the conversation and its own bookkeeping; the protocol's bracket, lock and lifecycle
events are the server's alone (``SERVER_ONLY_BODIES``, and a ``user/message`` whose source is a
compaction checkpoint), so a client batch carrying one is refused with reason
``SERVER_ONLY_EVENT``. compactd's own appends (``Origin.SERVER``: the compaction engine, summary
recoveries, restores) are trusted.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Generator, Iterator, Sequence
from typing import Final, Protocol

from google.protobuf import struct_pb2, timestamp_pb2

from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.core.limits import DEFAULT_LIMITS, MAX_TOKEN_COUNT, AppendLimits, json_depth
from compactd.core.pins import pin_violations
from compactd.errors import FieldViolation, InvalidArgument
from compactd.reasons import Reason
from compactd.v1 import events_pb2

MAX_EVENT_ID_LENGTH = 128
_BLOCK_BODIES: Final = frozenset({"user_message", "assistant_message", "tool_result"})

# A Timestamp's valid range (google/protobuf/timestamp.proto): 0001-01-01T00:00:00Z to
# 9999-12-31T23:59:59.999999999Z. Outside it, protobuf refuses to convert the value.
_MIN_TIMESTAMP_SECONDS: Final = -62_135_596_800
_MAX_TIMESTAMP_SECONDS: Final = 253_402_300_799
_MAX_NANOS: Final = 999_999_999

_SURFACE_OP_KINDS: Final = frozenset(events_pb2.SurfaceOpKind.values())
_HEADER_REASONS: Final = frozenset(events_pb2.HeaderReason.values())
_USAGE_FIELDS: Final = (
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
)


class Origin(enum.Enum):
    """Who appends a batch; the rules a batch must satisfy depend on it."""

    CLIENT = "client"  # a runtime, through AppendEvents: runtime events only, step rules apply
    SERVER = "server"  # compactd itself (compaction engine, recoveries, restore): trusted


#: Bodies only compactd writes (see ``events.proto``): the bracket, pruning, the lock's lifecycle
#: boundary and image offloads (written by error recovery).
SERVER_ONLY_BODIES: Final[frozenset[str]] = frozenset(
    {
        "compaction_start",
        "compaction_prune",
        "compaction_summary",
        "compaction_summary_error",
        "compaction_end",
        "session_end_seed",
        "image_offload",
        "session_fork",
    }
)


def server_only_violation(event: SessionEvent, kind: str | None = None) -> FieldViolation | None:
    """Why a client may not append ``event`` (the field named is the server-only part), or None.
    ``kind``: the event's body (``body_name``), when the caller has it."""
    kind = ev.body_name(event) if kind is None else kind
    if kind in SERVER_ONLY_BODIES:
        return FieldViolation(kind, f"{ev.event_type(event)} is written only by compactd")
    # ``ev.is_insert(event)``, inline: this runs for every event of a client's batch
    if event.HasField("surface_op") and event.surface_op.kind == events_pb2.SURFACE_OP_KIND_INSERT:
        return FieldViolation("surface_op.kind", "an INSERT is written only by compactd")
    if kind == "user_message" and (
        event.user_message.source.WhichOneof("origin") == "compaction_checkpoint"
    ):
        return FieldViolation(
            "user_message.source.compaction_checkpoint",
            "a compaction checkpoint is written only by compactd",
        )
    return None


def check_origin_in_steps(
    events: Sequence[SessionEvent], origin: Origin
) -> Generator[None, None, None]:
    """Raise ``InvalidArgument`` (reason ``SERVER_ONLY_EVENT``) if ``origin`` may not write one of
    ``events``, naming every server-only event of the batch; pausing (``yield``) after each
    event so that a caller on an event loop can let other work run between them."""
    if origin is Origin.SERVER:
        return
    violations: list[FieldViolation] = []
    for index, event in enumerate(events):
        _origin_violation(event, ev.body_name(event), index, violations)
        yield
    _refuse(violations, "server-only events", Reason.SERVER_ONLY_EVENT)


def _origin_violation(
    event: SessionEvent, kind: str, index: int, out: list[FieldViolation]
) -> None:
    violation = server_only_violation(event, kind)
    if violation is not None:
        out.append(FieldViolation(f"events[{index}].{violation.field}", violation.description))


def _refuse(violations: list[FieldViolation], what: str, reason: str | None = None) -> None:
    """Raise ``InvalidArgument`` naming ``violations`` (the first five in its message), if any."""
    if not violations:
        return
    summary = "; ".join(f"{v.field}: {v.description}" for v in violations[:5])
    if reason is None:
        raise InvalidArgument(f"{what}: {summary}", violations=violations)
    raise InvalidArgument(f"{what}: {summary}", violations=violations, reason=reason)


class _Bad(Protocol):
    """Records one violation (the local ``bad`` callback's shape)."""

    def __call__(self, field: str, description: str, /) -> None: ...


def check_batch(
    events: Sequence[SessionEvent],
    *,
    max_events: int,
    origin: Origin = Origin.SERVER,
    limits: AppendLimits = DEFAULT_LIMITS,
) -> None:
    """Raise ``InvalidArgument`` listing every shape violation in the batch.

    A client batch holding a server-only event is refused first, with reason
    ``SERVER_ONLY_EVENT`` naming every such event; then one with an oversized block or event,
    with reason ``EVENT_TOO_LARGE`` naming every one. JSON nesting and token counts are bounded
    for every origin.
    """
    for _ in check_batch_in_steps(events, max_events=max_events, origin=origin, limits=limits):
        pass


def check_batch_in_steps(
    events: Sequence[SessionEvent],
    *,
    max_events: int,
    origin: Origin = Origin.SERVER,
    limits: AppendLimits = DEFAULT_LIMITS,
) -> Generator[None, None, None]:
    """``check_batch``, pausing (``yield``) between two events' checks so that a caller on an
    event loop can let other work run between them (a large batch costs milliseconds). Every
    rule is checked in one pass over the events; the refusals keep their order. A one-event
    batch does not pause: its checks run in the generator's first step."""
    client = origin is Origin.CLIENT
    server_only: list[FieldViolation] = []
    too_large: list[FieldViolation] = []
    violations: list[FieldViolation] = []
    if not events:
        violations.append(FieldViolation("events", "a batch must hold at least one event"))
    if len(events) > max_events:
        violations.append(
            FieldViolation(
                "events", f"a batch holds at most {max_events} events, got {len(events)}"
            )
        )
    ids: dict[str, int] = {}
    bad = _EventViolations(violations)
    for index, event in enumerate(events):
        if index:
            yield
        kind = event.WhichOneof("body") or ""  # ``ev.body_name``, without its call per event
        if client:
            _origin_violation(event, kind, index, server_only)
            _size_violations(event, kind, index, limits, too_large)
        bad.index = index
        _event_violations(event, kind, bad, limits)
        if event.event_id:
            if event.event_id in ids:
                violations.append(
                    FieldViolation(
                        f"events[{index}].event_id", f"repeats events[{ids[event.event_id]}]"
                    )
                )
            ids[event.event_id] = index
    if server_only or too_large or violations:  # most batches have none: no call for them
        _refuse(server_only, "server-only events", Reason.SERVER_ONLY_EVENT)
        _refuse(too_large, "events too large", Reason.EVENT_TOO_LARGE)
        _refuse(violations, "malformed events")


def _size_violations(
    event: SessionEvent, kind: str, index: int, limits: AppendLimits, out: list[FieldViolation]
) -> None:
    """The ``EVENT_TOO_LARGE`` violations of one event: itself over ``max_event_bytes``, each
    content block over ``max_block_bytes``."""
    size = event.ByteSize()
    if size > limits.max_event_bytes:
        out.append(
            FieldViolation(
                f"events[{index}]",
                f"an event holds at most {limits.max_event_bytes} bytes, got {size}",
            )
        )
    if size <= limits.max_block_bytes or kind not in _BLOCK_BODIES:
        return  # no block of an event is larger than the event
    for i, block in enumerate(getattr(event, kind).content):
        block_size = block.ByteSize()
        if block_size > limits.max_block_bytes:
            out.append(
                FieldViolation(
                    f"events[{index}].{kind}.content[{i}]",
                    f"a content block holds at most {limits.max_block_bytes} bytes, "
                    f"got {block_size}",
                )
            )


class _EventViolations:
    """Records the violations of the event at ``index`` (set before each event's checks) into
    ``out``: one recorder per batch, where a closure per event would cost more than most
    events' checks."""

    def __init__(self, out: list[FieldViolation]) -> None:
        self.out = out
        self.index = 0

    def __call__(self, field: str, description: str, /) -> None:
        prefix = f"events[{self.index}]"  # made only for a violation: most events have none
        self.out.append(FieldViolation(f"{prefix}.{field}" if field else prefix, description))


def _event_violations(event: SessionEvent, kind: str, bad: _Bad, limits: AppendLimits) -> None:
    if event.seq:
        bad("seq", "seq is assigned by the server and must be unset")
    if len(event.event_id) > MAX_EVENT_ID_LENGTH:
        bad("event_id", f"at most {MAX_EVENT_ID_LENGTH} characters")
    if event.HasField("time") and not _valid_timestamp(event.time):
        bad("time", "a Timestamp from 0001-01-01 to 9999-12-31 UTC, nanos 0..999999999")
    if not kind:
        bad("body", "exactly one event body must be set")
        return
    if kind in ev.SURFACE_BODIES:
        _surface_op_violations(event, bad)
        if event.source_event_seqs and not (ev.is_replace(event) or ev.is_insert(event)):
            bad("source_event_seqs", "only a REPLACE or an INSERT cites source_event_seqs")
    else:
        if event.HasField("surface_op"):
            bad("surface_op", f"{ev.event_type(event)} is log-only and cannot carry surface_op")
        if event.source_event_seqs:
            bad(
                "source_event_seqs",
                f"{ev.event_type(event)} is log-only and cannot carry source_event_seqs",
            )
    _body_violations(event, kind, bad, limits)


def _valid_timestamp(stamp: timestamp_pb2.Timestamp) -> bool:
    return (
        _MIN_TIMESTAMP_SECONDS <= stamp.seconds <= _MAX_TIMESTAMP_SECONDS
        and 0 <= stamp.nanos <= _MAX_NANOS
    )


def _surface_op_violations(event: SessionEvent, bad: _Bad) -> None:
    if not event.HasField("surface_op"):
        return
    op = event.surface_op
    if op.kind not in _SURFACE_OP_KINDS:
        bad("surface_op.kind", f"unknown SurfaceOpKind {op.kind}")
    positioned = (events_pb2.SURFACE_OP_KIND_REPLACE, events_pb2.SURFACE_OP_KIND_INSERT)
    if op.kind not in positioned and (op.start_seq or op.end_seq):
        bad("surface_op", "start_seq and end_seq belong to REPLACE and INSERT only")
    if op.kind in positioned and (op.start_seq < 0 or op.end_seq < 0):
        bad("surface_op", "start_seq and end_seq must be non-negative")


def _body_violations(event: SessionEvent, kind: str, bad: _Bad, limits: AppendLimits) -> None:
    if kind in ("user_message", "assistant_message", "tool_result"):
        for i, block in enumerate(getattr(event, kind).content):
            _block_violations(block, f"{kind}.content[{i}]", bad, limits)
    if kind == "assistant_message" and event.assistant_message.HasField("usage"):
        _usage_violations(event.assistant_message.usage, "assistant_message.usage", bad)
    if kind == "tool_result" and not event.tool_result.tool_call_id:
        bad("tool_result.tool_call_id", "a tool/result must name the call it answers")
    elif kind == "request_header":
        _header_violations(event.request_header, bad, limits)
    elif kind in ("compaction_start", "compaction_end", "compaction_summary"):
        if not getattr(event, kind).compaction_id:
            bad(f"{kind}.compaction_id", "required")
    elif kind == "image_offload":
        for i, target in enumerate(event.image_offload.targets):
            if not target.image_indexes or min(target.image_indexes) < 0:
                bad(f"image_offload.targets[{i}].image_indexes", "non-empty, non-negative")
    elif kind == "state_pin":
        for field, description in pin_violations(event.state_pin):
            bad(f"state_pin.{field}", description)
    elif kind in ("subagent_start", "subagent_end"):
        if not getattr(event, kind).child_session_id:
            bad(f"{kind}.child_session_id", "required")
        if kind == "subagent_start" and any(c in event.subagent_start.task for c in "\r\n"):
            bad("subagent_start.task", "one line: no line breaks")


def _block_violations(
    block: events_pb2.ContentBlock, field: str, bad: _Bad, limits: AppendLimits
) -> None:
    which = block.WhichOneof("block")
    if which is None:
        bad(field, "a content block must set exactly one kind")
    elif which == "image":
        _image_violations(block.image, f"{field}.image", bad)
    elif which == "tool_call":
        if not block.tool_call.id:
            bad(f"{field}.tool_call.id", "required")
        if not block.tool_call.name:
            bad(f"{field}.tool_call.name", "required")
        _depth_violation(
            block.tool_call.arguments_json, f"{field}.tool_call.arguments_json", bad, limits
        )


def _image_violations(image: events_pb2.ImageBlock, field: str, bad: _Bad) -> None:
    """An image must be readable again: a request or a summary sends its inline bytes (which
    need their media type) or a reference (attachment id, path); a name alone is neither, and a
    summary that cannot carry an image stops the session's compaction."""
    if image.data:
        if not image.media_type:
            bad(f"{field}.media_type", "required with inline data (e.g. image/png)")
    elif not (image.attachment_id or image.path):
        bad(
            field,
            "an image carries its bytes (data and media_type), an attachment_id or a path "
            f"to read it again; {'a name' if image.name else 'nothing'} alone cannot be sent",
        )


def _depth_violation(text: str, field: str, bad: _Bad, limits: AppendLimits) -> bool:
    """Record a violation when ``text`` nests deeper than the limit; whether it did."""
    if text.count("[") + text.count("{") <= limits.max_json_depth:
        return False  # fewer opening brackets than the limit: no deeper (two C scans)
    depth = json_depth(text)
    if depth > limits.max_json_depth:
        bad(field, f"JSON nests at most {limits.max_json_depth} levels deep, got {depth}")
        return True
    return False


def _usage_violations(usage: events_pb2.Usage, field: str, bad: _Bad) -> None:
    for name in _USAGE_FIELDS:
        value = getattr(usage, name)
        if not 0 <= value <= MAX_TOKEN_COUNT:
            bad(f"{field}.{name}", f"a token count in 0..{MAX_TOKEN_COUNT}, got {value}")


def _header_violations(header: events_pb2.RequestHeader, bad: _Bad, limits: AppendLimits) -> None:
    if header.reason not in _HEADER_REASONS:
        bad("request_header.reason", f"unknown HeaderReason {header.reason}")
    config = header.config
    if config.HasField("max_output_tokens") and not (
        0 <= config.max_output_tokens <= MAX_TOKEN_COUNT
    ):
        bad(
            "request_header.config.max_output_tokens",
            f"a token count in 0..{MAX_TOKEN_COUNT}, got {config.max_output_tokens}",
        )
    for name in ("temperature", "top_p"):
        if config.HasField(name) and not math.isfinite(getattr(config, name)):
            bad(f"request_header.config.{name}", "must be a finite number")
    for path in sorted(non_finite_paths(config.extra, "request_header.config.extra")):
        bad(path, "numbers must be finite")
    for path in sorted(
        non_finite_paths(header.adapter_defaults, "request_header.adapter_defaults")
    ):
        bad(path, "numbers must be finite")
    names: set[str] = set()
    for i, tool in enumerate(header.tools):
        field = f"request_header.tools[{i}]"
        if not tool.name:
            bad(f"{field}.name", "required")
        elif tool.name in names:
            bad(f"{field}.name", f"duplicate tool name {tool.name!r}")
        names.add(tool.name)
        schema = f"{field}.input_schema_json"
        if tool.input_schema_json and not _depth_violation(
            tool.input_schema_json, schema, bad, limits
        ):
            try:
                json.loads(tool.input_schema_json)
            except (ValueError, RecursionError) as err:
                bad(schema, f"not valid JSON: {err}")


def non_finite_paths(struct: struct_pb2.Struct, field: str) -> Iterator[str]:
    """Paths (under ``field``) of NaN or infinite numbers in a Struct: JSON has no such numbers."""
    stack: list[tuple[str, struct_pb2.Value]] = [
        (f"{field}.{key}", value) for key, value in struct.fields.items()
    ]
    while stack:
        path, value = stack.pop()
        kind = value.WhichOneof("kind")
        if kind == "number_value" and not math.isfinite(value.number_value):
            yield path
        elif kind == "struct_value":
            stack += [(f"{path}.{k}", v) for k, v in value.struct_value.fields.items()]
        elif kind == "list_value":
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(value.list_value.values)]
