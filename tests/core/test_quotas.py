"""The quota ledger: each quota counted per tenant, refused at its limit, freed when released."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compactd.core.quotas import Quota, QuotaLedger, QuotaLimits, TokenBucket


def test_a_bucket_lets_its_burst_through_then_says_when_the_next_call_fits() -> None:
    bucket = TokenBucket(rate=10.0, burst=3.0, tokens=3.0, updated=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.1)
    assert bucket.take(0.1) == 0.0


def test_a_bucket_never_holds_more_than_its_burst() -> None:
    bucket = TokenBucket(rate=10.0, burst=2.0, tokens=2.0, updated=0.0)
    taken = [bucket.take(100.0) for _ in range(3)]
    assert taken[:2] == [0.0, 0.0]
    assert taken[2] > 0


@given(
    rate=st.floats(0.5, 100.0),
    burst=st.integers(1, 20),
    steps=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=200),
)
def test_admitted_appends_never_exceed_burst_plus_rate_times_elapsed(
    rate: float, burst: int, steps: list[float]
) -> None:
    ledger = QuotaLedger(QuotaLimits(appends_per_second=rate, append_burst=burst))
    now, admitted = 0.0, 0
    for step in steps:
        now += step
        refusal = ledger.take_append("t", now)
        if refusal is None:
            admitted += 1
        else:
            assert refusal.quota is Quota.APPENDS
            assert refusal.retry_after is not None
            assert 0 < refusal.retry_after <= 1 / rate + 1e-9
    assert admitted <= burst + rate * now + 1e-6


def test_streams_are_refused_at_the_limit_and_freed_when_one_closes() -> None:
    ledger = QuotaLedger(QuotaLimits(max_streams=2))
    assert ledger.open_stream("a") is None
    assert ledger.open_stream("a") is None
    refusal = ledger.open_stream("a")
    assert refusal is not None
    assert refusal.quota is Quota.STREAMS
    assert refusal.retry_after is None
    assert ledger.open_stream("b") is None  # another tenant counts apart
    ledger.close_stream("a")
    assert ledger.open_stream("a") is None


def test_a_released_session_frees_its_place() -> None:
    ledger = QuotaLedger(QuotaLimits(max_sessions=1))
    assert ledger.reserve_session("a") is None
    refused = ledger.reserve_session("a")
    assert refused is not None
    assert (refused.limit, refused.used) == (1, 1)
    ledger.release_session("a")
    assert ledger.reserve_session("a") is None


def test_bytes_over_the_limit_are_refused_unless_the_server_writes_them() -> None:
    ledger = QuotaLedger(QuotaLimits(max_bytes=100))
    assert ledger.reserve_bytes("a", 80) is None
    refused = ledger.reserve_bytes("a", 30)
    assert refused is not None
    assert refused.quota is Quota.BYTES
    assert ledger.of("a").bytes == 80  # a refusal counts nothing
    assert ledger.reserve_bytes("a", 30, enforce=False) is None  # compactd's own events
    assert ledger.of("a").bytes == 110
    ledger.release_bytes("a", 110)
    assert ledger.reserve_bytes("a", 100) is None


def test_a_tenant_with_overrides_is_held_to_them_and_others_to_the_default() -> None:
    ledger = QuotaLedger(
        QuotaLimits(max_sessions=1), overrides={"big": QuotaLimits(max_sessions=3)}
    )
    assert [ledger.reserve_session("big") for _ in range(3)] == [None, None, None]
    assert ledger.reserve_session("big") is not None
    assert ledger.reserve_session("small") is None
    assert ledger.reserve_session("small") is not None


def test_zero_turns_a_quota_off() -> None:
    ledger = QuotaLedger(QuotaLimits())
    assert all(ledger.take_append("a", 0.0) is None for _ in range(1000))
    assert all(ledger.open_stream("a") is None for _ in range(1000))
    assert ledger.reserve_bytes("a", 10**15) is None
    assert not ledger.counts_stored


def test_seeded_usage_counts_towards_the_held_quotas() -> None:
    ledger = QuotaLedger(QuotaLimits(max_sessions=2, max_bytes=1000))
    assert ledger.counts_stored
    ledger.seed("a", sessions=2, stored_bytes=990)
    assert ledger.reserve_session("a") is not None
    assert ledger.reserve_bytes("a", 20) is not None
