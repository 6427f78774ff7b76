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
    it left for the meter, and whether this process wrote it (the same lifecycle). Its work
    per node runs in worker threads (``_rebuilt``): on a surface at ``max_surface_bytes``, tens
    of milliseconds at a time on the loop otherwise."""
    session_id, tenant = record.session_id, record.tenant
    kept = await store.get_snapshot(session_id, tenant=tenant)
    if kept is None:
        return SessionFold(), None, False
    try:
        snap, needed = await asyncio.to_thread(_decoded, kept[1])
        if snap.revision != kept[0] or snap.revision > record.revision:
            raise snapshots.SnapshotInvalid(
                f"snapshot at revision {snap.revision} for a log of {record.revision} events"
            )
        stored = await store.read_seqs(session_id, needed, tenant=tenant)
        rows = None
        if snap.facts is not None:  # the nodes made from their stored bytes, none parsed
            rows = await store.read_stored(session_id, snap.surface, tenant=tenant)
        fold, restored = await asyncio.to_thread(_rebuilt, snap, stored, rows)
    except snapshots.SnapshotInvalid as err:
        log.warning(
            "snapshot unusable, replaying the log: %s", err, extra={"session_id": session_id}
        )
        return SessionFold(), None, False
    return fold, restored, snap.instance_id == instance_id


def _decoded(data: bytes) -> tuple[snapshots.FoldSnapshot, list[int]]:
    """A worker thread's: the snapshot and the seqs of the events it needs parsed (the nodes'
    too when it has no node facts)."""
    snap = snapshots.decode(data)
    return snap, snap.parsed_seqs() if snap.facts is not None else snap.needed_seqs()


#: Parsed events let go of at once: freeing many is one C call that holds the GIL throughout.
FREE_STEP = 256


def _rebuilt(
    snap: snapshots.FoldSnapshot,
    stored: list[SessionEvent],
    rows: dict[int, bytes] | None = None,
) -> tuple[SessionFold, Restored]:
    """A worker thread's: the snapshot's fold from the ``stored`` events it names (with
    ``rows``, the nodes' stored bytes: the events it needs parsed), and what it leaves for the
    meter. Empties ``stored`` ``FREE_STEP`` events at a time (raising or not), so that neither
    this thread nor the loop frees them all in one call."""
    by_seq = {e.seq: e for e in stored}
    try:
        fold = snapshots.rebuild(snap, by_seq, rows)
        anchor = None
        if snap.anchor is not None:
            seq, header_seq = snap.anchor
            header = fold.header if header_seq == fold.header_seq else None
            if header is None and header_seq in by_seq:
                header = by_seq[header_seq].request_header
            anchor = (seq, header_seq, header)
        return fold, Restored(snap.node_prices(), anchor)
    finally:
        by_seq.clear()
        if rows is not None:  # the nodes hold the bytes: what is left is the dict's own entries
            rows.clear()
        while stored:
            del stored[-FREE_STEP:]


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
