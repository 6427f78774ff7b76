"""The front door of a step: ``PrepareStep``, ``PrepareStepUnary`` and ``Compact``.

``StepService.prepare_step`` reads as the policy it runs, before every model call of an open turn:

1. the session may run compaction work now (an open turn, no live bracket, a ``held_revision``
   of the session);
2. a step to another route first fits history to that route (``service.switch``: its window,
   its policy) and logs its header;
3. the envelope is priced on the step's route; a route that cannot be priced (no capacity, a
   policy that does not fit its window, no route at all) warns once per target and goes on;
4. below the trigger nothing happens (a below-pressure step never prunes) and the crossing ends;
   above it, with ``auto``, the step relieves pressure: it prunes, then runs brackets
   (``service.bracket``) on the oldest balanced spans until pressure is below the trigger, the
   policy's ``compactionRetries`` are spent, or the guard's crossing budget is;
5. the result carries the reports before and after, what was pruned and compacted, the
   warnings, and the request to send (only the messages appended since ``held_revision`` when
   the surface just grew since).

``compact`` is the on-demand path: between turns, below pressure too, one bracket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

from compactd.core.planner import SHAPES, PlanMode
from compactd.core.policy import TargetPolicy
from compactd.core.selection import Declined
from compactd.errors import CompactdError, CompactionBusy
from compactd.reasons import Reason
from compactd.routes import Route
from compactd.service.bracket import Bracket, Brackets, Progress
from compactd.service.guard import CompactionGuard
from compactd.service.preconditions import (
    check_held_revision,
    refuse_live_bracket,
    require_open_turn,
)
from compactd.service.pressure import PressureService
from compactd.service.pruning import Pruning
from compactd.service.requests import appended_messages, request_in_steps
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
    attempts: int = 0  # brackets committed
    cause: str = "compaction did not bring it below"


class StepService:
    """Runs steps and on-demand compactions for sessions; one instance per server."""

    def __init__(
        self,
        manager: SessionManager,
        pressure: PressureService,
        brackets: Brackets,
        pruning: Pruning,
        switch: SwitchService,
    ) -> None:
        self._manager = manager
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
    ) -> cpb.PrepareStepResult:
        """The pre-step check (see ``CompactionService.PrepareStep``).

        ``held_revision``: the revision of the request the caller holds; the result then omits
        the full request when the surface only grew since (``SessionFold.appended_since``).

        Raises:
            NotFound: The session does not exist.
            InvalidArgument: ``held_revision`` is negative or beyond the session's revision.
            FailedPrecondition: ``NO_OPEN_TURN`` when ``turn`` is not open;
                ``MODEL_SWITCH_COMPACTION_FAILED`` when a changed route cannot be fitted.
            CompactionBusy: A bracket is live.
        """
        handle = await self._manager.get(session_id)
        check_held_revision(handle, held_revision)
        require_open_turn(handle, turn, _IN_A_TURN)
        refuse_live_bracket(handle)
        switched = None
        if intended is not None and self._switch.is_switch(handle, intended):
            switched = await self._switch.fit(handle, intended, turn, progress)
        outcome = StepOutcome()
        reports = await self._measured_and_relieved(handle, turn, intended, outcome, progress)
        result = await self._step_result(handle, reports, outcome, held_revision)
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
    ) -> tuple[cpb.PressureReport, cpb.PressureReport] | None:
        """(before, after) the step's relief; None when the route cannot be priced."""
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
        if before.state != ABOVE:
            self._guard.end_crossing(handle)
            return before, before
        if not policy.auto:
            return before, before
        relief = _Relief(handle, route, policy, turn, outcome, progress, before)
        await self._relieve(relief)
        return before, relief.report

    async def _relieve(self, relief: _Relief) -> None:
        """Prune, then compact, until pressure is below the trigger or nothing more may run."""
        while relief.report.state == ABOVE:
            if not self._guard.may_open(relief.handle, relief.policy):
                # This crossing's budget is spent; pruning opens no bracket.
                if relief.attempts == 0 and await self._prune_first(relief):
                    return
                await self._budget_spent(relief)
                return
            if relief.attempts > relief.policy.compaction_retries:
                relief.outcome.warnings.append(_still_above(relief, "retries exhausted"))
                return
            if not await self._compact_once(relief):
                return

    async def _compact_once(self, relief: _Relief) -> bool:
        """One bracket of the relief; whether it committed (and the relief may go on)."""
        handle, route, policy = relief.handle, relief.route, relief.policy
        spec = self._pressure.spec(handle, route)
        # Every compaction of the crossing keeps the retained budget, retries included: a retry
        # never reaches into the recent tail, so on an unchanged tail it declines.
        job = Bracket(
            handle, AUTO.trigger, AUTO.selection_for(relief.attempts), route,
            self._shrink_route(handle, route), policy, spec.retained_budget, relief.turn,
            min_span_tokens=self._guard.min_span_tokens(route, policy), guarded=True,
        )  # fmt: skip
        prelude = partial(self._prune_first, relief) if relief.attempts == 0 else None
        try:
            committed = await self._brackets.run(job, relief.progress, prelude=prelude)
        except CompactdError as error:
            relief.outcome.warnings.append(f"compaction failed ({error.reason}): {error.message}")
            relief.cause = f"the last bracket failed with {error.reason}"
            if not self._guard.may_open(handle, policy):
                await self._budget_spent(relief)
            return False
        if committed is None:  # pruning alone brought the envelope below the trigger
            return False
        if isinstance(committed, Declined):
            relief.outcome.warnings.append(
                _still_above(relief, f"nothing more to compact: {committed.reason}")
                if relief.attempts
                else f"nothing to compact: {committed.reason}"
            )
            return False
        relief.outcome.compactions.append(committed)
        relief.attempts += 1
        relief.report = self._pressure.report(handle, route)
        await relief.progress(_measured(relief.report, "re-measured after compaction"))
        return True

    async def _prune_first(self, relief: _Relief) -> bool:
        """The first bracket's opening step: prune, re-measure, and say if that was enough."""
        relief.outcome.pruned = await self._pruning.prune(relief.handle, relief.progress)
        relief.report = self._pressure.report(relief.handle, relief.route)
        if relief.outcome.pruned:
            await relief.progress(_measured(relief.report, "re-measured after pruning"))
        return relief.report.state != ABOVE

    async def _budget_spent(self, relief: _Relief) -> None:
        """The crossing may open no more brackets: say so once, skip silently afterwards."""
        note = self._guard.exhausted(relief.handle, relief.policy, relief.report, relief.cause)
        if note is not None:
            relief.outcome.warnings.append(note)
            await relief.progress(
                cpb.CompactionProgress(step=cpb.COMPACTION_STEP_SKIP, seq=-1, detail=note)
            )

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
        reports: tuple[cpb.PressureReport, cpb.PressureReport] | None,
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
                result.request.MergeFromString(await request_in_steps(handle.fold))
            else:
                # Cost follows the step: the nodes appended since the caller's request, not the
                # whole surface (the caller holds the rest).
                result.request_unchanged = True
                result.appended_messages.extend(appended_messages(fold, appended))
        if reports is not None:
            result.before.CopyFrom(reports[0])
            result.after.CopyFrom(reports[1])
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
        self._guard.end_crossing(handle)  # an explicit request starts afresh
        route = self._pressure.logged_route_or_heuristic(handle)
        policy = self._pressure.target_policy(handle, route)
        job = Bracket(
            handle, MANUAL.trigger, MANUAL.selection, route, route, policy, focus=focus,
            min_span_tokens=self._guard.min_span_tokens(route, policy),
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


def _still_above(relief: _Relief, why: str) -> str:
    """The warning of a step whose compactions could not bring pressure below the trigger."""
    report, policy = relief.report, relief.policy
    return (
        f"pressure stays above the trigger after {relief.attempts} compaction(s) ({why}): "
        f"measured {report.measured_tokens} >= trigger {report.trigger_tokens} "
        f"(compactionRetries={policy.compaction_retries}); continuing with this surface"
    )


def _measured(report: cpb.PressureReport, detail: str) -> cpb.CompactionProgress:
    return cpb.CompactionProgress(
        step=cpb.COMPACTION_STEP_MEASURE,
        seq=-1,
        measured_tokens=report.measured_tokens,
        detail=detail,
    )
