"""RecoverFromError and ClassifyProviderError: a runtime's moves after a provider refused a step.

A runtime whose model request failed asks what it may do next. The error arrives as a canonical
kind (the runtime's adapter classified it) or raw (status, body, headers), classified here with
the one provider error table (``providers.errors``). Two failures have a recovery:

- ``CONTEXT_WINDOW_EXCEEDED`` (the seed's canonical overflow recovery) bypasses the threshold and
  the retention policy: it prunes, first with ``[pruner]``, then every tool result that alone
  exceeds the room the window leaves for history; then it runs one maximal balanced head
  reduction (trigger OVERFLOW: everything selectable but the system head and the last unit).
  A retry is authorized only when the surface replacement generation advanced, and pruning that
  landed before a failed summary counts. Otherwise the provider's error stays authoritative, with
  the precise reason: an envelope that alone fills the window (with its figures), one
  indivisible unit, nothing selectable, an open tool call, a failed compaction. At most
  ``maxOverflowRetries`` recoveries per step (the runtime counts them in ``retries_so_far``);
  ``0`` disables this recovery only, and ``auto: false`` disables it too.
- ``IMAGE_OFFLOAD_REQUIRED`` with an ``offload_images`` count offloads the oldest input images
  (``service.offload``). It spends no overflow retry and needs no ``llm/retry``.

The window is the route's declared one, else the one the provider stated in its error (llama.cpp
``n_ctx``, "maximum context length is N tokens", ...): overflow recovery works for a route
without declared capacity. A caller's figure no real request can have (not positive, or above
``MAX_TOKEN_COUNT``) counts as not stated, like one the table reads from a hostile body.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, replace

from compactd.core.events import SessionEvent
from compactd.core.fold import SessionFold
from compactd.core.limits import MAX_TOKEN_COUNT
from compactd.core.meter import route_price
from compactd.core.offload import offloadable
from compactd.core.planner import SHAPES, PlanMode
from compactd.core.policy import TargetPolicy, output_reservation
from compactd.core.pruner import PrunePlan, plan_window_prunes
from compactd.core.selection import DeclineCode, Declined, head_length, unit_boundaries
from compactd.core.surface import SurfaceNode
from compactd.errors import CompactdError, CompactionBusy
from compactd.providers import errors
from compactd.providers.errors import ProviderFailure
from compactd.reasons import Reason
from compactd.redaction import Redactor
from compactd.routes import Route
from compactd.service.bracket import Bracket, Brackets, Progress
from compactd.service.offload import offload_oldest
from compactd.service.preconditions import refuse_live_bracket, require_open_turn
from compactd.service.pressure import PressureService
from compactd.service.pruning import Planner, Pruning
from compactd.service.requests import request_in_steps
from compactd.service.sessions import SessionHandle, SessionManager
from compactd.store.base import Clock, utc_now
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2

OVERFLOW = events_pb2.COMPACTION_TRIGGER_OVERFLOW
CONTEXT = cpb.PROVIDER_ERROR_KIND_CONTEXT_WINDOW_EXCEEDED
IMAGES = cpb.PROVIDER_ERROR_KIND_IMAGE_OFFLOAD_REQUIRED
_KINDS: Mapping[str, cpb.ProviderErrorKind.ValueType] = {
    Reason.CONTEXT_WINDOW_EXCEEDED: CONTEXT,
    Reason.IMAGE_OFFLOAD_REQUIRED: IMAGES,
}
Decline = cpb.RecoveryDecline
_IN_A_STEP = "recovery runs for a step of an open turn"
#: Redaction by credential shapes alone (no configured key values), for callers without routes.
PATTERNS_ONLY = Redactor()


def classify_raw(
    raw: cpb.RawProviderError,
    request_images: int | None = None,
    *,
    redact: Callable[[str], str] = PATTERNS_ONLY,
    now: float | None = None,
) -> ProviderFailure:
    """Classify a runtime's raw provider error with the table (status 0: inside a stream).

    The failure's message (the provider's text, returned to the caller) is ``redact``ed.
    ``request_images`` counts the images when ``raw`` states none (a negative count is none);
    ``now`` (POSIX seconds) reads an HTTP-date ``retry-after``.
    """
    stated = raw.HasField("request_images") and raw.request_images >= 0
    images = raw.request_images if stated else request_images
    failure = errors.classify(
        raw.http_status or None, raw.body, dict(raw.headers), request_images=images, now=now
    )
    return replace(failure, message=redact(failure.message))


def classification(failure: ProviderFailure) -> cpb.ProviderErrorClassification:
    """The wire form of a classified failure, with the error ready for RecoverFromError."""
    kind = _KINDS.get(failure.reason, cpb.PROVIDER_ERROR_KIND_UNSPECIFIED)
    result = cpb.ProviderErrorClassification(
        reason=failure.reason,
        kind=kind,
        retryable=failure.retryable,
        offload_images=failure.offload_images,
        context_window=failure.context_window,
        prompt_tokens=failure.prompt_tokens,
        message=failure.message,
        rule=failure.rule,
        error=cpb.ProviderError(
            kind=kind,
            offload_images=failure.offload_images,
            message=failure.message,
            context_window=failure.context_window,
            prompt_tokens=failure.prompt_tokens,
        ),
    )
    if failure.retry_after is not None:
        result.retry_after_seconds = failure.retry_after
    return result


@dataclass(frozen=True)
class _Window:
    """The window an overflow is measured against, with the figures of the request now."""

    figures: cpb.OverflowFigures

    @property
    def window(self) -> int:
        """W (0: unknown)."""
        return self.figures.context_window

    @property
    def room(self) -> int:
        """Tokens the window leaves for history after the envelope (negative: none)."""
        f = self.figures
        return f.context_window - f.output_reservation - f.envelope_tokens


class RecoveryService:
    """Runs RecoverFromError for sessions; one instance per server.

    Args:
        manager: Where sessions live.
        pressure: Routes, policies and the session meters.
        brackets: The bracket.
        pruning: Pruning (its ``[pruner]`` head:tail ratio shapes window-sized prunes).
        wall_clock: Now, for an HTTP-date ``retry-after`` (the server's; tests pin it).
    """

    def __init__(
        self,
        manager: SessionManager,
        pressure: PressureService,
        brackets: Brackets,
        pruning: Pruning,
        wall_clock: Clock = utc_now,
    ) -> None:
        self._manager = manager
        self._pressure = pressure
        self._brackets = brackets
        self._pruning = pruning
        self._wall_clock = wall_clock

    def classify(
        self, raw: cpb.RawProviderError, request_images: int | None = None
    ) -> cpb.ProviderErrorClassification:
        """ClassifyProviderError's answer for ``raw``: redacted, ``retry-after`` read at now."""
        now = self._wall_clock().timestamp()
        failure = classify_raw(raw, request_images, redact=self._brackets.redact, now=now)
        return classification(failure)

    async def recover(
        self,
        session_id: str,
        turn: int,
        error: cpb.ProviderError,
        retries_so_far: int,
        progress: Progress,
    ) -> cpb.RecoverFromErrorResult:
        """Recover from ``error`` on a step of ``turn`` (see ``CompactionService``).

        Raises:
            NotFound: The session does not exist.
            FailedPrecondition: ``NO_OPEN_TURN`` when ``turn`` is not open.
            CompactionBusy: A bracket is live.
        """
        handle = await self._manager.get(session_id)
        require_open_turn(handle, turn, _IN_A_STEP)
        refuse_live_bracket(handle)
        result = cpb.RecoverFromErrorResult()
        if error.kind == cpb.PROVIDER_ERROR_KIND_UNSPECIFIED:
            images = offloadable(handle.fold.surface.nodes, handle.fold.offloads)
            result.classification.CopyFrom(self.classify(error.raw, images))
            error = result.classification.error
        result.kind = error.kind
        if error.kind == IMAGES:
            await self._offload(handle, error, result, progress)
        elif error.kind == CONTEXT:
            await self._overflow(handle, turn, error, retries_so_far, result, progress)
        else:
            reason = result.classification.reason
            _decline(result, Decline.RECOVERY_DECLINE_NOT_RECOVERABLE, _not_recoverable(reason))
        async with handle.lock:  # the request shows committed events only
            result.request.MergeFromString(await request_in_steps(handle))
        return result

    # ---- image offload -----------------------------------------------------------------------

    async def _offload(
        self,
        handle: SessionHandle,
        error: cpb.ProviderError,
        result: cpb.RecoverFromErrorResult,
        progress: Progress,
    ) -> None:
        if error.offload_images <= 0:
            _decline(
                result,
                Decline.RECOVERY_DECLINE_OFFLOAD_COUNT_UNKNOWN,
                "the provider refused the request's images without saying how many to offload "
                "(and stated no limit to derive it from)",
            )
            return
        selection, seq = await offload_oldest(handle, error.offload_images)
        if not selection.targets:
            _decline(
                result,
                Decline.RECOVERY_DECLINE_NO_IMAGES,
                "every input image of the request is already offloaded",
            )
            return
        await progress(
            cpb.CompactionProgress(
                step=cpb.COMPACTION_STEP_OFFLOAD,
                seq=seq,
                detail=f"offloaded {selection.count} image(s) in {len(selection.targets)} node(s)",
            )
        )
        result.offloaded_images = selection.count
        result.retry = True

    # ---- context overflow --------------------------------------------------------------------

    async def _overflow(
        self,
        handle: SessionHandle,
        turn: int,
        error: cpb.ProviderError,
        retries_so_far: int,
        result: cpb.RecoverFromErrorResult,
        progress: Progress,
    ) -> None:
        route = self._pressure.logged_route_or_heuristic(handle)
        policy = self._pressure.target_policy(handle, route)
        window = self.window_of(handle, route, error)
        if _overflow_declined(route, policy, window, retries_so_far, result):
            return
        generation = handle.fold.surface.replacements
        result.pruned_count = await self._pruning.prune(handle, progress)
        if window.window:
            result.pruned_count += await self._pruning.prune(
                handle, progress, planner=self.window_planner(route, window.room)
            )
        shape = SHAPES[PlanMode.OVERFLOW]
        job = Bracket(handle, shape.trigger, shape.selection, route, route, policy, 0, turn)
        try:
            committed = await self._brackets.run(job, progress)
        except CompactionBusy:
            raise
        except CompactdError as failure:
            _compaction_failed(
                result, failure, advanced=handle.fold.surface.replacements > generation
            )
            return
        if isinstance(committed, cpb.CompactionOutcome):
            result.compactions.append(committed)
        if handle.fold.surface.replacements > generation:
            result.retry = True
            return
        assert isinstance(committed, Declined)
        self._declined(handle, route, window, committed, result)

    def window_of(self, handle: SessionHandle, route: Route, error: cpb.ProviderError) -> _Window:
        """The window to recover against (the route's declared one, else the one the provider
        stated) and today's figures."""
        header = handle.fold.header
        max_output = (
            header.config.max_output_tokens
            if header is not None and header.config.HasField("max_output_tokens")
            else None
        )
        reservation = output_reservation(max_output, route.default_output_tokens)
        measured = handle.context.meter.measure(handle.fold, route)
        stated = _token_figure(error.context_window)
        if route.context_window is not None:
            window, source = route.context_window, "route"
        elif stated:
            window, source = stated, "provider"
        else:
            window, source = 0, ""
        figures = cpb.OverflowFigures(
            context_window=window,
            window_source=source,
            output_reservation=reservation,
            system_tokens=measured.system,
            tools_tokens=measured.tools,
            config_tokens=measured.config,
            envelope_tokens=measured.system + measured.tools + measured.config + measured.pins,
            pins_tokens=measured.pins,
            measured_tokens=measured.total,
            prompt_tokens=_token_figure(error.prompt_tokens),
        )
        return _Window(figures)

    def window_planner(self, route: Route, room: int) -> Planner:
        """Plans of the tool results whose route price alone exceeds ``room``."""
        config = self._pruning.config

        def price(event: SessionEvent, offloaded: Set[int]) -> int:
            return route_price(event, route, offloaded)

        def planner(
            fold: SessionFold, shadow_price: Callable[[SurfaceNode], int]
        ) -> list[PrunePlan]:
            return plan_window_prunes(fold, config, price, room, shadow_price)

        return planner

    def _declined(
        self,
        handle: SessionHandle,
        route: Route,
        window: _Window,
        declined: Declined,
        result: cpb.RecoverFromErrorResult,
    ) -> None:
        """Why a reduction that advanced nothing could not: an open call, one unit, or nothing."""
        if declined.code is DeclineCode.OPEN_TAIL:
            _decline(result, Decline.RECOVERY_DECLINE_OPEN_TAIL, declined.reason)
            return
        nodes = handle.fold.surface.nodes
        start = head_length(nodes)
        bounds = unit_boundaries(nodes)
        if start < len(nodes) and not any(bounds[start + 1 : len(nodes)]):
            figures = result.figures
            figures.CopyFrom(window.figures)
            seqs = [node.seq for node in nodes[start:]]
            figures.unit_tokens = handle.context.meter.route_price_of_nodes(
                handle.fold, seqs, route
            )
            figures.unit_range.CopyFrom(
                events_pb2.SurfaceRange(
                    start_position=start,
                    end_position=len(nodes) - 1,
                    start_seq=seqs[0],
                    end_seq=seqs[-1],
                )
            )
            _decline(result, Decline.RECOVERY_DECLINE_INDIVISIBLE_UNIT, _indivisible(figures))
            return
        _decline(result, Decline.RECOVERY_DECLINE_NOTHING_SELECTABLE, declined.reason)


def _overflow_declined(
    route: Route,
    policy: TargetPolicy,
    window: _Window,
    retries_so_far: int,
    result: cpb.RecoverFromErrorResult,
) -> bool:
    """Decline an overflow recovery the policy or the envelope rules out (before any work)."""
    if not policy.auto:
        _decline(
            result,
            Decline.RECOVERY_DECLINE_AUTO_DISABLED,
            f"automatic compaction and overflow recovery are off for {route.name} (auto)",
        )
        return True
    if retries_so_far >= policy.max_overflow_retries:
        _decline(
            result,
            Decline.RECOVERY_DECLINE_RETRIES_EXHAUSTED,
            f"{retries_so_far} overflow retr{'y' if retries_so_far == 1 else 'ies'} already "
            f"made for this step (maxOverflowRetries={policy.max_overflow_retries})",
        )
        return True
    if window.window and window.room <= 0:
        result.figures.CopyFrom(window.figures)
        _decline(result, Decline.RECOVERY_DECLINE_ENVELOPE_ONLY, _envelope_only(window))
        return True
    return False


def _compaction_failed(
    result: cpb.RecoverFromErrorResult, failure: CompactdError, *, advanced: bool
) -> None:
    """An overflow compaction failed: a retry only when pruning advanced the surface first."""
    result.cause = failure.reason
    if not advanced:
        _decline(
            result,
            Decline.RECOVERY_DECLINE_COMPACTION_FAILED,
            f"the overflow compaction failed ({failure.reason}): {failure.message}",
        )
        return
    result.retry = True
    result.reason = f"pruned; the compaction then failed ({failure.reason})"


def _token_figure(stated: int) -> int:
    """A caller's token figure, or 0 (not stated) when no real request has it."""
    return stated if 0 < stated <= MAX_TOKEN_COUNT else 0


def _decline(
    result: cpb.RecoverFromErrorResult, decline: cpb.RecoveryDecline.ValueType, reason: str
) -> None:
    result.retry = False
    result.decline = decline
    result.reason = reason


def _envelope_only(window: _Window) -> str:
    f = window.figures
    return (
        f"the envelope alone does not fit the window: system {f.system_tokens} + tools "
        f"{f.tools_tokens} + framing {f.config_tokens} + pins {f.pins_tokens} = "
        f"{f.envelope_tokens} tokens, window {f.context_window} ({f.window_source}) - output "
        f"reservation {f.output_reservation} = {f.context_window - f.output_reservation}; no "
        "compaction reduces the system prompt, the tools or the pins"
    )


#: For the dry run (``service.inspection``).
envelope_only = _envelope_only


def _indivisible(figures: cpb.OverflowFigures) -> str:
    window = (
        f"window {figures.context_window} ({figures.window_source})"
        if figures.context_window
        else "an unknown window"
    )
    return (
        f"the history after the system head is one indivisible unit (seqs "
        f"{figures.unit_range.start_seq}..{figures.unit_range.end_seq}, {figures.unit_tokens} "
        f"tokens) that compaction cannot split; envelope {figures.envelope_tokens} tokens, "
        f"{window}"
    )


def _not_recoverable(reason: str) -> str:
    if reason in (Reason.RATE_LIMITED, Reason.TIMEOUT, Reason.PROVIDER_UNAVAILABLE):
        return f"{reason} is transient: retry the same request later, per the classification"
    return f"{reason or 'the error'} is not one compactd recovers from"
