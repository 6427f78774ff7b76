"""Recall handles: short, stable names of what a compaction took off the surface.

Every checkpoint and every pruned tool result names what it replaced in a handle the model can
quote, ``[recall:c41-9f3a]`` or ``[recall:p17-03bc]``. A handle is a pure function of the log:

- ``c<start>-<check>``: the checkpoint of the bracket whose ``compaction/start`` is at seq
  ``start``; it covers that start's ``shadowed_seqs``. ``check`` is four hex digits of the
  SHA-256 of the kind and the seq, so a misquoted handle does not name another bracket (and the
  same log always gets the same checkpoint bytes: replays and prefix caches see no noise).
- ``p<seq>-<check>``: the pruned result that shadowed the ``tool/result`` node at ``seq``; it
  covers ``[seq]``. ``check`` hashes the seq.

A handle needs no state besides the log: it resolves the same way after a restart, an eviction
and on any replica. Resolving reads one event (``covered_seqs``). The texts here are constants or
pure functions of their inputs, so the same result always gets the same bytes (prefix caches).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Final

from compactd.core.events import SessionEvent
from compactd.v1 import events_pb2

CHECKPOINT: Final = "c"
PRUNED: Final = "p"
_HANDLE = re.compile(r"^(?:\[?recall:)?([cp])(\d{1,19})-([0-9a-f]{4})\]?$")

#: The heading of the section a checkpoint ends with (after its closing tag).
HANDLES_HEADING: Final = "Recall handles"


@dataclass(frozen=True, slots=True)
class Handle:
    """A parsed handle: its kind (``CHECKPOINT`` or ``PRUNED``), its seq and check digits."""

    kind: str
    seq: int
    check: str

    def __str__(self) -> str:
        return f"{self.kind}{self.seq}-{self.check}"


def checkpoint_handle(start_seq: int) -> str:
    """The handle of the checkpoint of the bracket that opened at ``start_seq``."""
    return f"{CHECKPOINT}{start_seq}-{_check(f'{CHECKPOINT}{start_seq}')}"


def prune_handle(shadowed_seq: int) -> str:
    """The handle of the pruned result that shadowed the node at ``shadowed_seq``."""
    return f"{PRUNED}{shadowed_seq}-{_check(f'{PRUNED}{shadowed_seq}')}"


def quoted(handle: str) -> str:
    """A handle as the model sees it: ``[recall:<handle>]``."""
    return f"[recall:{handle}]"


def parse_handle(text: str) -> Handle | None:
    """The handle ``text`` names (bare, ``recall:...`` or ``[recall:...]``); None if malformed."""
    match = _HANDLE.match(text.strip())
    if match is None:
        return None
    return Handle(match.group(1), int(match.group(2)), match.group(3))


def covered_seqs(handle: Handle, event: SessionEvent | None) -> tuple[int, ...] | None:
    """The seqs ``handle`` covers, given the stored event at ``handle.seq`` (None: no such
    event); None when the handle does not name that event (wrong kind or check digits)."""
    if event is None:
        return None
    body = event.WhichOneof("body")
    if handle.kind == CHECKPOINT and body == "compaction_start":
        start = event.compaction_start
        if str(handle) == checkpoint_handle(event.seq):
            return tuple(start.shadowed_seqs)
        return None
    if handle.kind == PRUNED and body == "tool_result" and str(handle) == prune_handle(event.seq):
        return (event.seq,)
    return None


def recall_section(handles: list[str]) -> str:
    """The section a checkpoint ends with: the handles of what it replaced (short: every
    request pays for it; the recall tool's description says what a handle is)."""
    return f"{HANDLES_HEADING}: " + " ".join(quoted(h) for h in handles)


def with_recall_handles(framed: str, handles: list[str]) -> str:
    """``framed`` (``prompts.frame_checkpoint``) followed by its recall section."""
    return f"{framed}\n\n{recall_section(handles)}"


def without_recall_handles(text: str) -> str:
    """``text`` without a trailing recall section (the framed checkpoint it was made from)."""
    cut = text.rfind(f"\n\n{HANDLES_HEADING}: [recall:")
    return text if cut < 0 else text[:cut]


def prune_marker(marker: str, handle: str) -> str:
    """The omission ``marker`` of a pruned result, followed by the result's handle."""
    return f"{marker}{quoted(handle)}\n\n"


#: What the recall tool tells the model: when to call it and what it answers.
RECALL_TOOL_DESCRIPTION: Final = (
    "Fetch the original messages that were condensed or shortened to save context. Older parts "
    "of this conversation may have been replaced by a summary, and long tool outputs cut to "
    "their start and end; each names what it replaced with a handle like [recall:c41-9f3a]. "
    "Call this only when you need an exact detail the summary or the shortened output lacks "
    "(a file's contents, an error message, a command's output). Give the handle, and a query "
    "to get only the lines that contain it; a long answer comes in pages."
)
#: The recall tool's arguments (``handle``, ``query``, ``page``), as a JSON schema.
RECALL_TOOL_SCHEMA: Final = (
    '{"type":"object","properties":{'
    '"handle":{"type":"string","description":"The handle, e.g. c41-9f3a or [recall:c41-9f3a]"},'
    '"query":{"type":"string","description":"Optional: only lines containing this text"},'
    '"page":{"type":"string","description":"Optional: the page token a previous answer gave"}'
    '},"required":["handle"],"additionalProperties":false}'
)


def recall_tool(name: str) -> events_pb2.ToolDeclaration:
    """The recall tool's declaration under ``name`` (the same bytes every time)."""
    return events_pb2.ToolDeclaration(
        name=name, description=RECALL_TOOL_DESCRIPTION, input_schema_json=RECALL_TOOL_SCHEMA
    )


def _check(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:4]


#: The longest handle a seq can give (seqs are int64): what thresholds reserve room for.
LONGEST_PRUNE_HANDLE: Final = prune_handle(2**63 - 1)
