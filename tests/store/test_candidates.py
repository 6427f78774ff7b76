"""The prepared-ahead candidate contract (``store.candidates``), run against every backend."""

from __future__ import annotations

from compactd.store import EventStore
from compactd.store.candidates import CandidateClaim


def claim(candidate_id: str = "c1", owner: str = "a") -> CandidateClaim:
    return CandidateClaim(candidate_id, owner, "digest-1", 3, 40)


async def test_a_claimed_candidate_is_read_back_with_its_lease_and_no_summary(
    store: EventStore,
) -> None:
    await store.create_session("s", None)

    assert await store.claim_candidate("s", claim(), 30)

    held = await store.get_candidate("s")
    assert held is not None
    assert held.claim == claim()
    assert held.summary is None
    assert held.ready is None
    assert not held.abandoned
    assert 0 < held.remaining_s <= 30


async def test_one_candidate_per_session_while_its_preparer_holds_it(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.claim_candidate("s", claim(), 30)

    assert not await store.claim_candidate("s", claim("c2", "b"), 30)
    held = await store.get_candidate("s")
    assert held is not None
    assert held.candidate_id == "c1"


async def test_an_abandoned_candidate_is_claimed_over_and_its_preparer_is_fenced(
    store: EventStore,
) -> None:
    await store.create_session("s", None)
    await store.claim_candidate("s", claim(), 0)  # a preparer that died at once: lease lapsed
    abandoned = await store.get_candidate("s")
    assert abandoned is not None
    assert abandoned.abandoned

    assert await store.claim_candidate("s", claim("c2", "b"), 30)

    assert not await store.renew_candidate("s", "c1", "a", 30)
    assert not await store.finish_candidate("s", "c1", "a", b"late")
    held = await store.get_candidate("s")
    assert held is not None
    assert held.candidate_id == "c2"
    assert held.summary is None


async def test_a_ready_candidate_is_never_claimed_over_even_after_its_lease(
    store: EventStore,
) -> None:
    await store.create_session("s", None)
    await store.claim_candidate("s", claim(), 0)
    assert await store.finish_candidate("s", "c1", "a", b"summary")

    assert not await store.claim_candidate("s", claim("c2", "b"), 30)
    ready = await store.get_candidate("s")
    assert ready is not None
    assert (ready.summary, ready.abandoned) == (b"summary", False)
    assert ready.ready is not None


async def test_only_the_named_candidate_is_dropped(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.claim_candidate("s", claim(), 30)

    assert not await store.drop_candidate("s", "other")
    assert await store.drop_candidate("s", "c1")
    assert await store.get_candidate("s") is None
    assert await store.claim_candidate("s", claim("c2"), 30)


async def test_a_renewal_extends_only_its_owners_candidate(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.claim_candidate("s", claim(), 1)

    assert not await store.renew_candidate("s", "c1", "b", 60)
    assert await store.renew_candidate("s", "c1", "a", 60)
    held = await store.get_candidate("s")
    assert held is not None
    assert held.remaining_s > 30


async def test_deleting_the_session_deletes_its_candidate(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.claim_candidate("s", claim(), 30)

    await store.delete_session("s")

    assert await store.get_candidate("s") is None
