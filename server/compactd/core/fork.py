"""Forking a session: the events that start a child with a copy of its parent's surface.

``fork_events(fold, parent_id, seq)`` takes the parent's fold as it stood right after ``seq``
(its log prefix ``[0, seq]`` folded) and returns the child's first batch: a ``session/fork``
naming the parent, the seq and the parent seq of every copied node (their source), then each
surface node's event as an APPEND (the body as the parent holds it; its seq, time, id, surface
op and sources cleared), then the image offloads that applied to those nodes, renumbered to the
child's seqs, then the ``request/header`` in force (its reason left for the child's fold).
The child's request is then the parent's request at ``seq``, byte for byte, pins aside: pins are
task state of the parent, and a sub-agent pins its own.
"""

from __future__ import annotations

from compactd.core.events import SessionEvent
from compactd.core.fold import SessionFold
from compactd.v1 import events_pb2


def fork_events(fold: SessionFold, parent_id: str, seq: int) -> list[SessionEvent]:
    """The child's first batch (see the module docstring); ``fold`` is the parent's at ``seq``."""
    nodes = list(fold.surface)
    fork = events_pb2.SessionFork(
        parent_session_id=parent_id, fork_at_seq=seq, source_seqs=[n.seq for n in nodes]
    )
    events = [SessionEvent(session_fork=fork)]
    child_seq = {}
    for offset, node in enumerate(nodes, start=1):
        child_seq[node.seq] = offset
        copy = node.event
        for name in ("seq", "time", "event_id", "surface_op", "source_event_seqs"):
            copy.ClearField(name)
        events.append(copy)
    targets = [
        events_pb2.ImageOffloadTarget(seq=child_seq[parent], image_indexes=sorted(indexes))
        for parent, indexes in sorted(fold.offloads.items())
        if parent in child_seq and indexes
    ]
    if targets:
        events.append(SessionEvent(image_offload=events_pb2.ImageOffload(targets=targets)))
    if fold.header is not None:
        header = events_pb2.RequestHeader()
        header.CopyFrom(fold.header)
        header.ClearField("reason")
        header.ClearField("starts_series")
        events.append(SessionEvent(request_header=header))
    return events
