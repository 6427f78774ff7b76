"""The five-step bracket, run for real: one region replacement recorded in the log.

The pure core decides (``core.selection``, ``core.bracket``); this module appends what it decides,
in order, through the session's lock, calls the summarizer outside that lock, and traces every
step (``compaction.<step>`` spans inside one ``compaction.bracket`` span):

1. **open**: ``compaction/start`` is appended atomically with the lock check (``SessionFold``
   refuses a second live start, so of two concurrent requests exactly one proceeds);
2. **write the summary**: the summarizer is called, and a failed request is recorded
   (``compaction/summary-error``) and retried when a recovery records a durable input change;
3. **screen**: the quality gate (``service.guard``) judges the summary before anything commits;
4. **commit**: the span is revalidated (whole surface for automatic brackets, the selected span
   for manual ones), a summary that is not smaller than its span is rejected, and
   ``compaction/summary`` plus the checkpoint ``user/message`` REPLACE commit in one batch;
5. **close**: ``compaction/end`` releases the lock, last, in exactly one attempt (a failed close
   leaves a blocking orphan that only a later ``session/end-seed`` clears).

Cancellation is authoritative: a cancelled call still closes its bracket before it stops.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from compactd import genai, logs
from compactd.core import bracket, prompts
from compactd.core import events as ev
from compactd.core.fold import SessionFold
from compactd.core.handles import open_handles
from compactd.core.meter import SessionMeter, envelope_tools, route_price
from compactd.core.planner import choose_span, node_pricer, span_pricer
from compactd.core.policy import TargetPolicy
from compactd.core.pricing import HEURISTIC, PricingProfile, heuristic_price
from compactd.core.probes import SpanFacts
from compactd.core.projection import project
from compactd.core.selection import (
    DeclineCode,
    Declined,
    Selection,
    SelectionMode,
    SurfaceSnapshot,
    drift,
    revalidation_for,
    surface_snapshot,
)
from compactd.core.surface import SurfaceNode
from compactd.errors import CompactdError
from compactd.metrics import Metrics
from compactd.providers.base import Summarizer, SummaryError, SummaryRequest, SummaryResult
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.reasons import Reason
from compactd.redaction import Redactor
from compactd.routes import Route
from compactd.service.guard import CompactionGuard
from compactd.service.preconditions import refuse_live_bracket
from compactd.service.screening import Screened, Screener, SummaryRejected, drop_facts
from compactd.service.sessions import SessionHandle
from compactd.service.summarizers import EXTRACTIVE_TARGET, SummarizerRegistry
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1.session_service_pb2 import Message

log = logging.getLogger(__name__)

Progress = Callable[[cpb.CompactionProgress], Awaitable[None]]
MAX_SUMMARY_ATTEMPTS = 3


class BracketFailed(CompactdError):
    """A bracket closed without committing; ``reason`` says why (the log says the same)."""

    reason = Reason.SUMMARY_FAILED


#: The share of a span's price an extractive checkpoint the route counted above its share is
#: written again for (``Brackets._screened``).
_REFIT_SHARE = 0.85


@dataclass(frozen=True)
class Bracket:
    """The inputs of one bracket run."""

    handle: SessionHandle
    trigger: events_pb2.CompactionTrigger.ValueType
    mode: SelectionMode
    route: Route  # selection pricing (the destination)
    shrink_route: Route  # shrink-check pricing (the last committed route)
    policy: TargetPolicy
    retained_budget: int = 0
    turn: int | None = None
    focus: str | None = None
    min_span_tokens: int = 0  # selection declines a smaller span (0: overflow recovery)
    guarded: bool = False  # failure memory may hold the span back (PrepareStep)
    extractive: bool = False  # the extractive checkpoint, without a model call (the ladder)
    prepared: PreparedSummary | None = None  # a summary prepared ahead (``service.ahead``)
    #: Whether the quality gate's probe and section checks judge the extractive rung's
    #: checkpoint: not when the request is over the window and the summary is cut to fit it (a
    #: checkpoint that fits beats a request a provider refuses, and one whose share cannot hold
    #: the eight headings leaves the empty ones out); its size and echo are still judged.
    gate_extractive: bool = True
    #: The most a summary may take for the request to fit the window (0: unbounded but for the
    #: policy's ``maxTokens``); ``policy.max_tokens`` is no larger.
    room_tokens: int = 0


@dataclass(frozen=True)
class PreparedSummary:
    """A summary written ahead of the trigger, off the log (``service.ahead``), that a bracket
    applies instead of writing one: its five steps follow one another at once.

    Attributes:
        summary: The summary as the summarizer returned it (redacted).
        target: The route that wrote it; ``summarizer`` its summarizer's name.
        span: The span it summarizes as it sits on the surface now, priced on the job's route,
            or ``Declined`` when it changed (called under the lock, at step 1).
        record: What ``compaction/start`` records of it (``prepared_ahead``).
    """

    summary: SummaryResult
    target: Route
    summarizer: str
    span: Callable[[SessionFold], Selection | Declined]
    record: events_pb2.PreparedAhead


@dataclass(frozen=True)
class SummaryFailure:
    """A failed summary request inside a live bracket, as a recovery sees it."""

    compaction_id: str
    error: SummaryError
    attempt: int  # from 1
    selection: Selection  # a recovery may only change occurrences inside this span


class SummaryErrorRecovery(Protocol):
    """The summary-error step's hook: record a durable input change, then ask for a retry.

    ``wants`` decides, from the error alone, whether this recovery handles it (the
    ``compaction/summary-error`` event records that decision as ``retrying``). ``recover`` then
    appends its change through ``handle.append`` (an ``image/offload``, say) and returns whether
    it recorded one; only then is the summary re-derived, re-priced and retried in the same
    bracket. What a recovery records stays in the log even if the bracket later fails.
    """

    def wants(self, error: SummaryError) -> bool:
        """Whether this recovery handles ``error``."""
        ...

    async def recover(self, handle: SessionHandle, failure: SummaryFailure) -> bool:
        """Record a durable input change for ``failure``; True when one was recorded."""
        ...


@dataclass(frozen=True)
class _Writer:
    """Who writes a bracket's summary: the target route and its summarizer, and the rung of the
    ladder that is (with, for the extractive rung after a failure, what failed before it)."""

    target: Route
    summarizer: Summarizer
    rung: events_pb2.CompactionRung.ValueType = events_pb2.COMPACTION_RUNG_SUMMARY
    fallback: events_pb2.SummaryFallback | None = None


@dataclass(frozen=True)
class _Opened:
    """A bracket after step 1: its id, its span, and what the commit revalidates against."""

    compaction_id: str
    selection: Selection
    start_seq: int
    snapshot: SurfaceSnapshot
    envelope_before: int
    held: Declined | None = None  # failure memory held the span back from the summary target


@dataclass(frozen=True)
class _Written:
    """A bracket after step 2: the summary, the request it answered, the span as priced now."""

    request: SummaryRequest
    serialized: list[bytes]  # one per request message: its text blocks, for the gate's echo check
    summary: SummaryResult
    selection: Selection
    envelope_before: int
    facts: asyncio.Future[SpanFacts] | None  # the span's facts, extracted while a model wrote
    writer: _Writer  # who wrote it (the extractive rung when the target's summary failed)


class Brackets:
    """Runs brackets for sessions; one instance per server.

    Args:
        summarizers: Summary targets and their summarizers.
        guard: Minimum spans and failure memory.
        screener: The quality gate.
        tracer: Where the ``compaction.<step>`` spans go (timed by ``metrics``).
        metrics: Where the compactions' outcomes go.
        redact: Applied to provider error text before it is logged, stored, traced or returned.
        recoveries: The summary-error step's recoveries, in the order they are asked.
    """

    def __init__(
        self,
        summarizers: SummarizerRegistry,
        guard: CompactionGuard,
        screener: Screener,
        *,
        tracer: trace.Tracer,
        metrics: Metrics,
        redact: Callable[[str], str],
        recoveries: Sequence[SummaryErrorRecovery] = (),
    ) -> None:
        self.summarizers = summarizers
        self.guard = guard
        self._screener = screener
        self._tracer = tracer
        self._metrics = metrics
        self.redact = redact
        #: Applied to a summary before it is screened and stored: the keys only (a provider may
        #: echo them in its answer), not the patterns, which would cut what a summary must keep.
        self.redact_summary: Callable[[str], str] = (
            redact.literals if isinstance(redact, Redactor) else redact
        )
        self._recoveries = tuple(recoveries)
        self._extractive = ExtractiveSummarizer()

    async def run(
        self,
        job: Bracket,
        progress: Progress,
        *,
        prelude: Callable[[], Awaitable[bool | Declined | Bracket]] | None = None,
    ) -> cpb.CompactionOutcome | Declined | None:
        """Run one bracket; Declined when nothing is selectable (nothing is written then).

        ``prelude`` runs first inside the bracket's span (pressure-qualified pruning); when it
        answers True no summary is needed and the bracket never opens (None); when it answers
        ``Declined`` the bracket does not open either, for that reason; a ``Bracket`` it answers
        is the job to run instead (chosen on what the prelude measured). The summary target
        and its summarizer are resolved before ``compaction/start``, so a configuration error
        writes nothing to the log.

        Raises:
            CompactionBusy: Another bracket is live.
            FailedPrecondition: No model can write the summary (``SUMMARY_TARGET_UNKNOWN``) or
                its summarizer is misconfigured; nothing was written.
            BracketFailed: The bracket closed without committing (summary failed, span drifted,
                summary not smaller); the log holds its ``compaction/end`` with the error.
        """
        with self._tracer.start_as_current_span("compaction.bracket") as span:
            span.set_attribute("compactd.session_id", job.handle.session_id)
            trigger = events_pb2.CompactionTrigger.Name(job.trigger)
            span.set_attribute("compactd.trigger", trigger)
            before = await prelude() if prelude is not None else False
            if isinstance(before, Declined):
                await self._declined(trigger, before, span, progress)
                return before
            if before is True:
                span.set_attribute("compactd.relieved_by", "pruning")
                self._metrics.compaction(trigger, "relieved")
                return None
            if isinstance(before, Bracket):
                job = before
            compaction_id = uuid.uuid4().hex
            span.set_attribute("compactd.compaction_id", compaction_id)
            logs.bind(compaction_id=compaction_id)
            writer = self._writer(job)
            opened = await self._open(job, compaction_id, span)
            if isinstance(opened, Declined):
                await self._declined(trigger, opened, span, progress)
                return opened
            if opened.held is not None:  # the span failed with the target: the next rung
                writer = self._extractive_writer(DeclineCode.KNOWN_FAILURE, opened.held.reason)
            outcome, rung = await self._summarize_and_commit(job, writer, opened, span, progress)
            span.set_attribute("compactd.tokens_freed", outcome.tokens_freed)
            span.set_attribute("compactd.rung", _RUNGS[rung])
            self._metrics.compaction(
                trigger, "committed", freed=outcome.tokens_freed, rung=_RUNGS[rung]
            )
            return outcome

    def _writer(self, job: Bracket) -> _Writer:
        """The summary target's writer, or the extractive rung's for a job that asks for it."""
        if job.prepared is not None:  # written already: its target, no call (``_write``)
            prepared = job.prepared
            return _Writer(prepared.target, _Prepared(prepared.summarizer))
        if job.extractive:
            return _Writer(
                EXTRACTIVE_TARGET, self._extractive, events_pb2.COMPACTION_RUNG_EXTRACTIVE
            )
        target = self.summarizers.target(job.policy, job.handle.fold.header)
        return _Writer(target, self.summarizers.for_route(target))

    def _extractive_writer(
        self, reason: str, failure: str, previous: _Writer | None = None
    ) -> _Writer:
        """The extractive rung after the target's summary failed (``reason``, ``failure``)."""
        fallback = events_pb2.SummaryFallback(failure_reason=reason, failure=failure)
        if previous is not None:
            fallback.rejected_summarizer = previous.summarizer.name
            fallback.rejected_target.CopyFrom(
                events_pb2.Route(provider=previous.target.provider, model=previous.target.model)
            )
        return _Writer(
            EXTRACTIVE_TARGET, self._extractive, events_pb2.COMPACTION_RUNG_EXTRACTIVE, fallback
        )

    async def _summarize_and_commit(
        self, job: Bracket, writer: _Writer, opened: _Opened, span: Span, progress: Progress
    ) -> tuple[cpb.CompactionOutcome, events_pb2.CompactionRung.ValueType]:
        """Steps 2 to 5 of an opened bracket: whatever fails, the bracket is closed. The rung
        that wrote the committed checkpoint comes with the outcome."""
        handle = job.handle
        await progress(_step(cpb.COMPACTION_STEP_START, opened.compaction_id, opened.start_seq))
        try:
            written = await self._write(job, writer, opened, progress)
            try:
                written, screened = await self._screened(job, opened, written, progress)
            finally:
                drop_facts(written.facts)
            rung = _rung_of(written.writer, screened)
            outcome = await self._commit(job, opened, written, screened, rung, progress)
        except BaseException as error:
            reason = close_reason(error)[1]
            self._metrics.compaction(events_pb2.CompactionTrigger.Name(job.trigger), "failed",
                                     reason=reason)  # fmt: skip
            await asyncio.shield(self._close(handle, opened.compaction_id, error, progress))
            self.guard.failed(handle, opened.selection, writer.target, reason, job.policy)
            if not isinstance(error, Exception):
                record_error(span, error)  # the span records Exceptions, not cancellation
            raise
        await self._close(handle, opened.compaction_id, None, progress, rung)
        return outcome, rung

    # ---- 1. open ---------------------------------------------------------------------------

    async def _open(self, job: Bracket, compaction_id: str, parent: Span) -> _Opened | Declined:
        """Choose the span and append ``compaction/start`` under the lock (Declined: nothing
        selectable, nothing written)."""
        handle = job.handle
        with self._tracer.start_as_current_span("compaction.start") as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            async with handle.lock:
                refuse_live_bracket(handle)
                meter = handle.context.meter
                chosen = self._chosen(job)
                if isinstance(chosen, Declined):
                    return chosen
                held = self._held(job, chosen)
                if held is not None and not job.policy.extractive_fallback:
                    return held
                snapshot = surface_snapshot(handle.fold)
                envelope_before = meter.measure(handle.fold, job.route).total
                start = bracket.start_event(compaction_id, job.trigger, chosen, job.turn)
                if job.prepared is not None:
                    start.compaction_start.prepared_ahead.CopyFrom(job.prepared.record)
                    for target in (span, parent):
                        target.set_attribute("compactd.prepared_ahead", True)
                result = await handle.append_locked([start])
            for target in (span, parent):
                range_attributes(target, chosen)
            span.set_attribute("compactd.seq", result.seqs[0])
            parent.set_attribute("compactd.tokens_before", envelope_before)
        return _Opened(compaction_id, chosen, result.seqs[0], snapshot, envelope_before, held)

    def _chosen(self, job: Bracket) -> Selection | Declined:
        """The span step 1 opens on: the prepared summary's, else selection's (under the lock)."""
        fold, meter = job.handle.fold, job.handle.context.meter
        if job.prepared is not None:
            return job.prepared.span(fold)
        return choose_span(
            fold, node_pricer(meter, fold, job.route),
            selection=job.mode, retained_budget=job.retained_budget,
            min_span_tokens=job.min_span_tokens, span_price=span_pricer(meter, fold, job.route),
        )  # fmt: skip

    def _held(self, job: Bracket, chosen: Selection) -> Declined | None:
        """Failure memory's say on a selected span (guarded jobs only; called under the lock)."""
        if not job.guarded or job.extractive:
            return None
        target = self.summarizers.target(job.policy, job.handle.fold.header)
        return self.guard.hold(job.handle, chosen, target, job.policy)

    async def _declined(
        self, trigger: str, declined: Declined, span: Span, progress: Progress
    ) -> None:
        span.set_attribute("compactd.declined", declined.reason)
        span.set_attribute("compactd.decline_code", declined.code)
        if declined.code is DeclineCode.KNOWN_FAILURE:
            self._metrics.compaction(trigger, "skipped", reason=declined.code)
            await progress(_step(cpb.COMPACTION_STEP_SKIP, "", -1, declined.reason))
        else:
            self._metrics.compaction(trigger, "declined", reason=declined.code)

    # ---- 2. write the summary ---------------------------------------------------------------

    async def _write(
        self, job: Bracket, writer: _Writer, opened: _Opened, progress: Progress
    ) -> _Written:
        """The summary of the span, its request re-derived on every attempt (a recovery's change,
        an offload, must show) until it succeeds or the summary-error step gives up."""
        selection, envelope_before = opened.selection, opened.envelope_before
        if job.prepared is not None:  # written ahead of the trigger: nothing to call now
            request, serialized = summary_request(
                job.handle, selection, writer.target, job.policy, job.focus
            )
            summary = job.prepared.summary
            await progress(_step(cpb.COMPACTION_STEP_SUMMARIZE, opened.compaction_id, -1,
                                 f"{len(summary.text)} chars, prepared ahead"))  # fmt: skip
            return _Written(request, serialized, summary, selection, envelope_before, None, writer)
        attempt = 1
        while True:
            request, serialized = summary_request(
                job.handle, selection, writer.target, job.policy, job.focus
            )
            # The checkpoint as the gate will price it: a summarizer fitting a share of the span
            # counts its checkpoint instead of estimating it.
            request = replace(
                request, checkpoint_tokens=checkpoint_pricer(job, opened),
                room_tokens=job.room_tokens,
            )  # fmt: skip
            facts = self._screener.facts_beside(job.policy, request, writer.summarizer)
            try:
                summary = await self._summarize(opened.compaction_id, writer, request, progress)
            except BaseException as error:
                drop_facts(facts)
                if not isinstance(error, SummaryError):
                    raise
                failure = SummaryFailure(opened.compaction_id, error, attempt, selection)
                if not await self._summary_error(job, failure, opened.snapshot, progress):
                    # The next rung: the extractive checkpoint of the same span, no model call.
                    writer = self._extractive_writer(error.reason, error.message, writer)
                # The recovery changed the span's projection (an offload): re-price the span and
                # the envelope, so the figures logged with the summary are today's.
                selection, envelope_before = await self._repriced(job, selection, envelope_before)
                attempt += 1
                continue
            return _Written(request, serialized, summary, selection, envelope_before, facts, writer)

    async def _summarize(
        self, compaction_id: str, writer: _Writer, request: SummaryRequest, progress: Progress
    ) -> SummaryResult:
        """One summary request, traced; a ``SummaryError`` is recorded on its span and raised."""
        target, summarizer = writer.target, writer.summarizer
        # The span records the provider's SummaryError itself; the BracketFailed raised from it
        # later is recorded on the bracket span, not here again.
        with self._tracer.start_as_current_span(
            "compaction.summarize", record_exception=False
        ) as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            span.set_attribute("compactd.summarizer", summarizer.name)
            # A model-backed summary is a GenAI client span (``chat {model}``) inside this one.
            with genai.summary_call(
                self._tracer, self._metrics, target, request, summarizer
            ) as call:
                try:
                    summary = await summarizer.summarize(request)
                except SummaryError as error:
                    redact_error(error, self.redact)  # provider text may echo credentials
                    record_error(span, error)  # the summary-error step reports it to the caller
                    call.failed(error)
                    raise
                call.answered(summary)
        summary = replace(summary, text=self.redact_summary(summary.text))
        await progress(
            _step(cpb.COMPACTION_STEP_SUMMARIZE, compaction_id, -1, f"{len(summary.text)} chars")
        )
        return summary

    async def _summary_error(
        self, job: Bracket, failure: SummaryFailure, snapshot: SurfaceSnapshot, progress: Progress
    ) -> bool:
        """The summary-error step: log it, let a recovery record a change, or go down the ladder.

        Returns True when the summary may be retried, False when the extractive rung writes the
        span's checkpoint instead (the policy's ``extractiveFallback``, for a failed model
        summary); raises ``BracketFailed`` otherwise.
        """
        handle, error = job.handle, failure.error
        recovery = next((r for r in self._recoveries if r.wants(error)), None)
        retrying = recovery is not None and failure.attempt < MAX_SUMMARY_ATTEMPTS
        seq = await self._log_summary_error(job, failure, snapshot, retrying)
        detail = f"failed: {error}" + (" (recovering)" if retrying else "")
        await progress(_step(cpb.COMPACTION_STEP_SUMMARIZE, failure.compaction_id, seq, detail))
        if recovery is None or not retrying:
            if job.policy.extractive_fallback and not job.extractive:
                return False
            raise BracketFailed(
                f"the summary request failed: {error.message}", reason=error.reason
            ) from error
        if not await recovery.recover(handle, failure):
            raise BracketFailed(
                f"the summary request failed and its recovery recorded no change: {error.message}",
                reason=error.reason,
            ) from error
        return True

    async def _log_summary_error(
        self, job: Bracket, failure: SummaryFailure, snapshot: SurfaceSnapshot, retrying: bool
    ) -> int:
        """Append ``compaction/summary-error`` (after checking the span did not drift); its seq."""
        handle = job.handle
        async with handle.lock:
            handle.check_bracket(failure.compaction_id)
            stale = drift(handle.fold, failure.selection, snapshot, revalidation_for(job.trigger))
            if stale is not None:
                raise BracketFailed(
                    f"stale span after a failed summary: {stale}", reason=Reason.SPAN_DRIFT
                )
            event = bracket.summary_error_event(
                failure.compaction_id, failure.error.message, failure.error.reason,
                attempt=failure.attempt, retrying=retrying,
            )  # fmt: skip
            result = await handle.append_locked([event])
        return result.seqs[0]

    async def _repriced(
        self, job: Bracket, selection: Selection, envelope_before: int
    ) -> tuple[Selection, int]:
        """``selection`` with the span's current route price, and the envelope measured now
        (unchanged when a span node is gone: the commit's revalidation rejects the span)."""
        handle = job.handle
        meter = handle.context.meter
        async with handle.lock:
            try:
                price = meter.route_price_of_nodes(handle.fold, selection.shadowed_seqs, job.route)
            except ValueError:
                return selection, envelope_before
            envelope = meter.measure(handle.fold, job.route).total
        return replace(selection, shadowed_price=price), envelope

    # ---- 3. screen -------------------------------------------------------------------------

    async def _screen(
        self,
        job: Bracket,
        writer: _Writer,
        opened: _Opened,
        written: _Written,
        progress: Progress,
    ) -> Screened:
        """The summary the quality gate lets commit (``Screener.screen``)."""
        policy = job.policy
        ungated = isinstance(writer.summarizer, ExtractiveSummarizer) and not job.gate_extractive
        if ungated:  # its probes and sections are not judged: a lean checkpoint has no room
            policy = replace(policy, min_probe_retention=0.0)
        return await self._screener.screen(
            policy=policy, compaction_id=opened.compaction_id, start_seq=opened.start_seq,
            request=written.request,
            summary=written.summary, serialized=written.serialized,
            summarizer=writer.summarizer.name, target=writer.target,
            span_tokens=span_tokens(job.handle, written.selection, job.shrink_route),
            shrink_route=job.shrink_route, progress=progress, facts=written.facts,
            sections=not ungated,
        )  # fmt: skip

    async def _screened(
        self, job: Bracket, opened: _Opened, written: _Written, progress: Progress
    ) -> tuple[_Written, Screened]:
        """``_screen``, with one refit of an extractive checkpoint the route counted above its
        share of the span (the only failed check ``REDUCTION``): its estimate of its own tokens
        ran low, so it is written again for a span priced ``_REFIT_SHARE`` as high, without a
        model call."""
        try:
            return written, await self._screen(job, written.writer, opened, written, progress)
        except SummaryRejected as error:
            checks = {failure.check for failure in error.gate.failures}
            summarizer = written.writer.summarizer
            extractive = isinstance(summarizer, ExtractiveSummarizer)
            if not extractive or checks != {events_pb2.SUMMARY_CHECK_REDUCTION}:
                raise
        request = replace(
            written.request, span_tokens=int(written.request.span_tokens * _REFIT_SHARE)
        )
        summary = await summarizer.summarize(request)
        written = replace(written, request=request, summary=summary)
        return written, await self._screen(job, written.writer, opened, written, progress)

    # ---- 4. commit -------------------------------------------------------------------------

    async def _commit(
        self,
        job: Bracket,
        opened: _Opened,
        written: _Written,
        screened: Screened,
        rung: events_pb2.CompactionRung.ValueType,
        progress: Progress,
    ) -> cpb.CompactionOutcome:
        """Revalidate the span, check the checkpoint shrinks it, and append
        ``compaction/summary`` plus the checkpoint REPLACE in one batch."""
        compaction_id, selection = opened.compaction_id, written.selection
        with self._tracer.start_as_current_span("compaction.summary") as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            async with job.handle.lock:
                job.handle.check_bracket(compaction_id)  # replicas: not taken over meanwhile
                events, tokens = self._commit_events(job, opened, written, screened, rung)
                result = await job.handle.append_locked(events)
            span.set_attribute("compactd.seq", result.seqs[0])
            span.set_attribute("compactd.tokens_before", tokens.envelope_before)
            span.set_attribute("compactd.tokens_after", tokens.envelope_after)
            range_attributes(span, selection)
        await progress(_step(cpb.COMPACTION_STEP_SUMMARY, compaction_id, result.seqs[0]))
        with self._tracer.start_as_current_span("compaction.replace") as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            span.set_attribute("compactd.seq", result.seqs[1])
            span.set_attribute("compactd.checkpoint_tokens", tokens.checkpoint_route_tokens)
            range_attributes(span, selection)
        await progress(_step(cpb.COMPACTION_STEP_REPLACE, compaction_id, result.seqs[1]))
        return cpb.CompactionOutcome(
            compaction_id=compaction_id,
            items_condensed=selection.count,
            tokens_freed=tokens.shadowed_route_tokens - tokens.checkpoint_route_tokens,
            range=bracket.surface_range(selection),
            checkpoint_seq=result.seqs[1],
        )

    def _commit_events(
        self,
        job: Bracket,
        opened: _Opened,
        written: _Written,
        screened: Screened,
        rung: events_pb2.CompactionRung.ValueType,
    ) -> tuple[list[events_pb2.SessionEvent], events_pb2.TokenMeasurement]:
        """The commit's two events and their token figures, decided under the lock.

        Raises:
            BracketFailed: The span drifted (``SPAN_DRIFT``) or the checkpoint is not smaller
                than the span (``SUMMARY_NOT_SMALLER``).
        """
        handle, selection, compaction_id = job.handle, written.selection, opened.compaction_id
        stale = drift(handle.fold, selection, opened.snapshot, revalidation_for(job.trigger))
        if stale is not None:
            raise BracketFailed(f"stale summary rejected: {stale}", reason=Reason.SPAN_DRIFT)
        span = handle.fold.surface.nodes[selection.start_position : selection.end_position + 1]
        handles = prompts.open_handles_section(open_handles(handle.fold, span))
        framed = bracket.checkpoint_text(screened.summary.text, opened.start_seq, handles)
        checkpoint = bracket.checkpoint_message(compaction_id, framed)
        tokens = _measurement(
            job, selection, written.envelope_before, checkpoint, screened, handles
        )
        summary_seq = handle.fold.revision
        target = events_pb2.Route(provider=screened.target.provider, model=screened.target.model)
        replacement = bracket.checkpoint_event(
            compaction_id, framed, selection, opened.start_seq, summary_seq
        )
        if job.prepared is not None:  # the meter's usage anchoring reads it (``core.meter``)
            replacement.user_message.source.compaction_checkpoint.prepared_ahead = True
        return [
            bracket.summary_event(
                compaction_id, screened.summary.text, selection, tokens, target=target,
                usage=screened.summary.usage, summarizer=screened.summarizer,
                gate=screened.report, fallback=screened.fallback or written.writer.fallback,
                rung=rung,
            ),
            replacement,
        ], tokens  # fmt: skip

    # ---- 5. close --------------------------------------------------------------------------

    async def _close(
        self,
        handle: SessionHandle,
        compaction_id: str,
        error: BaseException | None,
        progress: Progress,
        rung: events_pb2.CompactionRung.ValueType = events_pb2.COMPACTION_RUNG_UNSPECIFIED,
    ) -> None:
        """Step 5: exactly one closing attempt; a failure leaves the orphan start in place."""
        message, reason = close_reason(error)
        gate = error.gate if isinstance(error, SummaryRejected) else None
        with self._tracer.start_as_current_span("compaction.end") as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            try:
                async with handle.lock:
                    result = await handle.append_locked(
                        [bracket.end_event(compaction_id, message, reason, gate=gate, rung=rung)]
                    )
            except Exception as close_error:
                # Replicas: stop renewing, so the orphan's lease lapses and it is taken over.
                handle.leases.drop(compaction_id)
                record_error(span, close_error)
                log.error(
                    "compaction/end could not be appended; the bracket stays open until the "
                    "next session/end-seed",
                    extra={"session_id": handle.session_id, "compaction_id": compaction_id},
                )
                return
            span.set_attribute("compactd.seq", result.seqs[0])
            if message:
                span.set_attribute("compactd.error", message)
        if not isinstance(error, asyncio.CancelledError):
            await progress(_step(cpb.COMPACTION_STEP_END, compaction_id, result.seqs[0], message))


