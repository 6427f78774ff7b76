"""CheckPressure and WatchPressure: a session's envelope measured against a route's policy.

``PressureService`` builds every restored session's context (``service.context``: its
``SessionMeter``, fed by the session's commits, and the usage calibration), resolves the route
(the destination asked for, else the latest logged header's), layers the session's policy over
the service's, and turns a measurement into a ``PressureReport``. A report is computed
synchronously, so it describes one revision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import Any

from compactd.core.calibration import CalibrationStats
from compactd.core.fold import AdmittedBatch, SessionFold
from compactd.core.meter import Measurement, Method, SessionMeter
from compactd.core.policy import (
    CompactSpec,
    PressurePolicy,
    TargetPolicy,
    compact_spec,
    output_reservation,
)
from compactd.core.pricing import NodeCost, PricingProfile
from compactd.core.recall import recall_tool
from compactd.errors import FailedPrecondition
from compactd.reasons import Reason
from compactd.routes import Route, RouteCatalog
from compactd.service.calibration import UsageCalibration, annotate, estimated
from compactd.service.context import ResolvedPolicy, SessionContext, SessionMemory
from compactd.service.pinning import pins_checker
from compactd.service.sessions import Restored, SessionHandle, SessionManager, metered_context
from compactd.speed import in_steps
from compactd.tokenizers import unavailable
from compactd.v1 import compaction_service_pb2, events_pb2

PressureReport = compaction_service_pb2.PressureReport
log = logging.getLogger(__name__)


_METHODS = {
    Method.EXACT: compaction_service_pb2.MEASUREMENT_METHOD_EXACT,
    Method.ANCHORED: compaction_service_pb2.MEASUREMENT_METHOD_ANCHORED,
    Method.HEURISTIC: compaction_service_pb2.MEASUREMENT_METHOD_HEURISTIC,
    Method.ESTIMATED: compaction_service_pb2.MEASUREMENT_METHOD_ESTIMATED,
    Method.TOKENIZER: compaction_service_pb2.MEASUREMENT_METHOD_TOKENIZER,
}
_RESOLVED_CACHE = 1024  # resolved policies and specs kept (cleared when full)


async def _prepare(
    meter: SessionMeter,
    routes: RouteCatalog,
    fold: SessionFold,
    batch: AdmittedBatch,
    in_thread: bool = False,
) -> None:
    """Price ``batch`` ahead of its commit for every ledger the meter keeps and for the route of
    the header in force after it (the calibration prices with it): a new route's ledger (the
    whole surface) and the batch's texts nothing counted ahead (a new route's) in a worker
    thread, the batch's nodes on the loop in steps; ``in_thread`` (a restore's tail, which a
    caller waits for): all of it in a worker thread."""
    wanted = [p for p in _logged_profiles(fold.header, routes) if not meter.has_ledger(p)]
    if in_thread:  # a restore's tail: batched counts and prices, all in the worker thread
        await asyncio.to_thread(meter.prepare, fold, batch, wanted)
        return
    uncounted = meter.uncounted(wanted)
    count = await in_steps(meter.count_ahead(batch.events, uncounted)) if uncounted else None
    ledgers: dict[PricingProfile, dict[int, NodeCost]] = {}
    if wanted or count is not None:
        ledgers = await asyncio.to_thread(_off_loop, meter, wanted, count)
    await in_steps(meter.prepare_in_steps(fold, batch, ledgers))


def _off_loop(
    meter: SessionMeter, wanted: list[PricingProfile], count: Callable[[], None] | None
) -> dict[PricingProfile, dict[int, NodeCost]]:
    """A worker thread's share of ``_prepare``: counting texts, pricing new ledgers."""
    if count is not None:
        count()
    return meter.price_ledgers(wanted)


def _logged_profiles(
    header: events_pb2.RequestHeader | None, routes: RouteCatalog
) -> list[PricingProfile]:
    if header is None or not (header.config.provider and header.config.model):
        return []
    return [routes.resolve(header.config.provider, header.config.model).pricing]


