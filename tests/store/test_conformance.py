"""The EventStore contract, run against every backend (see conftest.BACKENDS)."""

from __future__ import annotations

import asyncio
from datetime import UTC

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactd import errors
from compactd.store import EventStore, MemoryEventStore
from compactd.store.base import encode_batch
from compactd.v1 import events_pb2

from .builders import batch, user_event, varied_events, wire
from .conftest import StoreFactory


async def read_all(
    store: EventStore, session_id: str, *bounds: int
) -> list[events_pb2.SessionEvent]:
    return [event async for event in store.read(session_id, *bounds)]


async def seqs_of(store: EventStore, session_id: str, *bounds: int) -> list[int]:
    return [event.seq for event in await read_all(store, session_id, *bounds)]


# --- sessions -------------------------------------------------------------------------------------


async def test_create_session_returns_an_empty_session_with_its_policy(store: EventStore) -> None:
    record = await store.create_session("s1", '{"thresholdRatio": 0.8}')

    assert record.session_id == "s1"
    assert record.revision == 0
    assert record.policy_json == '{"thresholdRatio": 0.8}'
    assert record.create_time.tzinfo is not None
    assert record.create_time.utcoffset() == UTC.utcoffset(None)
    assert await store.get_session("s1") == record


async def test_create_session_keeps_an_absent_policy_absent(store: EventStore) -> None:
    await store.create_session("s1", None)

    record = await store.get_session("s1")

    assert record is not None
    assert record.policy_json is None


async def test_get_session_returns_none_for_an_unknown_id(store: EventStore) -> None:
    assert await store.get_session("nope") is None


async def test_create_session_with_a_taken_id_raises_already_exists(store: EventStore) -> None:
    await store.create_session("s1", None)
    await store.append("s1", batch(0, 2))

    with pytest.raises(errors.AlreadyExists):
        await store.create_session("s1", "{}")
    record = await store.get_session("s1")
    assert record is not None
    assert (record.revision, record.policy_json) == (2, None)


async def test_list_sessions_pages_in_id_order(store: EventStore) -> None:
    for session_id in ["c", "a", "e", "b", "d"]:
        await store.create_session(session_id, None)

    first = await store.list_sessions(limit=2)
    second = await store.list_sessions(after=first[-1].session_id, limit=2)
    rest = await store.list_sessions(after=second[-1].session_id)

    assert [r.session_id for r in first + second + rest] == ["a", "b", "c", "d", "e"]
    assert await store.list_sessions(after="e") == []


async def test_list_sessions_reports_current_revisions(store: EventStore) -> None:
    await store.create_session("a", None)
    await store.append("a", batch(0, 3))

    [record] = await store.list_sessions()

    assert record.revision == 3


async def test_children_name_their_parent_and_list_by_it_a_page_at_a_time(
    store: EventStore,
) -> None:
    await store.create_session("p", None)
    made = await store.create_session("p.b", None, parent="p", fork_at_seq=4)
    for session_id in ["p.c", "p.a"]:
        await store.create_session(session_id, None, parent="p")
    await store.create_session("q.a", None, parent="q")
    await store.create_session("p.x", None, parent="p", tenant="other")

    first = await store.list_sessions(parent="p", limit=2)
    rest = await store.list_sessions(parent="p", after=first[-1].session_id)
    record = await store.get_session("p.b")

    assert [r.session_id for r in first + rest] == ["p.a", "p.b", "p.c"]
    assert record == made
    assert (record.parent_session_id, record.fork_at_seq) == ("p", 4)
    assert (rest[0].parent_session_id, rest[0].fork_at_seq) == ("p", None)
    assert [r.session_id for r in await store.list_sessions(parent="p", tenant="other")] == ["p.x"]
    assert len(await store.list_sessions()) == 5
    top = await store.get_session("p")
    assert top is not None
    assert (top.parent_session_id, top.fork_at_seq) == ("", None)


async def test_list_sessions_rejects_a_limit_below_one(store: EventStore) -> None:
    with pytest.raises(errors.InvalidArgument):
        await store.list_sessions(limit=0)


