"""The front door of a step: ``PrepareStep``, ``PrepareStepUnary`` and ``Compact``.

``StepService.prepare_step`` reads as the policy it runs, before every model call of an open turn:

1. the session may run compaction work now (an open turn, no live bracket, a ``held_revision``
   of the session);
2. a step to another route first fits history to that route (``service.switch``: its window,
   its policy) and logs its header;
3. the envelope is priced on the step's route; a route that cannot be priced (no capacity, a
   policy that does not fit its window, no route at all) warns once per target and goes on;
4. below the trigger nothing happens (a below-pressure step never prunes); above it, with
   ``auto``, the step goes down a ladder (``_relieve``): it prunes, runs one bracket
   (``service.bracket``), and while the request is still over the window masks older tool
   outputs and runs the overflow path's extractive bracket; every step ends with a typed
   outcome (``core.outcome``);
5. the result carries the reports before and after, what was pruned and compacted, the
   warnings, and the request to send (only the messages appended since ``held_revision`` when
   the surface just grew since).

``compact`` is the on-demand path: between turns, below pressure too, one bracket.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from functools import partial

from compactd.core.fold import SessionFold
from compactd.core.outcome import Outcome, StepFigures, floor_tokens, outcome_of
from compactd.core.planner import SHAPES, PlanMode, node_pricer, span_pricer
from compactd.core.policy import TargetPolicy
from compactd.core.selection import DeclineCode, Declined, SelectionMode
from compactd.errors import CompactdError, CompactionBusy
from compactd.providers.extractive import CHECKPOINT_FRAME_TOKENS, SKELETON_TOKENS
from compactd.reasons import Reason
from compactd.routes import Route
from compactd.service.ahead import AheadService
from compactd.service.bracket import Bracket, BracketFailed, Brackets, Progress
from compactd.service.guard import CompactionGuard
from compactd.service.preconditions import (
    check_held_revision,
    refuse_live_bracket,
    require_open_turn,
)
from compactd.service.pressure import PressureService
from compactd.service.pruning import Pruning
from compactd.service.requests import appended_messages, request_in_steps
from compactd.service.screening import SummaryRejected
from compactd.service.sessions import SessionHandle, SessionManager
from compactd.service.switch import SwitchService
from compactd.v1 import compaction_service_pb2 as cpb

log = logging.getLogger(__name__)

AUTO = SHAPES[PlanMode.AUTO]
MANUAL = SHAPES[PlanMode.MANUAL]
ABOVE = cpb.PRESSURE_STATE_ABOVE
#: Why a step could not be priced: it warns once per target and goes on unpriced.
_UNPRICEABLE = frozenset({Reason.CAPACITY_UNKNOWN, Reason.POLICY_INVALID, Reason.ROUTE_UNKNOWN})
_IN_A_TURN = "automatic compaction runs only inside an open turn"
#: The least output a model is asked to write a summary in when the window's room cuts the cap:
#: below it the eight sections hardly fit, the call would end cut off (``SUMMARY_TRUNCATED``), and
#: the extractive checkpoint is written without it.
MODEL_SUMMARY_TOKENS = 256
_OUTCOMES = {
    Outcome.FITS: cpb.PRESSURE_OUTCOME_FITS,
    Outcome.ABOVE_TRIGGER: cpb.PRESSURE_OUTCOME_ABOVE_TRIGGER,
    Outcome.OVER_WINDOW_IRREDUCIBLE: cpb.PRESSURE_OUTCOME_OVER_WINDOW_IRREDUCIBLE,
    Outcome.OVER_WINDOW: cpb.PRESSURE_OUTCOME_OVER_WINDOW,
    Outcome.UNPRICED: cpb.PRESSURE_OUTCOME_UNPRICED,
}


@dataclass
class StepOutcome:
    """What a step did besides measuring."""

    pruned: int = 0
    compactions: list[cpb.CompactionOutcome] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class _Relief:
    """One step's relief of pressure above the trigger, as it goes."""

    handle: SessionHandle
    route: Route
    policy: TargetPolicy
    turn: int
    outcome: StepOutcome
    progress: Progress
    report: cpb.PressureReport
    brackets: int = 0  # brackets opened
    why: str = ""  # why pressure stays above the trigger (the outcome's detail)
    floor: int = 0  # tokens no reduction removes (measured when pressure is above the trigger)


