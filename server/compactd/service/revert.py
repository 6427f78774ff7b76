"""``RevertCompaction``: a committed checkpoint's shadowed nodes put back in its place.

The revert is decided and appended under the session's lock, as one atomic batch planned by
``core.revert`` (a bracket with trigger REVERT: start, REPLACE, INSERTs, end), so the lock is
taken and released by the same append. It is refused while a turn is open or a bracket is live,
when the checkpoint is no longer on the surface, and when the restored surface would not fit
``max_surface_bytes``; the fold's own checks refuse a result that breaks the pairing rules.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from opentelemetry import trace

from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.core.revert import RevertPlan, plan_revert
from compactd.errors import CompactionBusy, FailedPrecondition, NotFound, ResourceExhausted
from compactd.reasons import Reason
from compactd.service.preconditions import refuse_live_bracket
from compactd.service.sessions import SessionHandle, SessionManager
from compactd.v1 import compaction_service_pb2 as cpb


class RevertService:
    """Reverts committed compactions; one per server."""

    def __init__(self, manager: SessionManager, tracer: trace.Tracer) -> None:
        self._manager = manager
        self._tracer = tracer

    async def revert(self, session_id: str, compaction_id: str) -> cpb.RevertCompactionResponse:
        """Revert bracket ``compaction_id`` of the session (see ``RevertCompaction``).

        Raises:
            NotFound: No such session, or no bracket ``compaction_id`` (``COMPACTION_UNKNOWN``).
            FailedPrecondition: ``REVERT_BLOCKED``: its checkpoint is not on the surface.
            CompactionBusy: A turn is open or a bracket is live.
            ResourceExhausted: ``SURFACE_FULL``: the restored surface would not fit.
        """
        handle = await self._manager.get(session_id)
        with self._tracer.start_as_current_span("compaction.revert") as span:
            span.set_attribute("compactd.compaction_id", compaction_id)
            async with handle.lock:
                _refuse_busy(handle)
                plan, checkpoint_seq = await self._plan(handle, compaction_id)
                span.set_attribute("compactd.revert.restored", len(plan.restored_seqs))
                expected = handle.fold.revision - 1
                result = await handle.append_locked(plan.events, expected_last_seq=expected)
        return cpb.RevertCompactionResponse(
            revert_compaction_id=plan.events[0].compaction_start.compaction_id,
            checkpoint_seq=checkpoint_seq,
            restored_seqs=plan.restored_seqs,
            original_seqs=plan.original_seqs,
            revision=result.revision,
        )

    async def _plan(self, handle: SessionHandle, compaction_id: str) -> tuple[RevertPlan, int]:
        """The revert batch of ``compaction_id``'s checkpoint, decided on the current fold."""
        found = _checkpoint_on_surface(handle, compaction_id)
        if found is None:
            await _refuse_missing(handle, compaction_id)
        assert found is not None
        position, checkpoint = found
        start = await _bracket_start(handle, checkpoint, compaction_id)
        shadowed = list(start.compaction_start.shadowed_seqs)
        stored = {event.seq: event for event in await handle.read_seqs(shadowed)}
        originals = [stored[seq] for seq in shadowed]
        revert_id = uuid.uuid4().hex
        plan = plan_revert(
            revert_id, compaction_id, checkpoint, position, originals, handle.fold.revision
        )
        _check_surface_room(handle, checkpoint, plan.events)
        return plan, checkpoint.seq


def _refuse_busy(handle: SessionHandle) -> None:
    """ABORTED ``COMPACTION_BUSY`` while a turn is open or a bracket is live."""
    if handle.fold.open_turns:
        turns = ", ".join(str(t) for t in sorted(handle.fold.open_turns))
        raise CompactionBusy(
            f"a revert is unavailable while turn {turns} is open; retry after it ends",
            metadata={"open_turns": turns},
        )
    refuse_live_bracket(handle)


def _checkpoint_on_surface(
    handle: SessionHandle, compaction_id: str
) -> tuple[int, SessionEvent] | None:
    """(position, event) of ``compaction_id``'s checkpoint when it is on the surface."""
    for position, node in enumerate(handle.fold.surface):
        if node.type == ev.USER_MESSAGE:
            event = node.event
            if ev.checkpoint_compaction_id(event) == compaction_id:
                return position, event
    return None


async def _bracket_start(
    handle: SessionHandle, checkpoint: SessionEvent, compaction_id: str
) -> SessionEvent:
    """The ``compaction/start`` of the bracket that wrote ``checkpoint``: the checkpoint cites
    it first; a checkpoint restored by an earlier revert is a copy citing its original last."""
    event = checkpoint
    while True:
        [cited] = await handle.read_seqs([event.source_event_seqs[0]])
        if cited.compaction_start.compaction_id == compaction_id:
            return cited
        [event] = await handle.read_seqs([event.source_event_seqs[-1]])


async def _refuse_missing(handle: SessionHandle, compaction_id: str) -> None:
    """Why ``compaction_id`` has no checkpoint to revert: unknown, or covered (read from the
    log: which later REPLACE shadowed its checkpoint)."""
    if compaction_id not in handle.fold.compaction_ids:
        raise NotFound(
            f"no compaction {compaction_id!r} in session {handle.session_id!r}",
            reason=Reason.COMPACTION_UNKNOWN,
            metadata={"compaction_id": compaction_id},
        )
    checkpoint, covering = -1, ""
    async for event in handle.read(0, handle.fold.revision):
        if ev.checkpoint_compaction_id(event) == compaction_id and ev.is_replace(event):
            checkpoint = event.seq
        elif checkpoint >= 0 and checkpoint in event.source_event_seqs:
            covering = ev.checkpoint_compaction_id(event) if ev.is_replace(event) else ""
    detail = (
        f"its checkpoint is covered by compaction {covering}: revert that one first"
        if covering
        else "it has no checkpoint on the surface (it never committed, or was reverted already)"
    )
    raise FailedPrecondition(
        f"compaction {compaction_id} cannot be reverted: {detail}",
        reason=Reason.REVERT_BLOCKED,
        metadata={"compaction_id": compaction_id, "covering_compaction_id": covering},
    )


def _check_surface_room(
    handle: SessionHandle, checkpoint: SessionEvent, events: Sequence[SessionEvent]
) -> None:
    """RESOURCE_EXHAUSTED ``SURFACE_FULL`` when the restored surface would not fit."""
    limit = handle.limits.max_surface_bytes
    restored = sum(e.ByteSize() for e in events if ev.is_surface(e))
    after = handle.fold.surface_bytes - checkpoint.ByteSize() + restored
    if after > limit:
        raise ResourceExhausted(
            f"the restored surface would hold {after} bytes, more than the session's "
            f"{limit}-byte limit (max_surface_bytes)",
            reason=Reason.SURFACE_FULL,
            metadata={"limit": str(limit), "after": str(after)},
        )