# --- append ---------------------------------------------------------------------------------------


async def test_append_returns_the_new_revision(store: EventStore) -> None:
    await store.create_session("s", None)

    assert await store.append("s", batch(0, 3)) == 3
    assert await store.append("s", batch(3, 1)) == 4
    record = await store.get_session("s")
    assert record is not None
    assert record.revision == 4


async def test_read_returns_the_appended_bytes_exactly(store: EventStore) -> None:
    await store.create_session("s", None)
    events = varied_events(0) + batch(5, 3, prefix="u")

    await store.append("s", events)

    assert wire(await read_all(store, "s")) == wire(events)


async def test_rows_the_caller_encoded_in_steps_are_what_the_store_keeps(
    store: EventStore,
) -> None:
    await store.create_session("s", None)
    events = varied_events(0) + batch(5, 3, prefix="r")
    rows = encode_batch(events)

    assert await store.append("s", events, rows=rows) == len(events)

    assert wire(await read_all(store, "s")) == wire(events)
    with pytest.raises(errors.SeqConflict):  # the store still checks that they continue the log
        await store.append("s", batch(0, 1, prefix="x"), rows=encode_batch(batch(0, 1, "x")))


async def test_appended_events_are_immune_to_later_changes_by_the_caller(
    store: EventStore,
) -> None:
    await store.create_session("s", None)
    events = batch(0, 1)
    expected = wire(events)

    await store.append("s", events)
    events[0].user_message.content[0].text.text = "changed afterwards"

    assert wire(await read_all(store, "s")) == expected


async def test_append_of_an_empty_batch_returns_the_revision(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.append("s", batch(0, 2))

    assert await store.append("s", []) == 2


async def test_append_keeps_seqs_contiguous_across_batches(store: EventStore) -> None:
    await store.create_session("s", None)
    revision = 0
    for size in [1, 4, 2, 7]:
        revision = await store.append("s", batch(revision, size))

    assert await seqs_of(store, "s") == list(range(14))


@pytest.mark.parametrize("first_seq", [0, 1, 3])
async def test_append_not_continuing_the_log_raises_seq_conflict(
    store: EventStore, first_seq: int
) -> None:
    await store.create_session("s", None)
    await store.append("s", batch(0, 2))

    with pytest.raises(errors.SeqConflict) as caught:
        await store.append("s", batch(first_seq, 2))

    assert caught.value.metadata["revision"] == "2"
    assert await seqs_of(store, "s") == [0, 1]


async def test_append_to_an_unknown_session_raises_not_found(store: EventStore) -> None:
    with pytest.raises(errors.NotFound):
        await store.append("nope", batch(0, 1))


async def test_empty_append_to_an_unknown_session_raises_not_found(store: EventStore) -> None:
    with pytest.raises(errors.NotFound):
        await store.append("nope", [])


async def test_append_reusing_an_event_id_fails_and_appends_nothing(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.append("s", [user_event(0, "a"), user_event(1, "b")])

    with pytest.raises(errors.InvalidArgument) as caught:
        await store.append("s", [user_event(2, "c"), user_event(3, ""), user_event(4, "b")])

    assert "'b'" in caught.value.message
    assert "'c'" not in caught.value.message
    assert await seqs_of(store, "s") == [0, 1]
    assert await store.find_event_ids("s", ["c"]) == {}
    assert await store.append("s", [user_event(2, "c")]) == 3


async def test_append_repeating_an_id_within_the_batch_is_rejected(store: EventStore) -> None:
    await store.create_session("s", None)

    with pytest.raises(errors.InvalidArgument) as caught:
        await store.append("s", [user_event(0, "x"), user_event(1, "x")])

    assert caught.value.violations[0].field == "events[1].event_id"
    assert await seqs_of(store, "s") == []


async def test_append_with_a_gap_in_its_seqs_is_rejected(store: EventStore) -> None:
    await store.create_session("s", None)

    with pytest.raises(errors.InvalidArgument) as caught:
        await store.append("s", [user_event(0), user_event(2)])

    assert caught.value.violations[0].field == "events[1].seq"
    assert await seqs_of(store, "s") == []


async def test_append_with_a_bodyless_event_appends_nothing(store: EventStore) -> None:
    await store.create_session("s", None)

    with pytest.raises(errors.InvalidArgument):
        await store.append("s", [user_event(0), events_pb2.SessionEvent(seq=1)])

    assert await seqs_of(store, "s") == []


async def test_empty_event_ids_never_collide(store: EventStore) -> None:
    await store.create_session("s", None)

    await store.append("s", batch(0, 3))
    await store.append("s", batch(3, 3))

    assert await seqs_of(store, "s") == list(range(6))


async def test_a_caller_cancelled_while_awaiting_commit_wakes_to_its_settled_outcome(
    store: EventStore,
) -> None:
    await store.create_session("s1", None)
    await store.create_session("s2", None)
    outcome = store.commit("s1", batch(0, 2))
    refused = store.commit("s2", batch(5, 1))  # not at the revision: refused

    async def awaiting(future: asyncio.Future[int]) -> None:
        await future

    waiters = [asyncio.create_task(awaiting(f)) for f in (outcome, refused)]
    await asyncio.sleep(0)
    for waiter in waiters:
        waiter.cancel()
    for waiter in waiters:
        with pytest.raises(asyncio.CancelledError):
            await waiter

    assert outcome.result() == 2  # settled before its caller heard of the cancellation
    assert isinstance(refused.exception(), errors.SeqConflict)
    assert await seqs_of(store, "s1") == [0, 1]
    assert await seqs_of(store, "s2") == []


# --- reads ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        ((), list(range(20))),
        ((5,), list(range(5, 20))),
        ((5, 9), [5, 6, 7, 8]),
        ((0, 20), list(range(20))),
        ((13, 100), list(range(13, 20))),
        ((20,), []),
        ((25,), []),
        ((9, 5), []),
        ((4, 4), []),
    ],
)
async def test_read_returns_the_half_open_seq_range(
    store: EventStore, bounds: tuple[int, ...], expected: list[int]
) -> None:
    await store.create_session("s", None)
    await store.append("s", batch(0, 20))

    assert await seqs_of(store, "s", *bounds) == expected


