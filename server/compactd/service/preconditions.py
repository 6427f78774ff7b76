"""Whether compaction work may run on a session now: the checks every entry point makes first.

A step (``PrepareStep``), a recovery (``RecoverFromError``) and a model switch run for a step of
an open turn; none runs while a bracket is live (the log-recorded lock); a step's
``held_revision`` must name a revision of the session. Each check raises the error its RPC
documents and writes nothing.
"""

from __future__ import annotations

from compactd.core.lock import live_bracket
from compactd.errors import CompactionBusy, FailedPrecondition, FieldViolation, InvalidArgument
from compactd.reasons import Reason
from compactd.service.sessions import SessionHandle


def require_open_turn(handle: SessionHandle, turn: int, runs: str) -> None:
    """FAILED_PRECONDITION ``NO_OPEN_TURN`` unless ``turn`` is open; ``runs`` says what runs
    only inside an open turn (the message's reason)."""
    if turn not in handle.fold.open_turns:
        raise FailedPrecondition(
            f"turn {turn} is not open: {runs}",
            reason=Reason.NO_OPEN_TURN,
            metadata={"turn": str(turn)},
        )


def refuse_live_bracket(handle: SessionHandle) -> None:
    """ABORTED ``COMPACTION_BUSY`` while a bracket is live."""
    live = live_bracket(handle.fold.lock)
    if live is not None:
        raise CompactionBusy(
            f"compaction {live.compaction_id} (started at seq {live.start_seq}) is still running",
            metadata={"compaction_id": live.compaction_id, "start_seq": str(live.start_seq)},
        )


def check_held_revision(handle: SessionHandle, held_revision: int | None) -> None:
    """INVALID_ARGUMENT for a ``held_revision`` no request of this session was built at."""
    revision = handle.fold.revision
    if held_revision is not None and not 0 <= held_revision <= revision:
        description = f"must be a revision of the session, 0..{revision}; got {held_revision}"
        raise InvalidArgument(
            f"held_revision {description}",
            violations=[FieldViolation("held_revision", description)],
        )
