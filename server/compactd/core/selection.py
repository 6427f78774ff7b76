"""Range selection: which contiguous surface span a compaction replaces.

A span starts at the first node that is not a ``system/message``: the system head at position 0
and any system/message right after it are never selected, a ``system/message`` after other
history is ordinary history. It ends where the recent tail begins. It is cut only at
unit boundaries: a tool call and *all* of its current results form one indivisible unit, so no
cut separates them and no unanswered call crosses a cut. This is stricter than
``pairing.balanced_cuts``, which closes a call at its first result; every boundary here is also a
balanced cut there. Turn boundaries protect nothing.

Rules this module decides (documented because the spec leaves them open):

- The last unit is never selected, in either mode: the model continues from real history.
- A span that is only one previous checkpoint is not selected (re-summarizing a lone summary
  frees nothing); a single ordinary node, or a previous checkpoint together with newer nodes, is.
- Any unanswered call on the surface (an open indivisible tail) declines the whole selection.
- A span priced below ``min_span_tokens`` (the minimum useful checkpoint, see
  ``gate.minimum_useful_span``) is declined: its checkpoint could not be smaller. Overflow
  recovery passes 0.

Selection never raises for "nothing to do": it returns ``Declined`` with a code and a reason.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

from compactd.core import events as ev
from compactd.core.fold import SessionFold
from compactd.core.surface import SurfaceNode
from compactd.v1 import events_pb2


class SelectionMode(enum.Enum):
    """How far a span may reach."""

    PRESSURE = "pressure"  # keep at least the newest retained-budget tokens verbatim
    MAXIMAL = "maximal"  # overflow and on-demand: everything selectable but the last unit


class Revalidation(enum.Enum):
    """What must be unchanged when a summary returns, for the span to be committed."""

    WHOLE_SURFACE = "whole_surface"  # automatic brackets: no surface change at all
    SELECTED_SPAN = "selected_span"  # manual brackets: the span's nodes, in place


class DeclineCode(enum.StrEnum):
    """Why nothing was selected."""

    OPEN_TAIL = "OPEN_TAIL"
    NOTHING_SELECTABLE = "NOTHING_SELECTABLE"
    SPAN_TOO_SMALL = "SPAN_TOO_SMALL"
    KNOWN_FAILURE = "KNOWN_FAILURE"  # the caller's failure memory holds this span back
    FLOOR_ABOVE_TRIGGER = "FLOOR_ABOVE_TRIGGER"  # no compaction can bring pressure below it
    SPAN_CHANGED = "SPAN_CHANGED"  # a summary prepared ahead no longer fits its span (core.ahead)


@dataclass(frozen=True, slots=True)
class Selection:
    """A selected span: surface positions (inclusive), its end seqs, every node's seq, its price."""

    start_position: int
    end_position: int
    start_seq: int
    end_seq: int
    shadowed_seqs: tuple[int, ...]
    shadowed_price: int  # route price of the span

    @property
    def count(self) -> int:
        """How many surface nodes the span covers."""
        return len(self.shadowed_seqs)


@dataclass(frozen=True, slots=True)
class Declined:
    """Nothing was selected: the caller writes nothing to the log and reports ``reason``.

    ``cause``: for ``KNOWN_FAILURE``, the reason the span's bracket failed with before
    (``SUMMARY_NOT_SMALLER``, say): what holds it back, reported as that failure; "" else.
    """

    code: DeclineCode
    reason: str
    cause: str = ""


@dataclass(frozen=True, slots=True)
class SurfaceSnapshot:
    """The surface when a bracket started: ``drift`` compares its change count."""

    changes: int


