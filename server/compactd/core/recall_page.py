"""Pages of recalled events: what ``Recall`` answers, bounded in bytes, and its text for a model.

A ``Pager`` takes the covered events in seq order and keeps those that fit ``max_bytes`` (the
serialized size of the ``RecalledEvent``s). An event larger than a whole page is cut into pieces
by its text (its text blocks joined, counted in code points); its other blocks (tool calls,
images, reasoning) travel with the first piece. With a query, an event becomes its matching
lines, and a piece is a run of them. Where the next page starts is a ``Cursor``, carried in an
opaque page token bound to the request it was issued for.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.core.projection import project
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as pb

DEFAULT_MAX_BYTES: Final = 65536
MIN_MAX_BYTES: Final = 1024
MAX_MAX_BYTES: Final = 1048576
MAX_SEQS: Final = 1000
_TOKEN_PREFIX: Final = "recall1"
_ROLES: Final = {
    pb.MESSAGE_ROLE_SYSTEM: "system",
    pb.MESSAGE_ROLE_DEVELOPER: "developer",
    pb.MESSAGE_ROLE_USER: "user",
    pb.MESSAGE_ROLE_ASSISTANT: "assistant",
    pb.MESSAGE_ROLE_TOOL: "tool",
}


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a page starts: the index of an event among the covered seqs, and the offset in it
    (code points of text, or lines with a query) already sent."""

    index: int = 0
    offset: int = 0


def page_size(max_bytes: int) -> int:
    """The page's byte bound for a request's ``max_bytes`` (0: the default; clamped)."""
    if max_bytes == 0:
        return DEFAULT_MAX_BYTES
    return min(max(max_bytes, MIN_MAX_BYTES), MAX_MAX_BYTES)


def digest(event: SessionEvent) -> str:
    """Hex SHA-256 of an event's stored bytes (the store keeps the deterministic serialization)."""
    return hashlib.sha256(event.SerializeToString(deterministic=True)).hexdigest()


def fingerprint(handle: str, seqs: Sequence[int], query: str) -> str:
    """What a page token is bound to: the same handle (or seqs) and query."""
    text = json.dumps([handle, list(seqs), query])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def page_token(cursor: Cursor, bound: str) -> str:
    """The opaque token of the page at ``cursor`` for the request ``bound`` names."""
    text = f"{_TOKEN_PREFIX}:{cursor.index}:{cursor.offset}:{bound}"
    return base64.urlsafe_b64encode(text.encode()).decode()


def cursor_of(token: str, bound: str) -> Cursor | None:
    """The cursor a page token carries; None when it is not one issued for ``bound``."""
    if not token:
        return Cursor()
    try:
        prefix, index, offset, issued = base64.urlsafe_b64decode(token.encode()).decode().split(":")
        cursor = Cursor(int(index), int(offset))
    except (ValueError, UnicodeError):
        return None
    if prefix != _TOKEN_PREFIX or issued != bound or cursor.index < 0 or cursor.offset < 0:
        return None
    return cursor


class Pager:
    """Fills one page from ``start``: feed the covered events in order with ``add`` until it
    answers False (the page is full, ``next`` says where the next one starts)."""

    def __init__(self, start: Cursor, max_bytes: int, query: str = "") -> None:
        self.events: list[pb.RecalledEvent] = []
        self.next: Cursor | None = None
        self._index, self._offset = start.index, start.offset
        self._room = max_bytes
        self._query = query.casefold()

    def add(self, event: SessionEvent) -> bool:
        """Put ``event`` (the next covered one) on the page, whole or its first piece that fits.

        Returns False when the page is full: ``next`` is then where the next page starts.
        """
        offset, self._offset = self._offset, 0
        whole = self._recalled(event, offset)
        if whole is None:  # nothing matches the query
            self._index += 1
            return True
        size = whole.ByteSize()
        if size <= self._room:
            self.events.append(whole)
            self._room -= size
            self._index += 1
            return True
        if self.events:
            self.next = Cursor(self._index, offset)
            return False
        piece, cut = self._piece(event, offset)
        self.events.append(piece)
        self.next = Cursor(self._index, cut)
        return False

    def finish(self, covered: int) -> None:
        """Close the page after the last fed event; ``covered``: how many events there are."""
        if self.next is None and self._index < covered:
            self.next = Cursor(self._index, self._offset)

    def _recalled(
        self, event: SessionEvent, offset: int, stop: int | None = None
    ) -> pb.RecalledEvent | None:
        recalled = pb.RecalledEvent(seq=event.seq, type=ev.event_type(event), sha256=digest(event))
        message = project(event)
        if self._query:
            lines = _matching_lines(message, self._query) if message is not None else []
            if not lines:
                return None
            recalled.lines.extend(lines[offset:stop])
            recalled.offset = offset
            recalled.truncated = stop is not None and stop < len(lines)
            return recalled
        if message is not None:
            recalled.message.CopyFrom(_text_slice(message, offset, stop))
            recalled.offset = offset
            recalled.truncated = stop is not None and stop < _text_length(message)
        return recalled

    def _piece(self, event: SessionEvent, offset: int) -> tuple[pb.RecalledEvent, int]:
        """The largest piece of ``event`` from ``offset`` that fits an empty page (at least one
        code point or line, so paging always moves on), and where the next piece starts."""
        low, high = offset + 1, offset + 1
        while True:  # grow, then bisect: the fitting stop is in [low, high]
            piece = self._recalled(event, offset, high)
            if piece is None or piece.ByteSize() > self._room or not piece.truncated:
                break
            low, high = high, offset + 2 * (high - offset)
        while low < high:
            middle = (low + high + 1) // 2
            piece = self._recalled(event, offset, middle)
            if piece is not None and piece.ByteSize() <= self._room:
                low = middle
            else:
                high = middle - 1
        best = self._recalled(event, offset, low)
        assert best is not None
        return best, low


