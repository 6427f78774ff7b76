"""Builders for the ``SessionEvent`` messages an agent runtime appends.

Each builder returns a complete event whose ``seq`` is unset (the server assigns it). Every
builder takes an optional keyword ``event_id``: a client-chosen idempotency key that makes a
retried append return the original seqs instead of appending twice.

Example::

    events = [
        turn_start(1),
        user_message("List the files."),
        assistant_message(tool_calls=[tool_call_block("c1", "ls", {"path": "."})]),
        tool_result("c1", "README.md\\nsrc/", tool_name="ls"),
    ]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from compactd_client.v1.events_pb2 import (
    HEADER_REASON_INITIAL,
    SUBAGENT_STATUS_COMPLETED,
    AssistantMessage,
    ContentBlock,
    DeveloperMessage,
    HeaderReason,
    ImageBlock,
    ReasoningBlock,
    RequestConfig,
    RequestHeader,
    Route,
    SessionEvent,
    StatePin,
    StepEnd,
    StepStart,
    SubagentEnd,
    SubagentStart,
    SubagentStatus,
    SystemMessage,
    TextBlock,
    ToolCall,
    ToolCallBlock,
    ToolDeclaration,
    ToolResult,
    TurnEnd,
    TurnStart,
    Usage,
    UserMessage,
)

__all__ = [
    "Content",
    "assistant_message",
    "clear_pin",
    "developer_message",
    "event_type",
    "image_block",
    "pin",
    "request_header",
    "route",
    "step_end",
    "step_start",
    "subagent_end",
    "subagent_start",
    "system_message",
    "text_block",
    "tool_call",
    "tool_call_block",
    "tool_declaration",
    "tool_result",
    "turn_end",
    "turn_start",
    "user_message",
]

#: Message content: plain text, or content blocks in order.
Content = str | Sequence[ContentBlock]

# The spec's event type strings, by `SessionEvent.body` field name.
_EVENT_TYPES: dict[str, str] = {
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


def event_type(event: SessionEvent) -> str:
    """Returns the spec's type string of an event (``user/message``, ``compaction/start``...).

    Raises:
        ValueError: if the event has no body.
    """
    field = event.WhichOneof("body")
    if field is None:
        raise ValueError("event has no body")
    return _EVENT_TYPES[field]


def text_block(text: str) -> ContentBlock:
    """Returns a text content block."""
    return ContentBlock(text=TextBlock(text=text))


def image_block(
    media_type: str,
    *,
    data: bytes = b"",
    attachment_id: str = "",
    name: str = "",
    path: str = "",
) -> ContentBlock:
    """Returns an image block, inline (``data``) or by reference (``attachment_id``/``path``)."""
    image = ImageBlock(
        media_type=media_type,
        data=data,
        attachment_id=attachment_id,
        name=name,
        path=path,
        size_bytes=len(data),
    )
    return ContentBlock(image=image)


def tool_call_block(call_id: str, name: str, arguments: str | Mapping[str, Any]) -> ContentBlock:
    """Returns an assistant tool-call block; a mapping of arguments is serialized as JSON."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ContentBlock(tool_call=ToolCallBlock(id=call_id, name=name, arguments_json=args))


def _blocks(content: Content) -> list[ContentBlock]:
    return [text_block(content)] if isinstance(content, str) else list(content)


def system_message(text: str, *, event_id: str = "") -> SessionEvent:
    """Returns a ``system/message`` (the system prompt, normally surface position 0)."""
    return SessionEvent(event_id=event_id, system_message=SystemMessage(text=text))


def developer_message(text: str, *, event_id: str = "") -> SessionEvent:
    """Returns a ``developer/message``."""
    return SessionEvent(event_id=event_id, developer_message=DeveloperMessage(text=text))


def user_message(content: Content, *, event_id: str = "") -> SessionEvent:
    """Returns a ``user/message`` of user input (text or blocks)."""
    return SessionEvent(event_id=event_id, user_message=UserMessage(content=_blocks(content)))


def assistant_message(
    text: str = "",
    *,
    tool_calls: Sequence[ContentBlock] = (),
    reasoning: str = "",
    usage: Usage | None = None,
    provider: str = "",
    model: str = "",
    stop_reason: str = "",
    event_id: str = "",
) -> SessionEvent:
    """Returns an ``assistant/message``: reasoning, then text, then tool calls.

    Args:
        text: The completion text; empty adds no text block.
        tool_calls: Blocks made with :func:`tool_call_block`.
        reasoning: Reasoning text; empty adds no reasoning block.
        usage: The provider's usage for the request this message answers (anchors pressure).
        provider: Provider that produced the message.
        model: Model that produced the message.
        stop_reason: Provider stop reason (``stop``, ``tool_calls``...).
        event_id: Optional idempotency key.
    """
    blocks: list[ContentBlock] = []
    if reasoning:
        blocks.append(ContentBlock(reasoning=ReasoningBlock(text=reasoning)))
    if text:
        blocks.append(text_block(text))
    blocks.extend(tool_calls)
    message = AssistantMessage(
        content=blocks, provider=provider, model=model, stop_reason=stop_reason
    )
    if usage is not None:
        message.usage.CopyFrom(usage)
    return SessionEvent(event_id=event_id, assistant_message=message)


