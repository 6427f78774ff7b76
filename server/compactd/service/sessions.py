"""Sessions in memory: each session's fold, kept in step with its durable log.

A ``SessionManager`` restores a session from the store on first use (appending
``session/end-seed``: a new lifecycle begins, so brackets left open by a dead process become
stale evidence), then keeps its ``SessionFold`` current as batches commit. Appends to one session
are serialized by its lock; the store shares commits across sessions (group commit).

Cost follows the work (issue 11):

- A large batch is background work. It is checked and admitted on the loop in steps of at most
  ``STEP_S``, and after each step it waits while other callbacks are ready, within bounds
  (``in_steps``): a call next door takes several loop turns, and none of them waits behind a
  step. Once committed, it is freed in steps too. Readers that do
  not take the lock see only committed state. Its texts are counted in a worker thread from the
  end of its checks (``add_precounter``; the tokenizers release the GIL) and its prices made from
  those counts, in steps on the loop, while the store commits it (``add_preparer``); the commit
  observers then run with those prices, still under the session's lock, before the append
  answers: a read after the commit sees its prices. Python work stays off worker threads: a
  thread running Python takes the GIL from the loop every switch interval.
- Every ``snapshot_interval`` events (more on a long log: ``snapshot_due``) a fold snapshot
  (``core.snapshot``: the state, the surface as seqs, the meter's node prices) is made in steps
  on the loop and written in one store transaction. A restore reads the latest
  snapshot, the events it names and the log after it, and folds them in worker threads; without a
  usable snapshot it replays the log, also off the loop.
- At most ``max_resident`` sessions stay in memory: the least recently used idle one (its lock
  free, no stream following it, no bracket open) is snapshotted and dropped, and restored on
  demand. Eviction is not a restart: a session restored after an eviction in the same process
  gets no ``session/end-seed``. A handle someone still holds stays the session's one handle (a
  weak reference finds it), so no session ever has two folds.

On a store several replicas share (PostgreSQL), the fold is a cache of the log that other
replicas also append to: ``service.replicas`` keeps it current (catch-up under the lock, appends
retried on a stale fold, bracket leases, change notifications), and a restore appends
``session/end-seed`` only when the process that owned a live bracket died (its lease expired).
Tenancy lives here, as a key: a session is (tenant, id), the tenant being the caller's
(``compactd.tenancy.current_tenant``) unless one is named. Another tenant's session is simply not
there (NotFound), so nothing past the manager needs to know tenants exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, Protocol, TypeGuard, TypeVar

from google.protobuf.timestamp_pb2 import Timestamp

from compactd.core import snapshot as snapshots
from compactd.core.events import SessionEvent
from compactd.core.fold import AdmittedBatch, SessionFold
from compactd.core.limits import DEFAULT_LIMITS, AppendLimits
from compactd.core.lock import live_bracket
from compactd.core.pricing import NodeCost
from compactd.core.validation import Origin, check_batch, check_batch_in_steps
from compactd.errors import (
    AlreadyExists,
    Busy,
    CompactdError,
    ConfigError,
    Fenced,
    FieldViolation,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    SeqConflict,
)
from compactd.service.quotas import QuotaBook, Reservation
from compactd.service.replicas import (
    MAX_APPEND_ATTEMPTS,
    CatchUpLock,
    ChangeListener,
    LeaseKeeper,
    lease_for,
    retry_pause,
)
from compactd.store.base import (
    EventStore,
    SessionRecord,
    StoreUsage,
    encode_batch_in_steps,
    session_not_found,
)
from compactd.store.leases import LeaseAction, LeaseOp, fenced
from compactd.tenancy import Tenant, current_tenant
from compactd.v1 import events_pb2

log = logging.getLogger(__name__)

Observer = Callable[[SessionFold, AdmittedBatch], None]
# Prices a large batch ahead of its commit: on the loop in steps, or (True) in a worker thread.
Preparer = Callable[[SessionFold, AdmittedBatch, bool], Awaitable[None]]
# Called with a large batch once it passed its checks: steps on the loop, then a job for a thread.
Precounter = Callable[
    [Sequence[events_pb2.SessionEvent]], Generator[None, None, Callable[[], None] | None]
]
T = TypeVar("T")
_Key = tuple[str, str]  # (tenant id, session id)
# Batches at least this large (events or serialized bytes) have their texts counted in a worker
# thread and are priced while they commit (``_priced_ahead``).
OFFLOAD_EVENTS = 16
OFFLOAD_BYTES = 16 * 1024
# A batch of at least this many events is checked and admitted in steps, between which other
# calls run: no step holds the event loop longer than ``STEP_S``.
ADMIT_STEP = 128
STEP_S = 0.0002
# A large batch's work is background work: after each step it waits while other callbacks are
# ready (a pressure check's next turn, a reply to send), for at most this many loop turns and
# this long, so that a flood of small calls slows it down (it keeps a fifth of the loop) but
# never stops it: a restore's caller waits for it too.
YIELD_TURNS = 32
YIELD_S = 4 * STEP_S


class PriceSource(Protocol):
    """What a snapshot takes from the session's meter (``core.meter.SessionMeter``)."""

    def persisted_prices(self) -> dict[str, dict[int, NodeCost]]:
        """Node prices per pricing-profile key."""
        ...

    def anchor_state(self) -> tuple[int, int] | None:
        """(anchor seq, its header seq), or None."""
        ...


@dataclass(frozen=True)
class Restored:
    """What a snapshot restore hands the session's meter: the node prices it persisted and its
    usage anchor (seq, header seq, that header)."""

    prices: dict[str, dict[int, NodeCost]]
    anchor: tuple[int, int, events_pb2.RequestHeader | None] | None


@dataclass(frozen=True)
class AppendResult:
    """Seqs assigned to a batch (in request order) and the revision after it."""

    seqs: list[int]
    revision: int
    replayed: bool = False  # every event was already in the log (an idempotent retry)


