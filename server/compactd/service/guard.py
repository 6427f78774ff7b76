"""``CompactionGuard``: compaction never makes a session worse.

The bracket (``service.bracket``) asks the guard four things, each at one point of its steps:

1. **Is the span worth a bracket?** ``min_span_tokens`` prices the minimum useful checkpoint (the
   framing plus the eight empty sections) on the selection route; selection declines a smaller
   span (``SPAN_TOO_SMALL``) instead of paying a model call that must fail.
2. **May this span go to this target now?** ``hold`` consults the session's failure memory
   (``core.attempts``): a span that failed with the same summary target waits for its backoff
   unless it changed (``KNOWN_FAILURE``). ``may_open`` / ``exhausted`` bound the brackets of one
   threshold crossing and report an exhausted crossing once.
3. **May this summary replace history?** ``screen`` runs the quality gate (``core.gate``) before
   the commit; a failing summary is replaced by the extractive one when the policy says so, or
   the bracket closes with ``SUMMARY_REJECTED`` and the failed checks (``SummaryRejected``).
4. **What failed?** ``failed`` remembers a bracket that closed without committing.

The memory lives in the session's in-process state (``SessionContext.memory``): it outlives an
eviction from the resident cache, but a restart forgets it, so a failing span may be sent once more
after a restart (the log keeps every failed bracket's ``compaction/end`` for audit).

Every decision is observable: the ``compaction.gate`` and ``compaction.skip`` spans (failed
checks, missed probes), the metrics (``compactd.metrics``: ``compactd.summary.gate``,
``compactd.summary.probe_retention``, and ``compactd.compactions`` with outcome ``skipped``), the
``GATE`` and ``SKIP`` progress steps, and ``PrepareStep``'s warnings.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

from opentelemetry import trace

from compactd import genai
from compactd.core import bracket, gate, prompts
from compactd.core.attempts import Backoff, span_key
from compactd.core.meter import MeteredRoute, route_price
from compactd.core.policy import TargetPolicy
from compactd.core.pricing import PricingProfile, node_texts, price_node, with_counted
from compactd.core.probes import (
    ProbeKind,
    SpanFacts,
    select_probes,
    span_facts,
    span_facts_in_steps,
)
from compactd.core.selection import DeclineCode, Declined, Selection
from compactd.errors import CompactdError
from compactd.metrics import Metrics
from compactd.providers.base import Summarizer, SummaryRequest, SummaryResult
from compactd.providers.extractive import ExtractiveSummarizer, minimum_span_tokens
from compactd.reasons import Reason
from compactd.routes import Route
from compactd.service.sessions import SessionHandle, in_steps
from compactd.service.summarizers import EXTRACTIVE_TARGET
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2, session_service_pb2

Progress = Callable[[cpb.CompactionProgress], Awaitable[None]]
BUDGET_SPENT = "BUDGET_SPENT"  # a skip's reason in metrics and spans (never an error's)
_PROBE_TEXT = 200  # characters of a probe in a report
_CHECKS = {
    gate.GateCheck.SECTIONS: events_pb2.SUMMARY_CHECK_SECTIONS,
    gate.GateCheck.ECHO: events_pb2.SUMMARY_CHECK_ECHO,
    gate.GateCheck.REDUCTION: events_pb2.SUMMARY_CHECK_REDUCTION,
    gate.GateCheck.PROBES: events_pb2.SUMMARY_CHECK_PROBES,
}
_KINDS = {
    ProbeKind.REQUEST: events_pb2.SUMMARY_PROBE_KIND_REQUEST,
    ProbeKind.PATH: events_pb2.SUMMARY_PROBE_KIND_PATH,
    ProbeKind.COMMAND: events_pb2.SUMMARY_PROBE_KIND_COMMAND,
    ProbeKind.ERROR: events_pb2.SUMMARY_PROBE_KIND_ERROR,
}


class SummaryRejected(CompactdError):
    """The quality gate rejected the summary; ``gate`` holds the failed checks."""

    reason = Reason.SUMMARY_REJECTED

    def __init__(
        self,
        message: str,
        *,
        gate_report: events_pb2.SummaryGateReport,
        reason: str = Reason.SUMMARY_REJECTED,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.gate = gate_report


@dataclass(frozen=True)
class Screened:
    """The summary that may be committed, who wrote it, and the gate's report."""

    summary: SummaryResult
    summarizer: str
    target: Route
    report: events_pb2.SummaryGateReport | None = None
    fallback: events_pb2.SummaryFallback | None = None
    #: The route price (on the shrink route) of the framed checkpoint of ``summary``, when the
    #: gate priced it: the commit reuses it rather than tokenizing the checkpoint again.
    checkpoint_tokens: int | None = None