def tool_result(
    tool_call_id: str,
    content: Content,
    *,
    tool_name: str = "",
    is_error: bool = False,
    event_id: str = "",
) -> SessionEvent:
    """Returns a ``tool/result`` answering the tool-call block ``tool_call_id``."""
    result = ToolResult(
        tool_call_id=tool_call_id,
        tool_name=tool_name,
        content=_blocks(content),
        is_error=is_error,
    )
    return SessionEvent(event_id=event_id, tool_result=result)


def tool_call(
    tool_call_id: str, name: str, arguments: str | Mapping[str, Any], *, event_id: str = ""
) -> SessionEvent:
    """Returns a log-only ``tool/call``: the runtime dispatched a call."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    call = ToolCall(tool_call_id=tool_call_id, name=name, arguments_json=args)
    return SessionEvent(event_id=event_id, tool_call=call)


def turn_start(turn: int, *, event_id: str = "") -> SessionEvent:
    """Returns a ``turn/start``: opens turn ``turn`` (compaction is busy while it is open)."""
    return SessionEvent(event_id=event_id, turn_start=TurnStart(turn=turn))


def turn_end(turn: int, reason: str = "", *, event_id: str = "") -> SessionEvent:
    """Returns a ``turn/end`` closing turn ``turn``."""
    return SessionEvent(event_id=event_id, turn_end=TurnEnd(turn=turn, reason=reason))


def step_start(turn: int, step: int, *, event_id: str = "") -> SessionEvent:
    """Returns a ``step/start``."""
    return SessionEvent(event_id=event_id, step_start=StepStart(turn=turn, step=step))


def step_end(turn: int, step: int, *, event_id: str = "") -> SessionEvent:
    """Returns a ``step/end``."""
    return SessionEvent(event_id=event_id, step_end=StepEnd(turn=turn, step=step))


def tool_declaration(
    name: str, description: str, input_schema: str | Mapping[str, Any]
) -> ToolDeclaration:
    """Returns a tool declaration; a mapping schema is serialized as JSON."""
    schema = input_schema if isinstance(input_schema, str) else json.dumps(input_schema)
    return ToolDeclaration(name=name, description=description, input_schema_json=schema)


def request_header(
    provider: str,
    model: str,
    *,
    tools: Sequence[ToolDeclaration] = (),
    max_output_tokens: int | None = None,
    temperature: float | None = None,
    reason: HeaderReason.ValueType = HEADER_REASON_INITIAL,
    starts_series: bool = False,
    event_id: str = "",
) -> SessionEvent:
    """Returns a ``request/header``: the route, sampling settings and tools of later requests.

    The route (``provider``/``model``) is what pressure checks price against.
    """
    config = RequestConfig(provider=provider, model=model)
    if max_output_tokens is not None:
        config.max_output_tokens = max_output_tokens
    if temperature is not None:
        config.temperature = temperature
    header = RequestHeader(
        config=config, tools=list(tools), reason=reason, starts_series=starts_series
    )
    return SessionEvent(event_id=event_id, request_header=header)


def pin(key: str, text: str, *, event_id: str = "") -> SessionEvent:
    """Returns a ``state/pin``: ``text`` is in force under ``key`` (replacing the key's earlier
    pin) and never summarized; every rebuilt request shows the pins in force right after the
    system head. ``key``: 1-64 characters of ``[A-Za-z0-9._:/-]`` (``goal``, ``plan``...)."""
    return SessionEvent(event_id=event_id, state_pin=StatePin(key=key, text=text))


def clear_pin(key: str, *, event_id: str = "") -> SessionEvent:
    """Returns a ``state/pin`` that removes ``key`` from the pins in force."""
    return SessionEvent(event_id=event_id, state_pin=StatePin(key=key, clear=True))


def subagent_start(
    child_session_id: str, *, tool_call_id: str = "", task: str = "", event_id: str = ""
) -> SessionEvent:
    """Returns a ``subagent/start`` (in the parent's log): a sub-agent runs in session
    ``child_session_id``, spawned by tool call ``tool_call_id``, to do ``task`` (one line).
    Until its ``subagent/end``, every checkpoint of the parent lists it as an open handle."""
    start = SubagentStart(child_session_id=child_session_id, tool_call_id=tool_call_id, task=task)
    return SessionEvent(event_id=event_id, subagent_start=start)


def subagent_end(
    child_session_id: str,
    result: str = "",
    *,
    status: SubagentStatus.ValueType = SUBAGENT_STATUS_COMPLETED,
    event_id: str = "",
) -> SessionEvent:
    """Returns a ``subagent/end`` (in the parent's log): the sub-agent of ``child_session_id``
    ended with ``status``; ``result`` summarizes what it found."""
    end = SubagentEnd(child_session_id=child_session_id, status=status, result=result)
    return SessionEvent(event_id=event_id, subagent_end=end)


def route(provider: str, model: str) -> Route:
    """Returns a provider/model route."""
    return Route(provider=provider, model=model)
