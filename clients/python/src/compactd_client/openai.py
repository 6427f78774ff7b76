"""OpenAI chat completions ⇄ compactd: messages and tools to events, requests to bodies.

Import a conversation a runtime holds as OpenAI chat messages::

    events = openai.events_from_messages(messages, tools=tools, provider="openai", model="gpt-4o")
    client.append_events(session_id, events)

and send what compactd rebuilt (after compaction, the checkpoint included)::

    body = openai.request_body(client.build_request(session_id))   # POST /v1/chat/completions
    reply = ...                                                      # the provider's answer
    client.append_events(session_id, [step_start(t, s), openai.assistant_event(reply), ...])

The mapping, both ways (``messages_from_events`` renders events back; import then render gives
the original messages):

* ``system`` and ``developer`` messages: ``system/message`` and ``developer/message`` (text; a list
  of text parts is joined with a blank line);
* ``user``: ``user/message``; a string is one text block; ``text`` and ``image_url`` parts are
  text and image blocks (a ``data:`` URL inline, any other URL kept as the image's ``path``);
* ``assistant``: ``assistant/message`` inside a ``step/start``/``step/end`` of a turn: reasoning
  (``reasoning_content``), then the text (``""`` kept as an empty text block), then the tool
  calls, ids and argument text exactly as sent;
* ``tool``: ``tool/result`` answering its ``tool_call_id`` (its tool name taken from the call);
* tools: ``request/header`` tool declarations (name, description, JSON Schema parameters);
* pins: a rebuilt request's pinned-state message (``Message.pinned_state``, the pins in force)
  renders as a ``system`` message right after the system head; importing messages skips a
  system message that is exactly a ``<pinned-state>`` block, so pins never enter the
  conversation's own messages (log them with ``events.pin``).

Rendering follows compactd's own wire encoding (the server's summary requests use the same), so
a request body built here is a byte-identical prefix of the summary request and the provider's
prompt cache is reused: several text blocks join with a blank line, an assistant message with
tool calls and no text has ``content: null``, and ``reasoning_content`` is sent back only when
asked (``include_reasoning``: DeepSeek's thinking mode with tools wants it). Not carried: a
message's ``name``, image ``detail``, ``tool_calls`` of other types than ``function``, refusals
and audio; an unknown role or part is a ``ValueError`` naming it.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from compactd_client import _project
from compactd_client._timeline import Timeline
from compactd_client.events import request_header
from compactd_client.v1.events_pb2 import (
    AssistantMessage,
    ContentBlock,
    DeveloperMessage,
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
    MESSAGE_ROLE_USER,
    BuildRequestResponse,
    Message,
)

__all__ = [
    "assistant_event",
    "declarations",
    "encode_message",
    "events_from_messages",
    "messages_from_events",
    "request_body",
    "tools",
]

JSON = dict[str, Any]
_JOIN = "\n\n"
_DATA_URL = re.compile(r"^data:([^;,]+);base64,(.*)$", re.DOTALL)


# ---- messages and tools to events ------------------------------------------------------------


def events_from_messages(
    messages: Iterable[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    provider: str = "",
    model: str = "",
    first_turn: int = 1,
    close_turn: bool = True,
) -> list[SessionEvent]:
    """The events that log ``messages`` (OpenAI chat messages) as a valid compactd log.

    Args:
        messages: Chat-completions messages, in order.
        tools: The request's ``tools``; with ``provider``/``model`` they make a ``request/header``
            (logged after a leading system message).
        provider: The route's provider (``request/header``; empty logs no header).
        model: The route's model.
        first_turn: Number of the first turn opened.
        close_turn: Close the last turn (``turn/end``, reason ``imported``); False leaves it open
            for the runtime to continue.

    Raises:
        ValueError: A role, part or tool-call type the mapping does not carry (named).
    """
    timeline = Timeline(first_turn)
    names: dict[str, str] = {}
    header = request_header(provider, model, tools=declarations(tools or ())) if model else None
    for index, message in enumerate(messages):
        role = message.get("role")
        if header is not None and role not in ("system", "developer"):
            timeline.other(header)
            header = None
        if role == "system" and _project.is_pins(_text(message)):
            continue  # the pinned-state message of a rebuilt request: compactd renders it
        if role == "system":
            timeline.other(SessionEvent(system_message=SystemMessage(text=_text(message))))
        elif role == "developer":
            timeline.other(SessionEvent(developer_message=DeveloperMessage(text=_text(message))))
        elif role == "user":
            blocks = _parts(message.get("content"), f"messages[{index}]")
            timeline.user(SessionEvent(user_message=UserMessage(content=blocks)))
        elif role == "assistant":
            event = _assistant(message, index)
            names.update((b.tool_call.id, b.tool_call.name) for b in event.assistant_message.content
                         if b.HasField("tool_call"))  # fmt: skip
            timeline.assistant(event)
        elif role == "tool":
            call_id = str(message.get("tool_call_id", ""))
            blocks = _parts(message.get("content"), f"messages[{index}]")
            result = ToolResult(tool_call_id=call_id, tool_name=names.get(call_id, ""),
                                content=blocks)  # fmt: skip
            timeline.other(SessionEvent(tool_result=result))
        else:
            raise ValueError(f"messages[{index}]: role {role!r} is not carried")
    if header is not None:
        timeline.other(header)
    return timeline.finish(close_turn)


def declarations(tools: Iterable[Mapping[str, Any]]) -> list[ToolDeclaration]:
    """``request/header`` tool declarations of OpenAI ``tools`` (function tools)."""
    declared = []
    for index, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, Mapping):
            raise ValueError(f"tools[{index}]: only function tools are carried")
        schema = function.get("parameters")
        declared.append(
            ToolDeclaration(
                name=str(function.get("name", "")),
                description=str(function.get("description", "")),
                input_schema_json=_dumps(schema) if schema is not None else "",
            )
        )
    return declared


def assistant_event(completion: Mapping[str, Any], *, provider: str = "") -> SessionEvent:
    """The ``assistant/message`` of a chat completion (its first choice), with its usage.

    Usage is split as compactd records it: cached prompt tokens apart from the others.
    """
    choice = completion["choices"][0]
    event = _assistant(choice["message"], 0)
    reply = event.assistant_message
    reply.provider, reply.model = provider, str(completion.get("model", ""))
    reply.stop_reason = str(choice.get("finish_reason") or "")
    usage = completion.get("usage")
    if isinstance(usage, Mapping):
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
        reply.usage.CopyFrom(
            Usage(
                input_tokens=int(usage.get("prompt_tokens") or 0) - cached,
                cache_read_tokens=cached,
                output_tokens=int(usage.get("completion_tokens") or 0),
                reasoning_tokens=int(reasoning),
            )
        )
    return event


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return _JOIN.join(str(part.get("text", "")) for part in content)
    return "" if content is None else str(content)


def _parts(content: Any, where: str) -> list[ContentBlock]:
    if content is None:
        return []
    if isinstance(content, str):
        return [ContentBlock(text=TextBlock(text=content))]
    blocks = []
    for index, part in enumerate(content):
        kind = part.get("type")
        if kind == "text":
            blocks.append(ContentBlock(text=TextBlock(text=part.get("text", ""))))
        elif kind == "image_url":
            blocks.append(ContentBlock(image=_image(part["image_url"]["url"])))
        else:
            raise ValueError(f"{where}.content[{index}]: part type {kind!r} is not carried")
    return blocks


def _image(url: str) -> ImageBlock:
    inline = _DATA_URL.match(url)
    if inline is None:
        return ImageBlock(path=url)
    data = base64.b64decode(inline.group(2))
    return ImageBlock(media_type=inline.group(1), data=data, size_bytes=len(data))


def _assistant(message: Mapping[str, Any], index: int) -> SessionEvent:
    blocks: list[ContentBlock] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        blocks.append(ContentBlock(reasoning=ReasoningBlock(text=reasoning)))
    content = message.get("content")
    if isinstance(content, list):
        blocks += _parts([p for p in content if p.get("type") != "refusal"], f"messages[{index}]")
    elif content is not None:
        blocks.append(ContentBlock(text=TextBlock(text=str(content))))
    for number, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ValueError(f"messages[{index}].tool_calls[{number}]: not a function call")
        block = ToolCallBlock(id=str(call.get("id", "")), name=str(function.get("name", "")),
                              arguments_json=str(function.get("arguments") or ""))  # fmt: skip
        blocks.append(ContentBlock(tool_call=block))
    return SessionEvent(assistant_message=AssistantMessage(content=blocks))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ---- events and requests to messages ---------------------------------------------------------


def messages_from_events(
    events: Iterable[SessionEvent], *, include_reasoning: bool = False
) -> list[JSON]:
    """The chat messages of an append-only log's surface events (see ``_project``)."""
    return [
        encode_message(m, include_reasoning=include_reasoning) for m in _project.messages(events)
    ]


