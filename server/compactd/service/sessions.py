"""Sessions in memory: each session's fold, kept in step with its durable log.

A ``SessionManager`` restores a session from the store on first use (appending
``session/end-seed``: a new lifecycle begins, so brackets left open by a dead process become
stale evidence), then keeps its ``SessionFold`` current as batches commit. Appends to one session
are serialized by its lock; the store shares commits across sessions (group commit).

Tenancy lives here, as a key: a session is (tenant, id), the tenant being the caller's
(``compactd.tenancy.current_tenant``) unless one is named. Another tenant's session is simply not
there (NotFound), so nothing past the manager needs to know tenants exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from compactd.core.fold import AdmittedBatch, SessionFold
from compactd.core.limits import DEFAULT_LIMITS, AppendLimits
from compactd.core.validation import Origin, check_batch
from compactd.errors import (
    AlreadyExists,
    ConfigError,
    FieldViolation,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    SeqConflict,
)
from compactd.service.quotas import QuotaBook, Reservation
from compactd.store.base import EventStore, SessionRecord, StoreUsage, session_not_found
from compactd.tenancy import Tenant, current_tenant
from compactd.v1 import events_pb2

log = logging.getLogger(__name__)

Observer = Callable[[SessionFold, AdmittedBatch], None]
_Key = tuple[str, str]  # (tenant id, session id)


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
    ) -> None:
        self.session_id = record.session_id
        self.tenant = record.tenant
        self.deleted = False  # set (under the lock) by ``SessionManager.delete``
        self._quotas = quotas
        self.limits = limits
        self.record = record
        self.fold = fold
        self.policy_overrides: dict[str, object] | None = (
            json.loads(record.policy_json) if record.policy_json else None
        )
        self.extensions: dict[str, object] = {}
        self.lock = asyncio.Lock()
        # The committed revision: ``fold.revision`` also counts a batch admitted but not yet
        # durable, which readers that do not hold the lock must never see.
        self.revision = fold.revision
        self._store = store
        self._observers: list[Observer] = []
        self._changed = asyncio.Condition()

    def add_observer(self, observer: Observer) -> None:
        """Call ``observer(fold, batch)`` after every batch commits (while the lock is held)."""
        self._observers.append(observer)

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
        check_batch(events, max_events=max_events, origin=origin, limits=self.limits)
        async with self.lock:
            return await self.append_locked(
                events, expected_last_seq=expected_last_seq, origin=origin
            )

    async def append_locked(
        self,
        events: Sequence[events_pb2.SessionEvent],
        *,
        expected_last_seq: int | None = None,
        origin: Origin = Origin.SERVER,
    ) -> AppendResult:
        """``append`` for a caller that already holds ``self.lock`` (the compaction engine)."""
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
        now.GetCurrentTime()
        batch = self.fold.admit(
            events, now=now, origin=origin, max_surface_bytes=self.limits.max_surface_bytes
        )
        reservation = self._reserve_bytes(batch, origin)
        commit = asyncio.ensure_future(self._commit(batch, reservation))
        try:
            return await asyncio.shield(commit)
        except asyncio.CancelledError:
            # The caller went away, but the store may still commit the batch: finish the commit
            # (or its rollback) before the lock is released, so the fold never leaves the log.
            await asyncio.wait([commit])
            raise

    def _reserve_bytes(self, batch: AdmittedBatch, origin: Origin) -> Reservation | None:
        """Count the batch's bytes against the tenant's quota; only a runtime's is refused."""
        if self._quotas is None:
            return None
        size = sum(event.ByteSize() for event in batch.events)
        try:
            return self._quotas.reserve_bytes(
                size, enforce=origin is Origin.CLIENT, tenant=self.tenant
            )
        except QuotaExceeded:
            self.fold.rollback(batch)
            raise

    async def _commit(self, batch: AdmittedBatch, reservation: Reservation | None) -> AppendResult:
        try:
            await self._store.append(self.session_id, batch.events, tenant=self.tenant)
        except BaseException:
            self.fold.rollback(batch)
            if reservation is not None:
                reservation.release()
            raise
        self.revision = self.fold.revision
        for observer in self._observers:
            observer(self.fold, batch)
        await self._notify()
        return AppendResult([e.seq for e in batch.events], self.fold.revision)

    async def revisions(self) -> AsyncIterator[int]:
        """Yield the committed revision now, then the latest one after each commit (coalesced).

        Raises:
            NotFound: once the session is deleted (a follower's stream ends with it).
        """
        seen = -1
        while True:
            async with self._changed:
                await self._changed.wait_for(partial(self._moved_past, seen))
                if self.deleted:
                    raise session_not_found(self.session_id)
                seen = self.revision
            yield seen

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
        async with self._changed:
            self._changed.notify_all()

    async def _replayed(self, events: Sequence[events_pb2.SessionEvent]) -> AppendResult | None:
        """The original result when this batch was already committed (a retried batch)."""
        ids = [e.event_id for e in events]
        known = [i for i in ids if i in self.fold.event_ids]
        if not known:
            return None
        if len(known) != len(ids):
            raise InvalidArgument(
                "a batch mixes events already in the log with new ones",
                violations=[FieldViolation("events", "retry the original batch unchanged")],
                reason="IDEMPOTENCY_MISMATCH",
            )
        seqs = [self.fold.event_ids[i] for i in ids]
        stored = await self._store.read_seqs(self.session_id, seqs, tenant=self.tenant)
        for index, (sent, kept) in enumerate(zip(events, stored, strict=True)):
            if not _same_content(sent, kept):
                raise InvalidArgument(
                    f"event_id {sent.event_id!r} is already in the log with different content",
                    violations=[FieldViolation(f"events[{index}].event_id", "reused id")],
                    reason="IDEMPOTENCY_MISMATCH",
                )
        return AppendResult(seqs, self.fold.revision, replayed=True)


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


