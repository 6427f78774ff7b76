"""Event vocabulary: the spec's type strings and the surface/log-only split."""

from __future__ import annotations

from typing import Final

from compactd.v1 import events_pb2

SessionEvent = events_pb2.SessionEvent

# oneof field name -> the spec's event type string.
EVENT_TYPES: Final[dict[str, str]] = {
    "system_message": "system/message",
    "developer_message": "developer/message",
    "user_message": "user/message",
    "assistant_message": "assistant/message",
    "tool_result": "tool/result",
    "turn_start": "turn/start",
    "turn_end": "turn/end",
    "step_start": "step/start",
    "step_end": "step/end",
    "tool_call": "tool/call",
    "assistant_attempt": "assistant/attempt",
    "request_header": "request/header",
    "compaction_start": "compaction/start",
    "compaction_prune": "compaction/prune",
    "compaction_summary": "compaction/summary",
    "compaction_end": "compaction/end",
    "image_offload": "image/offload",
    "session_end_seed": "session/end-seed",
    "llm_retry": "llm/retry",
    "compaction_summary_error": "compaction/summary-error",
    "state_pin": "state/pin",
    "subagent_start": "subagent/start",
    "subagent_end": "subagent/end",
    "session_fork": "session/fork",
}

SURFACE_BODIES: Final[frozenset[str]] = frozenset(
    {"system_message", "developer_message", "user_message", "assistant_message", "tool_result"}
)

SYSTEM_MESSAGE: Final = "system/message"
TOOL_RESULT: Final = "tool/result"
USER_MESSAGE: Final = "user/message"
ASSISTANT_MESSAGE: Final = "assistant/message"


def body_name(event: SessionEvent) -> str:
    """The name of the event's ``body`` oneof field, or ``""`` when none is set."""
    return event.WhichOneof("body") or ""


def event_type(event: SessionEvent) -> str:
    """The spec's type string (``user/message``, ...), or ``""`` for an event with no body."""
    return EVENT_TYPES.get(body_name(event), "")


def is_surface(event: SessionEvent) -> bool:
    """Whether the event becomes a surface node."""
    return body_name(event) in SURFACE_BODIES


def is_replace(event: SessionEvent) -> bool:
    """Whether the event is a surface REPLACE."""
    return (
        event.HasField("surface_op") and event.surface_op.kind == events_pb2.SURFACE_OP_KIND_REPLACE
    )


def is_insert(event: SessionEvent) -> bool:
    """Whether the event is a surface INSERT (compactd's own, a revert's)."""
    return (
        event.HasField("surface_op") and event.surface_op.kind == events_pb2.SURFACE_OP_KIND_INSERT
    )


def checkpoint_compaction_id(event: SessionEvent) -> str:
    """The compaction id of a checkpoint ``user/message``, or ``""``."""
    if body_name(event) != "user_message":
        return ""
    source = event.user_message.source
    if source.WhichOneof("origin") == "compaction_checkpoint":
        return source.compaction_checkpoint.compaction_id
    return ""


def tool_call_ids(event: SessionEvent) -> list[str]:
    """Ids of the tool calls an ``assistant/message`` makes, in order."""
    if body_name(event) != "assistant_message":
        return []
    return [b.tool_call.id for b in event.assistant_message.content if b.HasField("tool_call")]