def select_range(
    fold: SessionFold,
    price: Callable[[SurfaceNode], int],
    *,
    mode: SelectionMode,
    retained_budget: int = 0,
    min_span_tokens: int = 0,
    span_price: Callable[[Sequence[SurfaceNode]], int] | None = None,
) -> Selection | Declined:
    """Select the oldest replaceable span of ``fold``'s surface.

    Args:
        fold: The session state; only its surface is read.
        price: The route price of one node (tokens).
        mode: PRESSURE keeps the newest ``retained_budget`` tokens; MAXIMAL ignores the budget.
        retained_budget: Tokens of recent history to keep verbatim (PRESSURE only).
        min_span_tokens: The smallest span worth a bracket (0: any).
        span_price: The summed ``price`` of the span's nodes, in one call (default: ``price``
            node by node).

    Returns:
        The span, or ``Declined`` when there is an open tail or nothing worth selecting.
    """
    surface = fold.surface
    nodes = surface.nodes
    unanswered = surface.unanswered_calls()
    if unanswered:
        return Declined(
            DeclineCode.OPEN_TAIL,
            f"tool call(s) {', '.join(sorted(unanswered))} still wait for results",
        )
    start = head_length(nodes)
    # Cuts are read from the end back to the span's end only: the cost is the retained tail and
    # the last unit, not the surface (whose head was condensed long ago).
    cuts = boundaries_from_end(fold)
    limit = next((cut for cut, bound in cuts if bound and cut < len(nodes)), 0)
    if mode is SelectionMode.PRESSURE:
        limit = min(limit, _retained_tail_start(nodes, price, retained_budget))
    end = _last_boundary_at_or_before(boundaries_from_end(fold), limit, start)
    if end <= start:
        reason = _nothing_reason(mode, retained_budget, empty=start >= len(nodes))
        return Declined(DeclineCode.NOTHING_SELECTABLE, reason)
    if end - start == 1 and ev.checkpoint_compaction_id(nodes[start].event):
        return Declined(
            DeclineCode.NOTHING_SELECTABLE, "only the previous checkpoint could be selected"
        )
    chosen = _selection(nodes[start:end], start, span_price or partial(_summed, price))
    if chosen.shadowed_price < min_span_tokens:
        return Declined(
            DeclineCode.SPAN_TOO_SMALL,
            f"the selectable span ({chosen.count} node(s), {chosen.shadowed_price} tokens) is "
            f"smaller than the minimum useful checkpoint ({min_span_tokens} tokens)",
        )
    return chosen


def last_unit_start(fold: SessionFold) -> int:
    """The position where the last indivisible unit begins: what no compaction replaces (the
    system head's length when the history is one unit)."""
    nodes = fold.surface.nodes
    start = head_length(nodes)
    cut = next((c for c, bound in boundaries_from_end(fold) if bound and c < len(nodes)), 0)
    return max(cut, start)


def head_length(nodes: Sequence[SurfaceNode]) -> int:
    """How many ``system/message`` nodes lead the surface (never selected): the system head at
    position 0 and any system/message right after it, as the reference's range "starts at the
    first surface node that is not a system/message"; 0 when position 0 is another node."""
    length = 0
    while length < len(nodes) and nodes[length].type == ev.SYSTEM_MESSAGE:
        length += 1
    return length


def unit_boundaries(nodes: Sequence[SurfaceNode]) -> list[bool]:
    """Whether each cut ``i`` in ``0..len(nodes)`` (before ``nodes[i]``) is a unit boundary.

    A call at position ``p`` whose last current result is at ``r`` blocks cuts ``p+1..r``; an
    unanswered call blocks every cut after it. A result naming no earlier call is its own unit.
    """
    depth = [0] * (len(nodes) + 2)  # difference array of calls spanning each cut
    for first, last in _call_spans(nodes).values():
        depth[first + 1] += 1
        depth[(len(nodes) if last is None else last) + 1] -= 1
    bounds, spanning = [], 0
    for cut in range(len(nodes) + 1):
        spanning += depth[cut]
        bounds.append(spanning == 0)
    return bounds


def boundaries_from_end(fold: SessionFold) -> Iterator[tuple[int, bool]]:
    """``(cut, is_unit_boundary)`` for cuts ``len(nodes)`` down to 0, as ``unit_boundaries``
    decides them on a surface without unanswered calls; each step reads one node.

    A cut is blocked when a result at or after it answers a call first made before it (a result
    before its call's first maker answers nothing, as in ``unit_boundaries``).
    """
    surface = fold.surface
    nodes = surface.nodes
    lowest = len(nodes)  # the earliest first-call position of the results read so far
    yield len(nodes), True
    for position in range(len(nodes) - 1, -1, -1):
        answers = nodes[position].answers
        if answers:
            made = surface.first_call_position(answers)
            if made is not None and made < min(lowest, position):
                lowest = made
        yield position, lowest >= position


def _last_boundary_at_or_before(cuts: Iterator[tuple[int, bool]], limit: int, start: int) -> int:
    """The largest boundary cut in ``start..limit`` (``start`` when there is none)."""
    for cut, bound in cuts:
        if cut < start:
            break
        if cut <= limit and bound:
            return cut
    return start


def open_calls(nodes: Sequence[SurfaceNode]) -> set[str]:
    """Call ids on the surface that no later result answers yet."""
    return {call for call, (_, last) in _call_spans(nodes).items() if last is None}


