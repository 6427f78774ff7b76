"""A restore from a snapshot does its per-node work off the event loop, in pieces.

Behaviour, not timing: where (which thread) the work runs and in what pieces. Freeing thousands
of parsed events at once is one long call: on the loop, a pause of every other call; in a
worker thread just as long, since no switch interval interrupts a C call holding the GIL.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from compactd.core.pricing import NodeCost
from compactd.core.snapshot import FoldSnapshot
from compactd.service.sessions import SessionManager
from compactd.store.sqlite import SqliteEventStore
from compactd.v1 import events_pb2
from tests.builders import header, user

NODES = 2000


class Released(list[events_pb2.SessionEvent]):
    """The events a restore read, and the threads that let go of them."""

    def __init__(self, events: Sequence[events_pb2.SessionEvent]) -> None:
        super().__init__(events)
        self.threads: set[int] = set()
        self.largest = 0  # most events let go of at once

    def __delitem__(self, index: int | slice) -> None:
        self.threads.add(threading.get_ident())
        before = len(self)
        super().__delitem__(index)
        self.largest = max(self.largest, before - len(self))

    def clear(self) -> None:
        self.threads.add(threading.get_ident())
        self.largest = max(self.largest, len(self))
        super().clear()


class Watched(SqliteEventStore):
    """The SQLite store, handing a restore the events it reads in a ``Released`` list."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.reads: list[Released] = []

    async def read_seqs(
        self, session_id: str, seqs: Sequence[int], *, tenant: str = "default"
    ) -> list[events_pb2.SessionEvent]:
        events = Released(await super().read_seqs(session_id, seqs, tenant=tenant))
        self.reads.append(events)
        return events


async def _snapshotted(path: Path) -> None:
    store = SqliteEventStore(str(path))
    await store.open()
    manager = SessionManager(store)
    await manager.create("s", None)
    handle = await manager.get("s")
    await handle.append([header("openai", "gpt-4o")])
    for start in range(0, NODES, 500):
        await handle.append([user(f"m{i}") for i in range(start, start + 500)])
    await manager.snapshot(handle)
    await manager.close()
    await store.close()


async def test_a_restore_does_its_per_node_work_off_the_loop_and_frees_its_reads_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _snapshotted(tmp_path / "s.db")
    priced_in: list[int] = []
    node_prices = FoldSnapshot.node_prices

    def watched_prices(self: FoldSnapshot) -> dict[str, dict[int, NodeCost]]:
        priced_in.append(threading.get_ident())
        return node_prices(self)

    monkeypatch.setattr(FoldSnapshot, "node_prices", watched_prices)
    store = Watched(str(tmp_path / "s.db"))
    await store.open()
    try:
        manager = SessionManager(store)
        handle = await manager.get("s")
        assert len(handle.fold.surface) == NODES
        (events,) = store.reads
        loop_thread = threading.get_ident()
        assert len(events) == 0  # let go of before the restore returned
        assert events.threads
        assert loop_thread not in events.threads
        assert events.largest < NODES
        assert priced_in
        assert loop_thread not in priced_in
        await manager.close()
    finally:
        await store.close()
