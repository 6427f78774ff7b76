"""Session events from the repository's real agent transcripts (``testdata/transcripts``).

Shared by the append and restore benchmarks. The OpenAI-format transcripts become surface events
(user messages, assistant messages with their tool calls, tool results), cycled with fresh
tool-call ids to reach any length; ``in_steps`` brackets assistant messages as a runtime must
over the API; ``compacting`` adds the REPLACE events a compacting runtime logs, so a long log keeps
a bounded surface, as a real one does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from compactd.v1 import events_pb2

SessionEvent = events_pb2.SessionEvent
ContentBlock = events_pb2.ContentBlock
TRANSCRIPTS = Path(__file__).resolve().parents[1] / "testdata" / "transcripts" / "openai.jsonl"


def conversations() -> list[dict[str, Any]]:
    """The transcripts, one dict per conversation."""
    with TRANSCRIPTS.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _event(
    message: dict[str, Any], prefix: str, calls: set[str], cycle: int = 0
) -> SessionEvent | None:
    role, text = message["role"], _text(message.get("content"))
    if text and cycle:  # every cycle's texts differ, as a real log's do (no free repeats)
        text = f"{text}\n[{cycle}]"
    blocks = [ContentBlock(text=events_pb2.TextBlock(text=text))] if text else []
    if role == "assistant":
        for call in message.get("tool_calls") or []:
            function = call["function"]
            block = events_pb2.ToolCallBlock(
                id=prefix + call["id"], name=function["name"], arguments_json=function["arguments"]
            )
            blocks.append(ContentBlock(tool_call=block))
            calls.add(block.id)
        return SessionEvent(assistant_message=events_pb2.AssistantMessage(content=blocks))
    call_id = prefix + str(message.get("tool_call_id", ""))
    if role == "tool":
        if call_id not in calls:
            return None
        calls.discard(call_id)
        return SessionEvent(tool_result=events_pb2.ToolResult(tool_call_id=call_id, content=blocks))
    if role == "system" or not blocks:
        return None
    return SessionEvent(user_message=events_pb2.UserMessage(content=blocks))


def surface_events(tag: str = "") -> Iterator[SessionEvent]:
    """Surface events from the transcripts, cycled forever with fresh tool-call ids. A
    conversation's calls are all answered before the next begins (unanswered ones are dropped),
    so the stream is balanced between conversations."""
    corpus = conversations()
    cycle = 0
    while True:
        for index, conversation in enumerate(corpus):
            calls: set[str] = set()
            pending: list[SessionEvent] = []
            for message in conversation["messages"]:
                event = _event(message, f"{tag}r{cycle}.{index}.", calls, cycle)
                if event is not None:
                    pending.append(event)
            yield from _answered(pending)
        cycle += 1


def _answered(events: list[SessionEvent]) -> Iterator[SessionEvent]:
    """The events, with tool calls that got no result removed (and messages left empty)."""
    answered = {e.tool_result.tool_call_id for e in events if e.HasField("tool_result")}
    for event in events:
        if event.HasField("assistant_message"):
            content = [
                b
                for b in event.assistant_message.content
                if not b.HasField("tool_call") or b.tool_call.id in answered
            ]
            if not content:
                continue
            del event.assistant_message.content[:]
            event.assistant_message.content.extend(content)
        yield event


def in_steps(batch: Sequence[SessionEvent], first_step: int) -> tuple[list[SessionEvent], int]:
    """``batch`` as a runtime appends it over the API: each assistant message in its own step of
    turn 1 (open it first with ``turn_start``); returns the events and the next step number."""
    out: list[SessionEvent] = []
    step = first_step
    for event in batch:
        if event.HasField("assistant_message"):
            out += [
                SessionEvent(step_start=events_pb2.StepStart(turn=1, step=step)),
                event,
                SessionEvent(step_end=events_pb2.StepEnd(turn=1, step=step)),
            ]
            step += 1
        else:
            out.append(event)
    return out, step


def turn_start() -> SessionEvent:
    """Opens turn 1."""
    return SessionEvent(turn_start=events_pb2.TurnStart(turn=1))


def header(provider: str, model: str) -> SessionEvent:
    """A ``request/header`` routing to ``provider``/``model``."""
    config = events_pb2.RequestConfig(provider=provider, model=model)
    return SessionEvent(request_header=events_pb2.RequestHeader(config=config))


def texts_of(event: SessionEvent) -> list[str]:
    """The strings the meter tokenizes for one event."""
    body = event.WhichOneof("body")
    if body == "system_message":
        return [event.system_message.text]
    if body not in ("user_message", "assistant_message", "tool_result"):
        return []
    texts = []
    for block in getattr(event, body or "").content:
        kind = block.WhichOneof("block")
        if kind == "text":
            texts.append(block.text.text)
        elif kind == "tool_call":
            texts += [block.tool_call.name, block.tool_call.arguments_json]
    return texts


def summary(start: int, end: int, sources: Sequence[int], text: str) -> SessionEvent:
    """A REPLACE of the span ``start``..``end`` by a user message holding ``text``."""
    event = SessionEvent(
        user_message=events_pb2.UserMessage(
            content=[ContentBlock(text=events_pb2.TextBlock(text=text))]
        )
    )
    event.surface_op.kind = events_pb2.SURFACE_OP_KIND_REPLACE
    event.surface_op.start_seq = start
    event.surface_op.end_seq = end
    event.source_event_seqs[:] = list(sources)
    return event