class PressureService:
    """Pressure reports for sessions.

    Args:
        manager: Where sessions live; every session it restores from now on gets a meter.
        routes: The route catalog (capacity, tokenizer, image pricing per provider/model).
        service_policy: The service-wide policy; a session's own settings layer over it.
    """

    def __init__(
        self, manager: SessionManager, routes: RouteCatalog, service_policy: PressurePolicy
    ) -> None:
        self._manager = manager
        self.routes = routes
        self.policy = service_policy
        self.calibration = UsageCalibration(routes)
        # Resolved once per policy and route (per step they cost more than the measurement).
        self._targets: dict[tuple[int, str, str], tuple[PressurePolicy, TargetPolicy]] = {}
        self._specs: dict[tuple[int, str, int | None, int], tuple[TargetPolicy, CompactSpec]] = {}
        # A report's fields that follow from its spec and route alone, per spec and route.
        self._fixed: dict[tuple[int, str, str], tuple[CompactSpec, PressureReport]] = {}
        manager.build_contexts(self._context)
        manager.on_restore(self._attach)
        self.fallbacks = route_fallbacks(routes)
        if self.fallbacks:
            log.warning(
                "%d routes are priced with the heuristic instead of their own tokenizer: %s",
                len(self.fallbacks),
                "; ".join(f"{name}: {why}" for name, why in self.fallbacks.items()),
            )

    def _context(
        self, handle: SessionHandle, restored: Restored | None, memory: SessionMemory | None
    ) -> SessionContext:
        """A restored session's context: its meter (``metered_context``), which also prices a
        large batch's texts ahead of its commit (counted in a worker thread, priced in steps on
        the loop, see ``SessionHandle.add_preparer``), and the usage calibration after it."""
        context = metered_context(handle, restored, memory)
        meter = context.meter
        meter.declare_tools(partial(self.declared_tools, handle))
        # After the meter's observer: the calibration reads the new revision's prices.
        handle.add_observer(self.calibration.observer(handle.session_id, meter))
        handle.add_preparer(partial(_prepare, meter, self.routes))
        handle.add_precounter(meter.count_ahead)
        handle.add_checker(pins_checker(self.routes))
        return context

    async def _attach(self, handle: SessionHandle) -> None:
        """Price a restored session's nodes for the logged route in a worker thread (persisted
        prices where a snapshot kept them), so its first pressure check is O(1) and no restore
        holds the event loop."""
        meter = handle.context.meter
        await _ensure_ledgers(meter, _logged_profiles(meter.header, self.routes))

    def calibration_stats(self, route: Route) -> CalibrationStats | None:
        """What provider usage has shown about ``route``'s counts (None before any sample): for
        the plan/inspect views and metrics."""
        return self.calibration.stats(route)

    async def check(self, session_id: str, destination: Route | None = None) -> PressureReport:
        """The session's pressure against ``destination`` (default: the latest logged route).

        Raises:
            NotFound: The session does not exist.
            FailedPrecondition: reason ``ROUTE_UNKNOWN`` when no destination is given and no
                header names a route; ``CAPACITY_UNKNOWN`` (``CapacityUnknown``) when the route
                declares no window; ``POLICY_INVALID`` when the policy does not fit the window.
            ConfigError: The session's own policy settings are invalid.
        """
        handle = await self._manager.get(session_id)
        await self.ready(handle, destination)
        return self.report(handle, destination)

    async def ready(self, handle: SessionHandle, destination: Route | None = None) -> None:
        """Price the session for ``destination`` (default: the logged route) in a worker thread
        when its meter has no ledger for that pricing yet (the first check of a new route), so
        the synchronous report that follows is O(1)."""
        meter = handle.context.meter
        profiles = (
            [destination.pricing]
            if destination is not None
            else _logged_profiles(meter.header, self.routes)
        )
        if all(meter.has_ledger(pricing) for pricing in profiles):
            return
        async with handle.lock:  # no batch is observed while the nodes are priced
            await _ensure_ledgers(meter, profiles)

    async def watch(
        self, session_id: str, destination: Route | None = None
    ) -> AsyncGenerator[PressureReport, None]:
        """One report now, then one per new revision, until the caller stops iterating.

        A slow reader gets the latest report; intermediate revisions are coalesced, and appends
        never wait for readers. Errors: as ``check``, raised from the iteration that meets them.
        """
        handle = await self._manager.get(session_id)
        await self.ready(handle, destination)
        revisions = handle.revisions()
        try:
            async for _revision in revisions:
                yield self.report(handle, destination)
        finally:
            close = getattr(revisions, "aclose", None)  # release the subscription now, not at GC
            if close is not None:
                await close()

    def route_for(self, provider: str, model: str) -> Route:
        """The catalog's route for ``provider``/``model`` (undeclared: no capacity)."""
        return self.routes.resolve(provider, model)

    def report(self, handle: SessionHandle, destination: Route | None = None) -> PressureReport:
        """The pressure report of ``handle``'s last committed revision (synchronous)."""
        meter = handle.context.meter
        route = destination or self._logged_route(meter)
        return self.report_of(handle, route, meter.measure(handle.fold, route))

    def report_of(self, handle: SessionHandle, route: Route, raw: Measurement) -> PressureReport:
        """The report of measurement ``raw`` (the meter's, or a planned one) against ``route``."""
        spec = self.spec(handle, route)
        stats = self.calibration.stats(route)
        measurement = estimated(route, raw, stats)
        report = _report(self._fixed_fields(route, spec), spec, measurement)
        annotate(
            report.breakdown,
            route=route,
            measured=measurement,
            unscaled=raw.total,
            stats=stats,
            # Only an anchored figure reports its anchor's age: no clock or surface lookup else.
            anchor_age=_anchor_age(handle, measurement)
            if measurement.method is Method.ANCHORED
            else None,
        )
        return report

    def spec(self, handle: SessionHandle, route: Route) -> CompactSpec:
        """Trigger and retained budget of ``route`` for this session (errors as ``check``)."""
        meter = handle.context.meter
        target = self.target_policy(handle, route)
        reservation = output_reservation(
            _envelope_max_output(meter.header, route), route.default_output_tokens
        )
        key = (id(target), route.name, route.context_window, reservation)
        cached = self._specs.get(key)
        if cached is not None and cached[0] is target:
            return cached[1]
        spec = compact_spec(
            target, route=route.name, window=route.context_window, output_reservation=reservation
        )
        self._remember(self._specs, key, (target, spec))
        return spec

    def _fixed_fields(self, route: Route, spec: CompactSpec) -> PressureReport:
        """The fields of ``route``'s reports that ``spec`` fixes (``_fixed_report``), built once
        per spec and route: a report copies them and writes its measurement over the copy."""
        key = (id(spec), route.provider, route.model)
        cached = self._fixed.get(key)
        if cached is not None and cached[0] is spec:
            return cached[1]
        fixed = _fixed_report(route, spec)
        self._remember(self._fixed, key, (spec, fixed))
        return fixed

    def logged_route(self, handle: SessionHandle) -> Route:
        """The route of the latest logged header (``ROUTE_UNKNOWN`` when none names one)."""
        return self._logged_route(handle.context.meter)

    def named_route(self, handle: SessionHandle) -> Route | None:
        """``logged_route``, or None when no logged header names a route: for a caller that
        only skips such a session (an error raised and caught per append costs more than the
        rest of its check)."""
        return self._route_of(handle.context.meter.header)

    def logged_route_or_heuristic(self, handle: SessionHandle) -> Route:
        """The logged route, or an undeclared heuristic route when no header names one."""
        return self.named_route(handle) or Route("", "")

    def target_policy(self, handle: SessionHandle, route: Route) -> TargetPolicy:
        """The session's resolved policy for ``route`` (service policy + session overrides)."""
        policy = self._session_policy(handle)
        key = (id(policy), route.provider, route.model)
        cached = self._targets.get(key)
        if cached is not None and cached[0] is policy:
            return cached[1]
        target = policy.for_target(route.provider, route.model)
        self._remember(self._targets, key, (policy, target))
        return target

    def declared_tools(
        self, handle: SessionHandle, header: events_pb2.RequestHeader | None
    ) -> tuple[events_pb2.ToolDeclaration, ...]:
        """The tools compactd adds to ``handle``'s requests routed by ``header``: the recall
        tool when the route's policy turns ``recallTool`` on (``core.recall``)."""
        config = header.config if header is not None else events_pb2.RequestConfig()
        target = self.target_policy(handle, Route(config.provider, config.model))
        return (recall_tool(target.recall_tool_name),) if target.recall_tool else ()

    @staticmethod
    def _remember(cache: dict[Any, Any], key: object, value: object) -> None:
        """Policies and specs resolve the same way every step: resolve each once. Entries hold
        the object their key's ``id`` names, so an id reused later never matches."""
        if len(cache) >= _RESOLVED_CACHE:
            cache.clear()
        cache[key] = value

    def _logged_route(self, meter: SessionMeter) -> Route:
        route = self._route_of(meter.header)
        if route is None:
            raise FailedPrecondition(
                "no route given and no request/header names one; pass a destination route",
                reason=Reason.ROUTE_UNKNOWN,
            )
        return route

    def _route_of(self, header: events_pb2.RequestHeader | None) -> Route | None:
        """The route ``header`` names (None: no header, or one that names none)."""
        config = header.config if header is not None else None  # read once: every step asks
        if config is None or not (config.provider and config.model):
            return None
        return self.routes.resolve(config.provider, config.model)

    def _session_policy(self, handle: SessionHandle) -> PressurePolicy:
        overrides = handle.policy_overrides
        if not overrides:
            return self.policy
        context = handle.context
        cached = context.policy
        if cached is not None and cached.overrides is overrides and cached.service is self.policy:
            return cached.policy
        policy = self.policy.with_overrides(overrides)
        context.policy = ResolvedPolicy(overrides, self.policy, policy)
        return policy