class _Prepared:
    """The summarizer of a prepared summary, by name only: ``_write`` never calls it."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def summarize(self, request: SummaryRequest) -> SummaryResult:
        raise AssertionError("a prepared summary is never written again")  # pragma: no cover


_RUNGS = {
    events_pb2.COMPACTION_RUNG_SUMMARY: "summary",
    events_pb2.COMPACTION_RUNG_EXTRACTIVE: "extractive",
}


def _rung_of(writer: _Writer, screened: Screened) -> events_pb2.CompactionRung.ValueType:
    """The rung that wrote a screened summary: the gate's extractive fallback is the next one."""
    if screened.fallback is not None:
        return events_pb2.COMPACTION_RUNG_EXTRACTIVE
    return writer.rung


def _measurement(
    job: Bracket,
    selection: Selection,
    envelope_before: int,
    checkpoint: events_pb2.SessionEvent,
    screened: Screened,
    open_handles: str,
) -> events_pb2.TokenMeasurement:
    """The commit's token figures; raises ``SUMMARY_NOT_SMALLER`` when the checkpoint does not
    shrink the span on the shrink route (call under the lock)."""
    handle = job.handle
    # The gate priced the checkpoint without its Open Handles section (it judges the summary):
    # its count is the committed checkpoint's only when that section is empty.
    gate_priced = screened.checkpoint_tokens if not open_handles else None
    checkpoint_route = (
        gate_priced if gate_priced is not None else route_price(checkpoint, job.shrink_route)
    )
    shadowed_route = handle.context.meter.route_price_of_nodes(
        handle.fold, selection.shadowed_seqs, job.shrink_route
    )
    if not bracket.shrinks(checkpoint_route, shadowed_route):
        raise BracketFailed(
            f"the summary ({checkpoint_route} tokens framed) is not smaller than the span it "
            f"replaces ({shadowed_route} tokens)",
            reason=Reason.SUMMARY_NOT_SMALLER,
            metadata={
                "checkpoint_tokens": str(checkpoint_route),
                "shadowed_tokens": str(shadowed_route),
            },
        )
    # The same pricing: one tokenization of the summary serves both figures.
    same = job.route.pricing == job.shrink_route.pricing
    checkpoint_now = checkpoint_route if same else route_price(checkpoint, job.route)
    return events_pb2.TokenMeasurement(
        envelope_before=envelope_before,
        envelope_after=envelope_before - selection.shadowed_price + checkpoint_now,
        shadowed_tokens=shadow_price_of_nodes(
            handle.context.meter, handle.fold, selection.shadowed_seqs
        ),
        checkpoint_tokens=heuristic_price(checkpoint),
        shadowed_route_tokens=shadowed_route,
        checkpoint_route_tokens=checkpoint_route,
    )


