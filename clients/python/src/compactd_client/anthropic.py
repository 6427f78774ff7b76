"""Anthropic Messages ⇄ compactd: messages and tools to events, requests to bodies.

Import a conversation a runtime holds as Anthropic messages::

    events = anthropic.events_from_messages(messages, system=system, tools=tools,
                                            model="claude-sonnet-4-5")
    client.append_events(session_id, events)

and send what compactd rebuilt::

    body = anthropic.request_body(client.build_request(session_id), max_tokens=8192)
    reply = ...                                      # POST /v1/messages
    client.append_events(session_id, [step_start(t, s), anthropic.assistant_event(reply), ...])

The mapping, both ways (``messages_from_events`` renders events back; import then render gives
the original messages):

* ``system`` (a string, or text blocks joined with a blank line): ``system/message``;
* a ``user`` message: its ``tool_result`` blocks become ``tool/result`` events (content a string
  or text and image blocks; ``is_error``), the rest one ``user/message`` (text and image blocks);
  consecutive user-side messages render back as one user message, tool results first (also
  when a system message or user text was logged between a call and its result);
* an ``assistant`` message: ``assistant/message`` inside a step of a turn, blocks in order:
  ``thinking`` (text and signature; ``redacted_thinking`` as a reasoning block with only its
  data as signature), ``text``, ``tool_use`` (id, name, ``input`` as JSON text);
* images: ``base64`` sources inline, ``url`` sources as the image's ``path``;
* tools: ``request/header`` tool declarations (``name``, ``description``, ``input_schema``);
* pins: a rebuilt request's pinned-state message (``Message.pinned_state``) always joins
  ``system`` (after the system head), never the ``messages``; importing drops a
  ``<pinned-state>`` block from ``system`` (log pins with ``events.pin``).

A user message or tool result that is one text block renders as a string. Thinking blocks are
always sent back (Anthropic requires them, signed, with tool use). Not carried: ``cache_control``,
citations, documents, server tools; an unknown block type is a ``ValueError`` naming it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from compactd_client import _project
from compactd_client._timeline import Timeline
from compactd_client.events import request_header
from compactd_client.v1.events_pb2 import (
    AssistantMessage,
    ContentBlock,
    ImageBlock,
    ReasoningBlock,
    SessionEvent,
    SystemMessage,
    TextBlock,
    ToolCallBlock,
    ToolDeclaration,
    ToolResult,
    Usage,
    UserMessage,
)
from compactd_client.v1.session_service_pb2 import (
    MESSAGE_ROLE_ASSISTANT,
    MESSAGE_ROLE_DEVELOPER,
    MESSAGE_ROLE_SYSTEM,
    MESSAGE_ROLE_TOOL,
    BuildRequestResponse,
    Message,
)

__all__ = [
    "assistant_event",
    "declarations",
    "encode_messages",
    "events_from_messages",
    "messages_from_events",
    "request_body",
    "tools",
]

JSON = dict[str, Any]
_JOIN = "\n\n"


# ---- messages and tools to events ------------------------------------------------------------


def events_from_messages(
    messages: Iterable[Mapping[str, Any]],
    *,
    system: str | Sequence[Mapping[str, Any]] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    provider: str = "anthropic",
    model: str = "",
    first_turn: int = 1,
    close_turn: bool = True,
) -> list[SessionEvent]:
    """The events that log an Anthropic conversation as a valid compactd log.

    Args:
        messages: Messages API ``messages``, in order.
        system: The request's ``system``.
        tools: The request's ``tools``; with ``model`` they make a ``request/header``.
        provider: The route's provider for the header.
        model: The route's model (empty logs no header).
        first_turn: Number of the first turn opened.
        close_turn: Close the last turn (``turn/end``, reason ``imported``).

    Raises:
        ValueError: A role or block type the mapping does not carry (named).
    """
    timeline = Timeline(first_turn)
    if system is not None:
        text = system if isinstance(system, str) else _JOIN.join(b["text"] for b in system)
        kept = _project.without_pins(text)  # a rebuilt request's pins are not the prompt
        if kept or kept == text:
            timeline.other(SessionEvent(system_message=SystemMessage(text=kept)))
    if model:
        timeline.other(request_header(provider, model, tools=declarations(tools or ())))
    names: dict[str, str] = {}
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role, content = message.get("role"), message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        if role == "assistant":
            event = _assistant(blocks, where)
            names.update((b.tool_call.id, b.tool_call.name) for b in event.assistant_message.content
                         if b.HasField("tool_call"))  # fmt: skip
            timeline.assistant(event)
        elif role == "user":
            rest = []
            for number, block in enumerate(blocks):
                if block.get("type") == "tool_result":
                    timeline.other(_tool_result(block, names, f"{where}.content[{number}]"))
                else:
                    rest.append(_block(block, f"{where}.content[{number}]"))
            if rest:
                timeline.user(SessionEvent(user_message=UserMessage(content=rest)))
        else:
            raise ValueError(f"{where}: role {role!r} is not carried")
    return timeline.finish(close_turn)


def declarations(tools: Iterable[Mapping[str, Any]]) -> list[ToolDeclaration]:
    """``request/header`` tool declarations of Anthropic ``tools`` (client tools)."""
    return [
        ToolDeclaration(
            name=str(tool.get("name", "")),
            description=str(tool.get("description", "")),
            input_schema_json=_dumps(tool["input_schema"]) if "input_schema" in tool else "",
        )
        for tool in tools
    ]


def assistant_event(reply: Mapping[str, Any], *, provider: str = "anthropic") -> SessionEvent:
    """The ``assistant/message`` of a Messages API response, with its usage and stop reason."""
    event = _assistant(reply.get("content") or [], "content")
    message = event.assistant_message
    message.provider, message.model = provider, str(reply.get("model", ""))
    message.stop_reason = str(reply.get("stop_reason") or "")
    usage = reply.get("usage")
    if isinstance(usage, Mapping):
        message.usage.CopyFrom(
            Usage(
                input_tokens=int(usage.get("input_tokens") or 0),
                cache_read_tokens=int(usage.get("cache_read_input_tokens") or 0),
                cache_write_tokens=int(usage.get("cache_creation_input_tokens") or 0),
                output_tokens=int(usage.get("output_tokens") or 0),
            )
        )
    return event


def _assistant(blocks: Iterable[Mapping[str, Any]], where: str) -> SessionEvent:
    content = [_block(block, f"{where}.content[{n}]") for n, block in enumerate(blocks)]
    return SessionEvent(assistant_message=AssistantMessage(content=content))


def _block(block: Mapping[str, Any], where: str) -> ContentBlock:
    kind = block.get("type")
    if kind == "text":
        return ContentBlock(text=TextBlock(text=str(block.get("text", ""))))
    if kind == "thinking":
        reasoning = ReasoningBlock(text=str(block.get("thinking", "")),
                                   signature=str(block.get("signature", "")))  # fmt: skip
        return ContentBlock(reasoning=reasoning)
    if kind == "redacted_thinking":
        return ContentBlock(reasoning=ReasoningBlock(signature=str(block.get("data", ""))))
    if kind == "tool_use":
        call = ToolCallBlock(id=str(block.get("id", "")), name=str(block.get("name", "")),
                             arguments_json=_dumps(block.get("input", {})))  # fmt: skip
        return ContentBlock(tool_call=call)
    if kind == "image":
        return ContentBlock(image=_image(block.get("source") or {}, where))
    raise ValueError(f"{where}: block type {kind!r} is not carried")


def _image(source: Mapping[str, Any], where: str) -> ImageBlock:
    if source.get("type") == "base64":
        data = base64.b64decode(source.get("data", ""))
        return ImageBlock(media_type=str(source.get("media_type", "")), data=data,
                          size_bytes=len(data))  # fmt: skip
    if source.get("type") == "url":
        return ImageBlock(path=str(source.get("url", "")))
    raise ValueError(f"{where}: image source {source.get('type')!r} is not carried")


def _tool_result(block: Mapping[str, Any], names: Mapping[str, str], where: str) -> SessionEvent:
    content = block.get("content", "")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    call_id = str(block.get("tool_use_id", ""))
    result = ToolResult(
        tool_call_id=call_id,
        tool_name=names.get(call_id, ""),
        content=[_block(part, f"{where}.content[{n}]") for n, part in enumerate(parts)],
        is_error=bool(block.get("is_error", False)),
    )
    return SessionEvent(tool_result=result)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ---- events and requests to messages ---------------------------------------------------------


def messages_from_events(events: Iterable[SessionEvent]) -> JSON:
    """``{"system": ..., "messages": [...]}`` of an append-only log (``system`` only if logged)."""
    return _render(_project.messages(events))


def request_body(
    request: BuildRequestResponse, *, max_tokens: int | None = None, stream: bool | None = None
) -> JSON:
    """A ready Messages API body for what ``BuildRequest`` answered.

    ``max_tokens`` (required by the API) is the header's ``max_output_tokens`` unless given;
    ``temperature`` and ``top_p`` when set; the header's ``extra`` keys.

    Raises:
        ValueError: Neither the header nor the caller gives ``max_tokens``.
    """
    config = request.config
    rendered = _render(list(request.messages))
    limit = max_tokens if max_tokens is not None else (
        config.max_output_tokens if config.HasField("max_output_tokens") else None
    )  # fmt: skip
    if limit is None:
        raise ValueError("max_tokens: the Messages API requires it; pass it or log a header")
    body: JSON = {"model": config.model, "max_tokens": limit, **rendered}
    if request.tools:
        body["tools"] = tools(request.tools)
    _project.add_settings(body, config, stream)
    return body


def tools(declared: Iterable[ToolDeclaration]) -> list[JSON]:
    """Anthropic ``tools`` of ``request/header`` tool declarations."""
    rendered = []
    for tool in declared:
        entry: JSON = {"name": tool.name}
        if tool.description:
            entry["description"] = tool.description
        schema = json.loads(tool.input_schema_json) if tool.input_schema_json else None
        entry["input_schema"] = schema if schema is not None else {"type": "object"}
        rendered.append(entry)
    return rendered


def encode_messages(messages: Sequence[Message]) -> list[JSON]:
    """compactd ``Message``s as Anthropic ``messages`` (system and developer text left out)."""
    return _render(list(messages))["messages"]  # type: ignore[no-any-return]


def _render(messages: Sequence[Message]) -> JSON:
    system: list[str] = []
    rendered: list[JSON] = []
    for message in messages:
        if message.role in (MESSAGE_ROLE_SYSTEM, MESSAGE_ROLE_DEVELOPER):
            text = _JOIN.join(b.text.text for b in message.content)
            if not rendered or message.pinned_state:
                system.append(text)
                continue
            blocks: list[JSON] = [{"type": "text", "text": text}]
            role = "user"  # a developer or system message mid-conversation: user text
        elif message.role == MESSAGE_ROLE_ASSISTANT:
            blocks, role = [_encode_block(b) for b in message.content], "assistant"
        elif message.role == MESSAGE_ROLE_TOOL:
            blocks, role = [_tool_result_block(message)], "user"
        else:
            blocks, role = [_encode_block(b) for b in message.content], "user"
        if rendered and rendered[-1]["role"] == role and role == "user":
            rendered[-1]["content"] = _as_blocks(rendered[-1]["content"]) + blocks
        else:
            rendered.append({"role": role, "content": blocks})
    for entry in rendered:
        if entry["role"] == "user":
            entry["content"] = _as_text(_tool_results_first(entry["content"]))
    body: JSON = {"messages": rendered}
    if system:
        body = {"system": _JOIN.join(system), **body}
    return body


def _tool_results_first(blocks: list[JSON]) -> list[JSON]:
    """A user message's ``tool_result`` blocks before its other blocks, each kind in order.

    Anthropic requires the results to open the user message that follows a ``tool_use``; a
    system message or user text logged between the call and its result would come first."""
    results = [b for b in blocks if b.get("type") == "tool_result"]
    return results + [b for b in blocks if b.get("type") != "tool_result"]


def _tool_result_block(message: Message) -> JSON:
    block: JSON = {
        "type": "tool_result",
        "tool_use_id": message.tool_call_id,
        "content": _as_text([_encode_block(b) for b in message.content]),
    }
    if message.is_error:
        block["is_error"] = True
    return block


def _encode_block(block: ContentBlock) -> JSON:
    kind = block.WhichOneof("block")
    if kind == "text":
        return {"type": "text", "text": block.text.text}
    if kind == "reasoning":
        if not block.reasoning.text and block.reasoning.signature:
            return {"type": "redacted_thinking", "data": block.reasoning.signature}
        return {"type": "thinking", "thinking": block.reasoning.text,
                "signature": block.reasoning.signature}  # fmt: skip
    if kind == "tool_call":
        call = block.tool_call
        arguments = json.loads(call.arguments_json) if call.arguments_json else {}
        return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}
    if kind == "image":
        image = block.image
        if image.data:
            data = base64.b64encode(image.data).decode("ascii")
            source: JSON = {"type": "base64", "media_type": image.media_type, "data": data}
        elif image.path:
            source = {"type": "url", "url": image.path}
        else:
            raise ValueError(f"image {image.attachment_id or image.name or '?'!r} has no data")
        return {"type": "image", "source": source}
    raise ValueError(f"content block {kind!r} has no Anthropic form")


def _as_blocks(content: str | list[JSON]) -> list[JSON]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _as_text(blocks: list[JSON]) -> str | list[JSON]:
    """One text block renders as its string (the form typed prompts and tool output take)."""
    if len(blocks) == 1 and blocks[0].get("type") == "text":
        return str(blocks[0]["text"])
    return blocks
