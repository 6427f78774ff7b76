"""Image offload selection: which input-image occurrences one ``image/offload`` removes.

A provider that refuses a request's image budget (``IMAGE_OFFLOAD_REQUIRED`` with an
``offload_images`` count) is answered by offloading the oldest input images: walking the failed
request in message order (surface order), the first ``count`` images of ``user/message`` and
``tool/result`` nodes that are not offloaded yet. Assistant output is never selected. An image is
named by its node's seq and its depth-first index among the node's image blocks (content is a
flat list, so the index is the image's ordinal in it).

Offloading writes no replacement node: the projection turns the selected images into attachment
text (name, attachment id, read-only path) and the meter prices that text. It is durable and
lossy: a larger route, a restart or a later compaction never brings an occurrence back; only
reading the attachment again (a new occurrence) does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass

from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.core.surface import SurfaceNode
from compactd.v1 import events_pb2

#: Node kinds whose images are input (the user's or a tool's), and so may be offloaded.
INPUT_KINDS = frozenset({"user_message", "tool_result"})


@dataclass(frozen=True, slots=True)
class OffloadSelection:
    """The images one offload selects, per node in message order, and how many that is."""

    targets: tuple[tuple[int, tuple[int, ...]], ...]  # (node seq, image indexes increasing)

    @property
    def count(self) -> int:
        """Images selected."""
        return sum(len(indexes) for _, indexes in self.targets)


def image_count(event: SessionEvent) -> int:
    """Image blocks of an input node (0 for any other event)."""
    kind = ev.body_name(event)
    if kind not in INPUT_KINDS:
        return 0
    return sum(1 for block in getattr(event, kind).content if block.HasField("image"))


def offloadable(nodes: Iterable[SurfaceNode], offloads: Mapping[int, Set[int]]) -> int:
    """Input images of ``nodes`` not offloaded yet (what a request still sends)."""
    return sum(
        1
        for node in nodes
        for index in range(image_count(node.event))
        if index not in offloads.get(node.seq, ())
    )


def select_offload(
    nodes: Iterable[SurfaceNode], offloads: Mapping[int, Set[int]], count: int
) -> OffloadSelection:
    """The oldest ``count`` input images of ``nodes`` (in order) not offloaded yet.

    Fewer are selected when fewer remain; none when ``count`` is not positive.
    """
    targets: list[tuple[int, tuple[int, ...]]] = []
    left = count
    for node in nodes:
        if left <= 0:
            break
        done = offloads.get(node.seq, frozenset())
        chosen = [i for i in range(image_count(node.event)) if i not in done][:left]
        if chosen:
            targets.append((node.seq, tuple(chosen)))
            left -= len(chosen)
    return OffloadSelection(tuple(targets))


def offload_event(selection: OffloadSelection) -> SessionEvent:
    """The ``image/offload`` event recording ``selection`` (which must not be empty)."""
    if not selection.targets:
        raise ValueError("an image/offload needs at least one target")
    body = events_pb2.ImageOffload(
        targets=[
            events_pb2.ImageOffloadTarget(seq=seq, image_indexes=list(indexes))
            for seq, indexes in selection.targets
        ]
    )
    return SessionEvent(image_offload=body)
