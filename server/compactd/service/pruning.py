"""Pruning, recorded for real: every oversized ``tool/result`` replaced by its head and tail.

The core plans (``core.pruner``: which results, the kept text, the ``compaction/prune`` +
REPLACE pair of each); this module appends the plans under the session's lock and traces them
(``compaction.prune``). Callers qualify pressure first: a step below the trigger never prunes.
"""

from __future__ import annotations

from collections.abc import Callable, Set

from opentelemetry import trace

from compactd.core.events import SessionEvent
from compactd.core.fold import SessionFold
from compactd.core.meter import route_price
from compactd.core.pruner import (
    PrunePlan,
    PrunerConfig,
    plan_masks,
    plan_prunes,
    plan_window_prunes,
)
from compactd.core.selection import last_unit_start
from compactd.core.surface import SurfaceNode
from compactd.metrics import Metrics
from compactd.routes import Route
from compactd.service.bracket import Progress, shadow_price_of
from compactd.service.sessions import SessionHandle
from compactd.v1 import compaction_service_pb2 as cpb

#: Plans prunes on a fold, given the heuristic price of a node (``shadow_price_of``).
Planner = Callable[[SessionFold, Callable[[SurfaceNode], int]], list[PrunePlan]]


class Pruning:
    """Prunes sessions; one instance per server.

    Args:
        config: The ``[pruner]`` thresholds.
        tracer: Where the ``compaction.prune`` spans go.
        metrics: Where the prune counts go.
    """

    def __init__(self, config: PrunerConfig, *, tracer: trace.Tracer, metrics: Metrics) -> None:
        self.config = config
        self._tracer = tracer
        self._metrics = metrics

    async def prune(
        self,
        handle: SessionHandle,
        progress: Progress,
        *,
        planner: Planner | None = None,
        what: str = "pruned",
    ) -> int:
        """Prune every oversized ``tool/result``; how many were pruned.

        ``planner(fold, shadow_price)`` replaces the configured pruner's plans (overflow
        recovery's window-sized prunes); it runs under the session's lock.
        """
        with self._tracer.start_as_current_span("compaction.prune") as span:
            span.set_attribute("compactd.session_id", handle.session_id)
            async with handle.lock:
                shadow_price = shadow_price_of(handle)
                plans = (
                    planner(handle.fold, shadow_price)
                    if planner is not None
                    else plan_prunes(handle.fold, self.config, shadow_price)
                )
                if not plans:
                    span.set_attribute("compactd.pruned_count", 0)
                    return 0
                events = [event for plan in plans for event in plan.events]
                result = await handle.append_locked(events)
            span.set_attribute("compactd.pruned_count", len(plans))
            self._metrics.pruned(len(plans))
            span.set_attribute("compactd.shadowed_seqs", [plan.shadowed_seq for plan in plans])
        for plan, seq in zip(plans, result.seqs[1::2], strict=True):
            await progress(
                cpb.CompactionProgress(
                    step=cpb.COMPACTION_STEP_PRUNE,
                    seq=seq,
                    detail=f"{what} tool/result {plan.shadowed_seq}",
                )
            )
        return len(plans)

    async def mask(self, handle: SessionHandle, route: Route, room: int, progress: Progress) -> int:
        """The ladder's masking rung: every older ``tool/result`` (before the last unit) cut to a
        short head and tail, and any result whose price alone exceeds ``room`` (the tokens the
        window leaves beside the floor) cut to fit it; how many were masked.

        ``compaction/prune`` records each with ``masked``; the originals stay in the log.
        """

        def price(event: SessionEvent, offloaded: Set[int]) -> int:
            return route_price(event, route, offloaded)

        def planner(fold: SessionFold, shadow: Callable[[SurfaceNode], int]) -> list[PrunePlan]:
            masks = plan_masks(fold, last_unit_start(fold), shadow)
            seqs = {plan.shadowed_seq for plan in masks}
            window = plan_window_prunes(fold, self.config, price, room, shadow, masked=True)
            return sorted(
                [*masks, *(plan for plan in window if plan.shadowed_seq not in seqs)],
                key=lambda plan: fold.surface.position_of(plan.shadowed_seq) or 0,
            )

        masked = await self.prune(handle, progress, planner=planner, what="masked")
        if masked:
            self._metrics.compaction("COMPACTION_TRIGGER_PRESSURE", "masked")
        return masked
