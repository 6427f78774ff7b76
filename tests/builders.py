"""Small builders for ``SessionEvent``s, shared by every test that needs a conversation.

Each returns a fresh event with no seq (the server assigns seqs). Surface builders APPEND by
default; wrap one in ``replace`` to make it a REPLACE. A runtime's conversation keeps the step
brackets: ``in_step`` and ``exchange`` put assistant messages inside steps of a turn. The
bracket, lifecycle and offload builders (``compaction_start``, ``end_seed``, ``offload``,
``checkpoint``) make server-only events: use them at the core level or through the service's
trusted path, never through ``AppendEvents`` (which refuses them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from compactd.v1 import events_pb2

SessionEvent = events_pb2.SessionEvent
ContentBlock = events_pb2.ContentBlock


def text_block(text: str) -> ContentBlock:
    """A text content block."""
    return ContentBlock(text=events_pb2.TextBlock(text=text))


def image_block(name: str = "", *, attachment_id: str = "", path: str = "") -> ContentBlock:
    """A PNG image content block, referenced by name / attachment id / path."""
    image = events_pb2.ImageBlock(
        media_type="image/png", name=name, attachment_id=attachment_id, path=path
    )
    return ContentBlock(image=image)


def system(text: str) -> SessionEvent:
    """A ``system/message``."""
    return SessionEvent(system_message=events_pb2.SystemMessage(text=text))


def developer(text: str) -> SessionEvent:
    """A ``developer/message``."""
    return SessionEvent(developer_message=events_pb2.DeveloperMessage(text=text))


def user(text: str = "", *, blocks: Sequence[ContentBlock] = ()) -> SessionEvent:
    """A ``user/message`` from the user: ``text`` (when non-empty) followed by ``blocks``."""
    content = [text_block(text)] if text else []
    return SessionEvent(user_message=events_pb2.UserMessage(content=[*content, *blocks]))


def checkpoint(compaction_id: str, text: str) -> SessionEvent:
    """A checkpoint ``user/message`` committed by bracket ``compaction_id`` (still an APPEND)."""
    event = user(text)
    event.user_message.source.compaction_checkpoint.compaction_id = compaction_id
    return event


def assistant(
    text: str = "", *, calls: Iterable[tuple[str, str, str]] = (), reasoning: str = ""
) -> SessionEvent:
    """An ``assistant/message``: reasoning and text when given, then ``(id, name, args)`` calls."""
    content = []
    if reasoning:
        content.append(ContentBlock(reasoning=events_pb2.ReasoningBlock(text=reasoning)))
    if text:
        content.append(text_block(text))
    for call_id, name, arguments in calls:
        call = events_pb2.ToolCallBlock(id=call_id, name=name, arguments_json=arguments)
        content.append(ContentBlock(tool_call=call))
    return SessionEvent(assistant_message=events_pb2.AssistantMessage(content=content))


def tool_result(
    call_id: str,
    text: str = "",
    *,
    name: str = "",
    is_error: bool = False,
    blocks: Sequence[ContentBlock] = (),
) -> SessionEvent:
    """A ``tool/result`` answering ``call_id``: ``text`` (when non-empty) followed by ``blocks``."""
    content = [text_block(text)] if text else []
    result = events_pb2.ToolResult(
        tool_call_id=call_id, tool_name=name, is_error=is_error, content=[*content, *blocks]
    )
    return SessionEvent(tool_result=result)


def replace(event: SessionEvent, start: int, end: int, sources: Iterable[int]) -> SessionEvent:
    """A copy of surface ``event`` that REPLACEs the span ``start``..``end`` (seqs of its ends)."""
    copy = SessionEvent()
    copy.CopyFrom(event)
    copy.surface_op.kind = events_pb2.SURFACE_OP_KIND_REPLACE
    copy.surface_op.start_seq = start
    copy.surface_op.end_seq = end
    copy.source_event_seqs[:] = list(sources)
    return copy


def tool(name: str, schema: str = "{}", description: str = "") -> events_pb2.ToolDeclaration:
    """A tool declaration."""
    return events_pb2.ToolDeclaration(name=name, description=description, input_schema_json=schema)


def header(
    provider: str,
    model: str,
    *,
    tools: Iterable[events_pb2.ToolDeclaration] = (),
    reason: events_pb2.HeaderReason.ValueType = events_pb2.HEADER_REASON_UNSPECIFIED,
) -> SessionEvent:
    """A ``request/header`` snapshot; an unspecified ``reason`` lets the server classify it."""
    config = events_pb2.RequestConfig(provider=provider, model=model)
    body = events_pb2.RequestHeader(config=config, tools=list(tools), reason=reason)
    return SessionEvent(request_header=body)


def turn_start(turn: int) -> SessionEvent:
    """A ``turn/start``."""
    return SessionEvent(turn_start=events_pb2.TurnStart(turn=turn))


def turn_end(turn: int) -> SessionEvent:
    """A ``turn/end``."""
    return SessionEvent(turn_end=events_pb2.TurnEnd(turn=turn))


def step_start(turn: int, step: int) -> SessionEvent:
    """A ``step/start``: one model request/response of ``turn`` begins."""
    return SessionEvent(step_start=events_pb2.StepStart(turn=turn, step=step))


def step_end(turn: int, step: int) -> SessionEvent:
    """A ``step/end``: the step finished."""
    return SessionEvent(step_end=events_pb2.StepEnd(turn=turn, step=step))


def in_step(turn: int, step: int, *events: SessionEvent) -> list[SessionEvent]:
    """``events`` (an ``assistant/message``, say) bracketed by ``step/start`` and ``step/end``."""
    return [step_start(turn, step), *events, step_end(turn, step)]


def exchange(
    turn: int, request: str, *events: SessionEvent, close: bool = True
) -> list[SessionEvent]:
    """A turn: ``request`` from the user, then each ``assistant/message`` of ``events`` in its
    own step (other events, tool results, follow the step before them); closed unless told."""
    out = [turn_start(turn), user(request)]
    step = 0
    for event in events:
        if event.HasField("assistant_message"):
            step += 1
            out += in_step(turn, step, event)
        else:
            out.append(event)
    return [*out, turn_end(turn)] if close else out


def compaction_start(compaction_id: str) -> SessionEvent:
    """A ``compaction/start`` (takes the log-recorded lock)."""
    return SessionEvent(compaction_start=events_pb2.CompactionStart(compaction_id=compaction_id))


def compaction_end(compaction_id: str, error: str = "") -> SessionEvent:
    """A ``compaction/end`` (releases the lock); ``error`` when the bracket failed."""
    body = events_pb2.CompactionEnd(compaction_id=compaction_id, error=error)
    return SessionEvent(compaction_end=body)


def end_seed(reason: str = "restore") -> SessionEvent:
    """A ``session/end-seed`` lifecycle boundary."""
    return SessionEvent(session_end_seed=events_pb2.SessionEndSeed(reason=reason))


def offload(targets: Mapping[int, Sequence[int]]) -> SessionEvent:
    """An ``image/offload`` selecting, per node seq, depth-first image indexes."""
    body = events_pb2.ImageOffload(
        targets=[
            events_pb2.ImageOffloadTarget(seq=seq, image_indexes=list(indexes))
            for seq, indexes in targets.items()
        ]
    )
    return SessionEvent(image_offload=body)


def pin(key: str, text: str = "", *, clear: bool = False) -> SessionEvent:
    """A ``state/pin``: ``text`` in force under ``key``, or ``clear`` to remove the key."""
    return SessionEvent(state_pin=events_pb2.StatePin(key=key, text=text, clear=clear))


def subagent_start(child: str, tool_call_id: str = "", task: str = "") -> SessionEvent:
    """A ``subagent/start`` of child session ``child``."""
    body = events_pb2.SubagentStart(child_session_id=child, tool_call_id=tool_call_id, task=task)
    return SessionEvent(subagent_start=body)


def subagent_end(
    child: str, result: str = "", status: int = events_pb2.SUBAGENT_STATUS_COMPLETED
) -> SessionEvent:
    """A ``subagent/end`` of child session ``child``."""
    body = events_pb2.SubagentEnd(child_session_id=child, status=status, result=result)  # type: ignore[arg-type]
    return SessionEvent(subagent_end=body)
