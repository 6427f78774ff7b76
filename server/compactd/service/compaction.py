"""The compaction engine: pressure-qualified pruning and the five-step bracket, run for real.

The pure core decides (``pruner``, ``selection``, ``bracket``); this module appends what it
decides, in order, through the session's lock, calls the summarizer outside that lock, and traces
every step. The bracket is one transaction recorded in the log:

1. ``compaction/start`` is appended atomically with the lock check (``SessionFold`` refuses a
   second live start, so of two concurrent requests exactly one proceeds);
2. the summary is written, then the span is revalidated (whole surface for automatic brackets,
   the selected span for manual ones); a summary that is not smaller than its span is rejected;
3. and 4. ``compaction/summary`` and the checkpoint ``user/message`` REPLACE commit in one batch;
5. ``compaction/end`` releases the lock, last, in exactly one attempt (a failed close leaves a
   blocking orphan that only a later ``session/end-seed`` clears).

Cancellation is authoritative: a cancelled call still closes its bracket before it stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from compactd import genai, logs
from compactd.core import bracket, prompts
from compactd.core import events as ev
from compactd.core.fold import SessionFold
from compactd.core.lock import live_bracket
from compactd.core.meter import SessionMeter, route_price
from compactd.core.planner import SHAPES, PlanMode, choose_span, node_pricer, span_pricer
from compactd.core.policy import TargetPolicy
from compactd.core.pricing import HEURISTIC, PricingProfile, heuristic_price
from compactd.core.projection import project
from compactd.core.pruner import PrunePlan, PrunerConfig, plan_prunes
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
from compactd.errors import (
    CompactdError,
    CompactionBusy,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
)
from compactd.metrics import Metrics
from compactd.providers.base import Summarizer, SummaryError, SummaryRequest, SummaryResult
from compactd.reasons import Reason
from compactd.redaction import Redactor
from compactd.routes import Route
from compactd.service.guard import CompactionGuard, SummaryRejected, drop_facts
from compactd.service.pressure import PressureService
from compactd.service.requests import appended_messages, build_request
from compactd.service.sessions import SessionHandle, SessionManager
from compactd.service.summarizers import SummarizerRegistry
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1.session_service_pb2 import Message

log = logging.getLogger(__name__)

Progress = Callable[[cpb.CompactionProgress], Awaitable[None]]
Planner = Callable[[SessionFold, Callable[[SurfaceNode], int]], list[PrunePlan]]
AUTO = SHAPES[PlanMode.AUTO]
MANUAL = SHAPES[PlanMode.MANUAL]
#: Why a step could not be priced: it warns once per target and goes on unpriced.
_UNPRICEABLE = frozenset({Reason.CAPACITY_UNKNOWN, Reason.POLICY_INVALID, Reason.ROUTE_UNKNOWN})


class BracketFailed(CompactdError):
    """A bracket closed without committing; ``reason`` says why (the log says the same)."""

    reason = Reason.SUMMARY_FAILED


@dataclass
class StepOutcome:
    """What a PrepareStep-like run did."""

    pruned: int = 0
    compactions: list[cpb.CompactionOutcome] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Bracket:
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


#: The inputs of one bracket run, for the recovery flows (``service.recovery``, ``.switch``).
Bracket = _Bracket


@dataclass(frozen=True)
class _Writer:
    """Who writes a bracket's summary: the target route and its summarizer."""

    target: Route
    summarizer: Summarizer


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


MAX_SUMMARY_ATTEMPTS = 3