async def _ensure_ledgers(meter: SessionMeter, profiles: list[PricingProfile]) -> None:
    """Build the meter's missing ledgers in a worker thread (the caller keeps batches out)."""
    for pricing in profiles:
        if not meter.has_ledger(pricing):
            costs = await asyncio.to_thread(meter.price_ledger, pricing)
            meter.add_ledger(pricing, costs)


def warm_up(routes: RouteCatalog) -> None:
    """Load every route's tokenizer (and chat template) and count once, so the first pressure
    check after start does not pay for it (``load_tokenizer`` caches per process). Blocking: run
    it in a worker thread."""
    for route in routes:
        route.pricing.count("warm up")


def route_fallbacks(routes: RouteCatalog) -> dict[str, str]:
    """Routes whose tokenizer or template files are missing, with why (checked without loading
    any tokenizer; the route's reports say it again)."""
    found = {}
    for route in routes:
        reason = unavailable(route.tokenizer, route.tokenizer_file, route.chat_template)
        if reason:
            found[route.name] = reason
    return found


def _anchor_age(handle: SessionHandle, measured: Measurement) -> tuple[int, float] | None:
    """(events since, seconds since) the anchoring message committed."""
    seq = measured.anchor_seq
    if seq is None:
        return None
    position = handle.fold.surface.position_of(seq)
    if position is None:
        return None
    stamp = handle.fold.surface[position].event.time
    # From the fields, not ``ToSeconds``: that refuses a time outside Timestamp's range, which
    # a log written before AppendEvents checked times may hold.
    seconds = max(0.0, time.time() - stamp.seconds - stamp.nanos / 1e9) if stamp.seconds else 0.0
    return measured.revision - 1 - seq, seconds


