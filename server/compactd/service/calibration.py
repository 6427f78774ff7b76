"""Token truth in reports: calibration from provider usage, and how exact each figure is.

``UsageCalibration`` watches every session's commits (an observer beside the meter's). When an
appended ``assistant/message`` carries usage, it records compactd's unanchored count of the
request that message answered (the envelope before it, for the route of the header in force)
next to the provider's prompt tokens (input + cache read + cache write), per route, in a
``core.calibration.Calibrator``. It never blocks or fails a commit: a route it cannot price is
skipped.

``annotate`` fills a report's exactness fields: the error bound of its method, the anchor's age,
the route's fallback warning, the calibration; for a route whose provider publishes no tokenizer
(``Route.estimate``) an unanchored heuristic figure becomes ESTIMATED and is scaled by the
calibration's bounded ratio.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Final

from compactd.core import events as ev
from compactd.core.calibration import CalibrationStats, Calibrator, Sample
from compactd.core.fold import AdmittedBatch, SessionFold
from compactd.core.meter import Measurement, Method, SessionMeter
from compactd.errors import CompactdError
from compactd.routes import Route, RouteCatalog
from compactd.v1 import compaction_service_pb2

log = logging.getLogger(__name__)

# The heuristic's worst measured error per content type against exact tokenizers (cl100k_base,
# o200k_base, deepseek-v4; README "Token truth", bench/bench_tokens.py): Chinese text is
# undercounted by up to 53%. Providers without a public tokenizer were not measured.
HEURISTIC_ERROR_BOUND: Final = 0.55


class UsageCalibration:
    """Records, per route, compactd's count of each request next to the provider's.

    Fed only by commit observers, which run on the event loop (never in the pricing worker
    threads, and never for the events a restore replays), so its ``Calibrator`` needs no lock.

    Args:
        routes: Resolves the header's provider/model to the route to price with.
        calibrator: Where samples go (one per service).
    """

    def __init__(self, routes: RouteCatalog, calibrator: Calibrator | None = None) -> None:
        self.routes = routes
        self.calibrator = calibrator or Calibrator()

    def observer(self, session_id: str, meter: SessionMeter) -> _Observer:
        """The commit observer of one session; register it after the meter's own."""
        return _Observer(self, session_id, meter)

    def stats(self, route: Route) -> CalibrationStats | None:
        """What usage has shown about ``route`` (None before its first sample)."""
        return self.calibrator.stats(route.name)


class _Observer:
    def __init__(self, owner: UsageCalibration, session_id: str, meter: SessionMeter) -> None:
        self._owner = owner
        self._session_id = session_id
        self._meter = meter

    def __call__(self, fold: SessionFold, batch: AdmittedBatch) -> None:
        for seq in batch.answered:  # the fold lists them: a large batch is not walked again
            event = batch.events[seq - batch.first_seq]
            if _answer_with_usage(event):
                try:
                    self._record(fold, batch, event)
                except (CompactdError, ValueError) as err:  # never fail a commit
                    log.debug("calibration skipped seq %d: %s", event.seq, err)

    def _record(self, fold: SessionFold, batch: AdmittedBatch, event: ev.SessionEvent) -> None:
        usage = event.assistant_message.usage
        provider = usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
        header = self._meter.header
        if provider <= 0 or header is None or not header.config.model:
            return
        route = self._owner.routes.resolve(header.config.provider, header.config.model)
        # compactd's count of the request: the envelope now, less the answer and what the same
        # batch appended after it.
        later = [
            e.seq
            for e in batch.events
            if e.seq >= event.seq and fold.surface.position_of(e.seq) is not None
        ]
        total = self._meter.measure(fold, route, anchored=False).total
        ours = total - self._meter.route_price_of_nodes(fold, later, route)
        sample = Sample(
            compactd=ours, provider=provider, session_id=self._session_id, seq=event.seq
        )
        self._owner.calibrator.record(route.name, sample)


def _answer_with_usage(event: ev.SessionEvent) -> bool:
    return (
        event.HasField("assistant_message")
        and event.assistant_message.HasField("usage")
        and not ev.is_replace(event)
        and not ev.is_insert(event)
    )


def estimated(route: Route, measured: Measurement, stats: CalibrationStats | None) -> Measurement:
    """``measured`` as an ESTIMATED figure when ``route`` has no public tokenizer and the figure
    is the heuristic's: scaled by the calibration (1.0 until it has enough samples)."""
    if not route.estimate or measured.method is not Method.HEURISTIC:
        return measured
    scale = stats.scale if stats is not None else 1.0
    total = round(measured.total * scale)
    gap = total - measured.total
    return replace(measured, total=total, messages=measured.messages + gap, method=Method.ESTIMATED)


def annotate(
    breakdown: compaction_service_pb2.PressureBreakdown,
    *,
    route: Route,
    measured: Measurement,
    unscaled: int,
    stats: CalibrationStats | None,
    anchor_age: tuple[int, float] | None,
) -> None:
    """Fill ``breakdown``'s exactness fields (see ``PressureBreakdown`` in the contract)."""
    fallback = route.pricing.fallback
    if fallback:
        breakdown.warnings.append(f"route {route.name}: {fallback}")
    if stats is not None:
        breakdown.calibration_ratio = stats.ratio
        breakdown.calibration_samples = stats.samples
    method = measured.method
    if method is Method.EXACT:
        breakdown.error_bound = 0.0
    elif method is Method.ESTIMATED:
        breakdown.unscaled_tokens = unscaled
        calibrated = stats is not None and stats.scale != 1.0
        breakdown.error_bound = stats.residual if calibrated and stats else HEURISTIC_ERROR_BOUND
    elif method is Method.HEURISTIC:
        breakdown.error_bound = HEURISTIC_ERROR_BOUND
    if method is Method.ANCHORED and anchor_age is not None:
        breakdown.anchor_age_events, breakdown.anchor_age_seconds = anchor_age
