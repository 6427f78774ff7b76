"""The EventStore contract for tenants and deletion, run against every backend."""

from __future__ import annotations

import asyncio

import pytest

from compactd import errors
from compactd.store import EventStore

from .builders import batch, wire
from .conftest import StoreFactory


async def test_one_id_names_a_separate_session_in_each_tenant(store: EventStore) -> None:
    await store.create_session("s", '{"a": 1}', tenant="a")
    await store.create_session("s", None, tenant="b")
    await store.append("s", batch(0, 3, "a-"), tenant="a")
    await store.append("s", batch(0, 1, "b-"), tenant="b")

    a = await store.get_session("s", tenant="a")
    b = await store.get_session("s", tenant="b")

    assert (a and a.tenant, a and a.revision, a and a.policy_json) == ("a", 3, '{"a": 1}')
    assert (b and b.tenant, b and b.revision, b and b.policy_json) == ("b", 1, None)
    assert wire([e async for e in store.read("s", tenant="b")]) == wire(batch(0, 1, "b-"))
    assert await store.find_event_ids("s", ["a-0", "b-0"], tenant="a") == {"a-0": 0}


async def test_another_tenants_session_is_not_found_by_any_method(store: EventStore) -> None:
    await store.create_session("s", None, tenant="a")
    await store.append("s", batch(0, 2), tenant="a")

    assert await store.get_session("s", tenant="b") is None
    assert await store.get_session("s") is None  # the default tenant is a tenant too
    with pytest.raises(errors.NotFound):
        await store.append("s", batch(2, 1), tenant="b")
    with pytest.raises(errors.NotFound):
        [e async for e in store.read("s", tenant="b")]
    with pytest.raises(errors.NotFound):
        await store.read_seqs("s", [0], tenant="b")
    with pytest.raises(errors.NotFound):
        await store.find_event_ids("s", ["x"], tenant="b")
    assert await store.delete_session("s", tenant="b") is False
    assert (await store.get_session("s", tenant="a")) is not None


async def test_list_sessions_lists_one_tenant_only(store: EventStore) -> None:
    for tenant, session_id in [("a", "1"), ("b", "2"), ("a", "3"), ("default", "4")]:
        await store.create_session(session_id, None, tenant=tenant)

    assert [r.session_id for r in await store.list_sessions(tenant="a")] == ["1", "3"]
    assert [r.session_id for r in await store.list_sessions(tenant="b")] == ["2"]
    assert [r.session_id for r in await store.list_sessions()] == ["4"]


async def test_delete_session_removes_the_log_and_frees_the_id(store: EventStore) -> None:
    await store.create_session("s", '{"x": 1}', tenant="a")
    await store.append("s", batch(0, 5, "e-"), tenant="a")

    assert await store.delete_session("s", tenant="a") is True

    assert await store.get_session("s", tenant="a") is None
    assert await store.list_sessions(tenant="a") == []
    with pytest.raises(errors.NotFound):
        [e async for e in store.read("s", tenant="a")]
    assert await store.delete_session("s", tenant="a") is False
    fresh = await store.create_session("s", None, tenant="a")
    assert (fresh.revision, fresh.policy_json) == (0, None)
    assert await store.append("s", batch(0, 1, "e-"), tenant="a") == 1  # old ids are gone too


async def test_delete_survives_reopening(store_factory: StoreFactory) -> None:
    store = store_factory()
    async with store:
        await store.create_session("s", None, tenant="a")
        await store.append("s", batch(0, 2), tenant="a")
        await store.delete_session("s", tenant="a")
        await store.create_session("kept", None, tenant="a")
    async with store:  # the in-memory store keeps its data across close/open
        assert await store.get_session("s", tenant="a") is None
        assert [r.session_id for r in await store.list_sessions(tenant="a")] == ["kept"]


async def test_last_active_is_the_last_append(store: EventStore) -> None:
    created = await store.create_session("s", None)
    assert created.last_active == created.create_time
    await asyncio.sleep(0.01)  # a later moment on any clock's resolution
    await store.append("s", batch(0, 1))
    await store.append("s", [])  # an empty batch changes nothing

    record = await store.get_session("s")

    assert record is not None
    assert record.create_time == created.create_time
    assert record.last_active > created.last_active
    assert [r.last_active for r in await store.list_sessions()] == [record.last_active]
