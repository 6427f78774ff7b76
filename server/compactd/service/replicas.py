"""Replicas: many compactd processes serving the same sessions from one shared store.

Each replica caches a session's fold. On a shared store (PostgreSQL) the cache may fall behind
what other replicas appended, so nothing is decided from it unchecked:

- **Catch up before deciding.** Taking a session's lock (``CatchUpLock``) compares the fold's
  revision with the store's (one indexed read) and folds whatever other replicas appended, so
  pricing, selection, a replacement's validation and every read see the log as a fresh process
  would. An append decided on that fold lands only if nobody appended since: the store checks the
  batch's first seq under its row lock. When another replica got in first, the batch is refused
  (``SeqConflict``), the fold catches up and the batch is checked and tried again.
- **Brackets have owners that can die** (``store.leases``): the batch that opens a bracket takes
  the session's lease; a ``LeaseKeeper`` renews it while the summary is written; every later write
  of the bracket carries its token. A replica that finds another replica's live bracket whose lease
  expired appends ``session/end-seed`` (breaking the lease in the same transaction): the owner
  died, its bracket is stale evidence, and its late writes are refused (``LEASE_LOST``).
- **Streams wake up on other replicas' appends**: ``ChangeListener`` turns the store's change
  notifications into catch-ups, which wake the session's watchers. A wake-up carries no events;
  the catch-up reads them by seq, so none is missed or seen twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Protocol

from compactd.core import events as ev
from compactd.store.base import EventStore
from compactd.store.leases import LeaseAction, LeaseOp
from compactd.v1 import events_pb2

log = logging.getLogger(__name__)

# How many times an append decided on a fold that turned out stale is re-checked and retried.
MAX_APPEND_ATTEMPTS = 32


async def retry_pause(attempt: int) -> None:
    """A short random pause before the ``attempt``-th retry (full jitter, at most 50 ms), so
    replicas appending to one session at once stop colliding instead of colliding in step."""
    await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))


_BRACKET_WRITES = ("compaction_summary", "compaction_summary_error", "compaction_end")


class CatchUpLock:
    """A session's lock: held, its fold is at least as new as the store's log.

    Used exactly like ``asyncio.Lock`` (``async with handle.lock``); entering it runs
    ``handle.catch_up_locked()`` once the lock is held (nothing to do on a store one process owns).
    """

    def __init__(self, catch_up: Callable[[], Awaitable[None]]) -> None:
        self._lock = asyncio.Lock()
        self._catch_up = catch_up

    def locked(self) -> bool:
        """Whether some task holds the lock."""
        return self._lock.locked()

    @contextlib.asynccontextmanager
    async def as_cached(self) -> AsyncIterator[None]:
        """Hold the lock without catching up: for a write whose store check proves the fold
        current (a batch decided on a stale fold is refused, and then decided again)."""
        async with self._lock:
            yield

    async def __aenter__(self) -> None:
        await self._lock.acquire()
        try:
            await self._catch_up()
        except BaseException:
            self._lock.release()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()


def bracket_of(event: events_pb2.SessionEvent) -> str | None:
    """The compaction id a bracket's own event writes into, if it is one."""
    kind = ev.body_name(event)
    # The checkpoint REPLACE rides in the batch of its ``compaction/summary``.
    if kind in _BRACKET_WRITES:
        return str(getattr(event, kind).compaction_id)
    return None


def lease_for(
    events: Sequence[events_pb2.SessionEvent],
    owned: set[str],
    owner: str,
    ttl_s: float,
    *,
    shared: bool = False,
) -> LeaseOp | None:
    """The lease action a batch of this replica carries.

    A ``compaction/start`` acquires (with its ``compaction/end`` in the same batch, a whole
    bracket, it only checks that no lease is live); a ``compaction/end`` of a bracket this
    replica opened releases; any other write into such a bracket holds (and renews) its lease. A
    ``session/end-seed`` (a restart's new lifecycle) clears whatever lease there was. On a
    shared store every bracket write is fenced, owned or not: a write into a bracket this
    replica lost must be refused, not let through because it forgot the bracket.
    """
    ended = {e.compaction_end.compaction_id for e in events if e.HasField("compaction_end")}
    for event in events:
        if ev.body_name(event) == "compaction_start":
            token = event.compaction_start.compaction_id
            if token in ended:  # a whole bracket in one batch (a revert)
                return LeaseOp(LeaseAction.WHOLE, owner, token)
            return LeaseOp(LeaseAction.ACQUIRE, owner, token, ttl_s)
        if ev.body_name(event) == "session_end_seed":
            return LeaseOp(LeaseAction.CLEAR, owner, "")
    tokens = [t for t in map(bracket_of, events) if t is not None and (shared or t in owned)]
    if not tokens:
        return None
    ends = any(ev.body_name(e) == "compaction_end" for e in events)
    action = LeaseAction.RELEASE if ends else LeaseAction.HOLD
    return LeaseOp(action, owner, tokens[0], ttl_s)


