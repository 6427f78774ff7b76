"""One resident session: its fold, kept in step with its durable log, and its lock.

``SessionHandle.append`` checks a batch, commits it durably (the store shares commits across
sessions: group commit) and folds it; appends to one session are serialized by its lock. A large
batch is background work (see the ``compactd.service.sessions`` docstring): checked and admitted
in steps on the loop, its texts counted in a worker thread and priced while it commits. On a
shared store the fold is a cache of a log other replicas append to (``service.replicas``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, Protocol, TypeGuard

from google.protobuf.timestamp_pb2 import Timestamp

from compactd.core.fold import AdmittedBatch, SessionFold
from compactd.core.limits import DEFAULT_LIMITS, AppendLimits
from compactd.core.lock import live_bracket
from compactd.core.pricing import NodeCost
from compactd.core.steps import run_to_end
from compactd.core.validation import Origin, check_batch, check_batch_in_steps
from compactd.errors import (
    CompactdError,
    CompactionBusy,
    Fenced,
    FieldViolation,
    InvalidArgument,
    QuotaExceeded,
    SeqConflict,
    ServerShuttingDown,
)
from compactd.reasons import Reason
from compactd.service.context import SessionContext
from compactd.service.quotas import QuotaBook, Reservation
from compactd.service.replicas import (
    MAX_APPEND_ATTEMPTS,
    CatchUpLock,
    LeaseKeeper,
    lease_for,
    retry_pause,
)
from compactd.speed import free_in_steps, in_steps
from compactd.store.base import EventStore, SessionRecord, encode_batch_in_steps, session_not_found
from compactd.store.leases import LeaseAction, LeaseOp, fenced
from compactd.v1 import events_pb2

log = logging.getLogger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

Observer = Callable[[SessionFold, AdmittedBatch], None]
# Prices a large batch ahead of its commit: on the loop in steps, or (True) in a worker thread.
Preparer = Callable[[SessionFold, AdmittedBatch, bool], Awaitable[None]]
#: Checks an admitted batch against the session's state (the fold right after it) before it
#: commits; raising refuses the batch (``SessionHandle.add_checker``).
Checker = Callable[[SessionFold, AdmittedBatch], None]
# Called with a large batch once it passed its checks: steps on the loop, then a job for a thread.
Precounter = Callable[
    [Sequence[events_pb2.SessionEvent]], Generator[None, None, Callable[[], None] | None]
]
Key = tuple[str, str]  # (tenant id, session id)
# Batches at least this large (events or serialized bytes) have their texts counted in a worker
# thread and are priced while they commit (``_priced_ahead``).
OFFLOAD_EVENTS = 16
OFFLOAD_BYTES = 16 * 1024
# A batch of at least this many events is checked and admitted in steps, between which other
# calls run.
ADMIT_STEP = 128
# A batch of fewer events is admitted in one go: the steps' own cost would exceed the pauses they
# spare other calls (a step holds the loop for at most this many events' admission).
ADMIT_IN_ONE = 16


class PriceSource(Protocol):
    """What a snapshot takes from the session's meter (``core.meter.SessionMeter``)."""

    def persisted_prices(self) -> dict[str, dict[int, NodeCost]]:
        """Node prices per pricing-profile key."""
        ...

    def anchor_state(self) -> tuple[int, int] | None:
        """(anchor seq, its header seq), or None."""
        ...


@dataclass(frozen=True)
class AppendResult:
    """Seqs assigned to a batch (in request order) and the revision after it."""

    seqs: list[int]
    revision: int
    replayed: bool = False  # every event was already in the log (an idempotent retry)


