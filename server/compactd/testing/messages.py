"""Short builders of projected ``compactd.v1.Message``s, for tests, examples and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

from compactd.v1 import events_pb2, session_service_pb2

Message = session_service_pb2.Message
ContentBlock = events_pb2.ContentBlock


def text_block(text: str) -> ContentBlock:
    """A text content block."""
    return ContentBlock(text=events_pb2.TextBlock(text=text))


def call_block(call_id: str, name: str, arguments_json: str = "{}") -> ContentBlock:
    """A tool-call content block."""
    return ContentBlock(
        tool_call=events_pb2.ToolCallBlock(id=call_id, name=name, arguments_json=arguments_json)
    )


def image_block(data: bytes, media_type: str = "image/png", name: str = "") -> ContentBlock:
    """An inline image content block."""
    return ContentBlock(image=events_pb2.ImageBlock(data=data, media_type=media_type, name=name))


def system(text: str) -> Message:
    """A system message."""
    return Message(role=session_service_pb2.MESSAGE_ROLE_SYSTEM, content=[text_block(text)])


def developer(text: str) -> Message:
    """A developer message."""
    return Message(role=session_service_pb2.MESSAGE_ROLE_DEVELOPER, content=[text_block(text)])


def user(text: str, *extra: ContentBlock) -> Message:
    """A user message: its text, then any further blocks (images)."""
    return Message(role=session_service_pb2.MESSAGE_ROLE_USER, content=[text_block(text), *extra])


def assistant(
    text: str = "",
    *,
    calls: Sequence[tuple[str, str, str]] = (),
    reasoning: str = "",
) -> Message:
    """An assistant message: reasoning, text, then ``(id, name, arguments_json)`` tool calls."""
    blocks: list[ContentBlock] = []
    if reasoning:
        blocks.append(ContentBlock(reasoning=events_pb2.ReasoningBlock(text=reasoning)))
    if text:
        blocks.append(text_block(text))
    blocks.extend(call_block(*call) for call in calls)
    return Message(role=session_service_pb2.MESSAGE_ROLE_ASSISTANT, content=blocks)


def tool_result(call_id: str, text: str, *, name: str = "", is_error: bool = False) -> Message:
    """A tool result answering ``call_id``."""
    return Message(
        role=session_service_pb2.MESSAGE_ROLE_TOOL,
        content=[text_block(text)],
        tool_call_id=call_id,
        name=name,
        is_error=is_error,
    )


def tool(
    name: str, schema_json: str = '{"type":"object"}', description: str = ""
) -> events_pb2.ToolDeclaration:
    """A tool declaration."""
    return events_pb2.ToolDeclaration(
        name=name, description=description, input_schema_json=schema_json
    )
