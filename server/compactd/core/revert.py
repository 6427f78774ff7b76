"""The events of a revert: a committed checkpoint's shadowed nodes put back in its place.

The log stays append-only: the originals come back as copies, each citing its original. The
batch is a bracket of its own (trigger REVERT, so the log-recorded lock covers it):

1. ``compaction/start`` naming the checkpoint (``shadowed_seqs``) and the reverted bracket;
2. a REPLACE of the checkpoint by a copy of the first original (citing both);
3. an INSERT of each next original's copy right after the previous copy;
4. ``compaction/end``.

Appended at revision ``r``, the copies are seqs ``r + 1 .. r + n``, so each INSERT can name the
copy before it. Nothing here does I/O: the caller reads the originals and appends the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compactd.core import bracket
from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.v1 import events_pb2


@dataclass(frozen=True, slots=True)
class RevertPlan:
    """The batch that reverts one checkpoint, and the seqs its copies will take."""

    events: list[SessionEvent]
    restored_seqs: list[int]
    original_seqs: list[int]


def plan_revert(
    revert_id: str,
    reverted_id: str,
    checkpoint: SessionEvent,
    position: int,
    originals: Sequence[SessionEvent],
    revision: int,
) -> RevertPlan:
    """The revert batch of ``checkpoint`` (at surface ``position``), to append at ``revision``.

    Args:
        revert_id: The revert bracket's own compaction id.
        reverted_id: The compaction id of the bracket that wrote ``checkpoint``.
        checkpoint: The checkpoint event (seq set), still on the surface.
        position: Its surface position.
        originals: The stored events the checkpoint shadowed, in surface order (at least one).
        revision: The log's revision the batch will be appended at.
    """
    start = events_pb2.CompactionStart(
        compaction_id=revert_id,
        trigger=events_pb2.COMPACTION_TRIGGER_REVERT,
        range=events_pb2.SurfaceRange(
            start_position=position,
            end_position=position,
            start_seq=checkpoint.seq,
            end_seq=checkpoint.seq,
        ),
        shadowed_seqs=[checkpoint.seq],
        reverted_compaction_id=reverted_id,
    )
    copies, restored = [], []
    for index, original in enumerate(originals):
        seq = revision + 1 + index
        if index == 0:
            copy = _copy(original, events_pb2.SURFACE_OP_KIND_REPLACE, checkpoint.seq)
            copy.source_event_seqs[:] = [checkpoint.seq, original.seq]
        else:
            copy = _copy(original, events_pb2.SURFACE_OP_KIND_INSERT, seq - 1)
            copy.source_event_seqs[:] = [original.seq]
        copies.append(copy)
        restored.append(seq)
    batch = [SessionEvent(compaction_start=start), *copies, bracket.end_event(revert_id)]
    return RevertPlan(batch, restored, [original.seq for original in originals])


def _copy(
    original: SessionEvent, kind: events_pb2.SurfaceOpKind.ValueType, at: int
) -> SessionEvent:
    """A copy of ``original``'s body as a new surface event positioned at ``at``."""
    copy = SessionEvent()
    body = ev.body_name(original)
    getattr(copy, body).CopyFrom(getattr(original, body))
    copy.surface_op.kind = kind
    copy.surface_op.start_seq = at
    copy.surface_op.end_seq = at
    return copy