# ---- what a bracket prices and sends --------------------------------------------------------


def shadow_price_of(handle: SessionHandle) -> Callable[[SurfaceNode], int]:
    """The fixed heuristic price of a current node, as logged (projection applied)."""
    offloads = handle.fold.offloads

    def price(node: SurfaceNode) -> int:
        return heuristic_price(node.event, offloads.get(node.seq, frozenset()))

    return price


@dataclass(frozen=True)
class _HeuristicRoute:
    """The reference heuristic as a metered route: the meter keeps its per-node prices like a
    route's (priced once per node as it is appended or reprojected, dropped when shadowed)."""

    provider: str = ""
    model: str = ""
    pricing: PricingProfile = HEURISTIC


_HEURISTIC_ROUTE = _HeuristicRoute()


def shadow_price_of_nodes(meter: SessionMeter, fold: SessionFold, seqs: Iterable[int]) -> int:
    """The heuristic price of the current surface nodes ``seqs`` (``shadowed_tokens``): the sum
    of the meter's maintained heuristic prices, each what ``shadow_price_of`` gives its node,
    without re-pricing the span's text at every compaction.

    Raises:
        ValueError: A seq is not a current surface node.
    """
    return meter.route_price_of_nodes(fold, seqs, _HEURISTIC_ROUTE)