class LeaseKeeper:
    """Renews the leases of the brackets this replica opened, while they run."""

    def __init__(
        self, store: EventStore, session_id: str, owner: str, ttl_s: float, *, tenant: str
    ) -> None:
        self._store = store
        self._session_id = session_id
        self._tenant = tenant
        self._owner = owner
        self.ttl_s = ttl_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def owned(self) -> set[str]:
        """Compaction ids of this replica's live brackets."""
        return set(self._tasks)

    def landed(self, lease: LeaseOp | None) -> None:
        """Track a batch's lease after it committed."""
        if lease is None:
            return
        if lease.action is LeaseAction.ACQUIRE:
            self._tasks[lease.token] = asyncio.ensure_future(self._renew(lease.token))
        elif lease.action is LeaseAction.RELEASE:
            self.drop(lease.token)
        elif lease.action in (LeaseAction.CLEAR, LeaseAction.BREAK):
            self.close()  # a new lifecycle: earlier brackets are stale evidence

    def drop(self, token: str) -> None:
        """Stop renewing ``token`` (its bracket closed, or its lease was lost)."""
        task = self._tasks.pop(token, None)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        """Stop every renewal (the process is shutting down)."""
        for token in list(self._tasks):
            self.drop(token)

    async def _renew(self, token: str) -> None:
        # Renew at a third of the lease: two renewals may fail (a slow database) before it lapses.
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                kept = await self._store.renew_lease(
                    self._session_id, self._owner, token, self.ttl_s, tenant=self._tenant
                )
            except Exception as error:  # the database is away: try again, the lease may hold
                log.warning("bracket lease renewal failed: %s", error)
                continue
            if not kept:
                log.warning(
                    "bracket lease lost: another replica took the session over",
                    extra={"session_id": self._session_id, "compaction_id": token},
                )
                self._tasks.pop(token, None)
                return


class Followed(Protocol):
    """What ``ChangeListener`` needs of a resident session (``SessionHandle``): its lock, which
    catches its fold up when taken."""

    @property
    def lock(self) -> CatchUpLock:
        """The session's lock."""
        ...


class ChangeListener:
    """Catches resident sessions up when other replicas append to them (store notifications).

    ``find(tenant, session_id)`` answers the resident handle (or None); ``resident()`` every one.
    """

    def __init__(
        self,
        store: EventStore,
        find: Callable[[str, str], Followed | None],
        resident: Callable[[], Iterable[Followed]],
    ) -> None:
        self._store = store
        self._find = find
        self._resident = resident
        self._task: asyncio.Task[None] | None = None
        self._pending: set[int] = set()  # ids of handles with a refresh in flight
        self._refreshes: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Begin listening (shared stores only)."""
        if self._store.shared and self._task is None:
            self._task = asyncio.ensure_future(self._listen())

    async def stop(self) -> None:
        """Stop listening and the refreshes in flight."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for refresh in list(self._refreshes):
            refresh.cancel()

    async def _listen(self) -> None:
        async for tenant, session_id in self._store.changes():
            if not session_id:
                targets = list(self._resident())
            else:
                found = self._find(tenant, session_id)
                targets = [] if found is None else [found]
            for handle in targets:
                if id(handle) not in self._pending:
                    self._schedule(handle)

    def _schedule(self, handle: Followed) -> None:
        # Coalesced: one refresh in flight per session; it reads everything up to the revision.
        self._pending.add(id(handle))
        task = asyncio.ensure_future(self._refresh(handle))
        self._refreshes.add(task)
        task.add_done_callback(self._refreshes.discard)

    async def _refresh(self, handle: Followed) -> None:
        self._pending.discard(id(handle))
        try:
            async with handle.lock:
                pass
        except Exception as error:  # the next wake-up (or the next call) catches up instead
            log.debug("catching up after a change notification failed: %s", error)
