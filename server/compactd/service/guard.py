"""``CompactionGuard``: compaction never makes a session worse, and never loops.

The bracket (``service.bracket``) and the step (``service.steps``) ask the guard three things,
each at one point of their work (the fourth, whether a summary may replace history, is the
quality gate's: ``service.screening``):

1. **Is the span worth a bracket?** ``min_span_tokens`` prices the minimum useful checkpoint (the
   framing plus the eight empty sections) on the selection route; selection declines a smaller
   span (``SPAN_TOO_SMALL``) instead of paying a model call that must fail.
2. **May this span go to this target now?** ``hold`` consults the session's failure memory
   (``core.attempts``): a span that failed with the same summary target waits for its backoff
   unless it changed (``KNOWN_FAILURE``). ``may_open`` / ``exhausted`` bound the brackets of one
   threshold crossing and report an exhausted crossing once.
3. **What failed?** ``failed`` remembers a bracket that closed without committing.

The memory lives in the session's in-process state (``SessionContext.memory``): it outlives an
eviction from the resident cache, but a restart forgets it, so a failing span may be sent once
more after a restart (the log keeps every failed bracket's ``compaction/end`` for audit).

Every decision is observable: the ``compaction.skip`` span, the metrics (``compactd.metrics``:
``compactd.compactions`` with outcome ``skipped``), the ``SKIP`` progress step, and
``PrepareStep``'s warnings.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from opentelemetry import trace

from compactd.core import bracket, gate, prompts
from compactd.core.attempts import Backoff, span_key
from compactd.core.fold import SessionFold
from compactd.core.handles import open_handles
from compactd.core.meter import MeteredRoute
from compactd.core.policy import TargetPolicy
from compactd.core.pricing import PricingProfile, price_node
from compactd.core.selection import DeclineCode, Declined, Selection
from compactd.metrics import Metrics
from compactd.providers.extractive import minimum_span_tokens
from compactd.routes import Route
from compactd.service.sessions import SessionHandle
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2

BUDGET_SPENT = "BUDGET_SPENT"  # a skip's reason in metrics and spans (never an error's)


class CompactionGuard:
    """Minimum spans, failure memory and crossing budgets; one per server."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] | None = None,
        tracer: trace.Tracer | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """Args:
        clock: Seconds on a monotonic clock (``time.monotonic``); tests inject their own.
        tracer: Where the ``compaction.skip`` spans go.
        metrics: Where the skips' figures go (``compactd.metrics``).
        """
        self._clock = clock or time.monotonic
        self._tracer = tracer or trace.get_tracer("compactd")
        self._metrics = metrics or Metrics()
        self._skeletons: dict[PricingProfile, int] = {}

    # ---- 1. the minimum useful span -------------------------------------------------------

    def min_span_tokens(
        self, route: MeteredRoute, policy: TargetPolicy, fold: SessionFold | None = None
    ) -> int:
        """The smallest span (route tokens) whose checkpoint could relieve anything; with
        ``fold``, the checkpoint also carries the open handles every span of it must list (its
        open sub-agents and pinned keys: ``core.handles``)."""
        settings = policy.gate
        ratio = settings.min_reduction_ratio if settings is not None else None
        # A ratio above a half also asks the extractive checkpoint (the fallback) to fit.
        skeleton = self._skeleton_tokens(route.pricing) + _handles_tokens(route.pricing, fold)
        return max(gate.minimum_useful_span(skeleton, ratio), minimum_span_tokens(ratio))

    def _skeleton_tokens(self, pricing: PricingProfile) -> int:
        """The empty checkpoint's price per pricing profile: priced once, not every bracket."""
        price = self._skeletons.get(pricing)
        if price is None:
            skeleton = bracket.checkpoint_message(
                "", prompts.frame_checkpoint(prompts.summary_skeleton())
            )
            price = self._skeletons[pricing] = price_node(skeleton, pricing).total
        return price

    # ---- 2. failure memory and crossing budgets -------------------------------------------

    def hold(
        self, handle: SessionHandle, selection: Selection, target: Route, policy: TargetPolicy
    ) -> Declined | None:
        """``KNOWN_FAILURE`` when failure memory holds ``selection`` back from ``target``."""
        if not policy.remembers_failures:
            return None
        key = span_key(selection.shadowed_seqs, handle.fold.offloads)
        held = handle.context.memory.failures.hold(key, target.name, self._clock())
        if held is None:
            return None
        return Declined(
            DeclineCode.KNOWN_FAILURE,
            f"the same span (seqs {selection.start_seq}..{selection.end_seq}, "
            f"{selection.count} node(s)) failed {held.failures} time(s) with {held.reason} on "
            f"{target.name}; it is sent again when it changes or in {held.retry_in:.0f} s",
        )

    def failed(
        self,
        handle: SessionHandle,
        selection: Selection,
        target: Route,
        reason: str,
        policy: TargetPolicy,
    ) -> None:
        """Remember a bracket on ``selection`` that closed without committing."""
        backoff = Backoff(policy.failure_backoff_seconds, policy.failure_backoff_max_seconds)
        key = span_key(selection.shadowed_seqs, handle.fold.offloads)
        handle.context.memory.failures.remember(key, target.name, reason, self._clock(), backoff)

    def may_open(self, handle: SessionHandle, policy: TargetPolicy) -> bool:
        """Whether the current threshold crossing may open another bracket."""
        if not policy.remembers_failures:
            return True
        crossing = handle.context.memory.failures.open_crossing()
        return crossing.may_open(1 + policy.compaction_retries, self._clock())

    def opened(self, handle: SessionHandle, policy: TargetPolicy) -> None:
        """Count a bracket the current crossing opened."""
        if policy.remembers_failures:
            handle.context.memory.failures.open_crossing().opened()

    def exhausted(
        self, handle: SessionHandle, policy: TargetPolicy, report: cpb.PressureReport, why: str
    ) -> str | None:
        """The warning for a crossing whose budget is spent while pressure stays above, the
        first time only (None afterwards, or when the budget is not the limit)."""
        if not policy.remembers_failures:
            return None
        crossing = handle.context.memory.failures.open_crossing()
        backoff = Backoff(policy.failure_backoff_seconds, policy.failure_backoff_max_seconds)
        now = self._clock()
        first = crossing.exhaust(now, backoff)
        with self._tracer.start_as_current_span("compaction.skip") as span:
            span.set_attribute("compactd.session_id", handle.session_id)
            span.set_attribute("compactd.skipped", BUDGET_SPENT)
            span.set_attribute("compactd.retry_in_s", crossing.retry_in(now))
        self._metrics.compaction(
            events_pb2.CompactionTrigger.Name(events_pb2.COMPACTION_TRIGGER_PRESSURE),
            "skipped",
            reason=BUDGET_SPENT,
        )
        if not first:
            return None
        budget = 1 + policy.compaction_retries
        return (
            f"pressure stays above the trigger after {crossing.brackets} compaction(s) in this "
            f"threshold crossing ({why}): measured {report.measured_tokens} >= trigger "
            f"{report.trigger_tokens} (compactionRetries={policy.compaction_retries}, budget "
            f"{budget}); no bracket opens before {crossing.retry_in(now):.0f} s pass or pressure "
            "drops below the trigger; continuing with this surface"
        )

    def end_crossing(self, handle: SessionHandle) -> None:
        """Pressure is below the trigger, or the runtime compacted explicitly."""
        handle.context.memory.failures.close_crossing()


def _handles_tokens(pricing: PricingProfile, fold: SessionFold | None) -> int:
    """What the open-handles section of ``fold``'s next checkpoint adds to it at least (the span's
    own unanswered calls come on top), in ``pricing``'s tokens; 0 without a fold."""
    if fold is None:
        return 0
    section = prompts.open_handles_section(open_handles(fold, ()))
    if not section:
        return 0
    skeleton = prompts.summary_skeleton()
    bare = bracket.checkpoint_message("", prompts.frame_checkpoint(skeleton))
    framed = bracket.checkpoint_message("", prompts.frame_checkpoint(skeleton, section))
    return price_node(framed, pricing).total - price_node(bare, pricing).total
