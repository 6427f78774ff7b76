"""The append rule on pinned state that needs the route catalog: pins that fit the window.

A runtime's batch holding a ``state/pin`` is refused (RESOURCE_EXHAUSTED, reason
``PINS_OVER_WINDOW``) when the pinned-state message it leaves in force costs, alone, more than
the context window of the route the session's header names: no compaction could ever bring such
a request under the window, since pins are never compacted. Without a routed header, or on a
route that declares no window, the pins are not bounded here (the surface's byte bound still
holds them).
"""

from __future__ import annotations

from compactd.core.fold import AdmittedBatch, SessionFold
from compactd.core.meter import route_price
from compactd.errors import ResourceExhausted
from compactd.reasons import Reason
from compactd.routes import RouteCatalog
from compactd.service.sessions.handle import Checker


def pins_checker(routes: RouteCatalog) -> Checker:
    """The ``SessionHandle`` checker that refuses pins over the routed window."""

    def check(fold: SessionFold, batch: AdmittedBatch) -> None:
        for event in batch.events:  # a loop, not ``any``: no generator per append
            if event.HasField("state_pin"):
                break
        else:
            return
        message = fold.pins_message()
        config = fold.header.config if fold.header is not None else None
        if message is None or config is None or not (config.provider and config.model):
            return
        route = routes.resolve(config.provider, config.model)
        window = route.context_window
        if window is None:
            return
        price = route_price(message, route)
        if price > window:
            raise ResourceExhausted(
                f"the pins in force would cost {price} tokens on {route.provider}/"
                f"{route.model}, more than its {window}-token context window; pins are never "
                "compacted: pin less, or clear a key",
                reason=Reason.PINS_OVER_WINDOW,
                metadata={"pins_tokens": str(price), "context_window": str(window)},
            )

    return check
