"""The quota book: settings validated by name, quotas applied to the tenant the call runs as."""

from __future__ import annotations

import asyncio

import pytest

from compactd.core.quotas import QuotaLimits
from compactd.errors import ConfigError, QuotaExceeded
from compactd.service.quotas import MAX_HELD, MAX_HOLD_S, QuotaBook, QuotaSettings
from compactd.tenancy import Tenant, bound_tenant


def test_settings_give_defaults_and_tenant_overrides_over_them() -> None:
    settings = QuotaSettings.from_mapping(
        {
            "max_streams": 8,
            "appends_per_second": 2.5,
            "tenants": {"big": {"appends_per_second": 100, "max_bytes": 10}},
        }
    )
    assert settings.default == QuotaLimits(max_streams=8, appends_per_second=2.5)
    assert settings.tenants["big"] == QuotaLimits(
        max_streams=8, appends_per_second=100, max_bytes=10
    )


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ({"max_stream": 1}, "quotas.max_stream: unknown setting"),
        ({"max_sessions": -1}, "quotas.max_sessions: must be an integer >= 0"),
        ({"max_bytes": 1.5}, "quotas.max_bytes: must be an integer >= 0"),
        ({"appends_per_second": float("nan")}, "quotas.appends_per_second: must be a number"),
        ({"max_streams": True}, "quotas.max_streams: must be an integer"),
        ({"tenants": {"a": {"burst": 1}}}, "quotas.tenants.a.burst: unknown setting"),
        ({"tenants": {"a": 3}}, "quotas.tenants.a: must be a table"),
        ({"tenants": []}, "quotas.tenants: must be a table of tables"),
    ],
)
def test_a_bad_quota_setting_is_named(table: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        QuotaSettings.from_mapping(table)


def test_a_refused_append_names_the_tenant_the_quota_and_when_to_retry() -> None:
    book = QuotaBook(
        QuotaSettings(QuotaLimits(appends_per_second=4, append_burst=1)), clock=lambda: 0.0
    )
    with bound_tenant(Tenant("noisy")):
        book.admit_append()
        with pytest.raises(QuotaExceeded) as caught:
            book.admit_append()
    error = caught.value
    assert error.reason == "QUOTA_EXCEEDED"
    assert error.retry_after == pytest.approx(0.25)
    assert [(v.subject, v.quota, v.limit) for v in error.quota_violations] == [
        ("tenant:noisy", "appends_per_second", 4)
    ]
    assert "'noisy'" in error.message
    assert "appends_per_second" in error.message


def test_quotas_count_the_tenant_the_call_runs_as() -> None:
    book = QuotaBook(QuotaSettings(QuotaLimits(max_streams=1)))
    with bound_tenant(Tenant("a")):
        close = book.open_stream()
        with pytest.raises(QuotaExceeded):
            book.open_stream()
    with bound_tenant(Tenant("b")):
        book.open_stream()
    close()
    close()  # closing twice frees one place, once
    with bound_tenant(Tenant("a")):
        book.open_stream()
        with pytest.raises(QuotaExceeded):
            book.open_stream()


def test_only_a_tenant_with_an_append_rate_has_one_to_keep() -> None:
    book = QuotaBook(QuotaSettings(tenants={"noisy": QuotaLimits(appends_per_second=5)}))
    with bound_tenant(Tenant("quiet")):
        assert not book.keeps_append_rate()  # its appends are admitted without a token
        for _ in range(1000):
            book.admit_append()
    with bound_tenant(Tenant("noisy")):
        assert book.keeps_append_rate()


def test_a_session_not_created_gives_its_place_back_once() -> None:
    book = QuotaBook(QuotaSettings(QuotaLimits(max_sessions=2)))
    not_created = book.reserve_session()
    not_created()
    not_created()
    book.reserve_session()
    book.reserve_session()
    with pytest.raises(QuotaExceeded):
        book.reserve_session()


async def test_a_call_over_the_rate_waits_for_a_token_that_comes_soon() -> None:
    book = QuotaBook(QuotaSettings(QuotaLimits(appends_per_second=40, append_burst=1)))
    with bound_tenant(Tenant("a")):
        await book.admit_append_or_wait()
        await book.admit_append_or_wait()  # its token comes in 25 ms: it waits, then goes


async def test_a_call_whose_token_is_far_is_refused_after_the_longest_wait() -> None:
    now = [0.0]
    book = QuotaBook(
        QuotaSettings(QuotaLimits(appends_per_second=1, append_burst=1)), clock=lambda: now[0]
    )
    with bound_tenant(Tenant("a")):
        await book.admit_append_or_wait()
        now[0] = MAX_HOLD_S  # the clock as the wait ends
        with pytest.raises(QuotaExceeded) as caught:
            await book.admit_append_or_wait()
    assert caught.value.retry_after == pytest.approx(1 - MAX_HOLD_S)


async def test_beyond_the_calls_that_may_wait_a_call_is_refused_at_once() -> None:
    book = QuotaBook(
        QuotaSettings(QuotaLimits(appends_per_second=1, append_burst=1)), clock=lambda: 0.0
    )

    async def call() -> None:
        with bound_tenant(Tenant("a")):
            await book.admit_append_or_wait()

    await call()
    waiting = [asyncio.ensure_future(call()) for _ in range(MAX_HELD)]
    await asyncio.sleep(0)  # every one of them is waiting now
    extra = asyncio.ensure_future(call())
    await asyncio.sleep(0)
    assert extra.done()
    assert isinstance(extra.exception(), QuotaExceeded)
    assert not any(task.done() for task in waiting)
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(result, QuotaExceeded) for result in results)