@dataclass(frozen=True)
class _Ended:
    """Where a priced step ended: its reports and its typed outcome."""

    before: cpb.PressureReport
    after: cpb.PressureReport
    outcome: Outcome
    floor: int
    detail: str


class StepService:
    """Runs steps and on-demand compactions for sessions; one instance per server."""

    def __init__(
        self,
        manager: SessionManager,
        pressure: PressureService,
        brackets: Brackets,
        pruning: Pruning,
        switch: SwitchService,
        ahead: AheadService | None = None,
    ) -> None:
        self._manager = manager
        self._ahead = ahead
        self._pressure = pressure
        self._brackets = brackets
        self._guard: CompactionGuard = brackets.guard
        self._pruning = pruning
        self._switch = switch

    # ---- PrepareStep -------------------------------------------------------------------------

    async def prepare_step(
        self,
        session_id: str,
        turn: int,
        intended: Route | None,
        progress: Progress,
        held_revision: int | None = None,
        *,
        held_incarnation: str = "",
        into: cpb.PrepareStepResult | None = None,
    ) -> cpb.PrepareStepResult:
        """The pre-step check (see ``CompactionService.PrepareStep``).

        ``held_revision``: the revision of the request the caller holds; the result then omits
        the full request when the surface only grew since (``SessionFold.appended_since``).
        ``held_incarnation``: the incarnation of the session that request is of; when it is not
        this session's (the id was deleted and created again: revisions restarted), the held
        request is of a log that is gone and the result carries the full request. Empty: the
        held revision is taken to be of this session (a client before incarnations).
        ``into``: an empty result to write the answer in (a reply's own field, so the reply
        does not copy it); a new one when None. The result written is returned.

        Raises:
            NotFound: The session does not exist.
            InvalidArgument: ``held_revision`` is negative or beyond the session's revision
                (and of this incarnation).
            FailedPrecondition: ``NO_OPEN_TURN`` when ``turn`` is not open;
                ``MODEL_SWITCH_COMPACTION_FAILED`` when a changed route cannot be fitted.
            CompactionBusy: A bracket is live.
        """
        handle = await self._manager.get(session_id)
        if held_incarnation and held_incarnation != handle.incarnation:
            held_revision = None  # of another session of this id: its revisions name nothing here
        check_held_revision(handle, held_revision)
        require_open_turn(handle, turn, _IN_A_TURN)
        refuse_live_bracket(handle)
        switched = None
        if intended is not None and self._switch.is_switch(handle, intended):
            switched = await self._switch.fit(handle, intended, turn, progress)
        outcome = StepOutcome()
        ended = await self._measured_and_relieved(handle, turn, intended, outcome, progress)
        result = await self._step_result(handle, ended, outcome, held_revision, into)
        if switched is not None:
            switched.lead(result)
        return result

    async def _measured_and_relieved(
        self,
        handle: SessionHandle,
        turn: int,
        intended: Route | None,
        outcome: StepOutcome,
        progress: Progress,
    ) -> _Ended | None:
        """Where the step ends after its relief; None when the route cannot be priced."""
        try:
            route = intended or self._pressure.logged_route(handle)
            before = self._pressure.report(handle, route)
        except CompactdError as error:
            if error.reason not in _UNPRICEABLE:
                raise
            target = intended.name if intended is not None else "the logged route"
            self._warn_once(handle, target, error.message, outcome)
            return None
        policy = self._pressure.target_policy(handle, route)
        relief = _Relief(handle, route, policy, turn, outcome, progress, before)
        if before.state == ABOVE:
            if policy.auto:
                await self._relieve(relief)
            else:
                relief.why = f"automatic compaction is off for {route.name} (auto)"
        elif self._ahead is not None:  # below the trigger: at most start a candidate, never wait
            self._ahead.consider(handle, route)
        return self._ended(before, relief)

    async def _relieve(self, relief: _Relief) -> None:
        """Go down the ladder until the request fits, with one bracket at most: a summary
        prepared ahead (``service.ahead``), applied first, before pruning changes its span, is
        that bracket when there is one; else prune and run one bracket (the summary target's
        summary, else the extractive checkpoint of the same span; over the window, the maximal
        span with a summary cut to the room the window leaves); while the request is over the
        window, mask older tool outputs, and only when no bracket opened yet (the span was too
        small to be worth one), the overflow path's maximal extractive bracket. No model call
        when the floor alone is at or above the trigger; no work repeated (``guard``)."""
        if await self._applied_ahead(relief):
            return
        committed = True if relief.brackets else await self._compact_once(relief, first=True)
        if committed is None or not _over_window(relief.report) or self._irreducible(relief):
            return
        await self._mask(relief)
        if (
            _over_window(relief.report)
            and not relief.brackets
            and relief.policy.compaction_retries > 0
        ):
            await self._compact_once(relief, first=False)

    async def _applied_ahead(self, relief: _Relief) -> bool:
        """The candidate prepared ahead, applied if there is one (``AheadService.apply``);
        whether that brought pressure below the trigger. A candidate whose bracket opened and
        failed (the gate rejected it) was the step's one bracket: no second one follows. Over
        the window none is applied: a span chosen before the trigger is too small to make the
        request fit, and the step runs one bracket only (the maximal one)."""
        if self._ahead is None or not relief.policy.prepares_ahead:
            return False  # off: not even the job is built
        if _over_window(relief.report):  # the step's one bracket must take the maximal span
            return False
        job = self._job(relief, first=True)
        try:
            committed = await self._ahead.apply(relief.handle, job, relief.progress)
        except (BracketFailed, SummaryRejected) as error:  # the step's one bracket ran, failed
            relief.brackets += 1
            relief.outcome.warnings.append(f"compaction failed ({error.reason}): {error.message}")
            relief.why = f"the bracket prepared ahead failed with {error.reason}"
            return False
        if committed is None:
            return False
        relief.brackets += 1
        relief.outcome.compactions.append(committed)
        relief.report = self._pressure.report(relief.handle, relief.route)
        await relief.progress(_measured(relief.report, "re-measured after compaction"))
        return relief.report.state != ABOVE

    def _job(self, relief: _Relief, *, first: bool) -> Bracket:
        """The relief's next bracket, on what the step measured last: a request over the window
        reaches for everything but the last unit (the first bracket still declines a span too
        small to be worth a checkpoint: masking is cheaper), with a summary cut to the room the
        window leaves beside the floor and the extractive checkpoint of the same span when the
        target's summary fails (in the same bracket: a step runs one); the overflow path's (not
        first) and one whose floor alone is above the trigger write the extractive checkpoint,
        no model call, as does one whose room leaves a model fewer than ``MODEL_SUMMARY_TOKENS``
        (a call bound to be cut off); the overflow path's is not judged by the quality gate (only
        the shrink check)."""
        handle, route, policy = relief.handle, relief.route, relief.policy
        if not first:  # the last rung: any checkpoint that fits beats a request over the window
            policy = dataclasses.replace(policy, summary_gate=False)
        maximal = _over_window(relief.report)
        cramped = False  # the room leaves a model too few tokens to finish a summary in
        room = 0
        if maximal:
            room = self._summary_room(relief)
            cap = min(policy.max_tokens, room)
            cramped = cap < min(policy.max_tokens, MODEL_SUMMARY_TOKENS)
            policy = dataclasses.replace(policy, extractive_fallback=True, max_tokens=cap)
        retained = 0 if maximal else self._pressure.spec(handle, route).retained_budget
        return Bracket(
            handle, AUTO.trigger, SelectionMode.MAXIMAL if maximal else AUTO.selection, route,
            self._shrink_route(handle, route), policy, retained, relief.turn,
            min_span_tokens=(
                self._guard.min_span_tokens(route, policy, handle.fold) if first else 0
            ),
            guarded=True,
            extractive=not first or cramped or self._floor_above_trigger(relief),
            gate_extractive=not maximal,
            room_tokens=room,
        )  # fmt: skip

    async def _compact_once(self, relief: _Relief, *, first: bool) -> bool | None:
        """One bracket of the relief (pruning first in the first one); whether it committed
        (None: pressure went below the trigger without one)."""
        handle, route = relief.handle, relief.route
        prelude = partial(self._prune_first, relief) if first else None
        try:
            committed = await self._brackets.run(
                self._job(relief, first=first), relief.progress, prelude=prelude
            )
        except CompactdError as error:
            relief.brackets += 1
            relief.outcome.warnings.append(f"compaction failed ({error.reason}): {error.message}")
            relief.why = f"the bracket failed with {error.reason}"
            return False
        if committed is None:  # pruning alone brought the envelope below the trigger
            return None
        if isinstance(committed, Declined):
            relief.outcome.warnings.append(_declined_warning(committed))
            relief.why = _declined_why(committed)
            return False
        relief.brackets += 1
        relief.outcome.compactions.append(committed)
        relief.report = self._pressure.report(handle, route)
        await relief.progress(_measured(relief.report, "re-measured after compaction"))
        return True

    async def _prune_first(self, relief: _Relief) -> bool | Declined | Bracket:
        """The first bracket's opening step: prune, re-measure, and say if that was enough, or
        why no bracket may open (the floor alone is at or above the trigger and the request fits
        the window), or the bracket to open on what pruning left."""
        relief.outcome.pruned = await self._pruning.prune(relief.handle, relief.progress)
        relief.report = self._pressure.report(relief.handle, relief.route)
        if relief.outcome.pruned:
            await relief.progress(_measured(relief.report, "re-measured after pruning"))
        if relief.report.state != ABOVE:
            return True
        relief.floor = self._floor(relief)
        if self._floor_above_trigger(relief) and (
            not _over_window(relief.report) or self._irreducible(relief)
        ):
            relief.why = (
                f"the floor ({relief.floor} tokens: the system head, the tools, the framing and "
                "the last unit) alone is at or above the trigger: no compaction brings pressure "
                "below it"
                + (" or makes the request fit" if self._irreducible(relief) else "")
                + ", so none runs"
            )
            return Declined(DeclineCode.FLOOR_ABOVE_TRIGGER, relief.why)
        return self._job(relief, first=True)

    def _summary_room(self, relief: _Relief) -> int:
        """The most the summary of a bracket whose request is over the window may take, so
        that its checkpoint fits the room the window leaves beside the floor (never below what
        the eight empty sections take: such a room leaves the request to the masking rung). A
        model's summary is capped at the policy's ``maxTokens`` too."""
        report = relief.report
        room = report.context_window - report.output_reservation - relief.floor
        return max(room - CHECKPOINT_FRAME_TOKENS, SKELETON_TOKENS)

    def _floor_above_trigger(self, relief: _Relief) -> bool:
        """Whether no summary can bring pressure below the trigger (then the extractive
        checkpoint, without a model call, is the only rung worth running)."""
        return relief.floor >= relief.report.trigger_tokens

    def _irreducible(self, relief: _Relief) -> bool:
        """Whether the floor alone does not fit the window: no rung can make the request fit."""
        report = relief.report
        return relief.floor > report.context_window - report.output_reservation

    def _floor(self, relief: _Relief) -> int:
        """The tokens no reduction removes from the step's request, measured now (0 while a
        tool call waits for its result: nothing is selectable until it arrives, which says
        nothing of the floor)."""
        handle, route = relief.handle, relief.route
        if handle.fold.surface.unanswered_calls():
            return 0
        meter = handle.context.meter
        return floor_tokens(
            handle.fold, relief.report.measured_tokens, node_pricer(meter, handle.fold, route),
            span_pricer(meter, handle.fold, route),
        )  # fmt: skip

    async def _mask(self, relief: _Relief) -> None:
        """The masking rung: older tool outputs cut to a short head and tail (and any result
        too large for the room the window leaves), so the request fits the window."""
        room = relief.report.context_window - relief.report.output_reservation - relief.floor
        masked = await self._pruning.mask(relief.handle, relief.route, room, relief.progress)
        if masked:
            relief.outcome.pruned += masked
            relief.report = self._pressure.report(relief.handle, relief.route)
            await relief.progress(_measured(relief.report, "re-measured after masking"))

    def _ended(self, before: cpb.PressureReport, relief: _Relief) -> _Ended:
        """The step's end: its reports and its typed outcome (the floor measured when pressure
        stays at or above the trigger)."""
        after = relief.report
        if after.state == ABOVE and not relief.floor:
            relief.floor = self._floor(relief)
        figures = StepFigures(
            after.measured_tokens, after.trigger_tokens,
            after.context_window - after.output_reservation, relief.floor,
        )  # fmt: skip
        kind, detail = outcome_of(figures, relief.why)
        return _Ended(before, after, kind, relief.floor if after.state == ABOVE else 0, detail)

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
        ended: _Ended | None,
        outcome: StepOutcome,
        held_revision: int | None,
        into: cpb.PrepareStepResult | None = None,
    ) -> cpb.PrepareStepResult:
        result = cpb.PrepareStepResult() if into is None else into
        # What the step did, set only when it did something (fields left at their defaults).
        if outcome.pruned:
            result.pruned_count = outcome.pruned
        if outcome.compactions:
            result.compactions.extend(outcome.compactions)
        if outcome.warnings:
            result.warnings.extend(outcome.warnings)
        # The request shows committed events only, of the fold as the step last caught it up
        # (on a shared store, catching up again would read the session's revision once more).
        # A write holds the lock from its admission to its commit: while nothing holds it, the
        # fold is committed, and the held request's answer (read without awaiting) is what
        # holding the lock would read, without the lock's context manager per step.
        if (
            held_revision is None
            or handle.lock.locked()
            or not _answered_held(result, handle.fold, held_revision)
        ):
            async with handle.lock.as_cached():
                if held_revision is None or not _answered_held(result, handle.fold, held_revision):
                    result.request_revision = handle.fold.revision
                    result.request.MergeFromString(await request_in_steps(handle))
        if ended is None:
            result.outcome = _OUTCOMES[Outcome.UNPRICED]
            result.outcome_detail = "the route could not be priced (see warnings)"
            return result
        result.before.CopyFrom(ended.before)
        result.after.CopyFrom(ended.after)
        result.outcome = _OUTCOMES[ended.outcome]
        result.floor_tokens = ended.floor
        result.outcome_detail = ended.detail
        return result

    # ---- Compact ---------------------------------------------------------------------------

    async def compact(
        self, session_id: str, focus: str | None, progress: Progress
    ) -> cpb.CompactResult:
        """On-demand compaction (see ``CompactionService.Compact``).

        Raises:
            NotFound: The session does not exist.
            CompactionBusy: A turn is open, or a bracket is live.
        """
        handle = await self._manager.get(session_id)
        if handle.fold.open_turns:
            turns = ", ".join(str(t) for t in sorted(handle.fold.open_turns))
            raise CompactionBusy(
                f"condensation is unavailable while turn {turns} is open; retry after it ends",
                metadata={"open_turns": turns},
            )
        refuse_live_bracket(handle)
        route = self._pressure.logged_route_or_heuristic(handle)
        policy = self._pressure.target_policy(handle, route)
        job = Bracket(
            handle, MANUAL.trigger, MANUAL.selection, route, route, policy, focus=focus,
            min_span_tokens=self._guard.min_span_tokens(route, policy, handle.fold),
        )  # fmt: skip
        committed = await self._brackets.run(job, progress)
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


