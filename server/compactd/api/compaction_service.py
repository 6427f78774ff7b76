"""``compactd.v1.CompactionService``: pressure reports and compaction, streamed step by step."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import grpc

from compactd.api.session_service import require_session_id
from compactd.api.status import handle_errors
from compactd.errors import FieldViolation, InvalidArgument
from compactd.routes import Route
from compactd.service.ahead import AheadService
from compactd.service.bracket import Progress
from compactd.service.inspection import MODES, InspectionService
from compactd.service.pressure import PressureService
from compactd.service.recovery import RecoveryService
from compactd.service.revert import RevertService
from compactd.service.steps import StepService
from compactd.service.switch import SwitchService
from compactd.v1 import compaction_service_pb2 as pb
from compactd.v1 import compaction_service_pb2_grpc, events_pb2

Context = grpc.aio.ServicerContext[Any, Any]
#: A step to run: given its progress callback (and, unary, the result to write in), its result.
_Step = Callable[..., Awaitable[pb.PrepareStepResult]]
Result = TypeVar("Result")
Response = TypeVar("Response")
#: The longest ``CompactRequest.focus`` (it is added to the summary instruction as written).
MAX_FOCUS_CHARS = 4096


class CompactionServicer(compaction_service_pb2_grpc.CompactionServiceServicer):
    """Adapter from the wire to ``PressureService``, ``StepService``, ``RecoveryService``,
    ``SwitchService`` and ``InspectionService``."""

    def __init__(
        self,
        pressure: PressureService,
        steps: StepService,
        recovery: RecoveryService,
        switch: SwitchService,
        inspection: InspectionService,
        reverts: RevertService,
        ahead: AheadService | None = None,
    ) -> None:
        self._ahead = ahead  # WatchPressure's candidate in progress
        self._inspection = inspection
        self._reverts = reverts
        self._pressure = pressure
        self._steps = steps
        self._recovery = recovery
        self._switch = switch

    @handle_errors
    async def CheckPressure(
        self, request: pb.CheckPressureRequest, context: Context
    ) -> pb.CheckPressureResponse:
        require_session_id(request.session_id)
        destination = self._destination(request.destination, request.HasField("destination"))
        report = await self._pressure.check(request.session_id, destination)
        return pb.CheckPressureResponse(report=report)

    @handle_errors
    async def WatchPressure(
        self, request: pb.WatchPressureRequest, context: Context
    ) -> AsyncIterator[pb.WatchPressureResponse]:
        require_session_id(request.session_id)
        destination = self._destination(request.destination, request.HasField("destination"))
        async for report in self._pressure.watch(request.session_id, destination):
            response = pb.WatchPressureResponse(report=report)
            if self._ahead is not None:
                candidate = await self._ahead.candidate_of(request.session_id)
                if candidate is not None:
                    response.candidate.CopyFrom(candidate)
            yield response

    @handle_errors
    async def PrepareStep(  # type: ignore[override]  # streams through context.write
        self, request: pb.PrepareStepRequest, context: Context
    ) -> None:
        await _streamed(self._step(request), pb.PrepareStepResponse, context)

    @handle_errors
    async def PrepareStepUnary(
        self, request: pb.PrepareStepUnaryRequest, context: Context
    ) -> pb.PrepareStepUnaryResponse:
        response = pb.PrepareStepUnaryResponse()
        await self._step(request)(_unreported, into=response.result)  # written in place
        return response

    def _step(self, request: pb.PrepareStepRequest | pb.PrepareStepUnaryRequest) -> _Step:
        """The step ``request`` asks for, run with a progress callback (both PrepareSteps)."""
        require_session_id(request.session_id)
        intended = self._destination(request.intended_route, request.HasField("intended_route"))
        held = request.held_revision if request.HasField("held_revision") else None
        step: _Step = partial(
            self._steps.prepare_step, request.session_id, request.turn, intended,
            held_revision=held, held_incarnation=request.held_incarnation,
        )  # fmt: skip
        return step

    @handle_errors
    async def Compact(  # type: ignore[override]  # streams through context.write
        self, request: pb.CompactRequest, context: Context
    ) -> None:
        require_session_id(request.session_id)
        if len(request.focus) > MAX_FOCUS_CHARS:
            raise InvalidArgument(
                f"focus holds at most {MAX_FOCUS_CHARS} characters, got {len(request.focus)}",
                violations=[FieldViolation("focus", f"at most {MAX_FOCUS_CHARS} characters")],
            )

        def run(progress: Progress) -> Awaitable[pb.CompactResult]:
            return self._steps.compact(request.session_id, request.focus or None, progress)

        await _streamed(run, pb.CompactResponse, context)

    @handle_errors
    async def RecoverFromError(  # type: ignore[override]  # streams through context.write
        self, request: pb.RecoverFromErrorRequest, context: Context
    ) -> None:
        require_session_id(request.session_id)
        _check_recovery(request)

        def run(progress: Progress) -> Awaitable[pb.RecoverFromErrorResult]:
            return self._recovery.recover(
                request.session_id, request.turn, request.error, request.retries_so_far, progress
            )

        await _streamed(run, pb.RecoverFromErrorResponse, context)

    @handle_errors
    async def SwitchModel(  # type: ignore[override]  # streams through context.write
        self, request: pb.SwitchModelRequest, context: Context
    ) -> None:
        require_session_id(request.session_id)
        destination = self._destination(request.destination, True)
        assert destination is not None
        turn = request.turn if request.HasField("turn") else None

        def run(progress: Progress) -> Awaitable[pb.SwitchModelResult]:
            return self._switch.switch_model(request.session_id, destination, turn, progress)

        await _streamed(run, pb.SwitchModelResponse, context)

    @handle_errors
    async def ClassifyProviderError(
        self, request: pb.ClassifyProviderErrorRequest, context: Context
    ) -> pb.ClassifyProviderErrorResponse:
        raw = request.raw
        if not (raw.http_status or raw.body):
            raise InvalidArgument(
                "a provider error needs its HTTP status or its body",
                violations=[FieldViolation("raw", "set http_status, body, or both")],
            )
        return pb.ClassifyProviderErrorResponse(classification=self._recovery.classify(raw))

    @handle_errors
    async def PlanCompaction(
        self, request: pb.PlanCompactionRequest, context: Context
    ) -> pb.PlanCompactionResponse:
        require_session_id(request.session_id)
        route = self._destination(request.route, request.HasField("route"), "route")
        mode = MODES.get(request.mode)
        if mode is None:
            raise InvalidArgument(
                f"unknown plan mode {request.mode}",
                violations=[FieldViolation("mode", "AUTO, MANUAL, OVERFLOW or SWITCH")],
            )
        plan = await self._inspection.plan(request.session_id, mode, route)
        return pb.PlanCompactionResponse(plan=plan)

    @handle_errors
    async def ListBrackets(
        self, request: pb.ListBracketsRequest, context: Context
    ) -> pb.ListBracketsResponse:
        require_session_id(request.session_id)
        return await self._inspection.brackets(request.session_id)

    @handle_errors
    async def RevertCompaction(
        self, request: pb.RevertCompactionRequest, context: Context
    ) -> pb.RevertCompactionResponse:
        require_session_id(request.session_id)
        if not request.compaction_id:
            raise InvalidArgument(
                "compaction_id is required",
                violations=[FieldViolation("compaction_id", "required")],
            )
        return await self._reverts.revert(request.session_id, request.compaction_id)

    def _destination(
        self, route: events_pb2.Route, present: bool, field: str = "destination"
    ) -> Route | None:
        if not present:
            return None
        if not (route.provider and route.model):
            raise InvalidArgument(
                "a route names both provider and model",
                violations=[FieldViolation(field, "provider and model are required")],
            )
        return self._pressure.route_for(route.provider, route.model)


def _check_recovery(request: pb.RecoverFromErrorRequest) -> None:
    """The request's error must say what failed, with a count for an image budget."""
    error, violations = request.error, []
    if error.kind == pb.PROVIDER_ERROR_KIND_UNSPECIFIED and not (
        error.raw.http_status or error.raw.body
    ):
        violations.append(
            FieldViolation("error.kind", "set a kind, or the provider's raw response in error.raw")
        )
    if error.kind == pb.PROVIDER_ERROR_KIND_IMAGE_OFFLOAD_REQUIRED and error.offload_images <= 0:
        violations.append(
            FieldViolation("error.offload_images", "IMAGE_OFFLOAD_REQUIRED needs a positive count")
        )
    if request.retries_so_far < 0:
        violations.append(FieldViolation("retries_so_far", "must not be negative"))
    if violations:
        raise InvalidArgument(
            "; ".join(f"{v.field}: {v.description}" for v in violations), violations=violations
        )


async def _unreported(update: pb.CompactionProgress) -> None:
    """The progress callback of a call that answers with its result only."""


async def _streamed(
    run: Callable[[Progress], Awaitable[Result]],
    response: Callable[..., Response],
    context: Context,
) -> None:
    """Run an engine operation, writing ``response(progress=...)`` per step, then
    ``response(result=...)``.

    The handler streams through ``context.write`` rather than being an async generator: the
    operation runs in the call's own task, so a step with nothing to report costs one write and
    no task, queue or generator layers (in this handler and in every interceptor around it). If
    the caller goes away, grpc.aio cancels the call's task: the operation is cancelled where it
    waits, so a bracket it opened is closed before the handler returns.
    """

    async def progress(update: pb.CompactionProgress) -> None:
        await context.write(response(progress=update))

    result = await run(progress)
    await context.write(response(result=result))
