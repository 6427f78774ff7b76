"""Prepare-ahead: the pure decisions of a summary written before the trigger.

The policy's ``prepareAheadRatio`` turns it on.

When the envelope reaches the prepare-ahead point (``CompactSpec.prepare_ahead``:
``floor(min(W * prepareAheadRatio, W - O - B))``, the trigger's formula with the smaller ratio),
the service selects the span selection would choose now (``core.selection``: the same balanced
cuts, retention and open-tail rules) and writes its summary in the background. The result, a
*candidate*, is bound to the span by ``span_digest``: the seqs of the span's nodes, their bytes
and the offloads that project them. At the trigger a step applies it only if the span is still
on the surface exactly as it was summarized (``span_now``): appends after the span change
nothing; a prune, a replacement or an offload inside it changes the digest and discards the
candidate. A step then decides (``step_choice``): apply a ready candidate, wait a bounded time
for one being prepared, or summarize itself as it always has.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from compactd.core.fold import SessionFold
from compactd.core.selection import Revalidation, Selection, SurfaceSnapshot, drift
from compactd.core.surface import SurfaceNode


class StepChoice(enum.Enum):
    """What a step at or above the trigger does with the session's candidate."""

    APPLY = "apply"  # a ready candidate whose span is unchanged: commit it at once
    WAIT = "wait"  # one is being prepared (its lease is live): wait for it, boundedly
    DISCARD = "discard"  # it no longer fits the surface, or its preparer died: drop it
    SUMMARIZE = "summarize"  # none: today's synchronous bracket


@dataclass(frozen=True, slots=True)
class CandidateView:
    """What the decisions need of a stored candidate."""

    start_seq: int
    end_seq: int
    digest: str
    ready: bool
    abandoned: bool  # not ready, and its preparer's lease lapsed


def span_digest(fold: SessionFold, nodes: Sequence[SurfaceNode]) -> str:
    """The content digest a candidate is bound to: each node's seq, its event's bytes and the
    offloads that change its projection, in surface order."""
    digest = hashlib.sha256()
    for node in nodes:
        offloaded = sorted(fold.offloads.get(node.seq, frozenset()))
        digest.update(f"{node.seq}:{len(node.data)}:{offloaded}|".encode())
        digest.update(node.data)
    return digest.hexdigest()


def span_now(fold: SessionFold, view: CandidateView) -> Selection | None:
    """The candidate's span as it sits on the surface now (``shadowed_price`` 0: the caller
    prices it on its route), or None when it changed: a node of it is gone or was replaced, its
    content or projection differs, or a tool call and its results now cross an edge."""
    surface = fold.surface
    start, end = surface.position_of(view.start_seq), surface.position_of(view.end_seq)
    if start is None or end is None or end < start:
        return None
    nodes = surface.nodes[start : end + 1]
    if span_digest(fold, nodes) != view.digest:
        return None
    seqs = tuple(node.seq for node in nodes)
    selection = Selection(start, end, view.start_seq, view.end_seq, seqs, 0)
    # The span's own seqs in place, and cut at unit boundaries (SELECTED_SPAN's rule, which
    # allows appends after the span); a snapshot that never matches forces the check.
    if drift(fold, selection, SurfaceSnapshot(-1), Revalidation.SELECTED_SPAN) is not None:
        return None
    return selection


def step_choice(fold: SessionFold, view: CandidateView | None) -> StepChoice:
    """What a step at or above the trigger does with ``view`` (see ``StepChoice``)."""
    if view is None:
        return StepChoice.SUMMARIZE
    if view.abandoned or span_now(fold, view) is None:
        return StepChoice.DISCARD
    return StepChoice.APPLY if view.ready else StepChoice.WAIT


def worth_preparing(measured: int, prepare_ahead: int, trigger: int) -> bool:
    """Whether an envelope of ``measured`` tokens starts a candidate: at or past the
    prepare-ahead point (0: off) and still below the trigger (at the trigger the step itself
    summarizes, or applies what was prepared)."""
    return 0 < prepare_ahead <= measured < trigger