def span_tokens(handle: SessionHandle, selection: Selection, route: Route) -> int | None:
    """The span's route price now; None when a node of it is gone (the commit then fails the
    span's revalidation, so the quality gate need not judge it)."""
    try:
        return handle.context.meter.route_price_of_nodes(
            handle.fold, selection.shadowed_seqs, route
        )
    except ValueError:
        return None


def projected_span(
    fold: SessionFold, nodes: Iterable[SurfaceNode]
) -> tuple[list[Message], list[bytes]]:
    """The messages ``nodes`` project to (offloads applied) and, one per message, bytes that
    hold its text blocks as ``gate.echoed_message`` reads them: the node's event, which holds
    its message's blocks as they are unless offloads rewrote some (then the message's own
    serialized form), so that no message is serialized for the gate."""
    messages, serialized = [], []
    for node in nodes:
        offloaded = fold.offloads.get(node.seq, frozenset())
        message = project(node.event, offloaded)
        if message is not None:
            messages.append(message)
            serialized.append(message.SerializeToString() if offloaded else node.data)
    return messages, serialized


def checkpoint_pricer(job: Bracket, opened: _Opened) -> Callable[[str], int]:
    """The shrink route's price of the checkpoint a summary text becomes in ``opened``'s
    bracket, framed and with its recall handle, as the commit will record it: as the quality
    gate prices it, or with its open handles when no gate judges it (``_measurement``)."""
    handles = ""
    if job.policy.gate is None:
        selection, nodes = opened.selection, job.handle.fold.surface.nodes
        span = nodes[selection.start_position : selection.end_position + 1]
        handles = prompts.open_handles_section(open_handles(job.handle.fold, span))

    def price(summary: str) -> int:
        framed = bracket.checkpoint_text(summary, opened.start_seq, handles)
        return route_price(bracket.checkpoint_message(opened.compaction_id, framed),
                           job.shrink_route)  # fmt: skip

    return price


