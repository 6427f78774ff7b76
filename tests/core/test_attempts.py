"""Failure memory and crossing budgets: a failing span waits for its backoff or a change."""

from __future__ import annotations

from compactd.core.attempts import MAX_ENTRIES, AttemptLedger, Backoff, Crossing, span_key

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


def test_a_failed_span_is_held_back_from_its_target_until_the_backoff_elapses() -> None:
    ledger = AttemptLedger()
    ledger.remember("s", "loop/m", "SUMMARY_REJECTED", 100.0, BACKOFF)

    held = ledger.hold("s", "loop/m", 130.0)
    assert held is not None
    assert (held.reason, held.failures, held.retry_in) == ("SUMMARY_REJECTED", 1, 30.0)
    assert ledger.hold("s", "loop/m", 160.0) is None
    assert ledger.hold("s", "other/model", 130.0) is None
    assert ledger.hold("changed", "loop/m", 130.0) is None


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
    ledger.remember("s", "t", "SUMMARY_REJECTED", 0.0, BACKOFF)

    held = ledger.hold("s", "t", 5.0)
    assert held is not None
    assert held.reason == "SUMMARY_REJECTED"


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


def test_a_crossing_opens_its_budget_then_reports_exhaustion_once() -> None:
    crossing = Crossing()
    for _ in range(2):
        assert crossing.may_open(2, 0.0)
        crossing.opened()

    assert not crossing.may_open(2, 0.0)
    assert crossing.exhaust(10.0, BACKOFF) is True
    assert crossing.exhaust(20.0, BACKOFF) is False
    assert crossing.retry_in(40.0) == 30.0


def test_an_exhausted_crossing_is_renewed_after_a_backoff_that_doubles() -> None:
    crossing = Crossing()
    crossing.opened()
    crossing.exhaust(0.0, BACKOFF)

    assert not crossing.may_open(1, 59.0)
    assert crossing.may_open(1, 60.0)
    crossing.opened()
    assert crossing.exhaust(60.0, BACKOFF) is True
    assert not crossing.may_open(1, 179.0)
    assert crossing.may_open(1, 180.0)


def test_closing_a_crossing_starts_the_next_one_with_a_fresh_budget() -> None:
    ledger = AttemptLedger()
    ledger.open_crossing().opened()
    ledger.close_crossing()

    assert ledger.open_crossing().brackets == 0