class SessionManager:
    """Creates sessions and restores them from the store, once per process."""

    def __init__(
        self,
        store: EventStore,
        *,
        instance_id: str | None = None,
        policy_validator: Callable[[Mapping[str, Any]], object] | None = None,
        limits: AppendLimits = DEFAULT_LIMITS,
        quotas: QuotaBook | None = None,
    ) -> None:
        self.store = store
        self.limits = limits
        self.quotas = quotas
        self._policy_validator = policy_validator
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        self._handles: dict[_Key, SessionHandle] = {}
        self._loading: dict[_Key, asyncio.Future[SessionHandle]] = {}
        self._on_restore: list[Callable[[SessionHandle], None]] = []

    @property
    def resident(self) -> int:
        """How many sessions are held in memory (the live-sessions gauge)."""
        return len(self._handles)

    def on_restore(self, callback: Callable[[SessionHandle], None]) -> None:
        """Call ``callback(handle)`` for every session restored from now on."""
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

    async def get(self, session_id: str, *, tenant: Tenant | None = None) -> SessionHandle:
        """The session's handle, restoring it from the log on first use.

        Raises:
            NotFound: No session ``session_id`` of ``tenant`` (the caller's by default).
        """
        key = (_tenant_id(tenant), session_id)
        handle = self._handles.get(key)
        if handle is not None:
            return handle
        # One restore per session however many callers arrive (and none left behind for ids
        # that do not exist); a caller that goes away does not cancel it for the others.
        restoring = self._loading.get(key)
        if restoring is None:
            restoring = asyncio.ensure_future(self._restore_once(key))
            self._loading[key] = restoring
            restoring.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(restoring)

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
        handle = self._handles.get(key)
        async with handle.lock if handle is not None else contextlib.nullcontext():
            if idle_before is not None and not await self._idle(key, idle_before):
                return False
            held = await self._held_by(key)
            deleted = await self.store.delete_session(session_id, tenant=key[0])
            if handle is not None:
                await handle.mark_deleted()
                self._handles.pop(key, None)
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

    async def _restore_once(self, key: _Key) -> SessionHandle:
        handle = await self._restore(*key)
        self._handles[key] = handle
        return handle

    async def _restore(self, tenant: str, session_id: str) -> SessionHandle:
        record = await self.store.get_session(session_id, tenant=tenant)
        if record is None:
            raise NotFound(
                f"session {session_id!r} does not exist", metadata={"session_id": session_id}
            )
        fold = SessionFold()
        chunk: list[events_pb2.SessionEvent] = []
        async for event in self.store.read(session_id, tenant=tenant):
            chunk.append(event)
            if len(chunk) >= 512:
                fold.admit(chunk, check=False)
                chunk = []
        if chunk:
            fold.admit(chunk, check=False)
        handle = SessionHandle(record, self.store, fold, self.limits, self.quotas)
        if fold.revision:
            # A new lifecycle: brackets opened by an earlier process become stale evidence.
            seed = events_pb2.SessionEvent(
                session_end_seed=events_pb2.SessionEndSeed(
                    reason="restore", instance_id=self.instance_id
                )
            )
            result = await handle.append([seed])
            fold.restored_at = result.seqs[0]
            log.info(
                "session restored", extra={"session_id": session_id, "revision": fold.revision}
            )
        for callback in self._on_restore:
            callback(handle)
        return handle

    async def close(self) -> None:
        """Forget every handle (the store is closed by its owner)."""
        self._handles.clear()


def _tenant_id(tenant: Tenant | None) -> str:
    return (tenant or current_tenant()).id