class SessionHandle:
    """One restored session: its fold, its lock, its observers and revision subscribers."""

    def __init__(
        self,
        record: SessionRecord,
        store: EventStore,
        fold: SessionFold,
        limits: AppendLimits = DEFAULT_LIMITS,
        quotas: QuotaBook | None = None,
        *,
        owner: str = "",
        lease_s: float = 30.0,
    ) -> None:
        self.session_id = record.session_id
        self.tenant = record.tenant
        self.key: _Key = (record.tenant, record.session_id)
        self.deleted = False  # set (under the lock) by ``SessionManager.delete``
        self._quotas = quotas
        self.limits = limits
        self.record = record
        self.fold = fold
        self.policy_overrides: dict[str, object] | None = (
            json.loads(record.policy_json) if record.policy_json else None
        )
        self.extensions: dict[str, object] = {}
        # Held, the fold is as new as the store's log (``service.replicas``).
        self.lock = CatchUpLock(self.catch_up_locked)
        self.owner = owner
        self.leases = LeaseKeeper(store, record.session_id, owner, lease_s, tenant=record.tenant)
        self._next_lease_check = 0.0  # monotonic time to look at another replica's lease again
        # The committed revision: ``fold.revision`` also counts a batch admitted but not yet
        # durable, which readers that do not hold the lock must never see.
        self.revision = fold.revision
        self._store = store
        self._observers: list[Observer] = []
        self._replaying: list[Observer] = []  # observers that also follow a restore's tail
        self._preparers: list[Preparer] = []
        self._precounters: list[Precounter] = []
        self._counting: asyncio.Future[None] | None = None  # the latest batch's precount jobs
        self._changed = asyncio.Condition()
        self.followers = 0  # streams following the revisions (``revisions``)
        self.snapshot_revision = 0  # the revision of the latest snapshot written (or read)
        self.prices: PriceSource | None = None  # the meter a snapshot takes prices from
        self.restored: Restored | None = None  # what a snapshot restore left for the meter

    def add_observer(self, observer: Observer, *, replays: bool = False) -> None:
        """Call ``observer(fold, batch)`` after every batch commits (while the lock is held).

        With ``replays``, also for the events a restore folds after the snapshot it started
        from (the meter's prices must follow them; a usage sample must not be taken twice)."""
        self._observers.append(observer)
        if replays:
            self._replaying.append(observer)

    def add_preparer(self, preparer: Preparer) -> None:
        """Await ``preparer(fold, batch, False)`` while a large batch commits, before the
        observers (its Python work in steps on the loop, ``in_steps``: in a worker thread it
        would take the GIL from the loop every switch interval), and ``preparer(fold, batch,
        True)`` for a restore's tail (a caller waits for it: all of it in a worker thread, not
        as background work); it may only read (the lock keeps the fold still)."""
        self._preparers.append(preparer)

    def add_precounter(self, precounter: Precounter) -> None:
        """Call ``precounter(events)`` on the loop, in steps, once a large batch passed its
        checks; the job it returns runs in a worker thread beside the admission and the commit,
        and the preparers start once it is done. It may only read (the fold may still refuse
        the batch)."""
        self._precounters.append(precounter)

    def replay(self, batch: AdmittedBatch) -> None:
        """Tell the replaying observers about a batch a restore folded (already durable)."""
        self.revision = self.fold.revision
        for observer in self._replaying:
            observer(self.fold, batch)

    @property
    def idle(self) -> bool:
        """Whether nothing uses the session now: no lock held, no stream, no open bracket."""
        return (
            not self.lock.locked() and not self.followers and live_bracket(self.fold.lock) is None
        )

    async def append(
        self,
        events: Sequence[events_pb2.SessionEvent],
        *,
        expected_last_seq: int | None = None,
        max_events: int = 1000,
        origin: Origin = Origin.SERVER,
    ) -> AppendResult:
        """Check, commit (durably) and fold a batch; see ``AppendEventsRequest`` for the rules.

        ``origin`` says who writes: compactd's own code appends as ``Origin.SERVER`` (trusted:
        bracket, lock and offload events); the API appends a runtime's batch as
        ``Origin.CLIENT``, which refuses server-only events, enforces the step brackets and
        bounds the batch by ``self.limits`` (blocks, events, the surface).
        """
        self._counting = None  # an earlier batch's counts, if it was refused, are not this one's
        if len(events) >= ADMIT_STEP:  # a large batch is checked in steps, other calls between
            await in_steps(
                check_batch_in_steps(
                    events, max_events=max_events, origin=origin, limits=self.limits
                )
            )
        else:
            check_batch(events, max_events=max_events, origin=origin, limits=self.limits)
        if self._precounters and _priced_ahead(events):
            await self._count_ahead(events)  # only a batch of valid events costs tokenizer time
        if self._store.shared and origin is Origin.CLIENT:
            return await self._append_optimistic(events, expected_last_seq)
        async with self.lock:
            return await self.append_locked(
                events, expected_last_seq=expected_last_seq, origin=origin
            )

    async def _append_optimistic(
        self, events: Sequence[events_pb2.SessionEvent], expected_last_seq: int | None
    ) -> AppendResult:
        """A runtime's batch on a shared store: first decided on the cached fold, without a
        revision read. The store lands it only at the fold's revision, so a batch that lands
        was decided on the current log; any refusal (a seq conflict, or a check the stale fold
        failed) is decided again on the caught-up fold, where it stands or falls for real."""
        async with self.lock.as_cached():
            try:
                return await self._append_once(events, expected_last_seq, Origin.CLIENT)
            except CompactdError:
                await self._catch_up()
            return await self.append_locked(
                events, expected_last_seq=expected_last_seq, origin=Origin.CLIENT
            )

    async def append_locked(
        self,
        events: Sequence[events_pb2.SessionEvent],
        *,
        expected_last_seq: int | None = None,
        origin: Origin = Origin.SERVER,
    ) -> AppendResult:
        """``append`` for a caller that already holds ``self.lock`` (the compaction engine)."""
        for attempt in range(1, MAX_APPEND_ATTEMPTS + 1):
            try:
                return await self._append_once(events, expected_last_seq, origin)
            except (SeqConflict, InvalidArgument) as error:
                # The store refused ids of the log that the fold no longer keeps (a late retry,
                # or a reuse): decided from the log, on a fold that is current (a shared store's
                # is once caught up, after its first attempt).
                current = not self._store.shared or attempt > 1
                if current and _duplicate_ids(error):
                    return await self._logged_before(events, error)
                # The store refused a batch decided on a fold another replica had moved past:
                # catch up, then decide again (a retry finds its own ids, a conflict shows).
                if not self._store.shared or not _stale_fold(error):
                    raise
                if attempt == MAX_APPEND_ATTEMPTS:
                    raise
                await retry_pause(attempt)
                await self._catch_up()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _append_once(
        self,
        events: Sequence[events_pb2.SessionEvent],
        expected_last_seq: int | None,
        origin: Origin,
        lease: LeaseOp | None = None,
    ) -> AppendResult:
        if self.deleted:  # a caller that got the handle before the delete
            raise session_not_found(self.session_id)
        replay = await self._replayed(events)
        if replay is not None:
            return replay
        if expected_last_seq is not None and expected_last_seq != self.fold.revision - 1:
            raise SeqConflict(
                f"expected last seq {expected_last_seq}, but the log ends at "
                f"{self.fold.revision - 1}",
                metadata={
                    "expected_last_seq": str(expected_last_seq),
                    "last_seq": str(self.fold.revision - 1),
                },
            )
        now = Timestamp()
        # GetCurrentTime's precision (microseconds), without its trip through a datetime.
        now.FromMicroseconds(time.time_ns() // 1000)
        batch = await self._admit(events, now, origin)
        reservation = self._reserve_bytes(batch, origin)
        if lease is None and origin is Origin.SERVER:  # a runtime's batch holds no bracket event
            lease = lease_for(
                batch.events,
                self.leases.owned,
                self.owner,
                self.leases.ttl_s,
                shared=self._store.shared,
            )
        commit = asyncio.ensure_future(self._commit(batch, reservation, lease))
        try:
            return await asyncio.shield(commit)
        except asyncio.CancelledError:
            # The caller went away, but the store may still commit the batch: finish the commit
            # (or its rollback) before the lock is released, so the fold never leaves the log.
            # Its outcome is nobody's now (a shield drops a cancelled caller's claim to it).
            commit.add_done_callback(_retrieve_outcome)
            await asyncio.wait([commit])
            raise

    async def _admit(
        self, events: Sequence[events_pb2.SessionEvent], now: Timestamp, origin: Origin
    ) -> AdmittedBatch:
        """``fold.admit``, in steps between which the loop runs other calls (readers that do not
        hold the lock read only the committed state)."""
        steps = self.fold.admit_in_steps(
            events,
            now=now,
            origin=origin,
            max_surface_bytes=self.limits.max_surface_bytes,
            step=1,  # ``in_steps`` decides when to let other calls run
        )
        return await in_steps(steps)  # a cancelled admission rolls back what it admitted

    def _reserve_bytes(self, batch: AdmittedBatch, origin: Origin) -> Reservation | None:
        """Count the batch's bytes against the tenant's quota; only a runtime's is refused."""
        if self._quotas is None:
            return None
        try:
            return self._quotas.reserve_bytes(
                batch.byte_size, enforce=origin is Origin.CLIENT, tenant=self.tenant
            )
        except QuotaExceeded:
            self.fold.rollback(batch)
            raise

    async def _commit(
        self, batch: AdmittedBatch, reservation: Reservation | None, lease: LeaseOp | None = None
    ) -> AppendResult:
        prepared = self._prepare(batch)
        try:
            rows = None
            if len(batch.events) >= ADMIT_STEP:  # serialized here in steps, not in the store
                rows = await in_steps(encode_batch_in_steps(batch.events, batch.serialized()))
            await self._store.append(
                self.session_id, batch.events, tenant=self.tenant, lease=lease, rows=rows
            )
        except BaseException as error:
            if prepared is not None:  # the worker reads the fold: let it finish first
                await asyncio.wait([prepared])
            self.fold.rollback(batch)
            if reservation is not None:
                reservation.release()
            if isinstance(error, Fenced) and lease is not None:
                self.leases.drop(lease.token)  # another replica took the bracket over
            raise
        if prepared is not None:
            await prepared
        self.leases.landed(lease)
        self._folded(batch)
        await self._notify()
        first, count = batch.first_seq, len(batch.events)  # seqs are assigned in order
        if count >= ADMIT_STEP:  # the observers are done with it: free it in the background
            _free_in_steps(batch.release())
        return AppendResult(list(range(first, first + count)), self.fold.revision)

    def _folded(self, batch: AdmittedBatch) -> None:
        self.revision = self.fold.revision
        for observer in self._observers:
            observer(self.fold, batch)

    # --- replicas -------------------------------------------------------------------------------

    async def catch_up_locked(self) -> None:
        """Fold what other replicas appended, then take over a dead replica's bracket.

        Runs with ``self.lock`` held (entering the lock calls it). One revision read when
        nothing changed; nothing at all on a store one process owns.
        """
        if not self._store.shared:
            return
        await self._catch_up()
        await self._take_over_orphan()

    def check_bracket(self, compaction_id: str) -> None:
        """Refuse to go on with a bracket another replica took over (call with the lock held).

        Raises:
            Fenced: ``LEASE_LOST``; the bracket's lifecycle ended (``session/end-seed``).
        """
        if not self._store.shared:
            return
        live = live_bracket(self.fold.lock)
        if live is None or live.compaction_id != compaction_id:
            self.leases.drop(compaction_id)
            raise fenced(self.session_id, compaction_id, None)

    async def _catch_up(self) -> None:
        record = await self._store.get_session(self.session_id, tenant=self.tenant)
        if record is None or record.create_time != self.record.create_time:
            # Another replica deleted the session (and perhaps created a new one of that id):
            # this fold is of a log that is gone. Its followers end; the manager drops it.
            await self.mark_deleted()
            raise session_not_found(self.session_id)
        if record.revision <= self.fold.revision:
            return
        chunk: list[events_pb2.SessionEvent] = []
        async for event in self.read(self.fold.revision, record.revision):
            chunk.append(event)
            if len(chunk) >= 512:
                self._folded(self.fold.admit(chunk, check=False))
                chunk = []
        if chunk:
            self._folded(self.fold.admit(chunk, check=False))
        await self._notify()

    async def _take_over_orphan(self) -> None:
        """End the lifecycle of a live bracket whose owner died (its lease expired)."""
        live = live_bracket(self.fold.lock)
        if live is None or live.compaction_id in self.leases.owned:
            return
        if time.monotonic() < self._next_lease_check:
            return
        lease = await self._store.get_lease(self.session_id, tenant=self.tenant)
        if lease is not None and not lease.expired:
            self._next_lease_check = time.monotonic() + lease.remaining_s
            return
        seed = events_pb2.SessionEvent(
            session_end_seed=events_pb2.SessionEndSeed(
                reason="lease-expired", instance_id=self.owner
            )
        )
        breaking = LeaseOp(LeaseAction.BREAK, self.owner, live.compaction_id)
        try:
            await self._append_once([seed], None, Origin.SERVER, lease=breaking)
        except (Busy, SeqConflict):  # renewed meanwhile, or another replica took it over first
            self._next_lease_check = 0.0
            return
        log.warning(
            "took over a session whose bracket owner stopped renewing its lease",
            extra={"session_id": self.session_id, "compaction_id": live.compaction_id},
        )

    async def _count_ahead(self, events: Sequence[events_pb2.SessionEvent]) -> None:
        """Start the precounters' jobs for a large batch (see ``add_precounter``)."""
        jobs = []
        for precounter in self._precounters:
            try:
                job = await in_steps(precounter(events))
            except Exception:  # the preparers count on their own: never fail an append
                log.exception("collecting a batch's texts ahead of its commit failed")
                continue
            if job is not None:
                jobs.append(job)
        if jobs:
            self._counting = asyncio.ensure_future(asyncio.to_thread(_run_jobs, jobs))

    def _prepare(self, batch: AdmittedBatch) -> asyncio.Future[None] | None:
        """Start the preparers for a large batch (None: small, or none), after the batch's
        precount jobs."""
        counting, self._counting = self._counting, None
        if not self._preparers or not batch.surface_changes:
            return None
        if not _priced_ahead(batch.events, batch.byte_size):
            return None
        return asyncio.ensure_future(self._prepare_after(counting, batch))

    async def _prepare_after(
        self, counting: asyncio.Future[None] | None, batch: AdmittedBatch
    ) -> None:
        if counting is not None:
            await asyncio.wait([counting])
        await self.run_preparers(batch)

    @property
    def replays(self) -> bool:
        """Whether an observer follows a restore's tail."""
        return bool(self._replaying)

    async def run_preparers(self, batch: AdmittedBatch, *, in_thread: bool = False) -> None:
        """Run the preparers on ``batch`` (see ``add_preparer``)."""
        for preparer in self._preparers:
            try:
                await preparer(self.fold, batch, in_thread)
            except Exception:  # the observers price on their own: never fail a commit
                log.exception("pricing a batch ahead of its commit failed")

    async def revisions(self) -> AsyncIterator[int]:
        """Yield the committed revision now, then the latest one after each commit (coalesced).

        Raises:
            NotFound: once the session is deleted (a follower's stream ends with it).
        """
        seen = -1
        self.followers += 1
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(partial(self._moved_past, seen))
                    if self.deleted:
                        raise session_not_found(self.session_id)
                    seen = self.revision
                yield seen
        finally:
            self.followers -= 1

    def read(
        self, from_seq: int = 0, to_seq: int | None = None
    ) -> AsyncIterator[events_pb2.SessionEvent]:
        """The session's stored events in ``[from_seq, to_seq)`` (see ``EventStore.read``)."""
        return self._store.read(self.session_id, from_seq, to_seq, tenant=self.tenant)

    async def mark_deleted(self) -> None:
        """Called by the manager with the lock held: wake every follower to end its stream."""
        self.deleted = True
        await self._notify()

    def _moved_past(self, seen: int) -> bool:
        return self.deleted or self.revision != seen

    async def _notify(self) -> None:
        if not self.followers:  # only ``revisions`` waits, and it counts itself a follower first
            return
        async with self._changed:
            self._changed.notify_all()

    async def _replayed(self, events: Sequence[events_pb2.SessionEvent]) -> AppendResult | None:
        """The original result when this batch was already committed (a retried batch).

        Decided on the ids the fold keeps (its latest events'): a batch none of whose ids it
        keeps goes on to its commit, where the store's unique index refuses an older id
        (``DUPLICATE_EVENT_ID``) and ``_logged_before`` decides from the log."""
        if self.fold.event_ids.keys().isdisjoint(e.event_id for e in events):  # one C pass
            return None
        return await self._logged(events)

    async def _logged_before(
        self, events: Sequence[events_pb2.SessionEvent], error: InvalidArgument
    ) -> AppendResult:
        """A batch the store refused for ids already in the log (``error``), older than the
        fold keeps: the original result when the whole batch is logged as it is (a late
        retry), ``IDEMPOTENCY_MISMATCH`` when only part of it is or its content differs."""
        ids = [e.event_id for e in events]
        if len(set(ids)) != len(ids):  # the batch reuses an id of its own
            raise error
        replay = await self._logged(events)
        if replay is None:
            raise error
        return replay

    async def _logged(self, events: Sequence[events_pb2.SessionEvent]) -> AppendResult | None:
        """The original result of ``events`` if each of their ids is in the log (the fold's or,
        beyond what it keeps, the store's) with the same content; None if none is."""
        ids = [e.event_id for e in events]
        cached = self.fold.event_ids
        logged = {i: cached[i] for i in ids if i in cached}
        older = [i for i in ids if i and i not in logged]
        if older:
            logged.update(
                await self._store.find_event_ids(self.session_id, older, tenant=self.tenant)
            )
        if not logged:
            return None
        if len(logged) != len(ids) or not all(ids):
            raise InvalidArgument(
                "a batch mixes events already in the log with new ones",
                violations=[FieldViolation("events", "retry the original batch unchanged")],
                reason="IDEMPOTENCY_MISMATCH",
            )
        seqs = [logged[i] for i in ids]
        stored = await self._store.read_seqs(self.session_id, seqs, tenant=self.tenant)
        for index, (sent, kept) in enumerate(zip(events, stored, strict=True)):
            if not _same_content(sent, kept):
                raise InvalidArgument(
                    f"event_id {sent.event_id!r} is already in the log with different content",
                    violations=[FieldViolation(f"events[{index}].event_id", "reused id")],
                    reason="IDEMPOTENCY_MISMATCH",
                )
        return AppendResult(seqs, self.fold.revision, replayed=True)


def _retrieve_outcome(future: asyncio.Future[Any]) -> None:
    """Mark a shielded task's failure as seen: when every caller awaiting it through
    ``asyncio.shield`` went away, nothing else retrieves it, and asyncio would log it as
    "Task exception was never retrieved" with a traceback. The failure itself was handled (a
    commit rolls back its batch; a restore leaves nothing behind)."""
    if not future.cancelled():
        future.exception()


def _priced_ahead(events: Sequence[events_pb2.SessionEvent], size: int | None = None) -> bool:
    """Whether a batch is large enough (events or serialized bytes) for its texts to be counted
    in a worker thread and its prices made while it commits; a smaller one is priced by the
    observers, where that costs less than the hop to a thread."""
    if len(events) >= OFFLOAD_EVENTS:
        return True
    return (sum(e.ByteSize() for e in events) if size is None else size) >= OFFLOAD_BYTES


# Entries of a committed batch's lists freed between pauses, and the tasks freeing them (asyncio
# keeps only weak references to tasks).
FREE_STEP = 64
_freeing: set[asyncio.Future[None]] = set()


def _free_in_steps(held: list[list[Any]]) -> None:
    """Free ``held`` (``AdmittedBatch.release``) in steps on the loop, in the background."""
    task = asyncio.ensure_future(in_steps(_emptied(held)))
    _freeing.add(task)
    task.add_done_callback(_freeing.discard)


def _emptied(held: list[list[Any]]) -> Generator[None, None, None]:
    for items in held:
        while items:
            del items[-FREE_STEP:]
            yield


def _run_jobs(jobs: Sequence[Callable[[], None]]) -> None:
    for job in jobs:
        try:
            job()
        except Exception:  # the preparers count on their own: never fail a commit
            log.exception("counting a batch's texts ahead of its commit failed")


async def in_steps(steps: Generator[None, None, T]) -> T:
    """Run ``steps`` to its end on the event loop, letting other calls run whenever it has held
    the loop for ``STEP_S`` (``_let_others_run``); its value. Cancelled, it closes ``steps``
    (which may roll back)."""
    deadline = time.perf_counter() + STEP_S
    try:
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result: T = done.value
                return result
            if time.perf_counter() >= deadline:
                await _let_others_run()
                deadline = time.perf_counter() + STEP_S
    finally:
        steps.close()


async def _let_others_run() -> None:
    """Yield the loop, then go on waiting while other callbacks are ready, for at most
    ``YIELD_TURNS`` turns and ``YIELD_S``. A call next door needs several loop turns (its
    request, its handler, its reply): without the wait, each of them would come after one more
    step of this work."""
    await asyncio.sleep(0)
    # ``_ready`` is asyncio's own queue of runnable callbacks; another loop may not have one.
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    if ready is None:
        return
    until = time.perf_counter() + YIELD_S
    for _ in range(YIELD_TURNS):
        if not ready or time.perf_counter() >= until:
            return
        await asyncio.sleep(0)


def _stale_fold(error: Exception) -> bool:
    """Whether the store refused a batch because another replica appended first."""
    if isinstance(error, SeqConflict):
        return "first_seq" in error.metadata  # the store's check, not ``expected_last_seq``
    return _duplicate_ids(error)


def _duplicate_ids(error: Exception) -> TypeGuard[InvalidArgument]:
    """Whether the store refused a batch for event ids already in the log."""
    return isinstance(error, InvalidArgument) and error.reason == "DUPLICATE_EVENT_ID"


def _same_content(sent: events_pb2.SessionEvent, kept: events_pb2.SessionEvent) -> bool:
    a, b = events_pb2.SessionEvent(), events_pb2.SessionEvent()
    a.CopyFrom(sent)
    b.CopyFrom(kept)
    for event in (a, b):
        event.ClearField("seq")
        event.ClearField("time")
        # The server fills a header's reason when the runtime leaves it unset.
        if event.HasField("request_header") and not sent.request_header.reason:
            event.request_header.ClearField("reason")
            event.request_header.ClearField("starts_series")
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


#: A snapshot is due after at least this many events per entry it copies (see ``snapshot_due``).
SNAPSHOT_EVENTS_PER_ENTRY = 1 / 16


def snapshot_due(fold: SessionFold, interval: int) -> int:
    """Events after the last snapshot that make the next one due: ``interval``, or more once
    what a snapshot copies (the surface's nodes and the event ids the fold keeps) outgrows it,
    so that writing snapshots costs a bounded amount per event (at most 16 copied entries) at
    any surface size; a restore then replays at most a sixteenth of those entries' worth of
    events."""
    entries = len(fold.event_ids) + len(fold.surface)
    return max(interval, int(entries * SNAPSHOT_EVENTS_PER_ENTRY))


class SessionManager:
    """Creates sessions, restores them from the store and keeps at most ``max_resident`` of
    them in memory (see the module docstring).

    Args:
        snapshot_interval: Events between fold snapshots (0: never snapshot).
        max_resident: Sessions held in memory at most (0: no bound).
    """

    def __init__(
        self,
        store: EventStore,
        *,
        instance_id: str | None = None,
        policy_validator: Callable[[Mapping[str, Any]], object] | None = None,
        limits: AppendLimits = DEFAULT_LIMITS,
        lease_s: float = 30.0,
        snapshot_interval: int = 0,
        max_resident: int = 0,
        quotas: QuotaBook | None = None,
    ) -> None:
        self.store = store
        self.limits = limits
        self.lease_s = lease_s
        self.snapshot_interval = snapshot_interval
        self.max_resident = max_resident
        self.quotas = quotas
        self._policy_validator = policy_validator
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        self._handles: OrderedDict[_Key, SessionHandle] = OrderedDict()  # least recent first
        # Every handle still referenced (a stream, a running call): the one handle of its session.
        self._alive: weakref.WeakValueDictionary[_Key, SessionHandle] = (
            weakref.WeakValueDictionary()
        )
        self._evicted: set[_Key] = set()  # sessions this process evicted (no new lifecycle)
        # What an evicted session's extensions held (its failure memory, say), handed to its
        # next handle; keys in ``_rebuilt`` are rebuilt on restore instead (the meter).
        self._carried: dict[_Key, dict[str, object]] = {}
        self._rebuilt: set[str] = set()
        self._loading: dict[_Key, asyncio.Future[SessionHandle]] = {}
        self._on_restore: list[Callable[[SessionHandle], Awaitable[None] | None]] = []
        self._snapshotting: dict[_Key, asyncio.Task[None]] = {}
        self._evicting: asyncio.Task[None] | None = None
        self.evictions = 0
        self._listener = ChangeListener(
            store,
            lambda tenant, session_id: self._handles.get((tenant, session_id)),
            self._handles.values,
        )

    def start(self) -> None:
        """Begin following other replicas' appends (a shared store; call on the event loop)."""
        self._listener.start()

    @property
    def resident(self) -> int:
        """How many sessions are held in memory (the live-sessions gauge)."""
        return len(self._handles)

    def rebuilds(self, *keys: str) -> None:
        """Extension keys a restore rebuilds (``on_restore``); every other key of an evicted
        session's ``extensions`` is carried to its next handle, as if it had never left."""
        self._rebuilt.update(keys)

    def on_restore(self, callback: Callable[[SessionHandle], Awaitable[None] | None]) -> None:
        """Call ``callback(handle)`` for every session restored from now on, before the session
        is used; a callback may be a coroutine function (awaited: e.g. pricing in a thread)."""
        self._on_restore.append(callback)

    def validate_policy(
        self, policy: dict[str, object], *, field: Callable[[str], str] | None = None
    ) -> None:
        """Reject per-session policy overrides the service-wide validator rejects.

        ``field`` turns the settings path of the bad setting (``modelPolicies[0].retainRatio``)
        into the request's field path (default: under ``compaction_policy``).
        """
        if self._policy_validator is None:
            return
        try:
            self._policy_validator(policy)
        except ConfigError as error:
            setting = error.metadata.get("field", "")
            path = field(setting) if field is not None else f"compaction_policy.{setting}"
            path = path.rstrip(".")
            raise InvalidArgument(
                f"{path.split('.')[0]}: {error.message}",
                violations=[FieldViolation(path, error.message)],
                reason="POLICY_INVALID",
            ) from error

    async def create(
        self, session_id: str, policy: dict[str, object] | None, *, tenant: Tenant | None = None
    ) -> SessionRecord:
        """Create an empty session of ``tenant`` (the caller's by default), idempotently.

        A retried create (the same id and the same policy; a reply may have been lost) answers
        the session as it is now. ``AlreadyExists`` when the id is taken with another policy;
        ``QuotaExceeded`` when the caller's tenant owns its ``max_sessions`` already.
        """
        owner = _tenant_id(tenant)
        policy_json = json.dumps(policy, sort_keys=True) if policy else None
        if self.quotas is None:
            return await self._create(owner, session_id, policy_json, lambda: None)
        try:
            not_created = self.quotas.reserve_session(owner)
        except QuotaExceeded:
            # At the quota, a retried create still answers the session it created.
            existing = await self.store.get_session(session_id, tenant=owner)
            if existing is not None and existing.policy_json == policy_json:
                return existing
            raise
        try:
            return await self._create(owner, session_id, policy_json, not_created)
        except BaseException:
            not_created()
            raise

    async def _create(
        self,
        owner: str,
        session_id: str,
        policy_json: str | None,
        not_created: Callable[[], None],
    ) -> SessionRecord:
        try:
            return await self.store.create_session(session_id, policy_json, tenant=owner)
        except AlreadyExists:
            not_created()
            existing = await self.store.get_session(session_id, tenant=owner)
            if existing is None or existing.policy_json != policy_json:
                raise AlreadyExists(
                    f"session {session_id!r} already exists with a different compaction_policy",
                    metadata={"session_id": session_id},
                ) from None
            return existing

    async def get(
        self, session_id: str, *, tenant: Tenant | None = None, fresh: bool = True
    ) -> SessionHandle:
        """The session's handle, restoring it from the log on first use.

        On a shared store the fold is caught up first; ``fresh=False`` skips that for a caller
        that takes the handle's lock next anyway (taking it catches up).

        Raises:
            NotFound: No session ``session_id`` of ``tenant`` (the caller's by default).
        """
        key = (_tenant_id(tenant), session_id)
        handle = self._handles.get(key)
        if handle is not None:
            self._handles.move_to_end(key)
        else:
            handle = self._alive.get(key)
            if handle is not None and not handle.deleted:  # evicted while in use: still its handle
                self._keep(handle)
            else:
                handle = None
        if handle is not None and fresh and self.store.shared:
            handle = await self._caught_up(key, handle)  # other replicas may have appended
        if handle is not None:
            return handle
        # One restore per session however many callers arrive (and none left behind for ids
        # that do not exist); a caller that goes away does not cancel it for the others.
        restoring = self._loading.get(key)
        if restoring is None:
            restoring = asyncio.ensure_future(self._restore_once(key))
            self._loading[key] = restoring
            restoring.add_done_callback(lambda _: self._loading.pop(key, None))
            restoring.add_done_callback(_retrieve_outcome)  # its callers may all have gone
        return await asyncio.shield(restoring)

    async def _caught_up(self, key: _Key, handle: SessionHandle) -> SessionHandle | None:
        """The handle with its fold caught up; None when another replica deleted its session
        (the handle is dropped, so a session created anew under the id is restored fresh)."""
        try:
            async with handle.lock:
                pass
        except NotFound:
            if not handle.deleted:
                raise
            if self._handles.get(key) is handle:
                del self._handles[key]
            return None
        return handle

    async def list(
        self, *, after: str = "", limit: int = 100, tenant: Tenant | None = None
    ) -> list[SessionRecord]:
        """Up to ``limit`` of the tenant's sessions after the id ``after``, in id order."""
        return await self.store.list_sessions(after=after, limit=limit, tenant=_tenant_id(tenant))

    async def delete(
        self,
        session_id: str,
        *,
        tenant: Tenant | None = None,
        idle_before: datetime | None = None,
    ) -> bool:
        """Remove the session, its log and everything derived from it, durably.

        In-flight appends finish first (the session's lock is taken); followers' streams end
        NOT_FOUND; the id may be created again, fresh. With ``idle_before`` (the retention
        sweep), a session active since then is kept: False.

        Raises:
            NotFound: No session ``session_id`` of ``tenant`` (the caller's by default).
        """
        key = (_tenant_id(tenant), session_id)
        restoring = self._loading.get(key)
        if restoring is not None:  # let a restore in flight land, so its handle is retired
            await asyncio.wait([restoring])
        handle = self._handles.get(key) or self._alive.get(key)
        async with handle.lock if handle is not None else contextlib.nullcontext():
            if idle_before is not None and not await self._idle(key, idle_before):
                return False
            held = await self._held_by(key)
            deleted = await self.store.delete_session(session_id, tenant=key[0])
            if handle is not None:
                await handle.mark_deleted()
                self._handles.pop(key, None)
            self._forget(key)
        if not deleted:
            raise session_not_found(session_id)
        if self.quotas is not None and held is not None:
            self.quotas.removed(key[0], held)
        log.info("session deleted", extra={"session_id": session_id, "tenant": key[0]})
        return True

    async def _held_by(self, key: _Key) -> StoreUsage | None:
        """What the session counts towards its tenant's held quotas (None: nothing counted)."""
        if self.quotas is None or not self.quotas.ledger.counts_stored:
            return None
        usage = await self.store.usage(tenant=key[0], session_id=key[1])
        return usage.get(key[0], StoreUsage())

    async def _idle(self, key: _Key, before: datetime) -> bool:
        record = await self.store.get_session(key[1], tenant=key[0])
        return record is None or record.last_active < before

    def _forget(self, key: _Key) -> None:
        """Drop what the manager keeps of a deleted session besides its handle."""
        self._alive.pop(key, None)
        self._evicted.discard(key)
        self._carried.pop(key, None)

    async def _restore_once(self, key: _Key) -> SessionHandle:
        handle = await self._restore(*key)
        self._keep(handle)
        return handle

    def _keep(self, handle: SessionHandle) -> None:
        self._handles[handle.key] = handle
        self._alive[handle.key] = handle
        over = bool(self.max_resident) and len(self._handles) > self.max_resident
        if over and (self._evicting is None or self._evicting.done()):
            self._evicting = asyncio.ensure_future(self._evict_over())

    async def _restore(self, tenant: str, session_id: str) -> SessionHandle:
        record = await self.store.get_session(session_id, tenant=tenant)
        if record is None:
            raise session_not_found(session_id)
        fold, restored, same_lifecycle = await self._from_snapshot(record)
        handle = SessionHandle(
            record,
            self.store,
            fold,
            self.limits,
            self.quotas,
            owner=self.instance_id,
            lease_s=self.lease_s,
        )
        handle.extensions.update(self._carried.pop(handle.key, {}))
        handle.restored = restored
        handle.snapshot_revision = fold.revision if restored is not None else 0
        handle.add_observer(partial(self._committed, weakref.ref(handle)))
        same_lifecycle = same_lifecycle or handle.key in self._evicted
        for callback in self._on_restore:
            pending = callback(handle)
            if pending is not None:
                await pending
        await self._fold_tail(handle)
        if self.store.shared:
            # Other replicas serve this session too: a restore is no new lifecycle. A bracket
            # whose owner died is taken over once its lease expired (``catch_up_locked``).
            async with handle.lock:
                pass
        elif handle.fold.revision and not same_lifecycle:
            # A new lifecycle: brackets opened by an earlier process become stale evidence.
            seed = events_pb2.SessionEvent(
                session_end_seed=events_pb2.SessionEndSeed(
                    reason="restore", instance_id=self.instance_id
                )
            )
            result = await handle.append([seed])
            handle.fold.restored_at = result.seqs[0]
            log.info(
                "session restored",
                extra={"session_id": session_id, "revision": handle.fold.revision},
            )
        return handle

    async def _from_snapshot(
        self, record: SessionRecord
    ) -> tuple[SessionFold, Restored | None, bool]:
        """The fold of the session's latest usable snapshot (an empty fold without one), what
        it left for the meter, and whether this process wrote it (the same lifecycle)."""
        session_id, tenant = record.session_id, record.tenant
        kept = await self.store.get_snapshot(session_id, tenant=tenant)
        if kept is None:
            return SessionFold(), None, False
        try:
            snap = await asyncio.to_thread(snapshots.decode, kept[1])
            if snap.revision != kept[0] or snap.revision > record.revision:
                raise snapshots.SnapshotInvalid(
                    f"snapshot at revision {snap.revision} for a log of {record.revision} events"
                )
            stored = await self.store.read_seqs(session_id, snap.needed_seqs(), tenant=tenant)
            fold = await asyncio.to_thread(snapshots.rebuild, snap, {e.seq: e for e in stored})
        except snapshots.SnapshotInvalid as err:
            log.warning(
                "snapshot unusable, replaying the log: %s", err, extra={"session_id": session_id}
            )
            return SessionFold(), None, False
        anchor = None
        if snap.anchor is not None:
            seq, header_seq = snap.anchor
            header = fold.header if header_seq == fold.header_seq else None
            if header is None and header_seq >= 0:
                found = [e for e in stored if e.seq == header_seq]
                header = found[0].request_header if found else None
            anchor = (seq, header_seq, header)
        restored = Restored(snap.node_prices(), anchor)
        return fold, restored, snap.instance_id == self.instance_id

    async def _fold_tail(self, handle: SessionHandle) -> None:
        """Fold the log after the handle's fold (all of it without a snapshot) in worker
        threads, telling the replaying observers (the meter) about it."""
        fold = handle.fold
        chunk: list[SessionEvent] = []
        async for event in handle.read(fold.revision):
            chunk.append(event)
            if len(chunk) >= 4096:
                await self._fold_chunk(handle, chunk)
                chunk = []
        if chunk:
            await self._fold_chunk(handle, chunk)
        handle.revision = fold.revision

    async def _fold_chunk(self, handle: SessionHandle, chunk: Sequence[SessionEvent]) -> None:
        batch = await asyncio.to_thread(partial(handle.fold.admit, chunk, check=False))
        if handle.replays:
            await handle.run_preparers(batch, in_thread=True)
        handle.replay(batch)

    # ---- snapshots and eviction ----------------------------------------------------------

    def _committed(
        self, ref: weakref.ref[SessionHandle], fold: SessionFold, batch: AdmittedBatch
    ) -> None:
        """After a commit: start a snapshot once ``snapshot_due`` events have passed."""
        del batch
        handle = ref()  # a weak reference: the handle's observers must not keep it alive
        if handle is None or not self.snapshot_interval:
            return
        if fold.revision - handle.snapshot_revision >= snapshot_due(fold, self.snapshot_interval):
            self._start_snapshot(handle)

    def _start_snapshot(self, handle: SessionHandle) -> None:
        running = self._snapshotting.get(handle.key)
        if running is not None and not running.done():
            return
        task = asyncio.ensure_future(self.snapshot(handle))
        self._snapshotting[handle.key] = task
        task.add_done_callback(partial(self._snapshot_done, handle.key))

    def _snapshot_done(self, key: _Key, task: asyncio.Task[None]) -> None:
        if self._snapshotting.get(key) is task:
            del self._snapshotting[key]
        if not task.cancelled() and task.exception() is not None:
            log.warning("snapshot failed: %s", task.exception(), extra={"session_id": key[1]})

    async def snapshot(self, handle: SessionHandle) -> None:
        """Write the session's fold snapshot now: built in steps on the loop and written while
        its lock is held (so no delete, and no re-created session, comes between)."""
        async with handle.lock:
            revision = handle.revision
            if revision == 0 or handle.deleted:
                return
            data = await in_steps(self._capture(handle))
            await self.store.put_snapshot(handle.session_id, revision, data, tenant=handle.tenant)
        handle.snapshot_revision = max(handle.snapshot_revision, revision)

    def _capture(self, handle: SessionHandle) -> Generator[None, None, bytes]:
        """The session's snapshot, made in steps on the loop (with its lock held): in a worker
        thread, its Python and its JSON encoding would take the GIL from the loop."""
        source = handle.prices
        prices = source.persisted_prices() if source is not None else {}
        anchor = source.anchor_state() if source is not None else None
        if source is not None and anchor is None:
            anchor = snapshots.NO_ANCHOR  # its anchor was dropped: a restore must not find one
        snap = yield from snapshots.capture_in_steps(handle.fold, self.instance_id, prices, anchor)
        return (yield from snapshots.encode_in_steps(snap))

    async def evict(self, session_id: str, *, tenant: Tenant | None = None) -> bool:
        """Snapshot the session and drop it from memory if it is idle (False: in use, or not
        resident). The next ``get`` restores it, in the same lifecycle."""
        return await self._evict((_tenant_id(tenant), session_id))

    async def _evict(self, key: _Key) -> bool:
        handle = self._handles.get(key)
        if handle is None or not handle.idle:
            return False
        running = self._snapshotting.get(key)
        if running is not None:  # it holds the handle: let it finish, then drop both
            await asyncio.wait([running])
        if handle.snapshot_revision < handle.revision:
            await self.snapshot(handle)
        if not handle.idle or self._handles.get(key) is not handle:
            return False
        del self._handles[key]
        self._evicted.add(key)
        carried = {k: v for k, v in handle.extensions.items() if k not in self._rebuilt}
        if carried:
            self._carried[key] = carried
        self.evictions += 1
        return True

    async def _evict_over(self) -> None:
        """Evict least recently used idle sessions until at most ``max_resident`` remain."""
        while len(self._handles) > self.max_resident:
            victims = [key for key, h in self._handles.items() if h.idle]
            over = len(self._handles) - self.max_resident
            if not victims:
                return  # every session is in use; the next keep tries again
            for key in victims[:over]:
                try:
                    await self._evict(key)
                except Exception as err:  # a snapshot that failed: keep the session resident
                    log.warning("eviction failed: %s", err, extra={"session_id": key[1]})
                    return

    async def close(self) -> None:
        """Finish snapshots under way, then forget every handle (the store is closed by its
        owner)."""
        if self._evicting is not None:
            await asyncio.wait([self._evicting])
        running = list(self._snapshotting.values())
        if running:
            await asyncio.wait(running)
        await self._listener.stop()
        for handle in self._handles.values():
            handle.leases.close()
        self._handles.clear()
        self._alive.clear()


def _tenant_id(tenant: Tenant | None) -> str:
    return (tenant or current_tenant()).id
