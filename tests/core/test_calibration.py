"""Calibration from usage: per-route windows, a bounded scale, the residual error after it."""

from __future__ import annotations

import pytest

from compactd.core.calibration import (
    MAX_SCALE,
    MIN_SAMPLES,
    MIN_SCALE,
    WINDOW,
    Calibrator,
    Sample,
)


def sample(compactd: int, provider: int, seq: int = 0) -> Sample:
    return Sample(compactd=compactd, provider=provider, session_id="s", seq=seq)


def test_a_route_without_samples_has_no_stats_and_scale_one() -> None:
    calibrator = Calibrator()
    assert calibrator.stats("a/b") is None
    assert calibrator.scale("a/b") == 1.0


def test_the_ratio_is_provider_over_compactd_over_the_window() -> None:
    calibrator = Calibrator()
    for seq, (ours, theirs) in enumerate([(100, 150), (200, 290), (100, 160)]):
        calibrator.record("a/b", sample(ours, theirs, seq))
    stats = calibrator.stats("a/b")
    assert stats is not None
    assert (stats.samples, stats.compactd_tokens, stats.provider_tokens) == (3, 400, 600)
    assert stats.ratio == pytest.approx(1.5)
    assert stats.scale == pytest.approx(1.5)
    assert stats.last_difference == 60
    # After scaling by 1.5: 150/150, 300 vs 290, 150 vs 160: the worst is 10/160.
    assert stats.residual == pytest.approx(10 / 160)


def test_the_scale_waits_for_enough_samples() -> None:
    calibrator = Calibrator()
    for seq in range(MIN_SAMPLES - 1):
        calibrator.record("a/b", sample(100, 200, seq))
    assert calibrator.scale("a/b") == 1.0
    calibrator.record("a/b", sample(100, 200))
    assert calibrator.scale("a/b") == pytest.approx(2.0)


def test_the_scale_is_bounded() -> None:
    calibrator = Calibrator()
    for seq in range(MIN_SAMPLES):
        calibrator.record("low/x", sample(1000, 10, seq))
        calibrator.record("high/x", sample(10, 1000, seq))
    assert calibrator.scale("low/x") == MIN_SCALE
    assert calibrator.scale("high/x") == MAX_SCALE


def test_the_window_keeps_the_latest_samples_per_route() -> None:
    calibrator = Calibrator()
    for seq in range(WINDOW + 5):
        calibrator.record("a/b", sample(100, 100 + seq, seq))
    calibrator.record("c/d", sample(100, 50))
    stats = calibrator.stats("a/b")
    assert stats is not None
    assert (stats.samples, stats.total_samples) == (WINDOW, WINDOW + 5)
    assert stats.provider_tokens == sum(100 + s for s in range(5, WINDOW + 5))
    assert calibrator.routes() == ["a/b", "c/d"]


def test_empty_samples_are_ignored() -> None:
    calibrator = Calibrator()
    calibrator.record("a/b", sample(0, 10))
    calibrator.record("a/b", sample(10, 0))
    assert calibrator.stats("a/b") is None
