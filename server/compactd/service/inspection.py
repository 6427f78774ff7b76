"""Reading compaction's mind: the dry-run plan, the surface's prices, the bracket history.

``plan`` answers what a compaction would do now without appending anything. It decides with
the parts the real paths use (``core.planner``'s shapes, pricer and span choice, the pruner's
thresholds, the bracket's guard and summary target, the recovery's window): under the session's
lock, without awaiting, it folds the planned prunes tentatively, chooses the span on that fold,
and rolls the prunes back, so a real bracket run on the same log chooses the same span.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

from compactd.core import bracket, prompts
from compactd.core.fold import SessionFold
from compactd.core.history import bracket_history
from compactd.core.lock import live_bracket
from compactd.core.meter import route_price
from compactd.core.outcome import floor_tokens
from compactd.core.planner import (
    SHAPES,
    PlanMode,
    choose_span,
    node_pricer,
    span_pricer,
    tentatively,
)
from compactd.core.policy import TargetPolicy, resolved_settings, setting_origins
from compactd.core.pruner import PrunePlan, PrunerConfig, plan_prunes
from compactd.core.selection import DeclineCode, Declined, Selection, SelectionMode
from compactd.core.surface import ShadowHistory, SurfaceChange, SurfaceNode
from compactd.errors import CompactdError, FieldViolation, InvalidArgument
from compactd.providers.extractive import ExtractiveSummarizer, counted_allowance
from compactd.reasons import Reason
from compactd.routes import Route
from compactd.service.bracket import Brackets, shadow_price_of
from compactd.service.policy_message import resolved_policy
from compactd.service.pressure import PressureService
from compactd.service.recovery import RecoveryService, envelope_only
from compactd.service.requests import detail_parts_in_steps, surface_parts_in_steps
from compactd.service.sessions import SessionHandle, SessionManager
from compactd.service.switch import SwitchService
from compactd.speed import in_steps, let_others_run
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb

_WIRE_MODES = {
    PlanMode.AUTO: cpb.PLAN_MODE_AUTO,
    PlanMode.MANUAL: cpb.PLAN_MODE_MANUAL,
    PlanMode.OVERFLOW: cpb.PLAN_MODE_OVERFLOW,
    PlanMode.SWITCH: cpb.PLAN_MODE_SWITCH,
}
#: The wire's modes (UNSPECIFIED is AUTO).
MODES = {wire: mode for mode, wire in _WIRE_MODES.items()} | {
    cpb.PLAN_MODE_UNSPECIFIED: PlanMode.AUTO
}
_PRESSURE_QUALIFIED = (PlanMode.AUTO, PlanMode.SWITCH)
_ORIGINS = {
    "DEFAULT": cpb.POLICY_ORIGIN_DEFAULT,
    "SERVICE": cpb.POLICY_ORIGIN_SERVICE,
    "SESSION": cpb.POLICY_ORIGIN_SESSION,
    "SERVICE_ROUTE": cpb.POLICY_ORIGIN_SERVICE_ROUTE,
    "SESSION_ROUTE": cpb.POLICY_ORIGIN_SESSION_ROUTE,
}


@dataclass
class _Inputs:
    """What one plan is decided from."""

    handle: SessionHandle
    mode: PlanMode
    route: Route  # selection pricing
    policy: TargetPolicy  # the route's (the destination's for SWITCH)
    writer_policy: TargetPolicy  # whose summary settings pick the target
    report_error: str = ""  # why the route has no pressure report, if it has none


class InspectionService:
    """Plans, surface detail and bracket history for sessions; one instance per server."""

    def __init__(
        self,
        manager: SessionManager,
        pressure: PressureService,
        brackets: Brackets,
        pruner: PrunerConfig,
        recovery: RecoveryService,
        switch: SwitchService,
    ) -> None:
        self._manager = manager
        self._brackets = brackets
        self._pruner = pruner
        self._recovery = recovery
        self._switch = switch
        self._pressure = pressure

    # ---- PlanCompaction ---------------------------------------------------------------------

    async def plan(
        self, session_id: str, mode: PlanMode, route: Route | None
    ) -> cpb.CompactionPlan:
        """The plan of the next compaction in ``mode`` (see ``CompactionService``).

        Raises:
            NotFound: The session does not exist.
            InvalidArgument: SWITCH without a route.
        """
        if mode is PlanMode.SWITCH and route is None:
            raise InvalidArgument(
                "a switch plan needs the destination route",
                violations=[FieldViolation("route", "required for PLAN_MODE_SWITCH")],
            )
        handle = await self._manager.get(session_id)
        async with handle.lock:  # one committed revision, and no await below: nothing moves
            return self._plan(self._inputs(handle, mode, route))

    def _inputs(self, handle: SessionHandle, mode: PlanMode, requested: Route | None) -> _Inputs:
        pressure = self._pressure
        if mode is PlanMode.AUTO and requested and self._switch.is_switch(handle, requested):
            mode = PlanMode.SWITCH  # PrepareStep to another route switches first
        logged = pressure.logged_route_or_heuristic(handle)
        route = (
            requested
            if requested is not None and mode in (PlanMode.AUTO, PlanMode.SWITCH)
            else logged
        )
        policy = pressure.target_policy(handle, route)
        writer = pressure.target_policy(handle, logged) if mode is PlanMode.SWITCH else policy
        return _Inputs(handle, mode, route, policy, writer)

    def _plan(self, job: _Inputs) -> cpb.CompactionPlan:
        handle, shape = job.handle, SHAPES[job.mode]
        plan = cpb.CompactionPlan(
            revision=handle.revision,
            mode=_WIRE_MODES[job.mode],
            trigger=shape.trigger,
            route=events_pb2.Route(provider=job.route.provider, model=job.route.model),
        )
        self._explain_policy(plan, job)
        report = self._report(plan, job)
        if job.mode in (PlanMode.AUTO, PlanMode.OVERFLOW) and not handle.fold.open_turns:
            plan.warnings.append(
                "no turn is open: PrepareStep and RecoverFromError run for a step of an open turn"
            )
        code, why = self._blocked(job, report)
        prunes = self._prunes(job) if shape.prunes else []
        drops_anchor = self._drops_anchor(job, prunes)
        with tentatively(handle.fold, [e for p in prunes for e in p.events]) as batch:
            self._planned_prunes(plan, job, batch.surface_changes[: len(prunes)], prunes)
            after = self._after_prune(plan, job, report, drops_anchor)
            relieved = after is not None and after.state != cpb.PRESSURE_STATE_ABOVE
            if not code and prunes and relieved and job.mode in _PRESSURE_QUALIFIED:
                assert after is not None
                code, why = (
                    "RELIEVED_BY_PRUNING",
                    (
                        f"pruning alone brings the envelope to {after.measured_tokens} < trigger "
                        f"{after.trigger_tokens}; no bracket opens"
                    ),
                )
            self._span(plan, job, report, after)
        plan.blocked_code, plan.blocked = code, why
        return plan

    def _explain_policy(self, plan: cpb.CompactionPlan, job: _Inputs) -> None:
        values = resolved_settings(job.policy)
        plan.policy.CopyFrom(resolved_policy(values))
        origins = setting_origins(
            self._pressure.policy, job.handle.policy_overrides, job.route.provider, job.route.model
        )
        for name, value in values.items():
            plan.settings.add(name=name, value=json.dumps(value), origin=_ORIGINS[origins[name]])

    def _report(self, plan: cpb.CompactionPlan, job: _Inputs) -> cpb.PressureReport | None:
        try:
            report = self._pressure.report(job.handle, job.route)
        except CompactdError as error:
            plan.warnings.append(
                f"no pressure report for {_name(job.route)} ({error.reason}): {error.message}"
            )
            job.report_error = error.reason
            return None
        plan.pressure.CopyFrom(report)
        return report

    def _blocked(self, job: _Inputs, report: cpb.PressureReport | None) -> tuple[str, str]:
        """``(code, why)`` the real path would not run now (``("", "")``: it would)."""
        fold, mode = job.handle.fold, job.mode
        live = live_bracket(fold.lock)
        if live is not None:
            why = f"compaction {live.compaction_id} (seq {live.start_seq}) is live"
            return Reason.COMPACTION_BUSY, why
        if mode is PlanMode.MANUAL:
            if fold.open_turns:
                turns = ", ".join(str(t) for t in sorted(fold.open_turns))
                return Reason.COMPACTION_BUSY, f"turn {turns} is open; Compact runs between turns"
            return "", ""
        if not job.policy.auto and mode is not PlanMode.SWITCH:
            return "AUTO_DISABLED", f"auto is off for {_name(job.route)}"
        if mode is PlanMode.OVERFLOW:
            if job.policy.max_overflow_retries == 0:
                return Reason.RETRIES_EXHAUSTED, "maxOverflowRetries is 0: overflow recovery is off"
            window = self._recovery.window_of(job.handle, job.route, cpb.ProviderError())
            if window.window and window.room <= 0:
                return "ENVELOPE_ONLY", envelope_only(window)
            return "", ""
        if report is None:
            return job.report_error, "the route has no pressure report (see warnings)"
        if report.state != cpb.PRESSURE_STATE_ABOVE:
            return "BELOW_TRIGGER", (
                f"measured {report.measured_tokens} < trigger {report.trigger_tokens}; a "
                "below-pressure step never prunes"
            )
        return "", ""

    # ---- prunes ---------------------------------------------------------------------------

    def _prunes(self, job: _Inputs) -> list[PrunePlan]:
        handle = job.handle
        shadow = shadow_price_of(handle)
        prunes = plan_prunes(handle.fold, self._pruner, shadow)
        if not SHAPES[job.mode].window_prunes:
            return prunes
        window = self._recovery.window_of(handle, job.route, cpb.ProviderError())
        if not window.window:
            return prunes
        # The window-sized pass runs on the surface the first pass leaves, as the real one does.
        with tentatively(handle.fold, [e for p in prunes for e in p.events]):
            planner = self._recovery.window_planner(job.route, window.room)
            more = planner(handle.fold, shadow)
        return [*prunes, *more]

    def _planned_prunes(
        self,
        plan: cpb.CompactionPlan,
        job: _Inputs,
        changes: Sequence[SurfaceChange],
        prunes: Sequence[PrunePlan],
    ) -> None:
        """Each prune as folded: the node it shadows and its replacement, priced for the route."""
        fold = job.handle.fold
        price = node_pricer(job.handle.context.meter, fold, job.route)
        for change, prune in zip(changes, prunes, strict=True):
            body = prune.prune.compaction_prune
            (shadowed,) = change.shadowed
            plan.prunes.add(
                seq=prune.shadowed_seq,
                position=change.position,
                original_code_points=body.original_code_points,
                retained_code_points=body.retained_code_points,
                tokens_before=price(shadowed),
                tokens_after=price(change.node),
                replacement_seq=change.node.seq,
            )

    def _drops_anchor(self, job: _Inputs, prunes: Sequence[PrunePlan]) -> bool:
        """Whether a prune replaces a node at or before the usage anchor (the meter then drops
        the anchor and measures its own estimate)."""
        handle = job.handle
        anchor = handle.context.meter.measure(handle.fold, job.route).anchor_seq
        if anchor is None:
            return False
        surface = handle.fold.surface
        anchor_at = surface.position_of(anchor)
        positions = [surface.position_of(p.shadowed_seq) for p in prunes]
        return any(at is not None and anchor_at is not None and at <= anchor_at for at in positions)

    def _after_prune(
        self,
        plan: cpb.CompactionPlan,
        job: _Inputs,
        report: cpb.PressureReport | None,
        drops_anchor: bool,
    ) -> cpb.PressureReport | None:
        """The envelope once the prunes are committed, measured as the meter would measure it."""
        handle = job.handle
        raw = handle.context.meter.measure(handle.fold, job.route, anchored=not drops_anchor)
        saved = sum(p.tokens_before - p.tokens_after for p in plan.prunes)
        raw = replace(raw, total=raw.total - saved, messages=raw.messages - saved)
        if report is None:
            plan.tokens_after_prune = raw.total
            return None
        after = self._pressure.report_of(handle, job.route, raw)
        plan.tokens_after_prune = after.measured_tokens
        return after

    # ---- the span --------------------------------------------------------------------------

    def _span(
        self,
        plan: cpb.CompactionPlan,
        job: _Inputs,
        report: cpb.PressureReport | None,
        after: cpb.PressureReport | None,
    ) -> None:
        handle, brackets = job.handle, self._brackets
        fold = handle.fold
        try:
            target = brackets.summarizers.target(job.writer_policy, fold.header)
            plan.summary_target.CopyFrom(
                events_pb2.Route(provider=target.provider, model=target.model)
            )
        except CompactdError as error:
            target = None
            plan.warnings.append(f"{error.reason}: {error.message}")
        chosen = self._chosen(plan, job, report, after, target)
        if isinstance(chosen, Declined):
            plan.decline_code, plan.decline_reason = chosen.code.value, chosen.reason
            plan.expected_tokens_after = plan.expected_tokens_after_max = plan.tokens_after_prune
            return
        shadow = shadow_price_of(handle)
        plan.span.CopyFrom(
            cpb.PlannedSpan(
                range=bracket.surface_range(chosen),
                shadowed_seqs=chosen.shadowed_seqs,
                shadowed_count=chosen.count,
                priced_tokens=chosen.shadowed_price,
                shadow_tokens=sum(shadow(node) for node in _nodes(fold, chosen)),
            )
        )
        floor = route_price(_skeleton(), job.route)
        # A model's summary is capped at maxTokens; the extractive checkpoint at its share of
        # the span (``counted_allowance``), whatever maxTokens says.
        written = (
            counted_allowance(chosen.shadowed_price)
            if target is not None and self._extractive(target)
            else floor + job.writer_policy.max_tokens
        )
        ceiling = min(written, chosen.shadowed_price - 1)
        base = plan.tokens_after_prune - chosen.shadowed_price
        plan.expected_tokens_after = base + min(floor, ceiling)
        plan.expected_tokens_after_max = base + max(floor, ceiling)

    def _extractive(self, target: Route) -> bool:
        """Whether the extractive summarizer writes the summaries of ``target``."""
        try:
            summarizer = self._brackets.summarizers.for_route(target)
        except CompactdError:
            return False
        return isinstance(summarizer, ExtractiveSummarizer)

    def _chosen(
        self,
        plan: cpb.CompactionPlan,
        job: _Inputs,
        report: cpb.PressureReport | None,
        after: cpb.PressureReport | None,
        target: Route | None,
    ) -> Selection | Declined:
        """The span the path's first bracket would choose, as the step chooses it: a step whose
        request is over the window reaches for everything but the last unit, and none runs when
        the floor alone is at or above the trigger of a request that fits."""
        handle, shape, guard = job.handle, SHAPES[job.mode], self._brackets.guard
        fold, meter = handle.fold, handle.context.meter
        price = node_pricer(meter, fold, job.route)
        selection, retains, min_span = shape.selection, shape.retains, shape.min_span
        if job.mode is PlanMode.AUTO and after is not None:
            over = after.measured_tokens > after.context_window - after.output_reservation
            floor = 0 if fold.surface.unanswered_calls() else floor_tokens(
                fold, after.measured_tokens, price, span_pricer(meter, fold, job.route)
            )  # fmt: skip
            limit = after.context_window - after.output_reservation
            if floor >= after.trigger_tokens and (not over or floor > limit):
                return Declined(DeclineCode.FLOOR_ABOVE_TRIGGER, f"the floor ({floor} tokens) "
                                "alone is at or above the trigger: no compaction runs")  # fmt: skip
            if over:
                selection, retains = SelectionMode.MAXIMAL, False
        plan.min_span_tokens = guard.min_span_tokens(job.route, job.policy, fold) if min_span else 0
        retained = report.retained_budget if report is not None and retains else 0
        if retains and report is None:
            plan.warnings.append(
                "no retained budget without a pressure report: the span keeps no tail"
            )
        chosen = choose_span(
            fold, price, selection=selection, retained_budget=retained,
            min_span_tokens=plan.min_span_tokens,
        )  # fmt: skip
        if shape.widened(selection, chosen):  # a switch reaches past the retained tail
            chosen = choose_span(
                fold, price, selection=SelectionMode.MAXIMAL, retained_budget=0,
                min_span_tokens=plan.min_span_tokens,
            )  # fmt: skip
        if isinstance(chosen, Declined) or not shape.guarded or target is None:
            return chosen
        held = guard.hold(handle, chosen, target, job.policy)
        if held is not None and not job.policy.extractive_fallback:
            return held
        if held is not None:
            plan.warnings.append(f"{held.reason}: the extractive checkpoint writes it instead")
        return chosen

    # ---- GetSurface detail and ListBrackets ----------------------------------------------------

    async def surface(self, handle: SessionHandle, route: events_pb2.Route | None) -> bytes:
        """The surface of ``handle`` (the caller has it already: no second look-up) with each
        node's prices, the generations, the anchor and the shadowed nodes, priced for ``route``
        (default: the logged route, else the heuristic): a ``GetSurfaceResponse``, serialized
        in steps on the loop (``service.requests``).

        Raises:
            InvalidArgument: ``route`` lacks its provider or model.
        """
        if route is not None and not (route.provider and route.model):
            raise InvalidArgument(
                "a route names both provider and model",
                violations=[FieldViolation("route", "provider and model are required")],
            )
        meter = handle.context.meter
        async with handle.lock:
            fold = handle.fold
            priced = (
                self._pressure.route_for(route.provider, route.model)
                if route is not None
                else self._pressure.logged_route_or_heuristic(handle)
            )
            price = node_pricer(meter, fold, priced)
            shadow = shadow_price_of(handle)
            parts = await in_steps(
                surface_parts_in_steps(fold, lambda node: (price(node), shadow(node)))
            )
            detail = spb.SurfaceDetail(
                replacement_generation=fold.surface.replacements,
                content_generation=fold.surface.replacements + fold.offload_generation,
            )
            detail.route.provider, detail.route.model = priced.provider, priced.model
            anchor = meter.anchor_of(priced)
            if anchor is not None:
                detail.anchor.seq, detail.anchor.usage_tokens, detail.anchor.delta_tokens = anchor
            revision = fold.revision
        # Read after the lock: the log before ``revision`` is immutable, and may be long.
        history = await _shadow_history(handle, revision)
        parts += await in_steps(detail_parts_in_steps(detail, sorted(history.items())))
        await let_others_run()  # joining them is one copy of the whole reply: a slice of its own
        return b"".join(parts)

    async def brackets(self, session_id: str) -> cpb.ListBracketsResponse:
        """Every bracket of the session's committed log (``NotFound`` when it does not exist)."""
        handle = await self._manager.get(session_id)
        end = handle.revision  # committed events only
        history = bracket_history([e async for e in handle.read(0, end)])
        history.revision = end
        return history


def _nodes(fold: SessionFold, chosen: Selection) -> list[SurfaceNode]:
    surface = fold.surface
    return list(surface.nodes[chosen.start_position : chosen.end_position + 1])


def _skeleton() -> events_pb2.SessionEvent:
    """The smallest useful checkpoint: the framing around the instruction's empty sections."""
    text = bracket.checkpoint_text(prompts.summary_skeleton(), 10_000)  # a typical handle
    return bracket.checkpoint_message("", text)


def _name(route: Route) -> str:
    return route.name if route.model else "the heuristic (no route logged)"


async def _shadow_history(handle: SessionHandle, revision: int) -> dict[int, tuple[int, str, str]]:
    """What shadowed each node of the log before ``revision`` (``ShadowHistory``), folded in
    worker threads a chunk at a time."""
    history = ShadowHistory()
    chunk: list[events_pb2.SessionEvent] = []
    async for event in handle.read(0, revision):
        chunk.append(event)
        if len(chunk) >= 4096:
            await asyncio.to_thread(history.add, chunk)
            chunk = []
    await asyncio.to_thread(history.add, chunk)
    return history.shadowed
