"""SwitchModel, and PrepareStep with a changed route: history fitted to a destination first.

Before a request to another provider/model is committed, history is measured against the
destination: its declared capacity, its default output reservation, its pressure policy. A
destination without capacity or without a valid pressure budget is refused even for short
history (a 64k window with the default 65,536-token headroom, say: set ``headroomTokens`` for
that route). Above the destination's trigger, the service prunes, then compacts (trigger
MODEL_SWITCH, the destination's retained budget, convergence retries under its
``compactionRetries``) with the previous routed model's summarizer and summary settings (an
explicit summary target wins), until history is below the trigger. Only then is the destination
``request/header`` appended (reason CHANGE).

A failure is FAILED_PRECONDITION ``MODEL_SWITCH_COMPACTION_FAILED`` naming the cause; the previous
header stays in force, and prunes and checkpoints already committed remain.

Cross-model image pricing (the seed's known limitation): range selection prices with the
destination route, the shrink check with the committed route. When the two price images
differently, a summary that would relieve the destination can fail the shrink check
(``SUMMARY_NOT_SMALLER``) and the switch fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from compactd.core.planner import SHAPES, PlanMode
from compactd.core.selection import Declined, SelectionMode
from compactd.errors import CompactdError, CompactionBusy, FailedPrecondition
from compactd.reasons import Reason
from compactd.routes import Route
from compactd.service.bracket import Bracket, Brackets, Progress
from compactd.service.preconditions import refuse_live_bracket, require_open_turn
from compactd.service.pressure import PressureService
from compactd.service.pruning import Pruning
from compactd.service.requests import request_in_steps
from compactd.service.sessions import SessionHandle, SessionManager
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2

SWITCH = SHAPES[PlanMode.SWITCH]
ABOVE = cpb.PRESSURE_STATE_ABOVE


@dataclass
class Switched:
    """What one switch did."""

    before: cpb.PressureReport
    after: cpb.PressureReport
    pruned: int = 0
    compactions: list[cpb.CompactionOutcome] = field(default_factory=list)
    header_seq: int | None = None

    def lead(self, step: cpb.PrepareStepResult) -> None:
        """Put the switch before the step that followed it: the step's report before is the
        switch's, its prunes and compactions come after the switch's."""
        step.before.CopyFrom(self.before)
        step.pruned_count += self.pruned
        committed = [*self.compactions, *step.compactions]
        del step.compactions[:]
        step.compactions.extend(committed)
        if self.header_seq is not None:
            step.header_seq = self.header_seq


class SwitchService:
    """Runs model switches for sessions; one instance per server."""

    def __init__(
        self,
        manager: SessionManager,
        pressure: PressureService,
        brackets: Brackets,
        pruning: Pruning,
    ) -> None:
        self._manager = manager
        self._pressure = pressure
        self._brackets = brackets
        self._pruning = pruning

    async def switch_model(
        self, session_id: str, destination: Route, turn: int | None, progress: Progress
    ) -> cpb.SwitchModelResult:
        """Fit history to ``destination`` and log its header (see ``CompactionService``).

        Raises:
            NotFound: The session does not exist.
            FailedPrecondition: ``NO_OPEN_TURN`` when ``turn`` is set and not open;
                ``MODEL_SWITCH_COMPACTION_FAILED`` when the switch cannot be made.
            CompactionBusy: A bracket is live.
        """
        handle = await self._manager.get(session_id)
        if turn is not None:
            require_open_turn(handle, turn, "a model switch runs for a step of an open turn")
        refuse_live_bracket(handle)
        switched = await self.fit(handle, destination, turn, progress)
        result = cpb.SwitchModelResult(
            before=switched.before,
            after=switched.after,
            compactions=switched.compactions,
            pruned_count=switched.pruned,
        )
        if switched.header_seq is not None:
            result.header_seq = switched.header_seq
        async with handle.lock:
            result.request.MergeFromString(await request_in_steps(handle))
        return result

    def is_switch(self, handle: SessionHandle, intended: Route) -> bool:
        """Whether a step to ``intended`` changes the logged route (and ``auto`` checks it)."""
        header = handle.fold.header
        if header is None or not (header.config.provider and header.config.model):
            return False
        if (header.config.provider, header.config.model) == (intended.provider, intended.model):
            return False
        return self._pressure.target_policy(handle, intended).auto

    async def fit(
        self, handle: SessionHandle, destination: Route, turn: int | None, progress: Progress
    ) -> Switched:
        """Fit history to ``destination`` and log its header (``PrepareStep`` to a changed route
        calls it first).

        Raises:
            FailedPrecondition: ``MODEL_SWITCH_COMPACTION_FAILED`` naming the cause.
            CompactionBusy: A bracket went live meanwhile.
        """
        try:
            before = self._pressure.report(handle, destination)
        except CompactdError as error:
            raise _failed(destination, error.reason, error.message) from error
        switched = Switched(before, before)
        if before.state == ABOVE:
            await self._fit(handle, destination, turn, switched, progress)
        switched.header_seq = await self._log_header(handle, destination, progress)
        switched.after = self._pressure.report(handle, destination)
        return switched

    async def _fit(
        self,
        handle: SessionHandle,
        destination: Route,
        turn: int | None,
        switched: Switched,
        progress: Progress,
    ) -> None:
        """Prune, then compact until history is below the destination trigger (or fail)."""
        policy = self._pressure.target_policy(handle, destination)
        previous = self._pressure.logged_route_or_heuristic(handle)
        writer_policy = self._pressure.target_policy(handle, previous)  # its summary settings
        shrink = previous if previous.model else destination
        retained = self._pressure.spec(handle, destination).retained_budget
        switched.pruned = await self._pruning.prune(handle, progress)
        report = await self._measured(handle, destination, progress, "after pruning")
        attempts = 0
        while report.state == ABOVE:
            if attempts > policy.compaction_retries:
                raise _failed(
                    destination,
                    Reason.RETRIES_EXHAUSTED,
                    f"history stays above the trigger after {attempts} compaction(s): measured "
                    f"{report.measured_tokens} >= trigger {report.trigger_tokens} "
                    f"(compactionRetries={policy.compaction_retries})",
                )
            # Unlike PrepareStep (see core.planner.SHAPES), a retry reaches into the retained tail.
            job = Bracket(
                handle, SWITCH.trigger, SWITCH.selection_for(attempts), destination, shrink,
                writer_policy, retained, turn,
            )  # fmt: skip
            committed = await self._compact(job, progress)
            if committed is not None:
                switched.compactions.append(committed)
            attempts += 1
            report = await self._measured(handle, destination, progress, "after compaction")

    async def _compact(self, job: Bracket, progress: Progress) -> cpb.CompactionOutcome | None:
        """One bracket of the fit; a failure or a decline is the switch's failure.

        A pressure selection that finds nothing older than the destination's retained tail is
        widened to the maximal one (everything but the last unit), as a retry is: the switch
        must bring history below the destination's trigger, and the reference selects the
        single older unit there rather than declining.
        """
        committed = await self._bracket(job, progress)
        if SWITCH.widened(job.mode, committed):
            committed = await self._bracket(replace(job, mode=SelectionMode.MAXIMAL), progress)
        if isinstance(committed, Declined):
            raise _failed(job.route, committed.code.value, committed.reason)
        return committed

    async def _bracket(
        self, job: Bracket, progress: Progress
    ) -> cpb.CompactionOutcome | Declined | None:
        try:
            return await self._brackets.run(job, progress)
        except CompactionBusy:
            raise
        except CompactdError as error:
            raise _failed(job.route, error.reason, error.message, error.metadata) from error

    async def _measured(
        self, handle: SessionHandle, destination: Route, progress: Progress, when: str
    ) -> cpb.PressureReport:
        report = self._pressure.report(handle, destination)
        await progress(
            cpb.CompactionProgress(
                step=cpb.COMPACTION_STEP_MEASURE,
                seq=-1,
                measured_tokens=report.measured_tokens,
                detail=f"re-measured against {destination.name} {when}",
            )
        )
        return report

    async def _log_header(
        self, handle: SessionHandle, destination: Route, progress: Progress
    ) -> int | None:
        """Append the destination header (None when the destination is the logged route)."""
        async with handle.lock:
            current = handle.fold.header
            config = current.config if current is not None else None
            if config is not None and (config.provider, config.model) == (
                destination.provider,
                destination.model,
            ):
                return None
            header = destination_header(current, destination)
            result = await handle.append_locked([events_pb2.SessionEvent(request_header=header)])
        seq = result.seqs[0]
        await progress(
            cpb.CompactionProgress(
                step=cpb.COMPACTION_STEP_HEADER,
                seq=seq,
                detail=f"request/header for {destination.name}",
            )
        )
        return seq


def destination_header(
    current: events_pb2.RequestHeader | None, destination: Route
) -> events_pb2.RequestHeader:
    """The logged header moved to ``destination``: tools and sampling kept, ``max_output_tokens``
    and adapter defaults dropped (they belong to the previous route); the fold records CHANGE."""
    header = events_pb2.RequestHeader()
    if current is not None:
        header.CopyFrom(current)
    header.ClearField("adapter_defaults")
    header.config.ClearField("max_output_tokens")
    header.config.provider = destination.provider
    header.config.model = destination.model
    header.reason = events_pb2.HEADER_REASON_UNSPECIFIED
    header.starts_series = False
    return header


def _failed(
    destination: Route, cause: str, message: str, details: Mapping[str, str] | None = None
) -> FailedPrecondition:
    """The switch's failure: the cause's reason and metadata, and the destination."""
    return FailedPrecondition(
        f"cannot switch to {destination.name}: {message}",
        reason=Reason.MODEL_SWITCH_COMPACTION_FAILED,
        metadata={**(details or {}), "cause": cause, "destination": destination.name},
    )
