"""Bracket leases: who may still write a live compaction bracket, checked with the batch's seqs.

A ``compaction/start`` is the log-recorded lock; across replicas it also needs an owner that can
die. The replica that opens a bracket takes the session's lease (its instance id as ``owner``,
the bracket's compaction id as the fencing ``token``) in the same transaction as the start, and
renews it while the summary is written. Every later append of the bracket carries the token and
is refused (``LEASE_LOST``) unless the lease still names it, so a replica that paused past its
lease cannot write into a session another replica has since taken over. Another replica may
break a lease only once it has expired, and does so in the transaction that appends the
``session/end-seed`` turning the orphaned bracket into stale evidence.

``apply`` is the one statement of these rules; every store runs it under the lock that guards
the session's seqs (the PostgreSQL row lock; the in-process stores' own locks), with the
store's clock (the database's, for PostgreSQL, so replicas never compare their own clocks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum

from compactd.errors import CompactionBusy, Fenced
from compactd.reasons import Reason

Key = tuple[str, str]
"""A session's key in the in-process lease table: (tenant, session id)."""


class LeaseAction(Enum):
    """What a batch does to its session's lease."""

    ACQUIRE = "acquire"  # the batch opens a bracket: take the lease for its token
    HOLD = "hold"  # the batch writes into the bracket: the lease must still be ours; renew it
    RELEASE = "release"  # the batch closes the bracket: the lease must still be ours; drop it
    BREAK = "break"  # the batch ends a dead owner's lifecycle: the lease must have expired
    CLEAR = "clear"  # a new lifecycle by fiat (a restart's ``session/end-seed``): no lease holds
    WHOLE = "whole"  # the batch opens and closes a bracket (a revert): no other may be live


@dataclass(frozen=True)
class LeaseOp:
    """A lease action checked atomically with the batch it rides on.

    Attributes:
        action: See :class:`LeaseAction`.
        owner: The writing replica's instance id (ignored by BREAK).
        token: The bracket's compaction id: the fencing token.
        ttl_s: How long the lease runs from this batch (ACQUIRE, HOLD).
    """

    action: LeaseAction
    owner: str
    token: str
    ttl_s: float = 0.0


@dataclass(frozen=True)
class Lease:
    """A session's current lease, as the store's clock sees it.

    Attributes:
        owner: The replica that holds it.
        token: The bracket it covers (a compaction id).
        expires: When it lapses unless renewed (the store's clock).
        remaining_s: Seconds left at the time of reading; <= 0 once expired.
    """

    owner: str
    token: str
    expires: datetime
    remaining_s: float

    @property
    def expired(self) -> bool:
        """Whether another replica may break it."""
        return self.remaining_s <= 0


def apply(session_id: str, current: Lease | None, op: LeaseOp, now: datetime) -> Lease | None:
    """The lease after ``op``, or raise when ``op`` may not happen.

    Raises:
        Fenced: HOLD or RELEASE when the lease no longer names ``op``'s owner and token.
        CompactionBusy: ACQUIRE while another bracket's lease is unexpired, WHOLE while any is;
            BREAK while the lease is unexpired or covers another bracket.
    """
    live = current is not None and current.expires > now
    if op.action is LeaseAction.ACQUIRE:
        if current is not None and live and current.token != op.token:
            raise _busy(session_id, current, now)
        return _lease(op, now)
    if op.action is LeaseAction.CLEAR:
        return None
    if op.action is LeaseAction.WHOLE:  # taken and released by this very batch
        if current is not None and live:
            raise _busy(session_id, current, now)
        return None
    if op.action is LeaseAction.BREAK:
        if current is None:
            return None
        if live or current.token != op.token:
            raise _busy(session_id, current, now)
        return None
    if current is None or current.owner != op.owner or current.token != op.token:
        raise fenced(session_id, op.token, current)
    return _lease(op, now) if op.action is LeaseAction.HOLD else None


def fenced(session_id: str, token: str, current: Lease | None) -> Fenced:
    """The error for a bracket's write after its lease was lost."""
    holder = "nobody" if current is None else f"{current.owner} (bracket {current.token})"
    return Fenced(
        f"compaction {token} of session {session_id!r} lost its lease (now held by {holder}); "
        "another replica took the session over, so this bracket's late writes are refused",
        reason=Reason.LEASE_LOST,
        metadata={"session_id": session_id, "compaction_id": token},
    )


def _lease(op: LeaseOp, now: datetime) -> Lease:
    expires = now + timedelta(seconds=op.ttl_s)
    return Lease(op.owner, op.token, expires, op.ttl_s)


def _busy(session_id: str, current: Lease, now: datetime) -> CompactionBusy:
    left = (current.expires - now).total_seconds()
    return CompactionBusy(
        f"compaction {current.token} of session {session_id!r} is held by replica "
        f"{current.owner} for {max(left, 0):.1f}s more",
        metadata={"session_id": session_id, "compaction_id": current.token},
    )


class ProcessLeases:
    """Leases kept in process memory, for stores one process owns (memory, SQLite).

    One owner per store means a lease cannot outlive its process; a restart begins a new
    lifecycle anyway (``session/end-seed``), so nothing here needs to be durable.
    """

    def __init__(self, clock: Callable[[], datetime]) -> None:
        self._clock = clock
        self._leases: dict[Key, Lease] = {}
        self._lock = threading.Lock()

    def get(self, key: Key) -> Lease | None:
        """The session's lease with its remaining time now."""
        with self._lock:
            lease = self._leases.get(key)
        if lease is None:
            return None
        remaining = (lease.expires - self._clock()).total_seconds()
        return Lease(lease.owner, lease.token, lease.expires, remaining)

    def apply(self, key: Key, op: LeaseOp | None) -> Callable[[], None]:
        """Apply ``op`` now; returns the undo for a batch that then fails to land."""
        if op is None:
            return _nothing
        with self._lock:
            before = self._leases.get(key)
            after = apply(key[1], before, op, self._clock())
            self._set(key, after)

        def undo() -> None:
            with self._lock:
                self._set(key, before)

        return undo

    def renew(self, key: Key, owner: str, token: str, ttl_s: float) -> bool:
        """Extend the lease if it still names ``owner`` and ``token``."""
        try:
            self.apply(key, LeaseOp(LeaseAction.HOLD, owner, token, ttl_s))
        except Fenced:
            return False
        return True

    def forget(self, key: Key) -> None:
        """Drop a deleted session's lease."""
        with self._lock:
            self._leases.pop(key, None)

    def _set(self, key: Key, lease: Lease | None) -> None:
        if lease is None:
            self._leases.pop(key, None)
        else:
            self._leases[key] = lease


def _nothing() -> None:
    return None
