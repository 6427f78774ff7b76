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
