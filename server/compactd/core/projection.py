"""Message projection: the model-visible message of one surface node.

``derive_messages`` turns the surface into system, developer, user, assistant and tool messages
in surface order. Registered projections apply here: an ``image/offload`` mark turns the selected
input images of a node into attachment text while the node and its event stay unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set

from compactd.core.events import SessionEvent
from compactd.v1 import events_pb2, session_service_pb2

Message = session_service_pb2.Message
ContentBlock = events_pb2.ContentBlock


def offload_placeholder(image: events_pb2.ImageBlock) -> str:
    """The text that stands in for an offloaded image: its name and where to read it again."""
    name = image.name or image.attachment_id or "image"
    parts = [f"[image offloaded: {name}"]
    if image.attachment_id:
        parts.append(f"attachment {image.attachment_id}")
    if image.path:
        parts.append(f"read-only path {image.path}")
    return "; ".join(parts) + "]"


def project_content(
    blocks: Iterable[ContentBlock], offloaded: Set[int] = frozenset()
) -> list[ContentBlock]:
    """Copy ``blocks``, replacing the images whose depth-first image index is in ``offloaded``."""
    projected: list[ContentBlock] = []
    image_index = 0
    for block in blocks:
        if block.HasField("image"):
            if image_index in offloaded:
                text = offload_placeholder(block.image)
                block = ContentBlock(text=events_pb2.TextBlock(text=text))
            image_index += 1
        projected.append(block)
    return projected


def project(event: SessionEvent, offloaded: Set[int] = frozenset()) -> Message | None:
    """The message a surface event projects to; None for an empty system or assistant message."""
    projector = _PROJECTORS.get(event.WhichOneof("body"))
    return None if projector is None else projector(event, offloaded)


# One projector per body kind, found by one dict lookup: ``project`` runs once per node of every
# request built (a full request, a summary request's span), so it does no more than each kind
# needs.


def _system(event: SessionEvent, offloaded: Set[int]) -> Message | None:
    text = event.system_message.text
    if not text:
        return None
    message = Message(role=session_service_pb2.MESSAGE_ROLE_SYSTEM)
    message.content.add().text.text = text  # one copy of the text, not one per wrapper
    return message


def _developer(event: SessionEvent, offloaded: Set[int]) -> Message:
    message = Message(role=session_service_pb2.MESSAGE_ROLE_DEVELOPER)
    message.content.add().text.text = event.developer_message.text
    return message


def _user(event: SessionEvent, offloaded: Set[int]) -> Message:
    message = Message(role=session_service_pb2.MESSAGE_ROLE_USER)
    _copy_content(message, event.user_message.content, offloaded)
    return message


def _assistant(event: SessionEvent, offloaded: Set[int]) -> Message | None:
    blocks = event.assistant_message.content
    if _all_empty_text(blocks):
        return None
    message = Message(role=session_service_pb2.MESSAGE_ROLE_ASSISTANT)
    _copy_content(message, blocks, frozenset())
    return message


def _tool(event: SessionEvent, offloaded: Set[int]) -> Message:
    result = event.tool_result
    message = Message(
        role=session_service_pb2.MESSAGE_ROLE_TOOL,
        tool_call_id=result.tool_call_id,
        is_error=result.is_error,
        name=result.tool_name,
    )
    _copy_content(message, result.content, offloaded)
    return message


_PROJECTORS: dict[str | None, Callable[[SessionEvent, Set[int]], Message | None]] = {
    "system_message": _system,
    "developer_message": _developer,
    "user_message": _user,
    "assistant_message": _assistant,
    "tool_result": _tool,
}


def _copy_content(message: Message, blocks: Iterable[ContentBlock], offloaded: Set[int]) -> None:
    """Copy ``blocks`` into ``message`` as ``project_content`` projects them, each block by
    ``CopyFrom``: a deep copy, where a constructor or ``extend`` merges each block through its
    serialized form (twice the cost on a long text)."""
    add = message.content.add
    images = 0  # depth-first image index of the next image block
    for block in blocks:
        if offloaded and block.HasField("image"):
            images += 1
            if images - 1 in offloaded:
                add().text.text = offload_placeholder(block.image)
                continue
        add().CopyFrom(block)


def derive_messages(
    events: Iterable[tuple[int, SessionEvent]], offloads: Mapping[int, Set[int]]
) -> list[Message]:
    """Messages for ``(seq, event)`` surface nodes in order, with image offloads applied."""
    messages = []
    for seq, event in events:
        message = project(event, offloads.get(seq, frozenset()))
        if message is not None:
            messages.append(message)
    return messages


def _all_empty_text(blocks: Iterable[ContentBlock]) -> bool:
    return not any(block.WhichOneof("block") != "text" or block.text.text for block in blocks)
