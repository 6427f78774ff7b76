"""Restoring a session: its fold from the latest snapshot and the log after it, its context.

A restore reads the session's latest usable snapshot (``core.snapshot``: the state, the surface as
seqs, the meter's node prices), the events it names and the log after it, and folds them in
worker threads; without a usable snapshot it replays the log, also off the loop. The context
(``service.context``) is built once, here, by the manager's ``ContextBuilder``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from compactd.core import snapshot as snapshots
from compactd.core.events import SessionEvent
from compactd.core.fold import SessionFold
from compactd.core.meter import SessionMeter
from compactd.core.pricing import NodeCost
from compactd.service.context import SessionContext, SessionMemory
from compactd.service.sessions.handle import SessionHandle
from compactd.store.base import EventStore, SessionRecord
from compactd.v1 import events_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What a snapshot restore hands the session's meter: the node prices it persisted and its
    usage anchor (seq, header seq, that header)."""

    prices: dict[str, dict[int, NodeCost]]
    anchor: tuple[int, int, events_pb2.RequestHeader | None] | None


#: Builds a restored session's context: ``(handle, what a snapshot restore left for the meter,
#: the memory an eviction carried over)``. It registers whatever observers the context needs.
ContextBuilder = Callable[[SessionHandle, Restored | None, SessionMemory | None], SessionContext]


def metered_context(
    handle: SessionHandle, restored: Restored | None, memory: SessionMemory | None
) -> SessionContext:
    """A context whose meter follows the session's commits (and a restore's tail), starting
    from the prices a snapshot kept; the snapshots take their prices from it."""
    if restored is not None:
        meter = SessionMeter(handle.fold, persisted=restored.prices, anchor=restored.anchor)
    else:
        meter = SessionMeter(handle.fold)
    handle.prices = meter
    handle.add_observer(meter.observe, replays=True)
    return SessionContext(meter, memory or SessionMemory())


async def from_snapshot(
    store: EventStore, record: SessionRecord, instance_id: str
) -> tuple[SessionFold, Restored | None, bool]:
    """The fold of the session's latest usable snapshot (an empty fold without one), what
    it left for the meter, and whether this process wrote it (the same lifecycle)."""
    session_id, tenant = record.session_id, record.tenant
    kept = await store.get_snapshot(session_id, tenant=tenant)
    if kept is None:
        return SessionFold(), None, False
    try:
        snap = await asyncio.to_thread(snapshots.decode, kept[1])
        if snap.revision != kept[0] or snap.revision > record.revision:
            raise snapshots.SnapshotInvalid(
                f"snapshot at revision {snap.revision} for a log of {record.revision} events"
            )
        stored = await store.read_seqs(session_id, snap.needed_seqs(), tenant=tenant)
        fold = await asyncio.to_thread(snapshots.rebuild, snap, {e.seq: e for e in stored})
    except snapshots.SnapshotInvalid as err:
        log.warning(
            "snapshot unusable, replaying the log: %s", err, extra={"session_id": session_id}
        )
        return SessionFold(), None, False
    anchor = None
    if snap.anchor is not None:
        seq, header_seq = snap.anchor
        header = fold.header if header_seq == fold.header_seq else None
        if header is None and header_seq >= 0:
            found = [e for e in stored if e.seq == header_seq]
            header = found[0].request_header if found else None
        anchor = (seq, header_seq, header)
    restored = Restored(snap.node_prices(), anchor)
    return fold, restored, snap.instance_id == instance_id


async def fold_tail(handle: SessionHandle) -> None:
    """Fold the log after the handle's fold (all of it without a snapshot) in worker
    threads, telling the replaying observers (the meter) about it."""
    fold = handle.fold
    chunk: list[SessionEvent] = []
    async for event in handle.read(fold.revision):
        chunk.append(event)
        if len(chunk) >= 4096:
            await _fold_chunk(handle, chunk)
            chunk = []
    if chunk:
        await _fold_chunk(handle, chunk)
    handle.revision = fold.revision


async def _fold_chunk(handle: SessionHandle, chunk: Sequence[SessionEvent]) -> None:
    batch = await asyncio.to_thread(partial(handle.fold.admit, chunk, check=False))
    if handle.replays:
        await handle.run_preparers(batch, in_thread=True)
    handle.replay(batch)
