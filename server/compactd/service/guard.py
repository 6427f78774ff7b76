"""``CompactionGuard``: compaction never makes a session worse, and never repeats itself.

The bracket (``service.bracket``) and the step (``service.steps``) ask the guard, each at one
point of their work (whether a summary may replace history is the quality gate's question:
``service.screening``):

1. **Is the span worth a bracket?** ``min_span_tokens`` prices the minimum useful checkpoint (the
   framing plus the eight empty sections) on the selection route; selection declines a smaller
   span (``SPAN_TOO_SMALL``) instead of paying a model call that must fail.
2. **May this span go to this target?** ``hold`` consults the session's failure memory
   (``core.attempts``): a span that failed with the same summary target is not sent to it again
   while it stays the same (after a transient provider failure, until its backoff elapses): the
   bracket writes the extractive checkpoint instead (``KNOWN_FAILURE``). New history makes a new
   span: nothing bounds progress, only repeated work.
3. **What failed?** ``failed`` remembers a bracket that closed without committing.

The memory lives in the session's in-process state (``SessionContext.memory``): it outlives an
eviction from the resident cache, but a restart forgets it, so a failing span may be sent once
more after a restart (the log keeps every failed bracket's ``compaction/end`` for audit).
"""

from __future__ import annotations

import math
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

#: A start seq of typical width for the empty checkpoint's recall handle (priced once).
_TYPICAL_START = 10_000


class CompactionGuard:
    """Minimum spans and failure memory; one per server."""

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
            text = bracket.checkpoint_text(prompts.summary_skeleton(), _TYPICAL_START)
            skeleton = bracket.checkpoint_message("", text)
            price = self._skeletons[pricing] = price_node(skeleton, pricing).total
        return price

    # ---- 2. failure memory -------------------------------------------------------------

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
            f"{target.name}; it is sent again when it changes"
            + ("" if math.isinf(held.retry_in) else f" or in {held.retry_in:.0f} s"),
            cause=held.reason,
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