class CompactionGuard:
    """The quality gate, failure memory and attempt budgets; one per engine."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] | None = None,
        tracer: trace.Tracer | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """Args:
        clock: Seconds on a monotonic clock (``time.monotonic``); tests inject their own.
        tracer: Where the ``compaction.gate`` and ``compaction.skip`` spans go.
        metrics: Where the gate's and the skips' figures go (``compactd.metrics``).
        """
        self._clock = clock or time.monotonic
        self._tracer = tracer or trace.get_tracer("compactd")
        self._metrics = metrics or Metrics()
        self._extractive = ExtractiveSummarizer()
        self._skeletons: dict[PricingProfile, int] = {}

    # ---- 1. the minimum useful span -------------------------------------------------------

    def min_span_tokens(self, route: MeteredRoute, policy: TargetPolicy) -> int:
        """The smallest span (route tokens) whose checkpoint could relieve anything."""
        settings = policy.gate
        ratio = settings.min_reduction_ratio if settings is not None else None
        # A ratio above a half also asks the extractive checkpoint (the fallback) to fit.
        skeleton = self._skeleton_tokens(route.pricing)
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

    # ---- 3. the quality gate ----------------------------------------------------------------

    def facts_beside(
        self, policy: TargetPolicy, request: SummaryRequest, summarizer: Summarizer
    ) -> asyncio.Task[SpanFacts] | None:
        """The facts of ``request``'s span for the gate, extracted on the loop in steps (other
        calls run between them) while ``summarizer`` writes: a model's summary takes far
        longer, so the gate no longer extracts them once it is back. None when the gate is off
        or no model writes the summary (the extractive summarizer hands them over itself). The
        caller ends the task with ``drop_facts`` when the gate does not take them."""
        if policy.gate is None or not genai.calls_a_model(summarizer):
            return None
        steps = span_facts_in_steps(_without_head(request.messages))
        return asyncio.ensure_future(in_steps(steps))

    async def screen(
        self,
        *,
        policy: TargetPolicy,
        compaction_id: str,
        request: SummaryRequest,
        summary: SummaryResult,
        summarizer: str,
        target: Route,
        span_tokens: int | None,
        shrink_route: MeteredRoute,
        progress: Progress,
        serialized: Sequence[bytes] | None = None,
        facts: asyncio.Future[SpanFacts] | None = None,
    ) -> Screened:
        """The summary to commit, after the quality gate (not judged when the policy turns the
        gate off, or when ``span_tokens`` is None: a span node is gone and the commit's
        revalidation rejects the span).

        ``serialized``: one per message of ``request``, bytes that hold its text blocks as
        ``gate.echoed_message`` takes them (None: the gate serializes the messages).
        ``facts``: the span's facts, being extracted (``facts_beside``), for a summary that
        brings none of its own (None: the gate extracts them).

        Raises:
            SummaryRejected: The summary failed the gate (reason ``SUMMARY_NOT_SMALLER`` when its
                checkpoint is not smaller at all) and no fallback passed it.
        """
        settings = policy.gate
        if settings is None or span_tokens is None:
            return Screened(summary, summarizer, target)
        span = _without_head(request.messages)
        span_bytes = serialized[len(serialized) - len(span) :] if serialized is not None else None

        async def verdict_of(text: str) -> gate.Verdict:
            checkpoint = bracket.checkpoint_message(compaction_id, prompts.frame_checkpoint(text))
            # The tokenizer releases the GIL: the checkpoint's texts are counted in a worker
            # thread while the text checks run here (a chat template route's whole price, which
            # renders text first). The checks hold the GIL throughout, so a worker that only
            # woke would wait for them to end; this thread lets it in (a moment, bounded) and
            # goes on once it runs. Collecting the texts here leaves the worker little but the
            # tokenizer to run while it holds the GIL.
            texts = node_texts(checkpoint, shrink_route.pricing)
            running = threading.Event()
            work: Callable[[], int | dict[str, int]] = (
                partial(_price_started, running, checkpoint, shrink_route)
                if texts is None
                else partial(_count_started, running, texts, shrink_route.pricing.count)
            )
            counting = asyncio.get_running_loop().run_in_executor(None, work)
            running.wait(_HANDOFF_SECONDS)
            try:
                findings = gate.examine(text, span, probes, span_bytes)
            finally:
                counted = await counting
            checkpoint_tokens = (
                counted
                if isinstance(counted, int)
                else price_node(checkpoint, with_counted(shrink_route.pricing, counted)).total
            )
            return gate.judge(
                text, span, probes, checkpoint_tokens=checkpoint_tokens, span_tokens=span_tokens,
                settings=settings, findings=findings,
            )  # fmt: skip

        with self._tracer.start_as_current_span("compaction.gate") as trace_span:
            trace_span.set_attribute("compactd.compaction_id", compaction_id)
            # The gate's own work, inside its span; a summarizer that extracted the span's
            # facts already (the extractive one) spares extracting them twice.
            if summary.span_facts is not None:
                found = summary.span_facts
            else:
                found = await facts if facts is not None else span_facts(span)
            probes = select_probes(found)
            verdict = await verdict_of(summary.text)
            report = _report(verdict, settings)
            _gate_attributes(trace_span, verdict)
            if verdict.passed:
                self._metrics.gate(summarizer, "passed", verdict.retention.ratio)
                await progress(_gate_step(compaction_id, f"passed: {_figures(verdict)}"))
                return Screened(
                    summary, summarizer, target, report, checkpoint_tokens=verdict.checkpoint_tokens
                )
            if policy.extractive_fallback:
                fallback = await self._extractive.summarize(request)
                second = await verdict_of(fallback.text)
                trace_span.set_attribute("compactd.gate.fallback_passed", second.passed)
                if second.passed:
                    self._metrics.gate(summarizer, "fallback", verdict.retention.ratio)
                    detail = f"rejected ({verdict.describe()}); the extractive fallback passed"
                    await progress(_gate_step(compaction_id, f"{detail}: {_figures(second)}"))
                    rejected = events_pb2.SummaryFallback(
                        rejected_summarizer=summarizer,
                        rejected_target=events_pb2.Route(
                            provider=target.provider, model=target.model
                        ),
                        rejected=report,
                    )
                    return Screened(
                        fallback, self._extractive.name, EXTRACTIVE_TARGET,
                        _report(second, settings), rejected,
                        checkpoint_tokens=second.checkpoint_tokens,
                    )  # fmt: skip
            await progress(_gate_step(compaction_id, f"rejected: {verdict.describe()}"))
            self._metrics.gate(summarizer, "rejected", verdict.retention.ratio)
        raise _rejection(verdict, report)


_HANDOFF_SECONDS = 0.0005  # at most this long on the loop for the worker to start


def drop_facts(facts: asyncio.Future[SpanFacts] | None) -> None:
    """End a ``facts_beside`` task the gate did not (or no longer) need. Cancelling a task that
    is done already also marks its failure, if any, as seen: asyncio logs none when it is freed."""
    if facts is not None:
        facts.cancel()


def _price_started(
    running: threading.Event, checkpoint: events_pb2.SessionEvent, route: MeteredRoute
) -> int:
    running.set()
    return route_price(checkpoint, route)


def _count_started(
    running: threading.Event, texts: Sequence[str], count: Callable[[str], int]
) -> dict[str, int]:
    running.set()
    return {text: count(text) for text in texts}


def _without_head(
    messages: Sequence[session_service_pb2.Message],
) -> Sequence[session_service_pb2.Message]:
    if messages and messages[0].role == session_service_pb2.MESSAGE_ROLE_SYSTEM:
        return messages[1:]
    return messages


def _rejection(verdict: gate.Verdict, report: events_pb2.SummaryGateReport) -> SummaryRejected:
    checks = ",".join(str(failure.check) for failure in verdict.failures)
    metadata = {
        "checks": checks,
        "probe_retention": f"{verdict.retention.ratio:.2f}",
        "reduction": f"{verdict.reduction:.3f}",
        "checkpoint_tokens": str(verdict.checkpoint_tokens),
        "shadowed_tokens": str(verdict.span_tokens),
    }
    missed = [f"{p.kind}:{_clip(p.text, 60)}" for p in verdict.retention.missed]
    if missed:
        metadata["missed_probes"] = " | ".join(missed[:8])
    if not verdict.smaller:
        return SummaryRejected(
            f"the summary is not smaller than the span it replaces: {verdict.describe()}",
            gate_report=report,
            reason=Reason.SUMMARY_NOT_SMALLER,
            metadata=metadata,
        )
    return SummaryRejected(
        f"the summary failed the quality gate: {verdict.describe()}",
        gate_report=report,
        metadata=metadata,
    )


def _report(verdict: gate.Verdict, settings: gate.GateSettings) -> events_pb2.SummaryGateReport:
    report = events_pb2.SummaryGateReport(
        probe_count=len(verdict.retention.probes),
        probes_kept=sum(verdict.retention.kept),
        reduction=verdict.reduction,
        min_reduction_ratio=settings.min_reduction_ratio,
        min_probe_retention=settings.min_probe_retention,
    )
    for failure in verdict.failures:
        report.failures.add(
            check=_CHECKS[failure.check],
            detail=failure.detail,
            missed_probes=[
                events_pb2.SummaryProbe(kind=_KINDS[p.kind], text=_clip(p.text, _PROBE_TEXT))
                for p in failure.missed
            ],
        )
    return report


def _gate_attributes(span: trace.Span, verdict: gate.Verdict) -> None:
    span.set_attribute("compactd.gate.passed", verdict.passed)
    span.set_attribute("compactd.gate.failed_checks", [str(f.check) for f in verdict.failures])
    span.set_attribute("compactd.gate.probes", len(verdict.retention.probes))
    span.set_attribute("compactd.gate.probes_kept", sum(verdict.retention.kept))
    span.set_attribute("compactd.gate.reduction", round(verdict.reduction, 4))
    missed = [f"{p.kind}: {_clip(p.text, 80)}" for p in verdict.retention.missed]
    if missed:
        span.set_attribute("compactd.gate.missed_probes", missed)


def _figures(verdict: gate.Verdict) -> str:
    kept = verdict.retention
    return (
        f"kept {sum(kept.kept)}/{len(kept.probes)} probes, "
        f"reduced the span by {verdict.reduction * 100:.0f}%"
    )


def _gate_step(compaction_id: str, detail: str) -> cpb.CompactionProgress:
    return cpb.CompactionProgress(
        step=cpb.COMPACTION_STEP_GATE, compaction_id=compaction_id, seq=-1, detail=detail
    )


def _clip(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