def request_body(
    request: BuildRequestResponse,
    *,
    include_reasoning: bool = False,
    developer_role: str = "developer",
    stream: bool | None = None,
) -> JSON:
    """A ready chat-completions body for what ``BuildRequest`` answered.

    ``model``, ``messages``, then ``tools``, ``max_tokens``, ``temperature`` and ``top_p`` when the
    header set them, and the header's ``extra`` keys; ``stream`` when given.
    """
    config = request.config
    body: JSON = {
        "model": config.model,
        "messages": [
            encode_message(m, include_reasoning=include_reasoning, developer_role=developer_role)
            for m in request.messages
        ],
    }
    if request.tools:
        body["tools"] = tools(request.tools)
    if config.HasField("max_output_tokens"):
        body["max_tokens"] = config.max_output_tokens
    _project.add_settings(body, config, stream)
    return body


def tools(declared: Iterable[ToolDeclaration]) -> list[JSON]:
    """OpenAI ``tools`` of ``request/header`` tool declarations."""
    rendered = []
    for tool in declared:
        function: JSON = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        schema = json.loads(tool.input_schema_json) if tool.input_schema_json else None
        function["parameters"] = schema if schema is not None else {"type": "object",
                                                                    "properties": {}}  # fmt: skip
        rendered.append({"type": "function", "function": function})
    return rendered