def summary_request(
    handle: SessionHandle,
    selection: Selection,
    target: Route,
    policy: TargetPolicy,
    focus: str | None,
) -> tuple[SummaryRequest, list[bytes]]:
    """System head and pins, then the span's messages exactly as the conversation sends them;
    and, one per message, bytes that hold its text blocks verbatim (the gate's echo check reads
    them)."""
    fold = handle.fold
    nodes = fold.surface.nodes
    span_nodes: list[SurfaceNode] = list(
        nodes[selection.start_position : selection.end_position + 1]
    )
    if nodes and selection.start_position > 0 and nodes[0].type == ev.SYSTEM_MESSAGE:
        span_nodes.insert(0, nodes[0])
    messages, serialized = projected_span(fold, span_nodes)
    pinned = fold.pins_message()  # where the conversation has it: the prefix stays the same
    if pinned is not None:
        at = 1 if span_nodes and span_nodes[0] is nodes[0] and fold.head_projects() else 0
        messages.insert(at, pinned)
        serialized.insert(at, pinned.SerializeToString())
    config = events_pb2.RequestConfig(provider=target.provider, model=target.model)
    header = fold.header
    if header is not None and (header.config.provider, header.config.model) == (
        target.provider,
        target.model,
    ):
        config.CopyFrom(header.config)  # same route: same sampling, so the prefix stays warm
    # The conversation's tools, compactd's own (the recall tool) included: the same prefix.
    tools = envelope_tools(header, handle.context.meter.declared_tools(header))
    request = SummaryRequest(
        messages=messages,
        tools=tools,
        config=config,
        instruction=prompts.compaction_instruction(focus),
        max_tokens=policy.max_tokens,
        pins=fold.pin_texts(),
        span_tokens=selection.shadowed_price,
    )
    return request, serialized


