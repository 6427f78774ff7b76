"""Failure memory: a failing span is not sent to its target again while it stays the same
(after a transient provider failure, until its backoff elapses)."""

from __future__ import annotations

import math

from compactd.core.attempts import MAX_ENTRIES, AttemptLedger, Backoff, span_key

BACKOFF = Backoff(base=60, cap=240)


def test_the_backoff_doubles_up_to_its_cap() -> None:
    assert [BACKOFF.delay(n) for n in range(6)] == [0, 60, 120, 240, 240, 240]
    assert Backoff(base=0, cap=0).delay(3) == 0


def test_a_span_key_changes_with_its_nodes_and_its_offloaded_images() -> None:
    key = span_key([3, 4, 5], {})

    assert span_key([3, 4, 5], {}) == key
    assert span_key([3, 4, 5, 6], {}) != key
    assert span_key([3, 4, 5], {4: frozenset({0})}) != key
    assert span_key([3, 4, 5], {9: frozenset({0})}) == key  # offloads outside the span


def test_a_transient_failure_holds_the_span_back_from_its_target_until_the_backoff_elapses() -> (
    None
):
    ledger = AttemptLedger()
    ledger.remember("s", "loop/m", "TIMEOUT", 100.0, BACKOFF)

    held = ledger.hold("s", "loop/m", 130.0)
    assert held is not None
    assert (held.reason, held.failures, held.retry_in) == ("TIMEOUT", 1, 30.0)
    assert ledger.hold("s", "loop/m", 160.0) is None
    assert ledger.hold("s", "other/model", 130.0) is None
    assert ledger.hold("changed", "loop/m", 130.0) is None


def test_a_failure_of_the_span_or_its_summary_holds_it_back_until_it_changes() -> None:
    # The same request would get the same answer: it is never sent again, only a new span is.
    ledger = AttemptLedger()
    for reason in ("SUMMARY_REJECTED", "SUMMARY_TRUNCATED", "SUMMARY_FAILED"):
        ledger.remember("s", "loop/m", reason, 100.0, BACKOFF)

    held = ledger.hold("s", "loop/m", 10.0**9)
    assert held is not None
    assert held.retry_in == math.inf
    assert ledger.hold("grown", "loop/m", 130.0) is None


def test_consecutive_failures_of_one_kind_wait_longer() -> None:
    ledger = AttemptLedger()
    ledger.remember("s", "t", "TIMEOUT", 0.0, BACKOFF)
    until = ledger.remember("s", "t", "TIMEOUT", 60.0, BACKOFF)

    assert until == 180.0
    held = ledger.hold("s", "t", 100.0)
    assert held is not None
    assert held.failures == 2


def test_the_longest_wait_of_any_kind_holds() -> None:
    ledger = AttemptLedger()
    ledger.remember("s", "t", "TIMEOUT", 0.0, Backoff(10, 10))
    ledger.remember("s", "t", "RATE_LIMITED", 0.0, BACKOFF)

    held = ledger.hold("s", "t", 5.0)
    assert held is not None
    assert held.reason == "RATE_LIMITED"


def test_drift_and_cancellation_are_not_remembered_nor_anything_with_memory_off() -> None:
    ledger = AttemptLedger()

    assert ledger.remember("s", "t", "SPAN_DRIFT", 0.0, BACKOFF) is None
    assert ledger.remember("s", "t", "CANCELLED", 0.0, BACKOFF) is None
    assert ledger.remember("s", "t", "SUMMARY_REJECTED", 0.0, Backoff(0, 0)) is None
    assert ledger.hold("s", "t", 1.0) is None


def test_the_memory_keeps_the_most_recent_entries_only() -> None:
    ledger = AttemptLedger()
    for i in range(MAX_ENTRIES + 5):
        ledger.remember(f"span-{i}", "t", "SUMMARY_REJECTED", float(i), BACKOFF)

    assert ledger.hold("span-0", "t", MAX_ENTRIES + 5.0) is None
    assert ledger.hold(f"span-{MAX_ENTRIES + 4}", "t", MAX_ENTRIES + 5.0) is not None