def incarnation_of(record: SessionRecord) -> str:
    """The ``BuildRequestResponse.incarnation`` of the session of ``record``: its create time in
    microseconds since the Unix epoch (the stores keep it to the microsecond), as text so a
    later incarnation token may be anything."""
    return str((record.create_time - _EPOCH) // _MICROSECOND)


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
        self.key: Key = (record.tenant, record.session_id)
        self.deleted = False  # set (under the lock) by ``SessionManager.delete``
        self.stopping = False  # set by ``SessionManager.end_streams``: the server is stopping
        self._quotas = quotas
        self.limits = limits
        self.record = record
        # Which session of this id the handle is of: revisions restart when the id is deleted
        # and created again, its create time does not (``catch_up_locked`` tells them apart the
        # same way). Held requests carry it, so a step never extends one of a session gone.
        self.incarnation = incarnation_of(record)
        self.fold = fold
        self.policy_overrides: dict[str, object] | None = (
            json.loads(record.policy_json) if record.policy_json else None
        )
        self._context: SessionContext | None = None  # set once, by the manager's restore
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
        self._checkers: list[Checker] = []
        self._counting: asyncio.Future[None] | None = None  # the latest batch's precount jobs
        self._changed = asyncio.Condition()
        self.followers = 0  # streams following the revisions (``revisions``)
        self.snapshot_revision = 0  # the revision of the latest snapshot written (or read)
        self.prices: PriceSource | None = None  # the meter a snapshot takes prices from

    @property
    def context(self) -> SessionContext:
        """The session's service state (``service.context``), built when it was restored."""
        if self._context is None:
            raise RuntimeError(f"session {self.session_id} has no context: not restored")
        return self._context

    @context.setter
    def context(self, context: SessionContext) -> None:
        self._context = context

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

    def add_checker(self, checker: Checker) -> None:
        """Call ``checker(fold, batch)`` on every batch a runtime appends, once the fold admitted
        it and before it commits; an error it raises rolls the batch back and reaches the
        caller (a rule the fold cannot decide alone, e.g. one that needs the route catalog)."""
        self._checkers.append(checker)

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
        if len(events) > max_events:  # refused before its texts cost tokenizer time
            check_batch(events, max_events=max_events, origin=origin, limits=self.limits)
        if self._precounters and _priced_ahead(events):
            # Counted in worker threads while the batch is checked and admitted on the loop:
            # the count is most of a large batch's time, and a core would idle meanwhile. A
            # batch the checks refuse wastes its count, bounded by the request size limit.
            await self._count_ahead(events)
        if len(events) >= ADMIT_STEP:  # a large batch is checked in steps, other calls between
            await in_steps(
                check_batch_in_steps(
                    events, max_events=max_events, origin=origin, limits=self.limits
                )
            )
        else:
            check_batch(events, max_events=max_events, origin=origin, limits=self.limits)
        if self._store.shared and origin is Origin.CLIENT:
            return await self._append_optimistic(events, expected_last_seq)
        async with self.lock:
            return await self.append_locked(
                events, expected_last_seq=expected_last_seq, origin=origin, checked=True
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
                return await self._append_once(
                    events, expected_last_seq, Origin.CLIENT, checked=True
                )
            except CompactdError:
                await self._catch_up()
            return await self.append_locked(
                events, expected_last_seq=expected_last_seq, origin=Origin.CLIENT, checked=True
            )

    async def append_locked(
        self,
        events: Sequence[events_pb2.SessionEvent],
        *,
        expected_last_seq: int | None = None,
        origin: Origin = Origin.SERVER,
        checked: bool = False,
    ) -> AppendResult:
        """``append`` for a caller that holds ``self.lock`` already (a bracket, a prune).
        ``checked``: the batch passed ``check_batch`` for ``origin`` (``append``'s own)."""
        for attempt in range(1, MAX_APPEND_ATTEMPTS + 1):
            try:
                return await self._append_once(events, expected_last_seq, origin, checked=checked)
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
        *,
        checked: bool = False,
    ) -> AppendResult:
        if self.deleted:  # a caller that got the handle before the delete
            raise session_not_found(self.session_id)
        if self._maybe_retried(events):
            replay = await self._logged(events)
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
        admission = self._admission(events, now, origin, checked)
        if len(events) < ADMIT_IN_ONE:  # a few events: steps would cost more than they do
            batch = run_to_end(admission)
        else:  # between steps the loop runs other calls; cancelled, it rolls back
            batch = await in_steps(admission)
        if origin is Origin.CLIENT:
            self._check(batch)
        reservation = self._reserve_bytes(batch, origin)
        if lease is None and origin is Origin.SERVER:  # a runtime's batch holds no bracket event
            lease = lease_for(
                batch.events,
                self.leases.owned,
                self.owner,
                self.leases.ttl_s,
                shared=self._store.shared,
            )
        prepared = self._prepare(batch)
        if prepared is None and len(batch.events) < ADMIT_STEP:
            return await self._commit_small(batch, reservation, lease)
        commit = asyncio.get_running_loop().create_task(
            self._commit(batch, reservation, lease, prepared)
        )
        try:
            return await asyncio.shield(commit)
        except asyncio.CancelledError:
            # The caller went away, but the store may still commit the batch: finish the commit
            # (or its rollback) before the lock is released, so the fold never leaves the log.
            # Its outcome is nobody's now (a shield drops a cancelled caller's claim to it).
            commit.add_done_callback(retrieve_outcome)
            await asyncio.wait([commit])
            raise

    def _admission(
        self,
        events: Sequence[events_pb2.SessionEvent],
        now: Timestamp,
        origin: Origin,
        checked: bool,
    ) -> Generator[None, None, AdmittedBatch]:
        """``fold.admit`` in steps, between which the loop may run other calls (readers that do
        not hold the lock read only the committed state). ``checked``: the batch passed
        ``check_batch`` for ``origin``, whose rules include the fold's check of the origin:
        not made twice."""
        return self.fold.admit_in_steps(
            events,
            now=now,
            origin=origin,
            max_surface_bytes=self.limits.max_surface_bytes,
            step=1,  # ``in_steps`` decides when to let other calls run
            origin_checked=checked,
        )

    def _check(self, batch: AdmittedBatch) -> None:
        """Run the checkers (``add_checker``) on an admitted batch; refused, it is rolled back."""
        try:
            for checker in self._checkers:
                checker(self.fold, batch)
        except BaseException:
            self.fold.rollback(batch)
            raise

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

    async def _commit_small(
        self, batch: AdmittedBatch, reservation: Reservation | None, lease: LeaseOp | None
    ) -> AppendResult:
        """``_commit`` for a small batch that nothing prices ahead, in the caller's own task (no
        task and shield per append): its one wait is the store's outcome, which a cancelled
        caller still waits for (``EventStore.commit``), so the fold follows the log either way
        before the caller hears of its cancellation."""
        try:
            rows = run_to_end(encode_batch_in_steps(batch.events, batch.serialized()))
            outcome = self._store.commit(
                self.session_id, batch.events, tenant=self.tenant, lease=lease, rows=rows
            )
        except BaseException as error:
            self._undo(batch, reservation, lease, error)
            raise
        cancelled: asyncio.CancelledError | None = None
        try:
            await outcome
        except asyncio.CancelledError as error:
            cancelled = error  # the outcome is settled now: it decides the fold, then we go
        except BaseException as error:
            self._undo(batch, reservation, lease, error)
            raise
        if cancelled is not None:
            failure = cancelled if outcome.cancelled() else outcome.exception()
            if failure is not None:  # retrieved: nobody else will
                self._undo(batch, reservation, lease, failure)
                raise cancelled
        self.leases.landed(lease)
        self._folded(batch)
        if self.followers:  # only ``revisions`` waits; a cancelled caller still wakes them
            await asyncio.shield(self._notify())
        if cancelled is not None:
            raise cancelled
        first = batch.first_seq
        return AppendResult(list(range(first, first + len(batch.events))), self.fold.revision)

    def _undo(
        self,
        batch: AdmittedBatch,
        reservation: Reservation | None,
        lease: LeaseOp | None,
        error: BaseException,
    ) -> None:
        """Leave the fold as the log after a batch failed to land."""
        self.fold.rollback(batch)
        if reservation is not None:
            reservation.release()
        if isinstance(error, Fenced) and lease is not None:
            self.leases.drop(lease.token)  # another replica took the bracket over

    async def _commit(
        self,
        batch: AdmittedBatch,
        reservation: Reservation | None,
        lease: LeaseOp | None,
        prepared: asyncio.Future[None] | None,
    ) -> AppendResult:
        try:
            # The store takes the rows made here, with the bytes the fold's surface nodes keep:
            # nothing is serialized twice (a large batch in steps, other calls between).
            encoding = encode_batch_in_steps(batch.events, batch.serialized())
            if len(batch.events) >= ADMIT_STEP:
                rows = await in_steps(encoding)
            else:
                rows = run_to_end(encoding)
            await self._store.append(
                self.session_id, batch.events, tenant=self.tenant, lease=lease, rows=rows
            )
        except BaseException as error:
            if prepared is not None:  # the worker reads the fold: let it finish first
                await asyncio.wait([prepared])
            self._undo(batch, reservation, lease, error)
            raise
        if prepared is not None:
            await prepared
        self.leases.landed(lease)
        self._folded(batch)
        if self.followers:  # only ``revisions`` waits for a commit
            await self._notify()
        first, count = batch.first_seq, len(batch.events)  # seqs are assigned in order
        if count >= ADMIT_STEP:  # the observers are done with it: free it in the background
            free_in_steps(batch.release())
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
        except (
            CompactionBusy,
            SeqConflict,
        ):  # renewed meanwhile, or another replica took it over first
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
            Unavailable: ``SERVER_SHUTTING_DOWN`` once the server stops (``end_streams``).
        """
        seen = -1
        self.followers += 1
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(partial(self._moved_past, seen))
                    if self.deleted:
                        raise session_not_found(self.session_id)
                    if self.stopping:
                        raise ServerShuttingDown()
                    seen = self.revision
                yield seen
        finally:
            self.followers -= 1

    def read(
        self, from_seq: int = 0, to_seq: int | None = None
    ) -> AsyncIterator[events_pb2.SessionEvent]:
        """The session's stored events in ``[from_seq, to_seq)`` (see ``EventStore.read``)."""
        return self._store.read(self.session_id, from_seq, to_seq, tenant=self.tenant)

    async def read_seqs(self, seqs: Sequence[int]) -> list[events_pb2.SessionEvent]:
        """The session's stored events at ``seqs`` (see ``EventStore.read_seqs``)."""
        return await self._store.read_seqs(self.session_id, seqs, tenant=self.tenant)

    async def mark_deleted(self) -> None:
        """Called by the manager with the lock held: wake every follower to end its stream."""
        self.deleted = True
        await self._notify()

    async def end_streams(self) -> None:
        """Called by the manager when the server stops: end every follower's stream now."""
        self.stopping = True
        await self._notify()

    def _moved_past(self, seen: int) -> bool:
        return self.deleted or self.stopping or self.revision != seen

    async def _notify(self) -> None:
        if not self.followers:  # only ``revisions`` waits, and it counts itself a follower first
            return
        async with self._changed:
            self._changed.notify_all()

    def _maybe_retried(self, events: Sequence[events_pb2.SessionEvent]) -> bool:
        """Whether this batch may have been committed already (a retried batch): then
        ``_logged`` has its original result.

        Decided on the ids the fold keeps (its latest events'): a batch none of whose ids it
        keeps goes on to its commit, where the store's unique index refuses an older id
        (``DUPLICATE_EVENT_ID``) and ``_logged_before`` decides from the log."""
        ids = self.fold.event_ids
        if len(events) == 1:  # most appends: no generator (an empty id is never a kept one)
            return events[0].event_id in ids
        return not ids.keys().isdisjoint(e.event_id for e in events)

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
                reason=Reason.IDEMPOTENCY_MISMATCH,
            )
        seqs = [logged[i] for i in ids]
        stored = await self._store.read_seqs(self.session_id, seqs, tenant=self.tenant)
        for index, (sent, kept) in enumerate(zip(events, stored, strict=True)):
            if not _same_content(sent, kept):
                raise InvalidArgument(
                    f"event_id {sent.event_id!r} is already in the log with different content",
                    violations=[FieldViolation(f"events[{index}].event_id", "reused id")],
                    reason=Reason.IDEMPOTENCY_MISMATCH,
                )
        return AppendResult(seqs, self.fold.revision, replayed=True)


def retrieve_outcome(future: asyncio.Future[Any]) -> None:
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
    if size is None:  # ``map`` of the unbound method: no generator frame per event
        size = sum(map(events_pb2.SessionEvent.ByteSize, events))
    return size >= OFFLOAD_BYTES


def _run_jobs(jobs: Sequence[Callable[[], None]]) -> None:
    for job in jobs:
        try:
            job()
        except Exception:  # the preparers count on their own: never fail a commit
            log.exception("counting a batch's texts ahead of its commit failed")


def _stale_fold(error: Exception) -> bool:
    """Whether the store refused a batch because another replica appended first."""
    if isinstance(error, SeqConflict):
        return "first_seq" in error.metadata  # the store's check, not ``expected_last_seq``
    return _duplicate_ids(error)


def _duplicate_ids(error: Exception) -> TypeGuard[InvalidArgument]:
    """Whether the store refused a batch for event ids already in the log."""
    return isinstance(error, InvalidArgument) and error.reason == Reason.DUPLICATE_EVENT_ID


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