def surface_snapshot(fold: SessionFold) -> SurfaceSnapshot:
    """The current surface, for ``still_valid`` with ``Revalidation.WHOLE_SURFACE``: its change
    count (every apply and undo counts), so taking and comparing it costs nothing."""
    return SurfaceSnapshot(fold.surface.changes)


def revalidation_for(trigger: events_pb2.CompactionTrigger.ValueType) -> Revalidation:
    """Manual brackets revalidate the selected span; every automatic trigger the whole surface."""
    if trigger == events_pb2.COMPACTION_TRIGGER_MANUAL:
        return Revalidation.SELECTED_SPAN
    return Revalidation.WHOLE_SURFACE


def drift(
    fold: SessionFold, selection: Selection, snapshot: SurfaceSnapshot, scope: Revalidation
) -> str | None:
    """Why ``selection`` may no longer be committed, or None when it still may.

    WHOLE_SURFACE: any surface change since ``snapshot`` (append or replace) is drift. Image
    offloads are projections, not surface changes, so a recovery offload inside the bracket is
    not drift. SELECTED_SPAN: the span's seqs must still occupy the same contiguous positions,
    with unit boundaries at both ends; appends after the span are allowed.
    """
    if fold.surface.changes == snapshot.changes:
        return None  # the surface the span was selected on, cut as selection cuts it
    if scope is Revalidation.WHOLE_SURFACE:
        return "the surface changed while the summary was written"
    for offset, seq in enumerate(selection.shadowed_seqs):
        if fold.surface.position_of(seq) != selection.start_position + offset:
            return f"node {seq} no longer sits at position {selection.start_position + offset}"
    if not _edges_are_boundaries(fold, selection):
        return "a tool call and its results now cross the span's edge"
    return None


def _edges_are_boundaries(fold: SessionFold, selection: Selection) -> bool:
    nodes = fold.surface.nodes
    if fold.surface.unanswered_calls():
        bounds = unit_boundaries(nodes)  # an open call blocks every cut after it
        return bounds[selection.start_position] and bounds[selection.end_position + 1]
    start, end = selection.start_position, selection.end_position + 1
    for cut, bound in boundaries_from_end(fold):  # from the end back to the span's start only
        if cut in (start, end) and not bound:
            return False
        if cut <= start:
            break
    return True


def still_valid(
    fold: SessionFold, selection: Selection, snapshot: SurfaceSnapshot, scope: Revalidation
) -> bool:
    """Whether ``selection`` may still be committed (see ``drift``)."""
    return drift(fold, selection, snapshot, scope) is None


def _call_spans(nodes: Sequence[SurfaceNode]) -> dict[str, tuple[int, int | None]]:
    """Each call id -> (position of its call, position of its last result or None)."""
    spans: dict[str, tuple[int, int | None]] = {}
    for position, node in enumerate(nodes):
        for call in node.calls:
            spans.setdefault(call, (position, None))
        if node.answers:
            call = node.answers
            if call in spans:
                spans[call] = (spans[call][0], position)
    return spans


def _retained_tail_start(
    nodes: Sequence[SurfaceNode], price: Callable[[SurfaceNode], int], budget: int
) -> int:
    """The position where the newest ``budget`` tokens begin (-1: the surface holds fewer)."""
    kept = 0
    for position in range(len(nodes), 0, -1):
        if kept >= budget:
            return position
        kept += price(nodes[position - 1])
    return 0 if kept >= budget else -1


def _selection(
    span: Sequence[SurfaceNode], start: int, price: Callable[[Sequence[SurfaceNode]], int]
) -> Selection:
    return Selection(
        start_position=start,
        end_position=start + len(span) - 1,
        start_seq=span[0].seq,
        end_seq=span[-1].seq,
        shadowed_seqs=tuple(n.seq for n in span),
        shadowed_price=price(span),
    )


def _summed(price: Callable[[SurfaceNode], int], nodes: Sequence[SurfaceNode]) -> int:
    return sum(price(n) for n in nodes)


def _nothing_reason(mode: SelectionMode, budget: int, *, empty: bool) -> str:
    if empty:
        return "there is no history after the system head"
    if mode is SelectionMode.PRESSURE:
        return (
            f"nothing older than the retained {budget} tokens can be replaced as a whole unit "
            "(the system head is never replaced)"
        )
    return "the history after the system head is a single indivisible unit"