def _envelope_max_output(header: events_pb2.RequestHeader | None, route: Route) -> int | None:
    """The header's max output tokens when the header routes to ``route``."""
    if header is None or not header.config.HasField("max_output_tokens"):
        return None
    if (header.config.provider, header.config.model) != (route.provider, route.model):
        return None
    return header.config.max_output_tokens


def _fixed_report(route: Route, spec: CompactSpec) -> PressureReport:
    """The fields of a report against ``spec`` on ``route`` that no measurement changes (the
    route, the window and what the policy derives from it), with the breakdown present."""
    return PressureReport(
        route=events_pb2.Route(provider=route.provider, model=route.model),
        context_window=spec.window,
        output_reservation=spec.output_reservation,
        headroom_tokens=spec.headroom,
        trigger_tokens=spec.trigger,
        retained_budget=spec.retained_budget,
        breakdown=compaction_service_pb2.PressureBreakdown(),
    )


def _report(fixed: PressureReport, spec: CompactSpec, measured: Measurement) -> PressureReport:
    """``measured`` against ``spec``: a copy of the spec's fixed fields (``_fixed_report``) with
    the measurement written over it (a copy and a few assignments cost less than building the
    report and its two nested messages from keywords, every step)."""
    report = PressureReport()
    report.CopyFrom(fixed)
    report.revision = measured.revision
    report.measured_tokens = measured.total
    report.state = (
        compaction_service_pb2.PRESSURE_STATE_ABOVE
        if spec.is_above(measured.total)
        else compaction_service_pb2.PRESSURE_STATE_BELOW
    )
    breakdown = report.breakdown
    breakdown.system_tokens = measured.system
    breakdown.tools_tokens = measured.tools
    breakdown.messages_tokens = measured.messages
    breakdown.images_tokens = measured.images
    breakdown.config_tokens = measured.config
    breakdown.method = _METHODS[measured.method]
    breakdown.tokenizer = measured.tokenizer
    breakdown.anchor_seq = measured.anchor_seq if measured.anchor_seq is not None else 0
    breakdown.pins_tokens = measured.pins
    return report
