"""Image offload, recorded for real: the two places compactd writes ``image/offload``.

``image/offload`` is a server-only event. It is appended

- by ``RecoverFromError`` for ``IMAGE_OFFLOAD_REQUIRED`` (``offload_oldest``): the oldest input
  images of the whole request, in message order;
- by ``ImageOffloadRecovery``, the always-on summary-error recovery: when a bracket's summary
  request fails on the image budget, the oldest images *inside the summary region* only; the
  bracket then re-derives and re-prices the summary input and retries in the same bracket.

Either way the offload is durable: the selection is chosen and appended under the session's lock
(``core.offload`` decides), it stays if a later summary fails, and no larger route, restart or
compaction restores an occurrence.
"""

from __future__ import annotations

from compactd.core.offload import OffloadSelection, offload_event, select_offload
from compactd.providers.base import SummaryError
from compactd.reasons import Reason
from compactd.service.bracket import SummaryFailure
from compactd.service.sessions import SessionHandle


async def offload_oldest(handle: SessionHandle, count: int) -> tuple[OffloadSelection, int]:
    """Append one ``image/offload`` of the oldest ``count`` input images of the surface.

    Returns the selection and the appended seq (-1 and an empty selection when no image is left
    to offload: nothing is written then).
    """
    async with handle.lock:
        fold = handle.fold
        selection = select_offload(fold.surface.nodes, fold.offloads, count)
        if not selection.targets:
            return selection, -1
        result = await handle.append_locked([offload_event(selection)])
    return selection, result.seqs[0]


class ImageOffloadRecovery:
    """The summary-error recovery for image budgets: offload images of the summary region.

    Handles ``IMAGE_OFFLOAD_REQUIRED`` carrying an ``offload_images`` count (the provider's, or
    derived from a limit it stated); selects the oldest that many input images among the span's
    nodes that are not offloaded yet. Registered by default in every server.
    """

    def wants(self, error: SummaryError) -> bool:
        """Image-budget failures with a count."""
        return error.reason == Reason.IMAGE_OFFLOAD_REQUIRED and error.offload_images > 0

    async def recover(self, handle: SessionHandle, failure: SummaryFailure) -> bool:
        """Offload the oldest ``offload_images`` images of the span; False when none is left."""
        async with handle.lock:
            fold = handle.fold
            positions = (fold.surface.position_of(seq) for seq in failure.selection.shadowed_seqs)
            nodes = [fold.surface[p] for p in positions if p is not None]
            selection = select_offload(nodes, fold.offloads, failure.error.offload_images)
            if not selection.targets:
                return False
            await handle.append_locked([offload_event(selection)])
        return True