def _declined_warning(declined: Declined) -> str:
    """A step's warning for a bracket that did not open. A span failure memory holds back is
    reported as the failure that put it there (``SUMMARY_NOT_SMALLER``, say), as a bracket
    failing with it again would be: the reference sends it again and fails the same way."""
    if declined.code is DeclineCode.KNOWN_FAILURE and declined.cause:
        return f"compaction failed ({declined.cause}): {declined.reason}"
    return f"nothing to compact: {declined.reason}"


def _declined_why(declined: Declined) -> str:
    """Why pressure stays above the trigger after ``declined`` (the outcome's detail)."""
    if declined.code is DeclineCode.KNOWN_FAILURE and declined.cause:
        return f"the bracket failed with {declined.cause} ({declined.reason})"
    return f"nothing to compact: {declined.reason}"


def _answered_held(result: cpb.PrepareStepResult, fold: SessionFold, held_revision: int) -> bool:
    """Answer the caller's held request in ``result``, if the surface only grew since
    ``held_revision``: with the messages appended since, not the whole surface (cost follows
    the step: the caller holds the rest); False, and ``result`` untouched, if it did not."""
    appended = fold.appended_since(held_revision)
    if appended is None:
        return False
    result.request_revision = fold.revision
    result.request_unchanged = True
    result.appended_messages.extend(appended_messages(fold, appended))
    return True


def _over_window(report: cpb.PressureReport) -> bool:
    """Whether a request priced by ``report`` does not fit its window less the reservation."""
    return report.measured_tokens > report.context_window - report.output_reservation


def _measured(report: cpb.PressureReport, detail: str) -> cpb.CompactionProgress:
    return cpb.CompactionProgress(
        step=cpb.COMPACTION_STEP_MEASURE,
        seq=-1,
        measured_tokens=report.measured_tokens,
        detail=detail,
    )