# ---- how a bracket reports ------------------------------------------------------------------


def close_reason(error: BaseException | None) -> tuple[str, str]:
    """``compaction/end``'s (message, reason) for a bracket that ended with ``error``."""
    if error is None:
        return "", ""
    if isinstance(error, asyncio.CancelledError):
        return "cancelled by the caller", Reason.CANCELLED
    if isinstance(error, CompactdError):
        return error.message, error.reason
    return f"internal error: {type(error).__name__}", Reason.INTERNAL


def redact_error(error: CompactdError, redact: Callable[[str], str]) -> None:
    """Redact ``error``'s message (and what ``str(error)`` shows) in place, and cut the chain of
    exceptions it was raised from: their texts (a URL, a first attempt's error) would show in
    every traceback recorded later, on spans and in logs."""
    error.message = redact(error.message)
    error.args = (error.message,)
    error.__cause__ = None
    error.__context__ = None
    error.__suppress_context__ = True


def record_error(span: Span, error: BaseException) -> None:
    """Record ``error`` on ``span`` and mark it failed."""
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))


def range_attributes(span: Span, selection: Selection) -> None:
    """The selected span's positions, seqs and size, as span attributes."""
    span.set_attribute("compactd.range.start_position", selection.start_position)
    span.set_attribute("compactd.range.end_position", selection.end_position)
    span.set_attribute("compactd.range.start_seq", selection.start_seq)
    span.set_attribute("compactd.range.end_seq", selection.end_seq)
    span.set_attribute("compactd.shadowed_count", selection.count)


def _step(
    step: cpb.CompactionStep.ValueType, compaction_id: str, seq: int, detail: str = ""
) -> cpb.CompactionProgress:
    return cpb.CompactionProgress(step=step, compaction_id=compaction_id, seq=seq, detail=detail)
