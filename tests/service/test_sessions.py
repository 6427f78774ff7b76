"""Sessions over the store: the fold always matches what the log durably holds."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import socket
import sqlite3
import time
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from compactd import speed
from compactd.core.fold import AdmittedBatch
from compactd.errors import NotFound, Unavailable
from compactd.service.sessions import SessionManager
from compactd.service.sessions.handle import ADMIT_STEP
from compactd.speed import FREE_STEP, STEP_S, YIELD_TURNS, in_steps
from compactd.store.base import EventRow
from compactd.store.leases import LeaseOp
from compactd.store.memory import MemoryEventStore
from compactd.store.sqlite import SqliteEventStore
from compactd.tenancy import Tenant, bound_tenant
from compactd.v1 import events_pb2
from tests.builders import user


class GatedStore(MemoryEventStore):
    """An in-memory store whose appends wait for a gate (and may be told to fail), and which
    remembers whether each batch came encoded."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.fail = False
        self.encoded: list[bool] = []
        self.rows: list[list[EventRow]] = []

    async def append(
        self,
        session_id: str,
        events: Sequence[events_pb2.SessionEvent],
        *,
        tenant: str = "default",
        lease: LeaseOp | None = None,
        rows: Sequence[EventRow] | None = None,
    ) -> int:
        self.encoded.append(rows is not None)
        self.rows.append(list(rows or ()))
        self.entered.set()
        await self.gate.wait()
        if self.fail:
            raise Unavailable("disk went away")
        return await super().append(session_id, events, tenant=tenant, lease=lease, rows=rows)


async def _session(store: GatedStore) -> SessionManager:
    await store.open()
    manager = SessionManager(store)
    await manager.create("s", None)
    return manager


async def test_a_cancelled_append_still_folds_what_the_store_committed() -> None:
    store = GatedStore()
    handle = await (await _session(store)).get("s")
    append = asyncio.create_task(handle.append([user("a")]))
    await store.entered.wait()
    append.cancel()
    store.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await append
    stored = [e.seq async for e in store.read("s")]
    assert stored == [0]
    assert (handle.revision, handle.fold.revision) == (1, 1)
    assert (await handle.append([user("b")])).seqs == [1]


async def test_a_cancelled_append_on_sqlite_waits_for_the_writer_and_folds_its_commit(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e.db"
    async with SqliteEventStore(str(path)) as store:
        manager = SessionManager(store)
        await manager.create("s", None)
        handle = await manager.get("s")
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # the writer waits: the batch is queued, not landed
            append = asyncio.create_task(handle.append([user("a")]))
            await asyncio.sleep(0.05)
            append.cancel()
            await asyncio.sleep(0.05)
            assert not append.done()  # a cancelled caller waits for the commit's outcome
            other.execute("ROLLBACK")
        finally:
            other.close()
        with pytest.raises(asyncio.CancelledError):
            await append
        assert [e.seq async for e in store.read("s")] == [0]
        assert (handle.revision, handle.fold.revision) == (1, 1)
        assert (await handle.append([user("b")])).seqs == [1]


async def test_a_failed_commit_leaves_the_fold_as_the_log() -> None:
    store = GatedStore()
    handle = await (await _session(store)).get("s")
    store.fail = True
    store.gate.set()
    with pytest.raises(Unavailable):
        await handle.append([user("a")])
    assert (handle.revision, handle.fold.revision, len(handle.fold.surface)) == (0, 0, 0)
    store.fail = False
    assert (await handle.append([user("a")])).seqs == [0]


async def test_a_cancelled_append_whose_commit_fails_rolls_back() -> None:
    store = GatedStore()
    handle = await (await _session(store)).get("s")
    append = asyncio.create_task(handle.append([user("a")]))
    await store.entered.wait()
    append.cancel()
    store.fail = True
    store.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await append
    assert (handle.revision, handle.fold.revision) == (0, 0)


@contextlib.contextmanager
def unretrieved_task_exceptions() -> Iterator[list[str]]:
    """What asyncio reports about the loop's futures meanwhile ("Task exception was never
    retrieved": logged at ERROR with a traceback), checked after the unreferenced ones are
    freed."""
    reported: list[str] = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(str(context.get("message"))))
    try:
        yield reported
        gc.collect()
    finally:
        loop.set_exception_handler(previous)