def _text_length(message: pb.Message) -> int:
    return sum(len(block.text.text) for block in message.content if block.HasField("text"))


def _text_slice(message: pb.Message, start: int, stop: int | None) -> pb.Message:
    """``message`` with only code points ``[start, stop)`` of its joined text blocks; its other
    blocks are kept in the piece that starts at 0."""
    if start == 0 and stop is None:
        return message
    piece = pb.Message()
    piece.CopyFrom(message)
    del piece.content[:]
    offset = 0
    for block in message.content:
        if not block.HasField("text"):
            if start == 0:
                piece.content.add().CopyFrom(block)
            continue
        text = block.text.text
        begin, end = offset, offset + len(text)
        offset = end
        kept = text[max(start - begin, 0) : len(text) if stop is None else max(stop - begin, 0)]
        if kept:
            piece.content.add(text=events_pb2.TextBlock(text=kept))
    return piece


def _matching_lines(message: pb.Message, query: str) -> list[pb.RecalledLine]:
    found = []
    for index, block in enumerate(message.content):
        kind = block.WhichOneof("block")
        if kind == "text":
            text = block.text.text
        elif kind == "tool_call":
            text = block.tool_call.arguments_json
        else:
            continue
        for number, line in enumerate(text.split("\n"), start=1):
            if query in line.casefold():
                found.append(pb.RecalledLine(block=index, line=number, text=line))
    return found


def render(label: str, seqs: Sequence[int], events: Sequence[pb.RecalledEvent], more: str) -> str:
    """A page as text for a model: a heading, each event under a ``--- seq N · role ---`` line,
    and how to ask for the next page (``more``: its token, empty on the last page)."""
    parts = [f"{label} holds {len(seqs)} original event(s)."]
    for item in events:
        parts.append(_render_event(item))
    if not events:
        parts.append("(nothing on this page)")
    if more:
        parts.append(f'--- more on the next page: call recall again with page "{more}" ---')
    return "\n".join(parts)


def _render_event(item: pb.RecalledEvent) -> str:
    head = f"--- seq {item.seq} · {_who(item)}"
    if item.offset:
        head += f" (continued from {item.offset})"
    lines = [head + " ---"]
    if item.lines:
        lines.extend(f"[block {line.block} line {line.line}] {line.text}" for line in item.lines)
    elif item.HasField("message"):
        lines.extend(_render_block(block) for block in item.message.content)
    else:
        lines.append(f"({item.type})")
    if item.truncated:
        lines.append("(continues on the next page)")
    return "\n".join(lines)


def _who(item: pb.RecalledEvent) -> str:
    if not item.HasField("message"):
        return item.type
    message = item.message
    role = _ROLES.get(message.role, item.type)
    if message.role == pb.MESSAGE_ROLE_TOOL:
        error = ", error" if message.is_error else ""
        return f"tool result {message.name or 'tool'} ({message.tool_call_id}{error})"
    return role


def _render_block(block: events_pb2.ContentBlock) -> str:
    kind = block.WhichOneof("block")
    if kind == "text":
        return block.text.text
    if kind == "tool_call":
        call = block.tool_call
        return f"[tool call {call.name} ({call.id})] {call.arguments_json}"
    if kind == "reasoning":
        return f"[reasoning] {block.reasoning.text}"
    if kind == "image":
        image = block.image
        return f"[image {image.name or image.attachment_id or image.path or 'inline'}]"
    return ""