class CompactionEngine:
    """Runs pruning and brackets for sessions; one instance per server."""

    def __init__(
        self,
        manager: SessionManager,
        pressure: PressureService,
        summarizers: SummarizerRegistry,
        *,
        pruner: PrunerConfig | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        recoveries: Sequence[SummaryErrorRecovery] = (),
        metrics: Metrics | None = None,
        redact: Callable[[str], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics or Metrics()
        self._manager = manager
        #: Applied to provider error text before it is logged, stored, traced or returned.
        self.redact: Callable[[str], str] = redact or Redactor()
        #: Applied to a summary before it is screened and stored: the keys only (a provider may
        #: echo them in its answer), not the patterns, which would cut what a summary must keep.
        self.redact_summary: Callable[[str], str] = (
            self.redact.literals if isinstance(self.redact, Redactor) else self.redact
        )
        self._recoveries = tuple(recoveries)
        self._pressure = pressure
        self._summarizers = summarizers
        self._pruner = pruner or PrunerConfig()
        tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("compactd")
        self._tracer = self._metrics.timed(tracer)  # each compaction.<step> span is timed
        self._guard = CompactionGuard(clock=clock, tracer=self._tracer, metrics=self._metrics)

    # The parts a dry run (``service.inspection``) decides with: the same ones the brackets use.

    @property
    def manager(self) -> SessionManager:
        """Where sessions live."""
        return self._manager

    @property
    def pressure(self) -> PressureService:
        """Routes, policies and meters."""
        return self._pressure

    @property
    def summarizers(self) -> SummarizerRegistry:
        """Summary targets and their summarizers."""
        return self._summarizers

    @property
    def pruner(self) -> PrunerConfig:
        """The ``[pruner]`` thresholds."""
        return self._pruner

    @property
    def guard(self) -> CompactionGuard:
        """Minimum spans, failure memory and crossing budgets."""
        return self._guard

    # ---- PrepareStep ---------------------------------------------------------------------

    async def prepare_step(
        self,
        session_id: str,
        turn: int,
        intended: Route | None,
        progress: Progress,
        held_revision: int | None = None,
    ) -> cpb.PrepareStepResult:
        """The pre-step check (see ``CompactionService.PrepareStep``).

        ``held_revision``: the revision of the request the caller holds; the result then omits
        the full request when the surface only grew since (``SessionFold.appended_since``).

        Raises:
            InvalidArgument: ``held_revision`` is negative or beyond the session's revision.
        """
        handle = await self._manager.get(session_id)
        return await self.prepare_step_of(handle, turn, intended, progress, held_revision)

    async def prepare_step_of(
        self,
        handle: SessionHandle,
        turn: int,
        intended: Route | None,
        progress: Progress,
        held_revision: int | None = None,
    ) -> cpb.PrepareStepResult:
        """``prepare_step`` on a handle the caller just got from the manager (on a shared
        store, caught up: a second lookup would read the session's revision again)."""
        check_held_revision(handle, held_revision)
        if turn not in handle.fold.open_turns:
            raise FailedPrecondition(
                f"turn {turn} is not open: automatic compaction runs only inside an open turn",
                reason=Reason.NO_OPEN_TURN,
                metadata={"turn": str(turn)},
            )
        _refuse_live_bracket(handle)
        outcome = StepOutcome()
        try:
            route = intended or self._pressure.logged_route(handle)
            before = self._pressure.report(handle, route)
        except CompactdError as error:
            if error.reason not in _UNPRICEABLE:
                raise
            self._warn_once(handle, _target_key(intended), error.message, outcome)
            return await self._step_result(handle, None, None, outcome, held_revision)
        after = before
        policy = self._pressure.target_policy(handle, route)
        if before.state != cpb.PRESSURE_STATE_ABOVE:
            self._guard.end_crossing(handle)
        elif policy.auto:
            after = await self._relieve(handle, route, policy, turn, outcome, progress)
        return await self._step_result(handle, before, after, outcome, held_revision)

    async def _relieve(
        self,
        handle: SessionHandle,
        route: Route,
        policy: TargetPolicy,
        turn: int,
        outcome: StepOutcome,
        progress: Progress,
    ) -> cpb.PressureReport:
        report = self._pressure.report(handle, route)

        async def prune_first() -> bool:
            """The first bracket's opening step: prune, re-measure, and say if that was enough."""
            nonlocal report
            outcome.pruned = await self.prune(handle, progress)
            report = self._pressure.report(handle, route)
            if outcome.pruned:
                await progress(_measured(report, "re-measured after pruning"))
            return report.state != cpb.PRESSURE_STATE_ABOVE

        attempts, cause = 0, "compaction did not bring it below"
        while report.state == cpb.PRESSURE_STATE_ABOVE:
            if not self._guard.may_open(handle, policy):  # this crossing's budget is spent
                if attempts == 0 and await prune_first():  # pruning opens no bracket
                    break
                await self._budget_spent(handle, policy, report, cause, outcome, progress)
                break
            if attempts > policy.compaction_retries:
                outcome.warnings.append(_still_above(report, attempts, policy, "retries exhausted"))
                break
            spec = self._pressure.spec(handle, route)
            # Every compaction of the crossing keeps the retained budget, retries included: a
            # retry never reaches into the recent tail, so on an unchanged tail it declines.
            job = _Bracket(
                handle, AUTO.trigger, AUTO.selection_for(attempts), route,
                self._shrink_route(handle, route), policy, spec.retained_budget, turn,
                min_span_tokens=self._guard.min_span_tokens(route, policy), guarded=True,
            )  # fmt: skip
            prelude = prune_first if attempts == 0 else None
            try:
                committed = await self.run_bracket(job, progress, prelude=prelude)
            except CompactdError as error:
                outcome.warnings.append(f"compaction failed ({error.reason}): {error.message}")
                cause = f"the last bracket failed with {error.reason}"
                if not self._guard.may_open(handle, policy):
                    await self._budget_spent(handle, policy, report, cause, outcome, progress)
                break
            if committed is None:  # pruning alone brought the envelope below the trigger
                break
            if isinstance(committed, Declined):
                why = f"nothing more to compact: {committed.reason}"
                outcome.warnings.append(
                    _still_above(report, attempts, policy, why)
                    if attempts
                    else f"nothing to compact: {committed.reason}"
                )
                break
            outcome.compactions.append(committed)
            attempts += 1
            report = self._pressure.report(handle, route)
            await progress(_measured(report, "re-measured after compaction"))
        return report

    # ---- Compact ---------------------------------------------------------------------------

    async def compact(
        self, session_id: str, focus: str | None, progress: Progress
    ) -> cpb.CompactResult:
        """On-demand compaction (see ``CompactionService.Compact``)."""
        handle = await self._manager.get(session_id)
        if handle.fold.open_turns:
            turns = ", ".join(str(t) for t in sorted(handle.fold.open_turns))
            raise CompactionBusy(
                f"condensation is unavailable while turn {turns} is open; retry after it ends",
                metadata={"open_turns": turns},
            )
        _refuse_live_bracket(handle)
        self._guard.end_crossing(handle)  # an explicit request starts afresh
        route = self._pressure.logged_route_or_heuristic(handle)
        policy = self._pressure.target_policy(handle, route)
        job = _Bracket(
            handle, MANUAL.trigger, MANUAL.selection, route, route, policy, focus=focus,
            min_span_tokens=self._guard.min_span_tokens(route, policy),
        )  # fmt: skip
        committed = await self.run_bracket(job, progress)
        result = cpb.CompactResult()
        if isinstance(committed, Declined):
            result.declined_reason = committed.reason
        elif committed is not None:
            result.outcome.CopyFrom(committed)
        try:
            result.after.CopyFrom(self._pressure.report(handle, route))
        except CompactdError:
            result.ClearField("after")  # no capacity for this route: no report, not an error
        return result

    # ---- pruning -----------------------------------------------------------------------------

    async def prune(
        self, handle: SessionHandle, progress: Progress, *, planner: Planner | None = None
    ) -> int:
        """Prune every oversized ``tool/result`` (callers qualify pressure first).

        ``planner(fold, shadow_price)`` replaces the configured pruner's plans (overflow
        recovery's window-sized prunes); it runs under the session's lock.
        """
        with self._tracer.start_as_current_span("compaction.prune") as span:
            span.set_attribute("compactd.session_id", handle.session_id)
            async with handle.lock:
                shadow_price = _shadow_price_of(handle)
                plans = (
                    planner(handle.fold, shadow_price)
                    if planner is not None
                    else plan_prunes(handle.fold, self._pruner, shadow_price)
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
                    detail=f"pruned tool/result {plan.shadowed_seq}",
                )
            )
        return len(plans)

    # ---- the bracket ---------------------------------------------------------------------------

    async def run_bracket(
        self,
        job: _Bracket,
        progress: Progress,
        *,
        prelude: Callable[[], Awaitable[bool]] | None = None,
    ) -> cpb.CompactionOutcome | Declined | None:
        """Run one bracket; Declined when nothing is selectable (nothing is written then).

        ``prelude`` runs first inside the bracket's span (pressure-qualified pruning); when it
        answers True no summary is needed and the bracket never opens (None). The summary target
        and its summarizer are resolved before ``compaction/start``, so a configuration error
        writes nothing to the log.

        Raises:
            CompactionBusy: Another bracket is live.
            FailedPrecondition: No model can write the summary (``SUMMARY_TARGET_UNKNOWN``) or
                its summarizer is misconfigured; nothing was written.
            BracketFailed: The bracket closed without committing (summary failed, span drifted,
                summary not smaller); the log holds its ``compaction/end`` with the error.
        """
        handle = job.handle
        compaction_id = uuid.uuid4().hex
        with self._tracer.start_as_current_span("compaction.bracket") as span:
            span.set_attribute("compactd.session_id", handle.session_id)
            trigger = events_pb2.CompactionTrigger.Name(job.trigger)
            span.set_attribute("compactd.trigger", trigger)
            if prelude is not None and await prelude():
                span.set_attribute("compactd.relieved_by", "pruning")
                self._metrics.compaction(trigger, "relieved")
                return None
            span.set_attribute("compactd.compaction_id", compaction_id)
            logs.bind(compaction_id=compaction_id)
            target = self._summarizers.target(job.policy, handle.fold.header)
            summarizer = self._summarizers.for_route(target)
            opened = await self._open(job, compaction_id, span)
            if isinstance(opened, Declined):
                span.set_attribute("compactd.declined", opened.reason)
                span.set_attribute("compactd.decline_code", opened.code)
                await self._declined(trigger, opened, progress)
                return opened
            selection, start_seq, snapshot, envelope_before = opened
            if job.guarded:
                self._guard.opened(handle, job.policy)
            await progress(_step(cpb.COMPACTION_STEP_START, compaction_id, start_seq))
            try:
                outcome = await self._summarize_and_commit(
                    job, _Writer(target, summarizer), compaction_id, selection, start_seq,
                    snapshot, envelope_before, progress,
                )  # fmt: skip
            except BaseException as error:
                self._metrics.compaction(trigger, "failed", reason=_close_reason(error)[1])
                await asyncio.shield(self._close(handle, compaction_id, error, progress))
                self._guard.failed(handle, selection, target, _close_reason(error)[1], job.policy)
                if not isinstance(error, Exception):
                    _record_error(span, error)  # the span records Exceptions, not cancellation
                raise
            await self._close(handle, compaction_id, None, progress)
            span.set_attribute("compactd.tokens_freed", outcome.tokens_freed)
            self._metrics.compaction(trigger, "committed", freed=outcome.tokens_freed)
            return outcome

    async def _open(
        self, job: _Bracket, compaction_id: str, parent: Span
    ) -> tuple[Selection, int, SurfaceSnapshot, int] | Declined:
        handle = job.handle
        with self._tracer.start_as_current_span("compaction.start") as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            async with handle.lock:
                _refuse_live_bracket(handle)
                meter = handle.context.meter
                chosen = choose_span(
                    handle.fold, node_pricer(meter, handle.fold, job.route),
                    selection=job.mode, retained_budget=job.retained_budget,
                    min_span_tokens=job.min_span_tokens, hold=partial(self._held, job),
                    span_price=span_pricer(meter, handle.fold, job.route),
                )  # fmt: skip
                if isinstance(chosen, Declined):
                    return chosen
                snapshot = surface_snapshot(handle.fold)
                envelope_before = meter.measure(handle.fold, job.route).total
                start = bracket.start_event(compaction_id, job.trigger, chosen, job.turn)
                result = await handle.append_locked([start])
            for target in (span, parent):
                _range_attributes(target, chosen)
            span.set_attribute("compactd.seq", result.seqs[0])
            parent.set_attribute("compactd.tokens_before", envelope_before)
        return chosen, result.seqs[0], snapshot, envelope_before

    async def _summarize_and_commit(
        self,
        job: _Bracket,
        writer: _Writer,
        compaction_id: str,
        selection: Selection,
        start_seq: int,
        snapshot: SurfaceSnapshot,
        envelope_before: int,
        progress: Progress,
    ) -> cpb.CompactionOutcome:
        handle, target = job.handle, writer.target
        attempt = 1
        facts = None  # the gate's span facts, extracted while a model writes (``facts_beside``)
        try:
            while True:
                # Re-derived on every attempt: a recovery's change (an offload) must show.
                request, serialized = _summary_request(
                    handle, selection, target, job.policy, job.focus
                )
                facts = self._guard.facts_beside(job.policy, request, writer.summarizer)
                try:
                    summary = await self._summarize(compaction_id, writer, request, progress)
                    break
                except SummaryError as error:
                    drop_facts(facts)
                    failure = SummaryFailure(compaction_id, error, attempt, selection)
                    await self._summary_error(job, failure, snapshot, progress)
                    # The recovery changed the span's projection (an offload): re-price the
                    # span and the envelope, so the figures logged with the summary are today's.
                    selection, envelope_before = await self._repriced(
                        job, selection, envelope_before
                    )
                attempt += 1
            screened = await self._guard.screen(
                policy=job.policy, compaction_id=compaction_id, request=request, summary=summary,
                serialized=serialized, summarizer=writer.summarizer.name, target=target,
                span_tokens=_span_tokens(handle, selection, job.shrink_route),
                shrink_route=job.shrink_route, progress=progress, facts=facts,
            )  # fmt: skip
        finally:
            drop_facts(facts)
        summary = screened.summary
        framed = prompts.frame_checkpoint(summary.text)
        with self._tracer.start_as_current_span("compaction.summary") as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            async with handle.lock:
                handle.check_bracket(compaction_id)  # replicas: not taken over meanwhile
                scope = revalidation_for(job.trigger)
                stale = drift(handle.fold, selection, snapshot, scope)
                if stale is not None:
                    raise BracketFailed(
                        f"stale summary rejected: {stale}", reason=Reason.SPAN_DRIFT
                    )
                checkpoint = bracket.checkpoint_message(compaction_id, framed)
                checkpoint_route = (
                    screened.checkpoint_tokens
                    if screened.checkpoint_tokens is not None
                    else route_price(checkpoint, job.shrink_route)
                )
                shadowed_route = handle.context.meter.route_price_of_nodes(
                    handle.fold, selection.shadowed_seqs, job.shrink_route
                )
                if not bracket.shrinks(checkpoint_route, shadowed_route):
                    raise BracketFailed(
                        f"the summary ({checkpoint_route} tokens framed) is not smaller than "
                        f"the span it replaces ({shadowed_route} tokens)",
                        reason=Reason.SUMMARY_NOT_SMALLER,
                        metadata={
                            "checkpoint_tokens": str(checkpoint_route),
                            "shadowed_tokens": str(shadowed_route),
                        },
                    )
                tokens = events_pb2.TokenMeasurement(
                    envelope_before=envelope_before,
                    envelope_after=envelope_before
                    - selection.shadowed_price
                    + (
                        checkpoint_route  # the same pricing: one tokenization of the summary
                        if job.route.pricing == job.shrink_route.pricing
                        else route_price(checkpoint, job.route)
                    ),
                    shadowed_tokens=_shadow_price(handle, selection),
                    checkpoint_tokens=heuristic_price(checkpoint),
                    shadowed_route_tokens=shadowed_route,
                    checkpoint_route_tokens=checkpoint_route,
                )
                summary_seq = handle.fold.revision
                events = [
                    bracket.summary_event(
                        compaction_id, summary.text, selection, tokens,
                        target=events_pb2.Route(
                            provider=screened.target.provider, model=screened.target.model
                        ),
                        usage=summary.usage,
                        summarizer=screened.summarizer,
                        gate=screened.report,
                        fallback=screened.fallback,
                    ),
                    bracket.checkpoint_event(
                        compaction_id, framed, selection, start_seq, summary_seq
                    ),
                ]  # fmt: skip
                result = await handle.append_locked(events)
            span.set_attribute("compactd.seq", result.seqs[0])
            span.set_attribute("compactd.tokens_before", tokens.envelope_before)
            span.set_attribute("compactd.tokens_after", tokens.envelope_after)
            _range_attributes(span, selection)
        await progress(_step(cpb.COMPACTION_STEP_SUMMARY, compaction_id, result.seqs[0]))
        with self._tracer.start_as_current_span("compaction.replace") as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            span.set_attribute("compactd.seq", result.seqs[1])
            span.set_attribute("compactd.checkpoint_tokens", checkpoint_route)
            _range_attributes(span, selection)
        await progress(_step(cpb.COMPACTION_STEP_REPLACE, compaction_id, result.seqs[1]))
        return cpb.CompactionOutcome(
            compaction_id=compaction_id,
            items_condensed=selection.count,
            tokens_freed=shadowed_route - checkpoint_route,
            range=bracket.surface_range(selection),
            checkpoint_seq=result.seqs[1],
        )

    async def _summarize(
        self,
        compaction_id: str,
        writer: _Writer,
        request: SummaryRequest,
        progress: Progress,
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
                    _redact_error(error, self.redact)  # provider text may echo credentials
                    _record_error(span, error)  # the summary-error step reports it to the caller
                    call.failed(error)
                    raise
                call.answered(summary)
        summary = replace(summary, text=self.redact_summary(summary.text))
        await progress(
            _step(cpb.COMPACTION_STEP_SUMMARIZE, compaction_id, -1, f"{len(summary.text)} chars")
        )
        return summary

    async def _summary_error(
        self,
        job: _Bracket,
        failure: SummaryFailure,
        snapshot: SurfaceSnapshot,
        progress: Progress,
    ) -> None:
        """The summary-error step: log it, let a recovery record a change, or fail the bracket.

        Returns when the summary may be retried; raises ``BracketFailed`` otherwise.
        """
        handle, error = job.handle, failure.error
        recovery = next((r for r in self._recoveries if r.wants(error)), None)
        retrying = recovery is not None and failure.attempt < MAX_SUMMARY_ATTEMPTS
        async with handle.lock:
            handle.check_bracket(failure.compaction_id)
            stale = drift(handle.fold, failure.selection, snapshot, revalidation_for(job.trigger))
            if stale is not None:
                raise BracketFailed(
                    f"stale span after a failed summary: {stale}", reason=Reason.SPAN_DRIFT
                )
            event = bracket.summary_error_event(
                failure.compaction_id, error.message, error.reason,
                attempt=failure.attempt, retrying=retrying,
            )  # fmt: skip
            result = await handle.append_locked([event])
        await progress(
            _step(
                cpb.COMPACTION_STEP_SUMMARIZE,
                failure.compaction_id,
                result.seqs[0],
                f"failed: {error}" + (" (recovering)" if retrying else ""),
            )
        )
        if recovery is None or not retrying:
            raise BracketFailed(
                f"the summary request failed: {error.message}", reason=error.reason
            ) from error
        if not await recovery.recover(handle, failure):
            raise BracketFailed(
                f"the summary request failed and its recovery recorded no change: {error.message}",
                reason=error.reason,
            ) from error

    async def _close(
        self,
        handle: SessionHandle,
        compaction_id: str,
        error: BaseException | None,
        progress: Progress,
    ) -> None:
        """Step 5: exactly one closing attempt; a failure leaves the orphan start in place."""
        message, reason = _close_reason(error)
        gate = error.gate if isinstance(error, SummaryRejected) else None
        with self._tracer.start_as_current_span("compaction.end") as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            try:
                async with handle.lock:
                    result = await handle.append_locked(
                        [bracket.end_event(compaction_id, message, reason, gate=gate)]
                    )
            except Exception as close_error:
                # Replicas: stop renewing, so the orphan's lease lapses and it is taken over.
                handle.leases.drop(compaction_id)
                _record_error(span, close_error)
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

    async def _repriced(
        self, job: _Bracket, selection: Selection, envelope_before: int
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

    # ---- the guard's hooks (service.guard) -------------------------------------------------------

    def _held(self, job: _Bracket, chosen: Selection) -> Declined | None:
        """Failure memory's say on a selected span (guarded jobs only; called under the lock)."""
        if not job.guarded:
            return None
        target = self._summarizers.target(job.policy, job.handle.fold.header)
        return self._guard.hold(job.handle, chosen, target, job.policy)

    async def _declined(self, trigger: str, declined: Declined, progress: Progress) -> None:
        if declined.code is DeclineCode.KNOWN_FAILURE:
            self._metrics.compaction(trigger, "skipped", reason=declined.code)
            await progress(_step(cpb.COMPACTION_STEP_SKIP, "", -1, declined.reason))
        else:
            self._metrics.compaction(trigger, "declined", reason=declined.code)

    async def _budget_spent(
        self,
        handle: SessionHandle,
        policy: TargetPolicy,
        report: cpb.PressureReport,
        why: str,
        outcome: StepOutcome,
        progress: Progress,
    ) -> None:
        """The crossing may open no more brackets: say so once, skip silently afterwards."""
        note = self._guard.exhausted(handle, policy, report, why)
        if note is not None:
            outcome.warnings.append(note)
            await progress(_step(cpb.COMPACTION_STEP_SKIP, "", -1, note))

    # ---- helpers -------------------------------------------------------------------------------

    def _shrink_route(self, handle: SessionHandle, destination: Route) -> Route:
        try:
            return self._pressure.logged_route(handle)
        except CompactdError:
            return destination

    def _warn_once(
        self, handle: SessionHandle, target: str, message: str, outcome: StepOutcome
    ) -> None:
        warned = handle.context.memory.warned_targets
        if target not in warned:
            warned.add(target)
            outcome.warnings.append(f"pressure check skipped for {target}: {message}")
            log.warning(
                "pressure check skipped", extra={"session_id": handle.session_id, "error": message}
            )

    async def _step_result(
        self,
        handle: SessionHandle,
        before: cpb.PressureReport | None,
        after: cpb.PressureReport | None,
        outcome: StepOutcome,
        held_revision: int | None,
    ) -> cpb.PrepareStepResult:
        result = cpb.PrepareStepResult(
            pruned_count=outcome.pruned, compactions=outcome.compactions, warnings=outcome.warnings
        )
        # The request shows committed events only, of the fold as the step last caught it up
        # (on a shared store, catching up again would read the session's revision once more).
        async with handle.lock.as_cached():
            fold = handle.fold
            result.request_revision = fold.revision
            appended = None if held_revision is None else fold.appended_since(held_revision)
            if appended is None:
                result.request.CopyFrom(build_request(handle))
            else:
                # Cost follows the step: the nodes appended since the caller's request, not the
                # whole surface (the caller holds the rest).
                result.request_unchanged = True
                result.appended_messages.extend(appended_messages(fold, appended))
        if before is not None:
            result.before.CopyFrom(before)
        if after is not None:
            result.after.CopyFrom(after)
        return result


def check_held_revision(handle: SessionHandle, held_revision: int | None) -> None:
    """Refuse a ``held_revision`` no request of this session was built at."""
    revision = handle.fold.revision
    if held_revision is not None and not 0 <= held_revision <= revision:
        description = f"must be a revision of the session, 0..{revision}; got {held_revision}"
        raise InvalidArgument(
            f"held_revision {description}",
            violations=[FieldViolation("held_revision", description)],
        )


def _still_above(report: cpb.PressureReport, attempts: int, policy: TargetPolicy, why: str) -> str:
    """The warning of a step whose compactions could not bring pressure below the trigger."""
    return (
        f"pressure stays above the trigger after {attempts} compaction(s) ({why}): "
        f"measured {report.measured_tokens} >= trigger {report.trigger_tokens} "
        f"(compactionRetries={policy.compaction_retries}); continuing with this surface"
    )


def _refuse_live_bracket(handle: SessionHandle) -> None:
    live = live_bracket(handle.fold.lock)
    if live is not None:
        raise CompactionBusy(
            f"compaction {live.compaction_id} (started at seq {live.start_seq}) is still running",
            metadata={"compaction_id": live.compaction_id, "start_seq": str(live.start_seq)},
        )


#: For the recovery flows (``service.recovery``, ``service.switch``).
refuse_live_bracket = _refuse_live_bracket


def _shadow_price_of(handle: SessionHandle) -> Callable[[SurfaceNode], int]:
    """The fixed heuristic price of a current node, as logged (projection applied)."""
    offloads = handle.fold.offloads

    def price(node: SurfaceNode) -> int:
        return heuristic_price(node.event, offloads.get(node.seq, frozenset()))

    return price


#: For the dry run (``service.inspection``).
shadow_price_of = _shadow_price_of


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


def _shadow_price(handle: SessionHandle, selection: Selection) -> int:
    return shadow_price_of_nodes(handle.context.meter, handle.fold, selection.shadowed_seqs)


def _span_tokens(handle: SessionHandle, selection: Selection, route: Route) -> int | None:
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


def _summary_request(
    handle: SessionHandle,
    selection: Selection,
    target: Route,
    policy: TargetPolicy,
    focus: str | None,
) -> tuple[SummaryRequest, list[bytes]]:
    """System head, then the span's messages exactly as the conversation sends them; and, one
    per message, bytes that hold its text blocks verbatim (the gate's echo check reads them).
    """
    fold = handle.fold
    nodes = fold.surface.nodes
    span_nodes: list[SurfaceNode] = list(
        nodes[selection.start_position : selection.end_position + 1]
    )
    if nodes and selection.start_position > 0 and nodes[0].type == ev.SYSTEM_MESSAGE:
        span_nodes.insert(0, nodes[0])
    messages, serialized = projected_span(fold, span_nodes)
    config = events_pb2.RequestConfig(provider=target.provider, model=target.model)
    header = fold.header
    if header is not None and (header.config.provider, header.config.model) == (
        target.provider,
        target.model,
    ):
        config.CopyFrom(header.config)  # same route: same sampling, so the prefix stays warm
    tools: Sequence[events_pb2.ToolDeclaration] = header.tools if header is not None else ()
    request = SummaryRequest(
        messages=messages,
        tools=list(tools),
        config=config,
        instruction=prompts.compaction_instruction(focus),
        max_tokens=policy.max_tokens,
    )
    return request, serialized


def _close_reason(error: BaseException | None) -> tuple[str, str]:
    if error is None:
        return "", ""
    if isinstance(error, asyncio.CancelledError):
        return "cancelled by the caller", Reason.CANCELLED
    if isinstance(error, CompactdError):
        return error.message, error.reason
    return f"internal error: {type(error).__name__}", Reason.INTERNAL


def _redact_error(error: CompactdError, redact: Callable[[str], str]) -> None:
    """Redact ``error``'s message (and what ``str(error)`` shows) in place, and cut the chain of
    exceptions it was raised from: their texts (a URL, a first attempt's error) would show in
    every traceback recorded later, on spans and in logs."""
    error.message = redact(error.message)
    error.args = (error.message,)
    error.__cause__ = None
    error.__context__ = None
    error.__suppress_context__ = True


def _record_error(span: Span, error: BaseException) -> None:
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))


def _range_attributes(span: Span, selection: Selection) -> None:
    span.set_attribute("compactd.range.start_position", selection.start_position)
    span.set_attribute("compactd.range.end_position", selection.end_position)
    span.set_attribute("compactd.range.start_seq", selection.start_seq)
    span.set_attribute("compactd.range.end_seq", selection.end_seq)
    span.set_attribute("compactd.shadowed_count", selection.count)


def _step(
    step: cpb.CompactionStep.ValueType, compaction_id: str, seq: int, detail: str = ""
) -> cpb.CompactionProgress:
    return cpb.CompactionProgress(step=step, compaction_id=compaction_id, seq=seq, detail=detail)


def _measured(report: cpb.PressureReport, detail: str) -> cpb.CompactionProgress:
    return cpb.CompactionProgress(
        step=cpb.COMPACTION_STEP_MEASURE,
        seq=-1,
        measured_tokens=report.measured_tokens,
        detail=detail,
    )


def _target_key(route: Route | None) -> str:
    return route.name if route is not None else "the logged route"
