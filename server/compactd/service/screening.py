"""The quality gate, run for real: whether a summary may replace history.

``Screener.screen`` is a bracket's third step (``service.bracket``). It judges a summary with the
pure gate (``core.gate``: its sections, the span's facts it keeps as probes, its echo of the span,
its reduction) before anything commits; a failing summary is replaced by the extractive one when
the policy says so (``extractiveFallback``), or the bracket closes with ``SUMMARY_REJECTED`` and
the failed checks (``SummaryRejected``, ``compaction/end.gate``). ``facts_beside`` extracts the
span's facts while a model writes its summary, so the gate does not wait for them afterwards.

Observable: the ``compaction.gate`` span (failed checks, missed probes), the metrics
(``compactd.summary.gate``, ``compactd.summary.probe_retention``) and the ``GATE`` progress step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from opentelemetry import trace

from compactd import genai
from compactd.core import bracket, gate
from compactd.core.meter import MeteredRoute, route_price
from compactd.core.pins import head_length
from compactd.core.policy import TargetPolicy
from compactd.core.pricing import node_texts, price_node, with_counted
from compactd.core.probes import (
    Probe,
    ProbeKind,
    SpanFacts,
    select_probes,
    span_facts,
    span_facts_in_steps,
)
from compactd.errors import CompactdError
from compactd.metrics import Metrics
from compactd.providers.base import Summarizer, SummaryRequest, SummaryResult
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.reasons import Reason
from compactd.routes import Route
from compactd.service.summarizers import EXTRACTIVE_TARGET
from compactd.speed import in_steps
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2, session_service_pb2

Progress = Callable[[cpb.CompactionProgress], Awaitable[None]]
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


@dataclass(frozen=True)
class _Judging:
    """What every verdict on one span is judged against."""

    compaction_id: str
    span: Sequence[session_service_pb2.Message]  # the span's messages, without the system head
    span_bytes: Sequence[bytes] | None  # their text blocks for the echo check (None: serialize)
    probes: Sequence[Probe]
    settings: gate.GateSettings
    span_tokens: int
    shrink_route: MeteredRoute
    start_seq: int  # the bracket's compaction/start (names the checkpoint's recall handle)
    pinned: str = ""  # the pins' texts: a probe they hold is kept (``gate.examine``)


class Screener:
    """The quality gate of every bracket; one per server.

    Args:
        tracer: Where the ``compaction.gate`` spans go.
        metrics: Where the gate's figures go (``compactd.metrics``).
    """

    def __init__(
        self, *, tracer: trace.Tracer | None = None, metrics: Metrics | None = None
    ) -> None:
        self._tracer = tracer or trace.get_tracer("compactd")
        self._metrics = metrics or Metrics()
        self._extractive = ExtractiveSummarizer()

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
        start_seq: int = 0,
        request: SummaryRequest,
        summary: SummaryResult,
        summarizer: str,
        target: Route,
        span_tokens: int | None,
        shrink_route: MeteredRoute,
        progress: Progress,
        serialized: Sequence[bytes] | None = None,
        facts: asyncio.Future[SpanFacts] | None = None,
        sections: bool = True,
    ) -> Screened:
        """The summary to commit, after the quality gate (not judged when the policy turns the
        gate off, or when ``span_tokens`` is None: a span node is gone and the commit's
        revalidation rejects the span).

        ``serialized``: one per message of ``request``, bytes that hold its text blocks as
        ``gate.echoed_message`` takes them (None: the gate serializes the messages).
        ``facts``: the span's facts, being extracted (``facts_beside``), for a summary that brings
        none of its own (None: the gate extracts them). ``sections``: see ``_gate_settings``.

        Raises:
            SummaryRejected: The summary failed the gate (reason ``SUMMARY_NOT_SMALLER`` when its
                checkpoint is not smaller at all) and no fallback passed it.
        """
        settings = _gate_settings(policy, sections)
        if settings is None or span_tokens is None:
            return Screened(summary, summarizer, target)
        span = _without_head(request.messages)
        span_bytes = serialized[len(serialized) - len(span) :] if serialized is not None else None
        with self._tracer.start_as_current_span("compaction.gate") as trace_span:
            trace_span.set_attribute("compactd.compaction_id", compaction_id)
            found = await _facts_of(summary, span, facts)  # the gate's own work, in its span
            judging = _Judging(
                compaction_id, span, span_bytes, select_probes(found), settings, span_tokens,
                shrink_route, start_seq, "\n".join(request.pins.values()),
            )  # fmt: skip
            verdict = await _verdict(judging, summary.text)
            report = _report(verdict, settings)
            _gate_attributes(trace_span, verdict)
            if verdict.passed:
                self._metrics.gate(summarizer, "passed", verdict.retention.ratio)
                await progress(_gate_step(compaction_id, f"passed: {_figures(verdict)}"))
                tokens = verdict.checkpoint_tokens
                return Screened(summary, summarizer, target, report, checkpoint_tokens=tokens)
            if policy.extractive_fallback:
                rejected = _fallback_record(summarizer, target, report)
                screened = await self._fallback(judging, request, verdict, rejected, progress)
                trace_span.set_attribute("compactd.gate.fallback_passed", screened is not None)
                if screened is not None:
                    return screened
            await progress(_gate_step(compaction_id, f"rejected: {verdict.describe()}"))
            self._metrics.gate(summarizer, "rejected", verdict.retention.ratio)
        raise _rejection(verdict, report)

    async def _fallback(
        self,
        judging: _Judging,
        request: SummaryRequest,
        verdict: gate.Verdict,
        rejected: events_pb2.SummaryFallback,
        progress: Progress,
    ) -> Screened | None:
        """The extractive summary of the span when it passes the gate the first one failed."""
        fallback = await self._extractive.summarize(request)
        second = await _verdict(judging, fallback.text)
        if not second.passed:
            return None
        self._metrics.gate(rejected.rejected_summarizer, "fallback", verdict.retention.ratio)
        detail = f"rejected ({verdict.describe()}); the extractive fallback passed"
        await progress(_gate_step(judging.compaction_id, f"{detail}: {_figures(second)}"))
        return Screened(
            fallback, self._extractive.name, EXTRACTIVE_TARGET, _report(second, judging.settings),
            rejected, checkpoint_tokens=second.checkpoint_tokens,
        )  # fmt: skip


async def _facts_of(
    summary: SummaryResult,
    span: Sequence[session_service_pb2.Message],
    facts: asyncio.Future[SpanFacts] | None,
) -> SpanFacts:
    """The span's facts: a summarizer that extracted them already (the extractive one) spares
    extracting them twice; else those extracted while a model wrote, else extracted now."""
    if summary.span_facts is not None:
        return summary.span_facts
    return await facts if facts is not None else span_facts(span)


def _fallback_record(
    summarizer: str, target: Route, report: events_pb2.SummaryGateReport
) -> events_pb2.SummaryFallback:
    """What ``compaction/summary.fallback`` keeps of a summary the extractive one replaced."""
    return events_pb2.SummaryFallback(
        rejected_summarizer=summarizer,
        rejected_target=events_pb2.Route(provider=target.provider, model=target.model),
        rejected=report,
    )


async def _verdict(judging: _Judging, text: str) -> gate.Verdict:
    """The gate's verdict on ``text`` as the span's checkpoint.

    The tokenizer releases the GIL: the checkpoint's texts are counted in a worker thread while
    the text checks run here (a chat template route's whole price, which renders text first).
    Collecting the texts here leaves the worker little but the tokenizer to run.
    """
    framed = bracket.checkpoint_text(text, judging.start_seq)
    checkpoint = bracket.checkpoint_message(judging.compaction_id, framed)
    route = judging.shrink_route
    texts = node_texts(checkpoint, route.pricing)
    counting: asyncio.Future[int | dict[str, int]] = asyncio.get_running_loop().run_in_executor(
        None,
        (lambda: route_price(checkpoint, route))
        if texts is None
        else (lambda: {t: route.pricing.count(t) for t in texts}),
    )
    try:
        findings = gate.examine(
            text, judging.span, judging.probes, judging.span_bytes, judging.pinned
        )
    finally:
        counted = await counting
    checkpoint_tokens = (
        counted
        if isinstance(counted, int)
        else price_node(checkpoint, with_counted(route.pricing, counted)).total
    )
    return gate.judge(
        text, judging.span, judging.probes, checkpoint_tokens=checkpoint_tokens,
        span_tokens=judging.span_tokens, settings=judging.settings, findings=findings,
    )  # fmt: skip


def drop_facts(facts: asyncio.Future[SpanFacts] | None) -> None:
    """End a ``facts_beside`` task the gate did not (or no longer) need. Cancelling a task that
    is done already also marks its failure, if any, as seen: asyncio logs none when it is freed."""
    if facts is not None:
        facts.cancel()


def _without_head(
    messages: Sequence[session_service_pb2.Message],
) -> Sequence[session_service_pb2.Message]:
    return messages[head_length(messages) :]  # the system head and the pins


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


def _gate_settings(policy: TargetPolicy, sections: bool) -> gate.GateSettings | None:
    """The policy's gate (None: off), without the eight-section check when ``sections`` is
    False (a lean checkpoint cut to fit the window)."""
    settings = policy.gate
    if settings is None or sections:
        return settings
    return replace(settings, require_sections=False)


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
