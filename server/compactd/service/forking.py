"""Sub-agent sessions: a child's parent checked at creation, and a fork's copied surface.

A child (``CreateSession`` with ``parent_session_id``) is an ordinary session of the caller's
tenant that names its parent; the parent must exist for that tenant (NOT_FOUND otherwise: another
tenant's session does not exist for the caller). With ``fork_at_seq`` the child starts with the
parent's surface as it stood right after that seq (``core.fork``), appended by compactd in one
batch; the parent is only read. A child's compactions touch its own log and surface alone.
"""

from __future__ import annotations

from typing import NoReturn

from compactd.core.fold import SessionFold
from compactd.core.fork import fork_events
from compactd.core.validation import Origin
from compactd.errors import FieldViolation, InvalidArgument, NotFound
from compactd.reasons import Reason
from compactd.service.sessions import Lineage, SessionHandle, SessionManager
from compactd.store.base import SessionRecord


async def checked_parent(manager: SessionManager, lineage: Lineage) -> SessionHandle | None:
    """The parent's handle (None for a top-level session), after checking the lineage.

    Raises:
        InvalidArgument: reason ``FORK_SEQ_INVALID``: a fork seq without a parent, or outside
            the parent's log.
        NotFound: The parent does not exist for the caller's tenant.
    """
    seq = lineage.fork_at_seq
    if not lineage.parent:
        if seq is not None:
            _bad_seq("fork_at_seq needs a parent_session_id")
        return None
    try:
        parent = await manager.get(lineage.parent)
    except NotFound:
        raise NotFound(
            f"parent session {lineage.parent!r} does not exist",
            metadata={"parent_session_id": lineage.parent},
        ) from None
    if seq is not None and not 0 <= seq < parent.revision:
        _bad_seq(f"fork_at_seq {seq} is not a seq of the parent's log (0..{parent.revision - 1})")
    return parent


async def fork_into(
    manager: SessionManager, child: SessionRecord, parent: SessionHandle, seq: int
) -> int:
    """Append to the new, empty ``child`` the copy of ``parent``'s surface at ``seq``; the
    child's revision after it."""
    fold = SessionFold()
    prefix = [event async for event in parent.read(0, seq + 1)]
    fold.admit(prefix, check=False)  # the parent's stored log: valid when it was written
    events = fork_events(fold, parent.session_id, seq)
    handle = await manager.get(child.session_id)
    result = await handle.append(events, max_events=len(events), origin=Origin.SERVER)
    return result.revision


def _bad_seq(description: str) -> NoReturn:
    raise InvalidArgument(
        description,
        violations=[FieldViolation("fork_at_seq", description)],
        reason=Reason.FORK_SEQ_INVALID,
    )
