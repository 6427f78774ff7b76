"""The model-visible messages of logged events, as compactd's own ``Message``s.

``messages(events)`` projects each surface event of an append-only log (the events a converter
made, or a runtime appended) the way the server's ``BuildRequest`` does, without the surface fold:
no REPLACE, no image offload, and empty system or assistant messages are kept. For the surface of
a compacted session, render ``BuildRequest``'s messages instead (``openai.request_body``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format

from compactd_client.v1.events_pb2 import ContentBlock, RequestConfig, SessionEvent, TextBlock
from compactd_client.v1.session_service_pb2 import (
    MESSAGE_ROLE_ASSISTANT,
    MESSAGE_ROLE_DEVELOPER,
    MESSAGE_ROLE_SYSTEM,
    MESSAGE_ROLE_TOOL,
    MESSAGE_ROLE_USER,
    Message,
)


def message(event: SessionEvent) -> Message | None:
    """The message a surface event shows the model; None for log-only events."""
    kind = event.WhichOneof("body")
    if kind == "system_message":
        text = ContentBlock(text=TextBlock(text=event.system_message.text))
        return Message(role=MESSAGE_ROLE_SYSTEM, content=[text])
    if kind == "developer_message":
        text = ContentBlock(text=TextBlock(text=event.developer_message.text))
        return Message(role=MESSAGE_ROLE_DEVELOPER, content=[text])
    if kind == "user_message":
        return Message(role=MESSAGE_ROLE_USER, content=event.user_message.content)
    if kind == "assistant_message":
        return Message(role=MESSAGE_ROLE_ASSISTANT, content=event.assistant_message.content)
    if kind == "tool_result":
        result = event.tool_result
        return Message(
            role=MESSAGE_ROLE_TOOL,
            content=result.content,
            tool_call_id=result.tool_call_id,
            is_error=result.is_error,
            name=result.tool_name,
        )
    return None


def messages(events: Iterable[SessionEvent]) -> list[Message]:
    """The messages of ``events``, in log order (see the module docstring)."""
    return [m for m in (message(e) for e in events) if m is not None]


#: The tags of the pinned-state message a rebuilt request holds (``Message.pinned_state``).
PINS_OPEN_TAG = "<pinned-state>"
PINS_CLOSE_TAG = "</pinned-state>"


def without_pins(text: str) -> str:
    """``text`` (a system text) without a pinned-state block a rendered request put in it, and
    the blank line before it: pins are the runtime's task state, not the conversation's system
    prompt, and compactd renders them itself."""
    start = text.find(PINS_OPEN_TAG)
    end = text.find(PINS_CLOSE_TAG, start) if start >= 0 else -1
    if end < 0:
        return text
    before, after = text[:start].rstrip("\n"), text[end + len(PINS_CLOSE_TAG) :].lstrip("\n")
    return f"{before}\n\n{after}" if before and after else before + after


def is_pins(text: str) -> bool:
    """Whether ``text`` is exactly a pinned-state block (the text of ``Message.pinned_state``)."""
    return text.startswith(PINS_OPEN_TAG) and text.endswith(PINS_CLOSE_TAG)


def add_settings(body: dict[str, Any], config: RequestConfig, stream: bool | None) -> None:
    """The header's sampling settings and ``extra`` keys, and ``stream``, into a request body."""
    if config.HasField("temperature"):
        body["temperature"] = config.temperature
    if config.HasField("top_p"):
        body["top_p"] = config.top_p
    if config.HasField("extra"):
        body.update(json_format.MessageToDict(config.extra))
    if stream is not None:
        body["stream"] = stream