async def test_a_failed_commit_whose_caller_went_away_is_not_reported_unretrieved() -> None:
    store = GatedStore()
    handle = await (await _session(store)).get("s")

    async def abandoned() -> None:  # its frame (and the commit task it names) freed on return
        append = asyncio.create_task(handle.append([user("a")]))
        await store.entered.wait()
        append.cancel()  # the caller's deadline passed mid-commit
        store.fail = True
        store.gate.set()
        await asyncio.wait([append])
        assert append.cancelled()

    with unretrieved_task_exceptions() as reported:
        await abandoned()
    assert reported == []


class FailingRestoreStore(MemoryEventStore):
    """An in-memory store whose session reads wait for a gate, then fail."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def get_session(self, session_id: str, *, tenant: str = "default") -> Any:
        self.entered.set()
        await self.gate.wait()
        raise Unavailable("disk went away")


async def test_a_failed_restore_whose_callers_went_away_is_not_reported_unretrieved() -> None:
    store = FailingRestoreStore()
    await store.open()

    async def abandoned() -> None:
        getting = asyncio.create_task(SessionManager(store).get("s"))
        await store.entered.wait()
        getting.cancel()  # the only caller goes away
        store.gate.set()
        await asyncio.wait([getting])
        assert getting.cancelled()
        await asyncio.sleep(0)  # the restore fails

    with unretrieved_task_exceptions() as reported:
        await abandoned()
    assert reported == []


async def test_concurrent_first_uses_restore_a_session_once() -> None:
    store = MemoryEventStore()
    await store.open()
    await SessionManager(store).create("s", None)
    first = SessionManager(store)
    handle = await first.get("s")
    await handle.append([user("a")])
    restarted = SessionManager(store)  # a new process over the same log
    handles = await asyncio.gather(*(restarted.get("s") for _ in range(5)))
    assert len({id(h) for h in handles}) == 1
    kinds = [e.WhichOneof("body") async for e in store.read("s")]
    assert kinds == ["user_message", "session_end_seed"]


async def test_unknown_session_ids_leave_nothing_behind() -> None:
    store = MemoryEventStore()
    await store.open()
    manager = SessionManager(store)
    for n in range(3):
        with pytest.raises(NotFound):
            await manager.get(f"missing-{n}")
    assert manager._loading == {}


# ---- tenants and deletion --------------------------------------------------------------------


async def test_the_callers_tenant_keys_its_sessions() -> None:
    store = MemoryEventStore()
    await store.open()
    manager = SessionManager(store)
    with bound_tenant(Tenant("a")):
        await manager.create("s", None)
        handle_a = await manager.get("s")
    with bound_tenant(Tenant("b")), pytest.raises(NotFound):
        await manager.get("s")
    await manager.create("s", None, tenant=Tenant("b"))

    handle_b = await manager.get("s", tenant=Tenant("b"))

    assert handle_a is not handle_b
    assert (handle_a.tenant, handle_b.tenant) == ("a", "b")
    assert [r.session_id for r in await manager.list(tenant=Tenant("b"))] == ["s"]
    assert await manager.list() == []


async def test_delete_ends_followers_and_frees_the_id() -> None:
    store = MemoryEventStore()
    await store.open()
    manager = SessionManager(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    revisions = handle.revisions()
    assert await anext(revisions) == 0
    waiting = asyncio.ensure_future(anext(revisions))
    await asyncio.sleep(0)

    await manager.delete("s")

    with pytest.raises(NotFound):
        await waiting
    with pytest.raises(NotFound):
        await handle.append([user("hi")])  # a handle taken before the delete
    with pytest.raises(NotFound):
        await manager.get("s")
    with pytest.raises(NotFound):
        await manager.delete("s")
    await manager.create("s", None)
    assert (await manager.get("s")).revision == 0


def _long_steps(done: list[int], steps: int) -> Generator[None, None, int]:
    for index in range(steps):
        time.sleep(STEP_S)  # every step uses up the loop's share on its own
        done.append(index)
        yield
    return steps


async def test_a_large_batchs_steps_wait_while_other_calls_have_turns_to_run() -> None:
    done: list[int] = []
    batch = asyncio.ensure_future(in_steps(_long_steps(done, 50)))
    await asyncio.sleep(0)  # its first step runs
    for _ in range(10):  # a call next door that needs ten loop turns
        await asyncio.sleep(0)
    assert len(done) <= 2  # not a step of the batch before each of its turns
    assert await batch == 50


async def test_a_large_batchs_steps_take_no_loop_turn_while_nothing_else_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    turns: list[None] = []
    original = speed.let_others_run

    async def counted() -> None:
        turns.append(None)
        await original()

    monkeypatch.setattr(speed, "let_others_run", counted)
    assert await in_steps(_long_steps([], 5)) == 5
    assert not turns  # every step used up its share, but no other callback, timer or I/O waited


async def test_a_call_arriving_during_a_large_batch_runs_before_its_next_step() -> None:
    loop = asyncio.get_running_loop()
    done: list[int] = []
    seen: list[int] = []
    reader, writer = socket.socketpair()

    def steps() -> Generator[None, None, int]:
        for index in range(5):
            time.sleep(STEP_S)
            done.append(index)
            if index == 1:
                writer.send(b"x")  # a request arrives while the batch holds the loop
            yield
        return 5

    try:
        loop.add_reader(reader, lambda: (seen.append(len(done)), reader.recv(1)))
        assert await in_steps(steps()) == 5
        assert seen == [2]  # its callback ran right after the step it arrived in
    finally:
        loop.remove_reader(reader)
        reader.close()
        writer.close()


async def test_a_flood_of_ready_calls_slows_a_large_batch_but_never_stops_it() -> None:
    done: list[int] = []
    batch = asyncio.ensure_future(in_steps(_long_steps(done, 3)))
    turns = 0
    while not batch.done():  # always ready: the batch goes on every ``YIELD_TURNS`` turns
        await asyncio.sleep(0)
        turns += 1
    assert await batch == 3
    assert turns <= 4 * (YIELD_TURNS + 2)


async def test_every_batch_reaches_the_store_serialized_with_its_surface_nodes_bytes() -> None:
    store = GatedStore()
    store.gate.set()
    handle = await (await _session(store)).get("s")
    await handle.append([user("one")])
    await handle.append([user(str(n)) for n in range(ADMIT_STEP)])  # in steps
    assert store.encoded[-2:] == [True, True]  # the store serializes nothing again
    node = handle.fold.surface.nodes[-1]
    assert store.rows[-1][-1].data is node.data  # the very bytes the node keeps
    assert [e.seq for e in [e async for e in handle.read()]] == list(range(1 + ADMIT_STEP))


async def test_a_committed_large_batch_is_freed_in_the_background_a_chunk_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every step pauses: how many fit in one pause's time depends on the machine's speed.
    monkeypatch.setattr(speed, "STEP_S", 0.0)
    store = GatedStore()
    store.gate.set()
    handle = await (await _session(store)).get("s")
    released: list[list[list[Any]]] = []
    original = AdmittedBatch.release

    def spy(batch: AdmittedBatch) -> list[list[Any]]:
        held = original(batch)
        released.append(held)
        return held

    AdmittedBatch.release = spy  # type: ignore[method-assign]
    try:
        result = await handle.append([user(str(n)) for n in range(12 * FREE_STEP)])
    finally:
        AdmittedBatch.release = original  # type: ignore[method-assign]
    assert result.seqs == list(range(12 * FREE_STEP))  # the answer read the batch before
    (held,) = released
    sizes = [sum(map(len, held))]
    while sizes[-1]:
        await asyncio.sleep(0)
        sizes.append(sum(map(len, held)))
    assert len(sizes) > 2  # over several loop turns
    assert all(0 < a - b <= FREE_STEP for a, b in itertools.pairwise(sizes) if a != b)
    assert [e.seq for e in [e async for e in handle.read()]] == result.seqs


async def test_a_flood_of_ready_calls_leaves_a_large_batch_a_share_of_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(speed, "YIELD_TURNS", 10**9)  # only the time bound holds it back
    done: list[int] = []
    batch = asyncio.ensure_future(in_steps(_long_steps(done, 3)))
    for _ in range(10**6):  # a flood: always a callback ready
        if batch.done():
            break
        await asyncio.sleep(0)
    assert await asyncio.wait_for(batch, 0) == 3  # it went on within the flood, every YIELD_S