def encode_message(
    message: Message, *, include_reasoning: bool = False, developer_role: str = "developer"
) -> JSON:
    """One compactd ``Message`` as a chat message (compactd's wire encoding)."""
    role = message.role
    if role in (MESSAGE_ROLE_SYSTEM, MESSAGE_ROLE_DEVELOPER):
        wire = "system" if role == MESSAGE_ROLE_SYSTEM else developer_role
        return {"role": wire, "content": _JOIN.join(b.text.text for b in message.content)}
    if role == MESSAGE_ROLE_USER:
        return {"role": "user", "content": _content(message.content, allow_empty=False)}
    if role == MESSAGE_ROLE_ASSISTANT:
        return _encode_assistant(message, include_reasoning)
    if role == MESSAGE_ROLE_TOOL:
        return {"role": "tool", "tool_call_id": message.tool_call_id,
                "content": _content(message.content, allow_empty=True)}  # fmt: skip
    raise ValueError(f"message role {role} has no chat role")


def _content(blocks: Sequence[ContentBlock], *, allow_empty: bool) -> str | list[JSON]:
    if all(b.HasField("text") for b in blocks) and (blocks or allow_empty):
        return _JOIN.join(b.text.text for b in blocks)
    parts: list[JSON] = []
    for block in blocks:
        if block.HasField("text"):
            parts.append({"type": "text", "text": block.text.text})
        elif block.HasField("image"):
            parts.append({"type": "image_url", "image_url": {"url": image_url(block.image)}})
        else:
            raise ValueError(f"a user or tool message cannot carry {block.WhichOneof('block')}")
    return parts


def image_url(image: ImageBlock) -> str:
    """A ``data:`` URL of an inline image, else its ``path`` (a URL the provider can fetch)."""
    if image.data:
        return f"data:{image.media_type};base64,{base64.b64encode(image.data).decode('ascii')}"
    if image.path:
        return image.path
    raise ValueError(f"image {image.attachment_id or image.name or '?'!r} has no data and no URL")


def _encode_assistant(message: Message, include_reasoning: bool) -> JSON:
    texts = [b.text.text for b in message.content if b.HasField("text")]
    reasoning = [b.reasoning.text for b in message.content if b.HasField("reasoning")]
    calls = [
        {"id": b.tool_call.id, "type": "function",
         "function": {"name": b.tool_call.name, "arguments": b.tool_call.arguments_json}}
        for b in message.content
        if b.HasField("tool_call")
    ]  # fmt: skip
    content = _JOIN.join(texts) if texts else (None if calls else "")
    encoded: JSON = {"role": "assistant", "content": content}
    if include_reasoning and reasoning:
        encoded["reasoning_content"] = _JOIN.join(reasoning)
    if calls:
        encoded["tool_calls"] = calls
    return encoded