async def test_read_streams_logs_longer_than_one_chunk(store: EventStore) -> None:
    await store.create_session("s", None)
    events = batch(0, 300, prefix="e")
    await store.append("s", events)

    assert wire(await read_all(store, "s")) == wire(events)


async def test_read_stops_at_the_revision_it_started_at(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.append("s", batch(0, 20))

    seen = []
    async for event in store.read("s"):
        seen.append(event.seq)
        if event.seq == 0:
            await store.append("s", batch(20, 5))

    assert seen == list(range(20))
    assert await seqs_of(store, "s", 20) == list(range(20, 25))


async def test_read_of_an_unknown_session_raises_not_found(store: EventStore) -> None:
    with pytest.raises(errors.NotFound):
        await read_all(store, "nope")


@pytest.mark.parametrize("bounds", [(-1,), (0, -1)])
async def test_read_rejects_negative_bounds(store: EventStore, bounds: tuple[int, ...]) -> None:
    await store.create_session("s", None)

    with pytest.raises(errors.InvalidArgument):
        await read_all(store, "s", *bounds)


async def test_read_seqs_returns_existing_events_in_seq_order_once(store: EventStore) -> None:
    await store.create_session("s", None)
    events = batch(0, 10)
    await store.append("s", events)

    found = await store.read_seqs("s", [7, 2, 7, 99, -1, 0])

    assert wire(found) == wire([events[0], events[2], events[7]])
    assert await store.read_seqs("s", []) == []


async def test_read_seqs_of_an_unknown_session_raises_not_found(store: EventStore) -> None:
    with pytest.raises(errors.NotFound):
        await store.read_seqs("nope", [0])


async def test_read_stored_returns_the_bytes_of_existing_events_by_seq(store: EventStore) -> None:
    await store.create_session("s", None)
    events = batch(0, 10)
    await store.append("s", events)

    found = await store.read_stored("s", [7, 2, 3, 4, 7, 99, -1, 0])

    assert sorted(found) == [0, 2, 3, 4, 7]
    parsed = {e.seq: e for e in await store.read_seqs("s", list(found))}
    assert found == {seq: e.SerializeToString(deterministic=True) for seq, e in parsed.items()}
    assert await store.read_stored("s", []) == {}
    with pytest.raises(errors.NotFound):
        await store.read_stored("nope", [0])


async def test_find_event_ids_maps_known_ids_to_seqs(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.append("s", [user_event(0, "a"), user_event(1), user_event(2, "b")])

    found = await store.find_event_ids("s", ["b", "zzz", "", "a", "b"])

    assert found == {"a": 0, "b": 2}


async def test_find_event_ids_handles_many_ids(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.append("s", batch(0, 1200, prefix="id-"))

    found = await store.find_event_ids("s", [f"id-{s}" for s in range(0, 1300, 3)])

    assert found == {f"id-{s}": s for s in range(0, 1200, 3)}


async def test_find_event_ids_of_an_unknown_session_raises_not_found(store: EventStore) -> None:
    with pytest.raises(errors.NotFound):
        await store.find_event_ids("nope", ["a"])


async def test_sessions_are_isolated(store: EventStore) -> None:
    await store.create_session("a", None)
    await store.create_session("b", None)
    a_events = [user_event(0, "same", "in a")]
    b_events = [user_event(0, "same", "in b"), user_event(1, "other", "in b")]

    await store.append("a", a_events)
    await store.append("b", b_events)

    assert wire(await read_all(store, "a")) == wire(a_events)
    assert wire(await read_all(store, "b")) == wire(b_events)
    assert await store.find_event_ids("a", ["same", "other"]) == {"same": 0}
    assert wire(await store.read_seqs("a", [0, 1])) == wire(a_events)


# --- concurrency ----------------------------------------------------------------------------------


async def _append_until_landed(store: EventStore, session_id: str, event_id: str) -> int:
    """Appends one event at the current revision, retrying on conflict like a real client."""
    while True:
        record = await store.get_session(session_id)
        assert record is not None
        try:
            await store.append(session_id, [user_event(record.revision, event_id)])
        except errors.SeqConflict:
            continue
        return record.revision


async def test_concurrent_appends_to_one_session_land_exactly_once(store: EventStore) -> None:
    await store.create_session("s", None)
    ids = [f"t{task}-{n}" for task in range(16) for n in range(5)]

    async def writer(task: int) -> None:
        for n in range(5):
            await _append_until_landed(store, "s", f"t{task}-{n}")

    await asyncio.gather(*(writer(task) for task in range(16)))

    events = await read_all(store, "s")
    assert [e.seq for e in events] == list(range(len(ids)))
    assert sorted(e.event_id for e in events) == sorted(ids)


async def test_concurrent_appends_to_many_sessions_all_land(store: EventStore) -> None:
    sessions = [f"s{i:02}" for i in range(24)]

    async def writer(session_id: str) -> None:
        await store.create_session(session_id, None)
        for start in range(0, 12, 3):
            await store.append(session_id, batch(start, 3, prefix=f"{session_id}-"))

    await asyncio.gather(*(writer(s) for s in sessions))

    for session_id in sessions:
        assert wire(await read_all(store, session_id)) == wire(batch(0, 12, f"{session_id}-"))


async def test_racing_appends_at_one_seq_let_exactly_one_win(store: EventStore) -> None:
    await store.create_session("s", None)

    results = await asyncio.gather(
        *(store.append("s", [user_event(0, f"r{i}")]) for i in range(10)), return_exceptions=True
    )

    assert results.count(1) == 1
    assert all(isinstance(r, errors.SeqConflict) for r in results if r != 1)
    assert await seqs_of(store, "s") == [0]


# --- lifecycle ------------------------------------------------------------------------------------


async def test_a_closed_store_raises_unavailable(store_factory: StoreFactory) -> None:
    store = store_factory()
    async with store:
        await store.create_session("s", None)

    with pytest.raises(errors.Unavailable):
        await store.append("s", batch(0, 1))
    with pytest.raises(errors.Unavailable):
        await store.get_session("s")
    await store.close()  # idempotent


async def test_stats_count_landed_and_failed_batches(store: EventStore) -> None:
    await store.create_session("s", None)
    await store.append("s", batch(0, 3))
    with pytest.raises(errors.SeqConflict):
        await store.append("s", batch(0, 1))

    stats = store.stats

    assert (stats.batches, stats.failed_batches, stats.events) == (2, 1, 3)
    assert stats.commits >= 1


async def test_stats_time_the_durable_stores_write_transactions_and_their_queue(
    store: EventStore,
) -> None:
    """SQLite and PostgreSQL add each committed append's transaction time (start to commit)
    and its wait for that transaction; the in-memory store, which has neither, adds none."""
    await store.create_session("s", None)
    await store.append("s", batch(0, 3))
    first = store.stats
    await store.append("s", batch(3, 2))
    second = store.stats

    if isinstance(store, MemoryEventStore):
        assert (second.commit_seconds, second.queued_seconds) == (0.0, 0.0)
        return
    assert 0 < first.commit_seconds < second.commit_seconds
    assert 0 < first.queued_seconds < second.queued_seconds


# --- properties -----------------------------------------------------------------------------------

_appends = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 5), st.integers(-1, 1)),
    max_size=25,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(appends=_appends)
def test_the_log_equals_every_accepted_batch_in_order(
    store_factory: StoreFactory, appends: list[tuple[str, int, int]]
) -> None:
    """Batches at a wrong seq are refused whole; the accepted ones read back exactly."""

    async def run() -> None:
        model: dict[str, list[bytes]] = {"a": [], "b": [], "c": []}
        async with store_factory() as store:
            for session_id in model:
                await store.create_session(session_id, None)
            for session_id, size, skew in appends:
                events = batch(max(len(model[session_id]) + skew, 0), size)
                try:
                    await store.append(session_id, events)
                except errors.SeqConflict:
                    assert events[0].seq != len(model[session_id])
                    continue
                model[session_id].extend(wire(events))
            for session_id, expected in model.items():
                assert wire(await read_all(store, session_id)) == expected
                record = await store.get_session(session_id)
                assert record is not None
                assert record.revision == len(expected)

    asyncio.run(run())


# --- fold snapshots (issue 11) --------------------------------------------------------------------


async def test_a_snapshot_is_kept_whole_and_replaced_by_the_next(store: EventStore) -> None:
    await store.create_session("s1", None)
    await store.append("s1", batch(0, 4))
    assert await store.get_snapshot("s1") is None

    await store.put_snapshot("s1", 2, b"at two")
    await store.put_snapshot("s1", 4, b"at four")

    assert await store.get_snapshot("s1") == (4, b"at four")
    assert await store.get_snapshot("nope") is None


# --- usage (what the quotas count) ----------------------------------------------------------------


async def test_usage_counts_each_tenants_sessions_and_serialized_bytes(store: EventStore) -> None:
    try:
        assert await store.usage() == {}
    except NotImplementedError:
        pytest.skip("this backend does not report usage (sessions and bytes quotas are refused)")
    events = batch(0, 3)
    await store.create_session("s1", None, tenant="a")
    await store.create_session("s2", None, tenant="a")
    await store.create_session("s1", None, tenant="b")
    await store.append("s1", events, tenant="a")
    size = sum(len(data) for data in wire(events))

    usage = await store.usage()

    assert {t: (u.sessions, u.bytes) for t, u in usage.items()} == {"a": (2, size), "b": (1, 0)}
    only_b = await store.usage(tenant="b")
    assert {t: (u.sessions, u.bytes) for t, u in only_b.items()} == {"b": (1, 0)}
    one = await store.usage(tenant="a", session_id="s1")
    assert {t: (u.sessions, u.bytes) for t, u in one.items()} == {"a": (1, size)}
    assert await store.usage(tenant="a", session_id="nope") == {}
    await store.delete_session("s1", tenant="a")
    after = await store.usage(tenant="a")
    assert {t: (u.sessions, u.bytes) for t, u in after.items()} == {"a": (1, 0)}
