"""``Recall``: the original events behind a recall handle (``core.recall``), a page at a time.

A handle resolves through the one event it names (a ``compaction/start`` or a pruned
``tool/result``), so it needs nothing but the log: it answers the same after a restart, an
eviction, and on any replica. Recall only reads; it takes no lock and appends nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from compactd.core import recall_page
from compactd.core.recall import covered_seqs as handle_seqs
from compactd.core.recall import parse_handle, quoted
from compactd.core.recall_page import Cursor, Pager
from compactd.errors import FieldViolation, InvalidArgument, NotFound
from compactd.reasons import Reason
from compactd.service.sessions import SessionHandle
from compactd.v1 import session_service_pb2 as pb

#: Events read from the store at a time while a page fills.
_READ_CHUNK = 64


async def recall(handle: SessionHandle, request: pb.RecallRequest) -> pb.RecallResponse:
    """One page of the events ``request`` names (see ``SessionService.Recall``).

    Raises:
        InvalidArgument: A malformed handle or seqs, a negative ``max_bytes`` or a page token
            not issued for this request.
        NotFound: The handle names nothing in this session (``RECALL_HANDLE_UNKNOWN``).
    """
    if request.max_bytes < 0:
        raise _invalid("max_bytes", "must be >= 0")
    revision = handle.revision
    seqs, label = await _covered(handle, request, revision)
    bound = recall_page.fingerprint(request.handle, request.seqs, request.query)
    cursor = recall_page.cursor_of(request.page_token, bound)
    if cursor is None or cursor.index > len(seqs):
        raise _invalid("page_token", "not a token this server issued for this request")
    pager = Pager(cursor, recall_page.page_size(request.max_bytes), request.query)
    await _fill(handle, pager, seqs, cursor)
    token = recall_page.page_token(pager.next, bound) if pager.next is not None else ""
    return pb.RecallResponse(
        revision=revision,
        seqs=seqs,
        events=pager.events,
        next_page_token=token,
        text=recall_page.render(label, seqs, pager.events, token),
    )


async def _fill(handle: SessionHandle, pager: Pager, seqs: Sequence[int], start: Cursor) -> None:
    """Feed ``pager`` the covered events from ``start``, reading them a chunk at a time."""
    for index in range(start.index, len(seqs), _READ_CHUNK):
        wanted = seqs[index : index + _READ_CHUNK]
        stored = {event.seq: event for event in await handle.read_seqs(wanted)}
        for seq in wanted:  # in the covered order (the store answers in seq order)
            if not pager.add(stored[seq]):
                return
    pager.finish(len(seqs))


async def _covered(
    handle: SessionHandle, request: pb.RecallRequest, revision: int
) -> tuple[list[int], str]:
    """The seqs the request covers, in the order the model saw them (a checkpoint's: surface
    order; requested seqs: ascending), and how the page's text names them."""
    if bool(request.handle) == bool(request.seqs):
        raise _invalid("handle", "set exactly one of handle and seqs")
    if request.seqs:
        return _checked_seqs(request.seqs, revision), "The requested events"
    parsed = parse_handle(request.handle)
    if parsed is None:
        raise _invalid("handle", "not a recall handle (like c41-9f3a or [recall:p17-03bc])")
    named = await handle.read_seqs([parsed.seq]) if parsed.seq < revision else []
    seqs = handle_seqs(parsed, named[0] if named else None)
    if seqs is None:
        raise NotFound(
            f"recall handle {parsed} names nothing in session {handle.session_id!r}",
            reason=Reason.RECALL_HANDLE_UNKNOWN,
            metadata={"handle": str(parsed)},
        )
    return list(seqs), quoted(str(parsed))


def _checked_seqs(seqs: Sequence[int], revision: int) -> list[int]:
    if len(seqs) > recall_page.MAX_SEQS:
        raise _invalid("seqs", f"at most {recall_page.MAX_SEQS} seqs")
    outside = [seq for seq in seqs if not 0 <= seq < revision]
    if outside:
        raise _invalid("seqs", f"seq {outside[0]} is not in the log (revision {revision})")
    return sorted(set(seqs))


def _invalid(field: str, description: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}: {description}", violations=[FieldViolation(field, description)]
    )
