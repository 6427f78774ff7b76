"""Prepared-ahead candidates: a summary written off the log before the trigger, kept by the store.

A session has at most one candidate (``service.ahead``). The replica that starts one claims it
with a lease (its instance id as ``owner``, ``ttl_s`` from now) and renews the lease while the
summarizer writes; once the summary is ready the lease no longer matters: any replica may apply
it, and whoever applies or discards it drops the row. A candidate still being prepared whose
lease expired belongs to a dead (or paused) preparer: another replica may claim the session's
candidate over it, and the dead one's late ``finish`` is refused because its id no longer
matches. The candidate is bound to its span by ``digest`` (``core.ahead.span_digest``); the
store never interprets it, nor the summary bytes.

``claim`` is the one statement of these rules; every store applies it under its own lock or in
one statement (PostgreSQL's ``INSERT ... ON CONFLICT ... WHERE``), with the store's clock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

Key = tuple[str, str]
"""A session's key in the in-process table: (tenant, session id)."""


@dataclass(frozen=True)
class CandidateClaim:
    """What a preparer claims: the candidate's id, its owner and the span it summarizes."""

    candidate_id: str
    owner: str
    digest: str
    start_seq: int
    end_seq: int


@dataclass(frozen=True)
class Candidate:
    """A session's candidate as the store holds it.

    Attributes:
        claim: Its id, owner and span.
        started: When it was claimed (the store's clock).
        expires: When its preparer's lease lapses unless renewed.
        remaining_s: Seconds left on the lease when read (<= 0: expired).
        summary: The prepared summary (opaque bytes), None while it is being written.
        ready: When the summary was stored.
    """

    claim: CandidateClaim
    started: datetime
    expires: datetime
    remaining_s: float
    summary: bytes | None = None
    ready: datetime | None = None

    @property
    def candidate_id(self) -> str:
        """The candidate's id."""
        return self.claim.candidate_id

    @property
    def abandoned(self) -> bool:
        """Whether its summary is not ready and its preparer stopped renewing: it may be
        claimed over."""
        return self.summary is None and self.remaining_s <= 0


def may_claim(current: Candidate | None) -> bool:
    """Whether a new candidate may replace ``current`` (none, or an abandoned one). A ready
    candidate or one still being prepared is dropped first, by whoever judged it stale."""
    return current is None or current.abandoned


class ProcessCandidates:
    """Candidates kept in process memory, for stores one process owns (memory, SQLite).

    As with ``ProcessLeases``: one owner per store, and a candidate is an optimization that a
    restart may lose (the next step prepares again or summarizes itself), so nothing here needs
    to be durable.
    """

    def __init__(self, clock: Callable[[], datetime]) -> None:
        self._clock = clock
        self._rows: dict[Key, Candidate] = {}
        self._lock = threading.Lock()

    def get(self, key: Key) -> Candidate | None:
        """The session's candidate, its lease's remaining time as of now."""
        with self._lock:
            row = self._rows.get(key)
        if row is None:
            return None
        return replace(row, remaining_s=(row.expires - self._clock()).total_seconds())

    def claim(self, key: Key, claim: CandidateClaim, ttl_s: float) -> bool:
        """Take the session's candidate for ``claim`` unless another one holds it."""
        with self._lock:
            if not may_claim(self._current(key)):
                return False
            now = self._clock()
            self._rows[key] = Candidate(claim, now, now + timedelta(seconds=ttl_s), ttl_s)
            return True

    def renew(self, key: Key, candidate_id: str, owner: str, ttl_s: float) -> bool:
        """Extend the preparer's lease if the candidate is still ``candidate_id``, ``owner``'s."""
        with self._lock:
            row = self._mine(key, candidate_id, owner)
            if row is None:
                return False
            expires = self._clock() + timedelta(seconds=ttl_s)
            self._rows[key] = replace(row, expires=expires, remaining_s=ttl_s)
            return True

    def finish(self, key: Key, candidate_id: str, owner: str, summary: bytes) -> bool:
        """Store the summary of ``owner``'s candidate ``candidate_id``; False when it is gone or
        was claimed over."""
        with self._lock:
            row = self._mine(key, candidate_id, owner)
            if row is None:
                return False
            self._rows[key] = replace(row, summary=summary, ready=self._clock())
            return True

    def drop(self, key: Key, candidate_id: str) -> bool:
        """Remove candidate ``candidate_id``; False when the session holds another or none."""
        with self._lock:
            row = self._rows.get(key)
            if row is None or row.candidate_id != candidate_id:
                return False
            del self._rows[key]
            return True

    def forget(self, key: Key) -> None:
        """Drop a deleted session's candidate."""
        with self._lock:
            self._rows.pop(key, None)

    def _current(self, key: Key) -> Candidate | None:
        row = self._rows.get(key)
        if row is None:
            return None
        return replace(row, remaining_s=(row.expires - self._clock()).total_seconds())

    def _mine(self, key: Key, candidate_id: str, owner: str) -> Candidate | None:
        row = self._rows.get(key)
        if row is None or row.candidate_id != candidate_id or row.claim.owner != owner:
            return None
        return row
