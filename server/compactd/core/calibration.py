"""Calibration from usage: how far compactd's count of a request was from what the provider billed.

When an ``assistant/message`` arrives with the provider's usage, its prompt tokens (input + cache
read + cache write) are what the provider counted for the request that message answered. The
service records them next to compactd's own unanchored count of the same envelope, per route
(``Calibrator.record``). The last ``WINDOW`` samples of a route give:

- ``ratio``: provider tokens / compactd tokens over the window (1.0 is perfect);
- ``scale``: the factor an ESTIMATED route applies to its estimate, the ratio clamped to
  ``[MIN_SCALE, MAX_SCALE]``, and 1.0 until the window holds ``MIN_SAMPLES`` samples;
- ``residual``: after scaling, the worst relative error left on the window's samples: the error
  bound an ESTIMATED report states.

Pure: the caller decides which counts to record; nothing here reads a clock or a store.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

WINDOW: Final = 32
MIN_SAMPLES: Final = 3
MIN_SCALE: Final = 0.5
MAX_SCALE: Final = 3.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One request: compactd's count and the provider's prompt tokens, and where it came from."""

    compactd: int
    provider: int
    session_id: str
    seq: int


@dataclass(frozen=True, slots=True)
class CalibrationStats:
    """What usage has shown about one route's counts.

    Attributes:
        route: ``provider/model``.
        samples: Samples in the window (at most ``WINDOW``).
        total_samples: Samples ever recorded for the route in this process.
        compactd_tokens: compactd's counts, summed over the window.
        provider_tokens: The provider's prompt tokens, summed over the window.
        last_difference: provider - compactd for the latest sample.
        ratio: provider / compactd over the window (0.0 when compactd counted nothing).
        scale: The factor an ESTIMATED route applies (1.0 until ``MIN_SAMPLES``).
        residual: Worst relative error of the scaled counts on the window's samples.
    """

    route: str
    samples: int
    total_samples: int
    compactd_tokens: int
    provider_tokens: int
    last_difference: int
    ratio: float
    scale: float
    residual: float


class Calibrator:
    """Per-route windows of (compactd, provider) counts."""

    def __init__(self) -> None:
        self._windows: dict[str, deque[Sample]] = {}
        self._totals: dict[str, int] = {}

    def record(self, route: str, sample: Sample) -> None:
        """Add one request's counts for ``route`` (``provider/model``). Ignores empty samples."""
        if sample.compactd <= 0 or sample.provider <= 0:
            return
        self._windows.setdefault(route, deque(maxlen=WINDOW)).append(sample)
        self._totals[route] = self._totals.get(route, 0) + 1

    def stats(self, route: str) -> CalibrationStats | None:
        """The route's calibration, or None before its first sample."""
        window = self._windows.get(route)
        if not window:
            return None
        ours = sum(s.compactd for s in window)
        theirs = sum(s.provider for s in window)
        ratio = theirs / ours if ours else 0.0
        scale = _scale(window, ratio)
        residual = max(abs(s.provider - s.compactd * scale) / s.provider for s in window)
        return CalibrationStats(
            route=route,
            samples=len(window),
            total_samples=self._totals[route],
            compactd_tokens=ours,
            provider_tokens=theirs,
            last_difference=window[-1].provider - window[-1].compactd,
            ratio=ratio,
            scale=scale,
            residual=residual,
        )

    def routes(self) -> list[str]:
        """Routes with at least one sample."""
        return sorted(self._windows)

    def scale(self, route: str) -> float:
        """The factor an ESTIMATED measurement of ``route`` is multiplied by."""
        stats = self.stats(route)
        return stats.scale if stats is not None else 1.0


def _scale(window: deque[Sample], ratio: float) -> float:
    if len(window) < MIN_SAMPLES or ratio <= 0:
        return 1.0
    return min(MAX_SCALE, max(MIN_SCALE, ratio))
