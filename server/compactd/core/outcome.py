"""How a step's request stands against its route's window: the typed outcome of every step.

A request must never go out over the window ``W - O`` (the route's window less its output
reservation) while something can still be reduced. What no reduction can remove is the *floor*:
the envelope less everything a maximal compaction could replace (the history between the system
head and the last indivisible unit, ``selection.SelectionMode.MAXIMAL``). The floor decides two
things:

- a step whose floor alone is at or above the trigger runs no model call: no summary can bring
  pressure below it (the request may still need reducing to fit the window, without a model);
- a request above ``W - O`` whose floor is above it too is *irreducible*: said so, with the
  figures, on every step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from compactd.core.fold import SessionFold
from compactd.core.selection import Declined, SelectionMode, select_range
from compactd.core.surface import SurfaceNode


class Outcome(enum.Enum):
    """``PressureOutcome`` on the wire."""

    FITS = "fits"  # below the trigger
    ABOVE_TRIGGER = "above_trigger"  # at or above the trigger, within W - O
    OVER_WINDOW_IRREDUCIBLE = "over_window_irreducible"  # above W - O, the floor alone too
    OVER_WINDOW = "over_window"  # above W - O though reducible (auto off, a busy session)
    UNPRICED = "unpriced"  # the route could not be priced


@dataclass(frozen=True, slots=True)
class StepFigures:
    """A step's figures against its route (tokens)."""

    envelope: int
    trigger: int
    limit: int  # W - O
    floor: int

    @property
    def above_trigger(self) -> bool:
        """Whether pressure is at or above the trigger."""
        return self.envelope >= self.trigger

    @property
    def over_window(self) -> bool:
        """Whether the request would not fit the window."""
        return self.envelope > self.limit

    @property
    def floor_above_trigger(self) -> bool:
        """Whether no compaction can bring pressure below the trigger."""
        return self.floor >= self.trigger


def floor_tokens(
    fold: SessionFold,
    envelope: int,
    price: Callable[[SurfaceNode], int],
    span_price: Callable[[Sequence[SurfaceNode]], int] | None = None,
) -> int:
    """The envelope less the route price of the largest span a compaction could replace (all of
    the envelope when nothing is selectable now: one unit, or an open tool call)."""
    chosen = select_range(fold, price, mode=SelectionMode.MAXIMAL, span_price=span_price)
    if isinstance(chosen, Declined):
        return envelope
    return max(0, envelope - chosen.shadowed_price)


def outcome_of(figures: StepFigures, why: str = "") -> tuple[Outcome, str]:
    """The outcome of a step that ended at ``figures``, and its detail; ``why`` says why
    pressure stays where it is when the history was reducible (the caller knows)."""
    if not figures.above_trigger:
        return Outcome.FITS, ""
    if not figures.over_window:
        detail = why or "pressure stays at or above the trigger"
        return Outcome.ABOVE_TRIGGER, f"{detail}: {_figures(figures)}"
    if figures.floor > figures.limit:
        return Outcome.OVER_WINDOW_IRREDUCIBLE, (
            f"the request does not fit the window and nothing reducible is left: the floor (the "
            f"system head, the tools, the framing and the last unit) alone is {figures.floor} "
            f"tokens; {_figures(figures)}"
        )
    detail = why or "the request does not fit the window"
    return Outcome.OVER_WINDOW, f"{detail}: {_figures(figures)}"


def _figures(figures: StepFigures) -> str:
    return (
        f"measured {figures.envelope}, trigger {figures.trigger}, window less output reservation "
        f"{figures.limit}, floor {figures.floor}"
    )
