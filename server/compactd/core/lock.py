"""The log-recorded compaction lock and its lifecycles.

A ``compaction/start`` without a matching ``compaction/end`` holds the lock. The latest unmatched
start *after* the newest ``session/end-seed`` belongs to the current lifecycle and means busy; an
unmatched start before that boundary is stale evidence from a process that died, and does not
block. ``LockState`` is folded incrementally from the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compactd.core import events as ev
from compactd.core.events import SessionEvent


@dataclass(frozen=True, slots=True)
class LiveBracket:
    """An open bracket of the current lifecycle."""

    compaction_id: str
    start_seq: int


@dataclass(slots=True)
class LockState:
    """Open brackets and the newest lifecycle boundary."""

    last_end_seed: int = -1
    open_starts: dict[str, int] = field(default_factory=dict)  # compaction id -> start seq

    def apply(self, event: SessionEvent, seq: int) -> None:
        """Fold one event."""
        kind = ev.body_name(event)
        if kind == "compaction_start":
            self.open_starts[event.compaction_start.compaction_id] = seq
        elif kind == "compaction_end":
            self.open_starts.pop(event.compaction_end.compaction_id, None)
        elif kind == "session_end_seed":
            self.last_end_seed = seq

    def copy(self) -> LockState:
        """An independent copy (for tentative batch checks)."""
        return LockState(self.last_end_seed, dict(self.open_starts))


def live_bracket(state: LockState) -> LiveBracket | None:
    """The latest unmatched ``compaction/start`` after the newest ``session/end-seed``, if any."""
    live = [(seq, cid) for cid, seq in state.open_starts.items() if seq > state.last_end_seed]
    if not live:
        return None
    seq, compaction_id = max(live)
    return LiveBracket(compaction_id, seq)


def stale_brackets(state: LockState) -> list[LiveBracket]:
    """Unmatched starts from earlier lifecycles: crash evidence that no longer blocks."""
    return sorted(
        (
            LiveBracket(cid, seq)
            for cid, seq in state.open_starts.items()
            if seq < state.last_end_seed
        ),
        key=lambda b: b.start_seq,
    )
