"""Tool pairing: where the surface can be cut without separating a call from its results.

Tool calls are blocks inside ``assistant/message`` nodes; results are ``tool/result`` nodes that
name the call id. A cut between two surface positions is *balanced* when every call before it
has its result before it. A call and all of its results form one indivisible unit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from compactd.core.events import SessionEvent, body_name, tool_call_ids
from compactd.errors import InvalidArgument
from compactd.reasons import Reason


class CorruptPairing(InvalidArgument):
    """A ``tool/result`` answers a call that no earlier surface node made."""

    reason = Reason.TOOL_RESULT_WITHOUT_CALL


def balanced_cuts(events: Sequence[SessionEvent]) -> list[bool]:
    """Whether each cut ``i`` in ``0..len(events)`` (before ``events[i]``) is balanced.

    ``result[0]`` (before everything) and a cut with no open call are balanced. Raises
    ``CorruptPairing`` when a result names a call that no earlier node made.
    """
    cuts = [True]
    open_calls: set[str] = set()
    seen_calls: set[str] = set()
    for event in events:
        _advance(event, open_calls, seen_calls)
        cuts.append(not open_calls)
    return cuts


def open_calls_after(events: Iterable[SessionEvent]) -> set[str]:
    """The call ids still waiting for a result after ``events`` (an open indivisible tail)."""
    open_calls: set[str] = set()
    seen_calls: set[str] = set()
    for event in events:
        _advance(event, open_calls, seen_calls)
    return open_calls


def is_balanced_cut(events: Sequence[SessionEvent], index: int) -> bool:
    """Whether cutting before ``events[index]`` is balanced (``0 <= index <= len(events)``)."""
    return not open_calls_after(events[:index])


def _advance(event: SessionEvent, open_calls: set[str], seen_calls: set[str]) -> None:
    kind = body_name(event)
    if kind == "assistant_message":
        for call_id in tool_call_ids(event):
            open_calls.add(call_id)
            seen_calls.add(call_id)
    elif kind == "tool_result":
        call_id = event.tool_result.tool_call_id
        if call_id not in seen_calls:
            raise CorruptPairing(
                f"tool/result answers call id {call_id!r} that no earlier node made"
            )
        # Several results may answer one call; the unit closes at the first.
        open_calls.discard(call_id)
