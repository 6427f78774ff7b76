"""The bracket's decisions, shared by the real compaction paths and the dry-run plan.

Every compaction path (``PrepareStep``, ``Compact``, overflow recovery, a model switch) decides
the same things: which kind of bracket its trigger opens (``SHAPES``), how a node is priced
(``node_pricer``) and which span it replaces, after a failure memory's say (``choose_span``).
The engine runs these and appends what they decide; ``PlanCompaction`` runs them on the same
fold and appends nothing. To plan the span that follows pruning, the planned prunes are folded
``tentatively``: admitted to the fold, read, and rolled back before anything else can run.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from compactd.core.events import SessionEvent
from compactd.core.fold import AdmittedBatch, SessionFold
from compactd.core.meter import MeteredRoute, SessionMeter, route_price
from compactd.core.selection import (
    DeclineCode,
    Declined,
    Selection,
    SelectionMode,
    select_range,
)
from compactd.core.surface import SurfaceNode
from compactd.v1 import events_pb2


class PlanMode(enum.Enum):
    """The compaction paths."""

    AUTO = "auto"  # PrepareStep above pressure
    MANUAL = "manual"  # Compact
    OVERFLOW = "overflow"  # RecoverFromError for CONTEXT_WINDOW_EXCEEDED
    SWITCH = "switch"  # SwitchModel, or PrepareStep to another route


@dataclass(frozen=True, slots=True)
class BracketShape:
    """What a path's first bracket is.

    Attributes:
        trigger: What ``compaction/start`` records.
        selection: How far the span may reach.
        prunes: Whether the ``[pruner]`` runs first (pressure-qualified paths only).
        window_prunes: Whether tool results too large for the window are pruned too (overflow).
        min_span: Whether selection declines a span below the minimum useful checkpoint.
        guarded: Whether failure memory and the crossing budget apply.
        retry_selection: How far a convergence retry's span may reach (PrepareStep keeps the
            retained budget on every bracket of a crossing; a switch reaches into the tail).
        widens: Whether a pressure selection that finds nothing older than the retained tail is
            widened to the maximal one (a switch: history must get below the destination's
            trigger, and the reference selects the single older unit there).
    """

    trigger: events_pb2.CompactionTrigger.ValueType
    selection: SelectionMode
    prunes: bool
    window_prunes: bool
    min_span: bool
    guarded: bool
    retry_selection: SelectionMode | None = None
    widens: bool = False

    def selection_for(self, attempt: int) -> SelectionMode:
        """The selection of the bracket ``attempt`` (from 0) of a convergence loop."""
        if attempt and self.retry_selection is not None:
            return self.retry_selection
        return self.selection

    def widened(self, mode: SelectionMode, chosen: object) -> bool:
        """Whether ``chosen`` (what a ``mode`` selection or its bracket answered) is chosen again
        with MAXIMAL: ``widens``, and the selection found nothing older than the retained tail."""
        return (
            self.widens
            and mode is SelectionMode.PRESSURE
            and isinstance(chosen, Declined)
            and chosen.code is DeclineCode.NOTHING_SELECTABLE
        )

    @property
    def retains(self) -> bool:
        """Whether the recent tail's retained budget is kept."""
        return self.selection is SelectionMode.PRESSURE


SHAPES: dict[PlanMode, BracketShape] = {
    PlanMode.AUTO: BracketShape(
        events_pb2.COMPACTION_TRIGGER_PRESSURE, SelectionMode.PRESSURE,
        prunes=True, window_prunes=False, min_span=True, guarded=True,
    ),
    PlanMode.MANUAL: BracketShape(
        events_pb2.COMPACTION_TRIGGER_MANUAL, SelectionMode.MAXIMAL,
        prunes=False, window_prunes=False, min_span=True, guarded=False,
    ),
    PlanMode.OVERFLOW: BracketShape(
        events_pb2.COMPACTION_TRIGGER_OVERFLOW, SelectionMode.MAXIMAL,
        prunes=True, window_prunes=True, min_span=False, guarded=False,
    ),
    PlanMode.SWITCH: BracketShape(
        events_pb2.COMPACTION_TRIGGER_MODEL_SWITCH, SelectionMode.PRESSURE,
        prunes=True, window_prunes=False, min_span=False, guarded=False,
        retry_selection=SelectionMode.MAXIMAL, widens=True,
    ),
}  # fmt: skip


def node_pricer(
    meter: SessionMeter, fold: SessionFold, route: MeteredRoute
) -> Callable[[SurfaceNode], int]:
    """The route price of a current node: the meter's cached price, or (for a node the meter
    has not observed, e.g. a tentatively folded prune) the same price computed afresh."""

    def price(node: SurfaceNode) -> int:
        try:
            return meter.route_price_of_nodes(fold, (node.seq,), route)
        except ValueError:
            return route_price(node.event, route, fold.offloads.get(node.seq, frozenset()))

    return price


def span_pricer(
    meter: SessionMeter, fold: SessionFold, route: MeteredRoute
) -> Callable[[Sequence[SurfaceNode]], int]:
    """``node_pricer``'s prices of current nodes, summed: the meter's cached prices in one call
    (node by node only when one of them is a node the meter has not observed)."""
    price = node_pricer(meter, fold, route)

    def total(nodes: Sequence[SurfaceNode]) -> int:
        try:
            return meter.route_price_of_nodes(fold, [node.seq for node in nodes], route)
        except ValueError:
            return sum(price(node) for node in nodes)

    return total


def choose_span(
    fold: SessionFold,
    price: Callable[[SurfaceNode], int],
    *,
    selection: SelectionMode,
    retained_budget: int,
    min_span_tokens: int,
    hold: Callable[[Selection], Declined | None] | None = None,
    span_price: Callable[[Sequence[SurfaceNode]], int] | None = None,
) -> Selection | Declined:
    """The span a bracket replaces, or why it declines (``select_range``, then ``hold``: the
    failure memory of guarded paths, which may hold a chosen span back as KNOWN_FAILURE)."""
    chosen = select_range(
        fold, price, mode=selection, retained_budget=retained_budget,
        min_span_tokens=min_span_tokens, span_price=span_price,
    )  # fmt: skip
    if isinstance(chosen, Declined) or hold is None:
        return chosen
    return hold(chosen) or chosen


@contextmanager
def tentatively(fold: SessionFold, events: Sequence[SessionEvent]) -> Iterator[AdmittedBatch]:
    """Fold ``events`` into ``fold`` for the duration of the block, then roll them back.

    The caller must hold the session's lock and must not await inside the block: nobody else
    may see the tentative state. Seqs are assigned as a real append would assign them.
    """
    batch = fold.admit(events)
    try:
        yield batch
    finally:
        fold.rollback(batch)
