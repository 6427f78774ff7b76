"""What one append may carry, so that every read of a legal session fits in one gRPC message.

A runtime's batch is bounded per content block, per event and per session surface:

- a content block (text, reasoning, image, tool call) holds at most ``max_block_bytes``;
- an event at most ``max_event_bytes``, so each ``ListEvents`` message fits;
- the surface plus the request header in force at most ``max_surface_bytes`` (as
  ``surface_bytes`` counts them), so ``GetSurface``, ``BuildRequest`` and ``PrepareStep`` always
  fit the message limit; the configuration keeps ``RESPONSE_MARGIN_BYTES`` between the two for
  the rest of a response (reports, warnings, wire framing);
- JSON a provider or summarizer will parse (tool schemas, tool-call arguments) nests at most
  ``max_json_depth`` levels;
- token counts (usage, output reservations) are at most ``MAX_TOKEN_COUNT``, so sums of them
  stay far inside the wire's int64.
"""

from __future__ import annotations

import re
from collections.abc import Set
from dataclasses import dataclass
from typing import Final

from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.core.projection import offload_placeholder

MIB: Final = 1 << 20
#: Room a response needs beyond the surface it carries (reports, warnings, framing).
RESPONSE_MARGIN_BYTES: Final = MIB
#: The largest token count an event may state (10^12: any real window fits many times over).
MAX_TOKEN_COUNT: Final = 10**12
#: Bytes a surface node adds in a read beyond its event: position, seq, type, message framing.
NODE_OVERHEAD_BYTES: Final = 128
#: Framing of a placeholder text block (block and text tags and lengths).
PLACEHOLDER_FRAMING_BYTES: Final = 16

# An unterminated string runs to the end (no parser reads past it): each quote then starts one
# scan, never a rescan of the rest, so the sub stays linear on hostile text.
_JSON_STRING = re.compile(r'"(?:[^"\\]+|\\.)*(?:"|\\?\Z)', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


@dataclass(frozen=True, slots=True)
class AppendLimits:
    """Bounds on what a runtime may append (defaults are the documented ones)."""

    max_block_bytes: int = MIB
    max_event_bytes: int = 2 * MIB
    max_surface_bytes: int = 12 * MIB
    max_json_depth: int = 64


DEFAULT_LIMITS: Final = AppendLimits()


def json_depth(text: str) -> int:
    """How deep brackets nest in ``text`` outside JSON strings (valid JSON or not; an
    unterminated string hides the rest).

    Linear and without recursion, so hostile input costs what its length costs.
    """
    depth = deepest = 0
    for match in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(0, depth - 1)
    return deepest


def node_bytes(
    event: SessionEvent, offloaded: Set[int] = frozenset(), *, byte_size: int | None = None
) -> int:
    """An upper bound on the bytes a surface node of ``event`` adds to a read of the surface.

    The node's projected message copies at most the event's content, plus the placeholder text
    of each offloaded image; the node itself adds its position, seq, type and framing.
    ``byte_size`` is ``event.ByteSize()`` when the caller has it already.
    """
    size = (event.ByteSize() if byte_size is None else byte_size) + NODE_OVERHEAD_BYTES
    if offloaded:
        kind = ev.body_name(event)
        images = [b.image for b in getattr(event, kind).content if b.HasField("image")]
        for index in offloaded:
            if 0 <= index < len(images):
                placeholder = offload_placeholder(images[index]).encode("utf-8")
                size += len(placeholder) + PLACEHOLDER_FRAMING_BYTES
    return size
