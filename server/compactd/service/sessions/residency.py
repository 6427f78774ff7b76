"""Which sessions are in memory: at most ``max_resident``, each snapshotted as it grows.

Every ``snapshot_interval`` events (more on a long log: ``snapshot_due``) a fold snapshot
(``core.snapshot``: the state, the surface as seqs, the meter's node prices) is made in steps on
the loop and written in one store transaction. At most ``max_resident`` sessions stay in memory:
the least recently used idle one (its lock free, no stream following it, no bracket open) is
snapshotted and dropped, and restored on demand. Eviction is not a restart: a session restored
after an eviction in the same process gets no ``session/end-seed``, and its context's memory is
handed to its next context. A handle someone still holds stays the session's one handle (a weak
reference finds it), so no session ever has two folds.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import OrderedDict
from collections.abc import Generator
from functools import partial

from compactd.core import snapshot as snapshots
from compactd.core.fold import AdmittedBatch, SessionFold
from compactd.service.context import SessionMemory
from compactd.service.sessions.handle import Key, SessionHandle
from compactd.speed import in_steps
from compactd.store.base import EventStore

log = logging.getLogger(__name__)

#: A snapshot is due after at least this many events per entry it copies (see ``snapshot_due``).
SNAPSHOT_EVENTS_PER_ENTRY = 1 / 16


def snapshot_due(fold: SessionFold, interval: int) -> int:
    """Events after the last snapshot that make the next one due: ``interval``, or more once
    what a snapshot copies (the surface's nodes and the event ids the fold keeps) outgrows it,
    so that writing snapshots costs a bounded amount per event (at most 16 copied entries) at
    any surface size; a restore then replays at most a sixteenth of those entries' worth of
    events."""
    entries = len(fold.event_ids) + len(fold.surface)
    return max(interval, int(entries * SNAPSHOT_EVENTS_PER_ENTRY))


class Residency:
    """The resident sessions of one manager, least recently used first.

    Args:
        store: Where snapshots are written.
        instance_id: This process, as snapshots name their writer.
        snapshot_interval: Events between fold snapshots (0: never snapshot).
        max_resident: Sessions held in memory at most (0: no bound).
    """

    def __init__(
        self, store: EventStore, instance_id: str, *, snapshot_interval: int, max_resident: int
    ) -> None:
        self.store = store
        self.instance_id = instance_id
        self.snapshot_interval = snapshot_interval
        self.max_resident = max_resident
        self.handles: OrderedDict[Key, SessionHandle] = OrderedDict()  # least recent first
        # Every handle still referenced (a stream, a running call): the one handle of its session.
        self._alive: weakref.WeakValueDictionary[Key, SessionHandle] = weakref.WeakValueDictionary()
        self.evicted: set[Key] = set()  # sessions this process evicted (no new lifecycle)
        # An evicted session's memory (its failure memory, say), handed to its next context.
        self._carried: dict[Key, SessionMemory] = {}
        self._snapshotting: dict[Key, asyncio.Task[None]] = {}
        self._evicting: asyncio.Task[None] | None = None
        self.evictions = 0

    def find(self, key: Key) -> SessionHandle | None:
        """The session's handle if it is in memory (or still held by someone after an eviction:
        then it is resident again), marked most recently used."""
        handle = self.handles.get(key)
        if handle is not None:
            self.handles.move_to_end(key)
            return handle
        handle = self._alive.get(key)
        if handle is not None and not handle.deleted:  # evicted while in use: still its handle
            self.keep(handle)
            return handle
        return None

    def held(self, key: Key) -> SessionHandle | None:
        """The session's handle if it is resident or still held by someone (no LRU change)."""
        return self.handles.get(key) or self._alive.get(key)

    def keep(self, handle: SessionHandle) -> None:
        """Make ``handle`` resident (most recently used); evict the least recently used idle
        sessions beyond ``max_resident`` in the background."""
        self.handles[handle.key] = handle
        self._alive[handle.key] = handle
        over = bool(self.max_resident) and len(self.handles) > self.max_resident
        if over and (self._evicting is None or self._evicting.done()):
            self._evicting = asyncio.ensure_future(self._evict_over())

    def follow(self, handle: SessionHandle) -> None:
        """Snapshot ``handle``'s session as it grows (a commit observer)."""
        handle.add_observer(partial(self._committed, weakref.ref(handle)))

    def held_handles(self) -> list[SessionHandle]:
        """Every handle in memory or still held by someone."""
        return list(self._alive.values())

    def carried(self, key: Key) -> SessionMemory | None:
        """The memory an eviction of the session kept for its next context (once)."""
        return self._carried.pop(key, None)

    def drop(self, key: Key, handle: SessionHandle) -> None:
        """No longer keep ``handle`` resident (a deleted session's)."""
        if self.handles.get(key) is handle:
            del self.handles[key]

    def forget(self, key: Key) -> None:
        """Drop everything kept of a deleted session."""
        self.handles.pop(key, None)
        self._alive.pop(key, None)
        self.evicted.discard(key)
        self._carried.pop(key, None)

    @property
    def resident(self) -> int:
        """How many sessions are held in memory."""
        return len(self.handles)

    def _committed(
        self, ref: weakref.ref[SessionHandle], fold: SessionFold, batch: AdmittedBatch
    ) -> None:
        """After a commit: start a snapshot once ``snapshot_due`` events have passed."""
        del batch
        handle = ref()  # a weak reference: the handle's observers must not keep it alive
        if handle is None or not self.snapshot_interval:
            return
        if fold.revision - handle.snapshot_revision >= snapshot_due(fold, self.snapshot_interval):
            self._start_snapshot(handle)

    def _start_snapshot(self, handle: SessionHandle) -> None:
        running = self._snapshotting.get(handle.key)
        if running is not None and not running.done():
            return
        task = asyncio.ensure_future(self.snapshot(handle))
        self._snapshotting[handle.key] = task
        task.add_done_callback(partial(self._snapshot_done, handle.key))

    def _snapshot_done(self, key: Key, task: asyncio.Task[None]) -> None:
        if self._snapshotting.get(key) is task:
            del self._snapshotting[key]
        if not task.cancelled() and task.exception() is not None:
            log.warning("snapshot failed: %s", task.exception(), extra={"session_id": key[1]})

    async def snapshot(self, handle: SessionHandle) -> None:
        """Write the session's fold snapshot now: built in steps on the loop and written while
        its lock is held (so no delete, and no re-created session, comes between)."""
        async with handle.lock:
            revision = handle.revision
            if revision == 0 or handle.deleted:
                return
            data = await in_steps(self._capture(handle))
            await self.store.put_snapshot(handle.session_id, revision, data, tenant=handle.tenant)
        handle.snapshot_revision = max(handle.snapshot_revision, revision)

    def _capture(self, handle: SessionHandle) -> Generator[None, None, bytes]:
        """The session's snapshot, made in steps on the loop (with its lock held): in a worker
        thread, its Python and its JSON encoding would take the GIL from the loop."""
        source = handle.prices
        prices = source.persisted_prices() if source is not None else {}
        anchor = source.anchor_state() if source is not None else None
        if source is not None and anchor is None:
            anchor = snapshots.NO_ANCHOR  # its anchor was dropped: a restore must not find one
        snap = yield from snapshots.capture_in_steps(handle.fold, self.instance_id, prices, anchor)
        return (yield from snapshots.encode_in_steps(snap))

    async def evict(self, key: Key) -> bool:
        """Snapshot the session and drop it from memory if it is idle (False: in use, or not
        resident). The next ``get`` restores it, in the same lifecycle."""
        return await self._evict(key)

    async def _evict(self, key: Key) -> bool:
        handle = self.handles.get(key)
        if handle is None or not handle.idle:
            return False
        running = self._snapshotting.get(key)
        if running is not None:  # it holds the handle: let it finish, then drop both
            await asyncio.wait([running])
        if handle.snapshot_revision < handle.revision:
            await self.snapshot(handle)
        if not handle.idle or self.handles.get(key) is not handle:
            return False
        del self.handles[key]
        self.evicted.add(key)
        self._carried[key] = handle.context.memory
        self.evictions += 1
        return True

    async def _evict_over(self) -> None:
        """Evict least recently used idle sessions until at most ``max_resident`` remain."""
        while len(self.handles) > self.max_resident:
            victims = [key for key, h in self.handles.items() if h.idle]
            over = len(self.handles) - self.max_resident
            if not victims:
                return  # every session is in use; the next keep tries again
            for key in victims[:over]:
                try:
                    await self._evict(key)
                except Exception as err:  # a snapshot that failed: keep the session resident
                    log.warning("eviction failed: %s", err, extra={"session_id": key[1]})
                    return

    async def close(self) -> None:
        """Finish snapshots under way, then forget every handle (the store is closed by its
        owner)."""
        if self._evicting is not None:
            await asyncio.wait([self._evicting])
        running = list(self._snapshotting.values())
        if running:
            await asyncio.wait(running)
        for handle in self.handles.values():
            handle.leases.close()
        self.handles.clear()
        self._alive.clear()
