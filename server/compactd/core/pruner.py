"""The tool-result pruner: model-free, deterministic shrinking of oversized tool output.

A ``tool/result`` whose text blocks hold more than ``max_code_points`` code points in total is
rewritten on the surface as its first ``head_code_points``, the fixed ``PRUNE_MARKER`` followed by
the result's recall handle (``core.recall.prune_handle`` of the shadowed seq: the same result
always gets the same text) and its last ``tail_code_points``, counted across all text blocks.
The rewrite is a REPLACE of that one node citing ``[originalSeq]``, immediately preceded by a
``compaction/prune`` event carrying the shadowed node's heuristic price; the log keeps the
original. The pruner only plans events: when
it runs (never below pressure) is the caller's decision.

Code points are counted as the spec counts them over UTF-16 text: a high surrogate followed by a
low surrogate is one code point and is never split. Protobuf strings cannot hold surrogates, so
this only matters for text that has not been through a message yet, but the slicing is exact
either way; a grapheme cluster may still be split.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, fields
from typing import Any, Final

from compactd.core import events as ev
from compactd.core.events import SessionEvent
from compactd.core.fold import SessionFold
from compactd.core.projection import ContentBlock, project_content
from compactd.core.recall import LONGEST_PRUNE_HANDLE, prune_handle, prune_marker
from compactd.core.surface import SurfaceNode
from compactd.errors import ConfigError
from compactd.v1 import events_pb2

#: The omission marker put where the middle of a result was removed. It never changes, so a
#: pruned result is the same bytes every time and provider prefix caches stay warm.
PRUNE_MARKER: Final = (
    "\n\n[... compactd pruned the middle of this tool output to save context; "
    "the start and the end are kept ...]\n\n"
)

#: What the ladder's masking rung keeps of an older tool output (code points): its start and its
#: end, enough to say what it was (``mask_config``).
MASK_HEAD_CODE_POINTS: Final = 256
MASK_TAIL_CODE_POINTS: Final = 128

#: The longest marker a pruned result can carry (the marker and a handle): the room thresholds
#: keep for it, so a pruned result is always within the threshold.
_LONGEST_MARKER: Final = prune_marker(PRUNE_MARKER, LONGEST_PRUNE_HANDLE)
#: Code points thresholds keep for the marker and handle of a pruned result.
MARKER_ROOM: Final = len(_LONGEST_MARKER)

_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


@dataclass(frozen=True, slots=True)
class PrunerConfig:
    """Pruning thresholds, in code points of a result's text blocks (defaults are the spec's).

    Attributes:
        max_code_points: A result whose text exceeds this is pruned.
        head_code_points: Code points kept from the start.
        tail_code_points: Code points kept from the end.

    Raises:
        ConfigError: naming the field, when a value is not a non-negative integer, the threshold
            is not positive, or head + marker + tail does not fit within the threshold (the
            pruned text must be within the threshold so it is never pruned again).
    """

    max_code_points: int = 8192
    head_code_points: int = 4096
    tail_code_points: int = 1024

    def __post_init__(self) -> None:
        _check_config({item.name: getattr(self, item.name) for item in fields(self)}, "pruner")

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any], *, prefix: str = "compaction.pruner"
    ) -> PrunerConfig:
        """Build from a config table, naming ``prefix.<key>`` in any ``ConfigError``.

        Missing keys take the defaults; unknown keys are rejected.
        """
        defaults = {item.name: item.default for item in fields(cls)}
        for key in values:
            if key not in defaults:
                raise ConfigError(f"{prefix}.{key}: unknown setting")
        _check_config({**defaults, **values}, prefix)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class PrunedContent:
    """A pruned copy of a content list, with the figures ``compaction/prune`` records."""

    content: list[ContentBlock]
    original_code_points: int
    retained_code_points: int  # head + tail, without the marker


@dataclass(frozen=True, slots=True)
class PrunePlan:
    """The two events that prune one result, to append in this order."""

    shadowed_seq: int
    prune: SessionEvent  # compaction/prune
    replacement: SessionEvent  # tool/result REPLACE of shadowed_seq

    @property
    def events(self) -> tuple[SessionEvent, SessionEvent]:
        """``(prune, replacement)``: the prune event immediately precedes its replacement."""
        return (self.prune, self.replacement)


def code_points(text: str) -> int:
    """Code points of ``text``, counting a UTF-16 surrogate pair as one."""
    return _CodePoints(text).length


def slice_code_points(text: str, start: int, stop: int) -> str:
    """``text[start:stop]`` by code point offsets; a surrogate pair is never split."""
    return _CodePoints(text).slice(start, stop)


def prune_content(
    blocks: Sequence[ContentBlock], config: PrunerConfig, marker: str = PRUNE_MARKER
) -> PrunedContent | None:
    """Prune ``blocks`` when their text exceeds ``config.max_code_points``; None when it does not.

    ``marker`` is what stands where the middle was (``plan_prune`` adds the result's handle).

    The head and tail are counted across all text blocks in order. The marker goes once into the
    first text block that meets the removed span, a text block left empty is dropped, and
    non-text blocks are kept in their relative order.
    """
    texts = [_CodePoints(b.text.text) if b.HasField("text") else None for b in blocks]
    total = sum(t.length for t in texts if t is not None)
    if total <= config.max_code_points:
        return None
    head_end = config.head_code_points
    tail_start = total - config.tail_code_points
    content: list[ContentBlock] = []
    offset, marked = 0, False
    for block, text in zip(blocks, texts, strict=True):
        if text is None:
            content.append(_copy(block))
            continue
        start, offset = offset, offset + text.length
        meets = text.length > 0 and start < tail_start and offset > head_end
        kept = text.text
        if meets:
            inserted = "" if marked else marker
            marked = True
            head = text.slice(0, max(head_end - start, 0))
            kept = head + inserted + text.slice(max(tail_start - start, 0), text.length)
        if kept:
            content.append(ContentBlock(text=events_pb2.TextBlock(text=kept)))
    return PrunedContent(content, total, config.head_code_points + config.tail_code_points)


def plan_prune(
    node: SurfaceNode,
    offloaded: Set[int],
    config: PrunerConfig,
    shadow_price: Callable[[SurfaceNode], int],
    compaction_id: str = "",
    *,
    again: bool = False,
    masked: bool = False,
) -> PrunePlan | None:
    """The prune of one surface node, or None when it is not an oversized, unpruned result.

    Args:
        node: A current surface node.
        offloaded: The node's offloaded image indexes; they become placeholder text in the new
            content, since the new node (a new seq) carries no offload marks of its own.
        config: The thresholds.
        shadow_price: The fixed heuristic price of a node, logged on ``compaction/prune``.
        compaction_id: The bracket or step the prune belongs to, if any.
        again: Also prune a result that is already a REPLACE (window-sized prunes, masks).
        masked: Record the prune as the masking rung's (``compaction/prune.masked``).
    """
    if node.type != ev.TOOL_RESULT or (ev.is_replace(node.event) and not again):
        return None  # a tool/result REPLACE is a pruned result: never pruned again
    original = node.event.tool_result
    marker = prune_marker(PRUNE_MARKER, prune_handle(node.seq))
    pruned = prune_content(project_content(original.content, offloaded), config, marker)
    if pruned is None:
        return None
    replacement = SessionEvent()
    replacement.tool_result.CopyFrom(original)
    del replacement.tool_result.content[:]
    replacement.tool_result.content.extend(pruned.content)
    replacement.surface_op.kind = events_pb2.SURFACE_OP_KIND_REPLACE
    replacement.surface_op.start_seq = node.seq
    replacement.surface_op.end_seq = node.seq
    replacement.source_event_seqs.append(node.seq)
    prune = SessionEvent(
        compaction_prune=events_pb2.CompactionPrune(
            compaction_id=compaction_id,
            shadowed_seq=node.seq,
            shadowed_tokens=shadow_price(node),
            original_code_points=pruned.original_code_points,
            retained_code_points=pruned.retained_code_points,
            masked=masked,
        )
    )
    return PrunePlan(node.seq, prune, replacement)


def plan_prunes(
    fold: SessionFold,
    config: PrunerConfig,
    shadow_price: Callable[[SurfaceNode], int],
    compaction_id: str = "",
) -> list[PrunePlan]:
    """Prunes of every oversized, unpruned ``tool/result`` on the surface, in surface order.

    The plans are independent (each rewrites one node in place), so their events can be
    appended as one batch: see ``prune_events``.
    """
    plans = []
    for node in fold.surface:
        offloaded = fold.offloads.get(node.seq, frozenset())
        plan = plan_prune(node, offloaded, config, shadow_price, compaction_id)
        if plan is not None:
            plans.append(plan)
    return plans


def plan_masks(
    fold: SessionFold, before: int, shadow_price: Callable[[SurfaceNode], int]
) -> list[PrunePlan]:
    """The masking rung's prunes: every ``tool/result`` at a position before ``before`` (the
    last unit's start) cut to ``MASK_HEAD_CODE_POINTS`` and ``MASK_TAIL_CODE_POINTS`` when its
    text is longer, a pruned one included, in surface order."""
    config = _scaled_config(MASK_HEAD_CODE_POINTS, MASK_TAIL_CODE_POINTS)
    plans = []
    for node in fold.surface.nodes[:before]:
        offloaded = fold.offloads.get(node.seq, frozenset())
        plan = plan_prune(node, offloaded, config, shadow_price, again=True, masked=True)
        if plan is not None:
            plans.append(plan)
    return plans


def plan_window_prunes(
    fold: SessionFold,
    config: PrunerConfig,
    price: Callable[[SessionEvent, Set[int]], int],
    room: int,
    shadow_price: Callable[[SurfaceNode], int],
    *,
    masked: bool = False,
) -> list[PrunePlan]:
    """Prunes of every ``tool/result`` whose price alone exceeds ``room`` tokens.

    ``[pruner]`` thresholds are code points, independent of any window; on a small window a
    result under ``max_code_points`` (or an already pruned one) can still not fit. Overflow
    recovery calls this with ``room``, the tokens the window leaves for history (W - O - system,
    tools and framing): each result priced above it is pruned, even a pruned one, keeping head
    and tail in ``config``'s ratio, scaled down until the result costs at most ``room // 2``.
    A result whose remainder (images, or text the marker alone outweighs) cannot get there is
    left alone.

    Args:
        fold: The session state; its surface and offload marks are read.
        config: The configured thresholds, whose head:tail ratio is kept.
        price: The route price of an event projected with the given offloaded image indexes.
        room: Tokens the window leaves for history.
        shadow_price: The fixed heuristic price of a node, logged on ``compaction/prune``.
        masked: Record the prunes as the masking rung's (``compaction/prune.masked``).
    """
    plans = []
    for node in fold.surface:
        offloaded = fold.offloads.get(node.seq, frozenset())
        if node.type != ev.TOOL_RESULT or price(node.event, offloaded) <= room:
            continue
        target = max(room // 2, 0)
        plan = _fit_prune(node, offloaded, config, price, target, shadow_price, masked)
        if plan is not None:
            plans.append(plan)
    return plans


def _fit_prune(
    node: SurfaceNode,
    offloaded: Set[int],
    config: PrunerConfig,
    price: Callable[[SessionEvent, Set[int]], int],
    target: int,
    shadow_price: Callable[[SurfaceNode], int],
    masked: bool = False,
) -> PrunePlan | None:
    """The largest head-and-tail prune of ``node`` that costs at most ``target`` tokens."""
    kept = config.head_code_points + config.tail_code_points
    share = config.head_code_points / kept if kept else 1.0
    # Start from the heuristic's 4 code points per token, then halve until the route agrees.
    budget = min(kept, max(target, 0) * 4)
    while True:
        head = int(budget * share)
        scaled = _scaled_config(head, budget - head)
        plan = plan_prune(node, offloaded, scaled, shadow_price, again=True, masked=masked)
        if plan is not None and price(plan.replacement, frozenset()) <= target:
            return plan
        if budget == 0:
            return None
        budget //= 2


def _scaled_config(head: int, tail: int) -> PrunerConfig:
    """A config keeping ``head`` and ``tail`` code points of any result longer than them."""
    threshold = head + code_points(_LONGEST_MARKER) + tail
    return PrunerConfig(max_code_points=threshold, head_code_points=head, tail_code_points=tail)


def prune_events(plans: Iterable[PrunePlan]) -> list[SessionEvent]:
    """The events of ``plans`` flattened in append order: prune, replacement, prune, ..."""
    return [event for plan in plans for event in plan.events]


class _CodePoints:
    """A text indexed by code point, where a surrogate pair is one code point."""

    __slots__ = ("_pairs", "length", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        # Code point offset of each surrogate pair: its str index minus the pairs before it.
        self._pairs = [m.start() - i for i, m in enumerate(_SURROGATE_PAIR.finditer(text))]
        self.length = len(text) - len(self._pairs)

    def index(self, offset: int) -> int:
        """The str index of code point boundary ``offset``."""
        return offset + bisect_left(self._pairs, offset)

    def slice(self, start: int, stop: int) -> str:
        start = min(max(start, 0), self.length)
        stop = min(max(stop, start), self.length)
        return self.text[self.index(start) : self.index(stop)]


def _copy(block: ContentBlock) -> ContentBlock:
    copy = ContentBlock()
    copy.CopyFrom(block)
    return copy


def _check_config(values: Mapping[str, Any], prefix: str) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{prefix}.{name}: must be a non-negative integer, got {value!r}")
    if values["max_code_points"] == 0:
        raise ConfigError(f"{prefix}.max_code_points: must be positive")
    needed = values["head_code_points"] + code_points(_LONGEST_MARKER) + values["tail_code_points"]
    if needed > values["max_code_points"]:
        raise ConfigError(
            f"{prefix}.max_code_points: head_code_points + marker + tail_code_points "
            f"({needed}) must fit within max_code_points ({values['max_code_points']})"
        )
