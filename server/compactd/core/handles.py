"""Open handles: what a checkpoint must carry verbatim because the work still refers to it.

When a bracket commits, ``open_handles(fold, nodes)`` lists, in a fixed order:

- every sub-agent started (``subagent/start``) and not ended, oldest first: the model must still
  expect its result;
- every tool call the shadowed ``nodes`` make that no current node answers (a call still
  waiting for its result), in span order;
- the keys of the pins in force (their text stays in the pinned-state message).

``prompts.open_handles_section`` renders them as the checkpoint's "Open Handles" section, which
compactd writes itself after the summary: no summarizer can drop one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from compactd.core.fold import OpenSubagent, SessionFold
from compactd.core.surface import SurfaceNode


@dataclass(frozen=True)
class OpenHandles:
    """The handles a checkpoint re-emits (see the module docstring).

    Attributes:
        subagents: (child session id, its start) pairs, oldest start first.
        calls: (call id, tool name) of the span's calls still without a result, in span order.
        pins: Keys of the pins in force, in key order.
    """

    subagents: tuple[tuple[str, OpenSubagent], ...] = ()
    calls: tuple[tuple[str, str], ...] = ()
    pins: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.subagents or self.calls or self.pins)


def open_handles(fold: SessionFold, nodes: Iterable[SurfaceNode]) -> OpenHandles:
    """The handles open when a checkpoint replaces ``nodes`` (current nodes of ``fold``)."""
    unanswered = fold.surface.unanswered_calls()
    calls: list[tuple[str, str]] = []
    for node in nodes:
        if not set(node.calls) & unanswered:
            continue
        for block in node.event.assistant_message.content:
            if block.HasField("tool_call") and block.tool_call.id in unanswered:
                calls.append((block.tool_call.id, block.tool_call.name))
    subagents = sorted(fold.open_subagents.items(), key=lambda item: item[1].seq)
    return OpenHandles(tuple(subagents), tuple(calls), tuple(sorted(fold.pins)))
