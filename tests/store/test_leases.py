"""The bracket lease contract (``store.leases``), run against every backend like the log's."""

from __future__ import annotations

import asyncio

import pytest

from compactd import errors
from compactd.store import EventStore
from compactd.store.leases import LeaseAction, LeaseOp

from .builders import batch


def op(action: LeaseAction, owner: str = "a", token: str = "k1", ttl_s: float = 30) -> LeaseOp:
    return LeaseOp(action, owner, token, ttl_s)


async def _opened(store: EventStore, owner: str = "a", ttl_s: float = 30) -> None:
    await store.create_session("s", None)
    await store.append("s", batch(0, 1), lease=op(LeaseAction.ACQUIRE, owner, ttl_s=ttl_s))


async def test_a_batch_that_acquires_records_its_owner_and_token(store: EventStore) -> None:
    await _opened(store)

    lease = await store.get_lease("s")

    assert lease is not None
    assert (lease.owner, lease.token, lease.expired) == ("a", "k1", False)
    assert 0 < lease.remaining_s <= 30


async def test_a_session_without_a_bracket_has_no_lease(store: EventStore) -> None:
    await store.create_session("s", None)

    assert await store.get_lease("s") is None


async def test_the_owner_holds_and_releases_its_lease(store: EventStore) -> None:
    await _opened(store)

    await store.append("s", batch(1, 1), lease=op(LeaseAction.HOLD))
    await store.append("s", batch(2, 1), lease=op(LeaseAction.RELEASE))

    assert await store.get_lease("s") is None
    assert (await store.get_session("s")).revision == 3  # type: ignore[union-attr]


async def test_a_renewal_extends_only_the_lease_it_names(store: EventStore) -> None:
    await _opened(store, ttl_s=1)

    assert await store.renew_lease("s", "a", "k1", 60)
    assert not await store.renew_lease("s", "b", "k1", 60)
    assert not await store.renew_lease("s", "a", "k2", 60)
    lease = await store.get_lease("s")
    assert lease is not None
    assert lease.remaining_s > 30


async def test_an_unexpired_lease_cannot_be_broken_or_taken(store: EventStore) -> None:
    await _opened(store)

    with pytest.raises(errors.CompactionBusy):
        await store.append("s", batch(1, 1), lease=op(LeaseAction.BREAK, "b"))
    with pytest.raises(errors.CompactionBusy):
        await store.append("s", batch(1, 1), lease=op(LeaseAction.ACQUIRE, "b", "k2"))
    assert (await store.get_session("s")).revision == 1  # type: ignore[union-attr]


async def test_a_broken_lease_fences_its_owners_late_writes(store: EventStore) -> None:
    await _opened(store, ttl_s=0.05)
    await asyncio.sleep(0.1)
    expired = await store.get_lease("s")
    assert expired is not None
    assert expired.expired

    await store.append("s", batch(1, 1), lease=op(LeaseAction.BREAK, "b"))

    with pytest.raises(errors.Fenced) as raised:
        await store.append("s", batch(2, 1), lease=op(LeaseAction.HOLD))
    assert raised.value.reason == "LEASE_LOST"
    assert not await store.renew_lease("s", "a", "k1", 30)
    assert (await store.get_session("s")).revision == 2  # type: ignore[union-attr]


async def test_a_refused_lease_appends_nothing_and_a_refused_batch_takes_no_lease(
    store: EventStore,
) -> None:
    await store.create_session("s", None)

    with pytest.raises(errors.Fenced):
        await store.append("s", batch(0, 1), lease=op(LeaseAction.HOLD))
    with pytest.raises(errors.SeqConflict):
        await store.append("s", batch(5, 1), lease=op(LeaseAction.ACQUIRE))

    assert (await store.get_session("s")).revision == 0  # type: ignore[union-attr]
    assert await store.get_lease("s") is None


async def test_a_new_lifecycle_by_fiat_clears_any_lease(store: EventStore) -> None:
    await _opened(store)

    await store.append("s", batch(1, 1), lease=op(LeaseAction.CLEAR, "restarted", ""))

    assert await store.get_lease("s") is None
    await store.append("s", batch(2, 1), lease=op(LeaseAction.ACQUIRE, "b", "k2"))
    lease = await store.get_lease("s")
    assert lease is not None
    assert (lease.owner, lease.token) == ("b", "k2")
