"""``SessionManager``: creates sessions, restores them on first use, deletes them.

Tenancy lives here, as a key: a session is (tenant, id), the tenant being the caller's
(``compactd.tenancy.current_tenant``) unless one is named. Another tenant's session is simply not
there (NotFound), so nothing past the manager needs to know tenants exist. Restoring is
``sessions.restore``'s, keeping sessions in memory ``sessions.residency``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from compactd.core.limits import DEFAULT_LIMITS, AppendLimits
from compactd.errors import (
    AlreadyExists,
    ConfigError,
    FieldViolation,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
)
from compactd.reasons import Reason
from compactd.service.quotas import QuotaBook
from compactd.service.replicas import ChangeListener
from compactd.service.sessions.handle import Key, SessionHandle, retrieve_outcome
from compactd.service.sessions.residency import Residency
from compactd.service.sessions.restore import (
    ContextBuilder,
    fold_tail,
    from_snapshot,
    metered_context,
)
from compactd.store.base import EventStore, SessionRecord, StoreUsage, session_not_found
from compactd.tenancy import Tenant, current_tenant
from compactd.v1 import events_pb2


@dataclass(frozen=True)
class Lineage:
    """A new session's parent (empty: a top-level session) and the parent seq it is forked at
    (None: not forked)."""

    parent: str = ""
    fork_at_seq: int | None = None


@dataclass(frozen=True)
class _Made:
    """What one ``create`` asks for: a retried create must ask for the same."""

    owner: str
    session_id: str
    policy_json: str | None
    lineage: Lineage

    def matches(self, record: SessionRecord) -> bool:
        return (record.policy_json, record.parent_session_id, record.fork_at_seq) == (
            self.policy_json,
            self.lineage.parent,
            self.lineage.fork_at_seq,
        )


log = logging.getLogger(__name__)


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
        self.quotas = quotas
        self._policy_validator = policy_validator
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        self.residency = Residency(
            store,
            self.instance_id,
            snapshot_interval=snapshot_interval,
            max_resident=max_resident,
        )
        self._contexts: ContextBuilder = metered_context
        self._loading: dict[Key, asyncio.Future[SessionHandle]] = {}
        self._on_restore: list[Callable[[SessionHandle], Awaitable[None] | None]] = []
        self._stopping = False  # ``end_streams`` was called
        self._listener = ChangeListener(
            store,
            lambda tenant, session_id: self.residency.handles.get((tenant, session_id)),
            self.residency.handles.values,
        )

    def start(self) -> None:
        """Begin following other replicas' appends (a shared store; call on the event loop)."""
        self._listener.start()

    @property
    def resident(self) -> int:
        """How many sessions are held in memory (the live-sessions gauge)."""
        return self.residency.resident

    @property
    def evictions(self) -> int:
        """How many sessions this manager evicted."""
        return self.residency.evictions

    def build_contexts(self, builder: ContextBuilder) -> None:
        """Build every session restored from now on a context with ``builder`` (default:
        ``metered_context``). An evicted session's memory is handed to its next context, as if
        it had never left."""
        self._contexts = builder

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
                reason=Reason.POLICY_INVALID,
            ) from error

    async def create(
        self,
        session_id: str,
        policy: dict[str, object] | None,
        *,
        tenant: Tenant | None = None,
        lineage: Lineage = Lineage(),
    ) -> SessionRecord:
        """Create an empty session of ``tenant`` (the caller's by default), idempotently; a
        child of ``lineage.parent`` (checked by the caller: ``service.forking``) when set.

        A retried create (the same id, policy and lineage; a reply may have been lost) answers
        the session as it is now. ``AlreadyExists`` when the id is taken with another policy or
        lineage; ``QuotaExceeded`` when the caller's tenant owns its ``max_sessions`` already.
        """
        owner = _tenant_id(tenant)
        policy_json = json.dumps(policy, sort_keys=True) if policy else None
        made = _Made(owner, session_id, policy_json, lineage)
        if self.quotas is None:
            return await self._create(made, lambda: None)
        try:
            not_created = self.quotas.reserve_session(owner)
        except QuotaExceeded:
            # At the quota, a retried create still answers the session it created.
            existing = await self.store.get_session(session_id, tenant=owner)
            if existing is not None and made.matches(existing):
                return existing
            raise
        try:
            return await self._create(made, not_created)
        except BaseException:
            not_created()
            raise

    async def _create(self, made: _Made, not_created: Callable[[], None]) -> SessionRecord:
        session_id, lineage = made.session_id, made.lineage
        try:
            return await self.store.create_session(
                session_id,
                made.policy_json,
                tenant=made.owner,
                parent=lineage.parent,
                fork_at_seq=lineage.fork_at_seq,
            )
        except AlreadyExists:
            not_created()
            existing = await self.store.get_session(session_id, tenant=made.owner)
            if existing is None or not made.matches(existing):
                raise AlreadyExists(
                    f"session {session_id!r} already exists with a different compaction_policy "
                    "or parent",
                    metadata={"session_id": session_id},
                ) from None
            return existing

    def in_memory(self, session_id: str, *, tenant: Tenant | None = None) -> SessionHandle | None:
        """The session's handle when it is in memory: what ``get(fresh=False)`` answers then,
        without a coroutine (None: ``get`` restores it, or says it does not exist)."""
        return self.residency.find((_tenant_id(tenant), session_id))

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
        handle = self.residency.find(key)
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
            restoring.add_done_callback(retrieve_outcome)  # its callers may all have gone
        return await asyncio.shield(restoring)

    async def _caught_up(self, key: Key, handle: SessionHandle) -> SessionHandle | None:
        """The handle with its fold caught up; None when another replica deleted its session
        (the handle is dropped, so a session created anew under the id is restored fresh)."""
        try:
            async with handle.lock:
                pass
        except NotFound:
            if not handle.deleted:
                raise
            self.residency.drop(key, handle)
            return None
        return handle

    async def list(
        self,
        *,
        after: str = "",
        limit: int = 100,
        tenant: Tenant | None = None,
        parent: str | None = None,
    ) -> list[SessionRecord]:
        """Up to ``limit`` of the tenant's sessions after the id ``after``, in id order; with
        ``parent``, that session's children only."""
        return await self.store.list_sessions(
            after=after, limit=limit, tenant=_tenant_id(tenant), parent=parent
        )

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
        handle = self.residency.held(key)
        async with handle.lock if handle is not None else contextlib.nullcontext():
            if idle_before is not None and not await self._idle(key, idle_before):
                return False
            held = await self._held_by(key)
            deleted = await self.store.delete_session(session_id, tenant=key[0])
            if handle is not None:
                await handle.mark_deleted()
            self.residency.forget(key)
        if not deleted:
            raise session_not_found(session_id)
        if self.quotas is not None and held is not None:
            self.quotas.removed(key[0], held)
        log.info("session deleted", extra={"session_id": session_id, "tenant": key[0]})
        return True

    async def _held_by(self, key: Key) -> StoreUsage | None:
        """What the session counts towards its tenant's held quotas (None: nothing counted)."""
        if self.quotas is None or not self.quotas.ledger.counts_stored:
            return None
        usage = await self.store.usage(tenant=key[0], session_id=key[1])
        return usage.get(key[0], StoreUsage())

    async def _idle(self, key: Key, before: datetime) -> bool:
        record = await self.store.get_session(key[1], tenant=key[0])
        return record is None or record.last_active < before

    async def _restore_once(self, key: Key) -> SessionHandle:
        handle = await self._restore(*key)
        self.residency.keep(handle)
        return handle

    async def _restore(self, tenant: str, session_id: str) -> SessionHandle:
        record = await self.store.get_session(session_id, tenant=tenant)
        if record is None:
            raise session_not_found(session_id)
        fold, restored, same_lifecycle = await from_snapshot(self.store, record, self.instance_id)
        handle = SessionHandle(
            record, self.store, fold, self.limits, self.quotas, owner=self.instance_id,
            lease_s=self.lease_s,
        )  # fmt: skip
        handle.stopping = self._stopping
        handle.context = self._contexts(handle, restored, self.residency.carried(handle.key))
        handle.snapshot_revision = fold.revision if restored is not None else 0
        self.residency.follow(handle)
        same_lifecycle = same_lifecycle or handle.key in self.residency.evicted
        for callback in self._on_restore:
            pending = callback(handle)
            if pending is not None:
                await pending
        await fold_tail(handle)
        if self.store.shared:
            # Other replicas serve this session too: a restore is no new lifecycle. A bracket
            # whose owner died is taken over once its lease expired (``catch_up_locked``).
            async with handle.lock:
                pass
        elif handle.fold.revision and not same_lifecycle:
            await self._new_lifecycle(handle)
        return handle

    async def _new_lifecycle(self, handle: SessionHandle) -> None:
        """Append ``session/end-seed``: brackets opened by an earlier process become stale
        evidence."""
        seed = events_pb2.SessionEvent(
            session_end_seed=events_pb2.SessionEndSeed(
                reason="restore", instance_id=self.instance_id
            )
        )
        result = await handle.append([seed])
        handle.fold.restored_at = result.seqs[0]
        log.info(
            "session restored",
            extra={"session_id": handle.session_id, "revision": handle.fold.revision},
        )

    # ---- residency ---------------------------------------------------------------------------

    async def snapshot(self, handle: SessionHandle) -> None:
        """Write the session's fold snapshot now (see ``Residency.snapshot``)."""
        await self.residency.snapshot(handle)

    async def evict(self, session_id: str, *, tenant: Tenant | None = None) -> bool:
        """Snapshot the session and drop it from memory if it is idle (False: in use, or not
        resident). The next ``get`` restores it, in the same lifecycle."""
        return await self.residency.evict((_tenant_id(tenant), session_id))

    async def end_streams(self) -> None:
        """End every stream that follows a session's revisions (``revisions``), now and for
        sessions restored from here on: the server is stopping, and a follower would otherwise
        hold its stream for the whole grace period, then lose it without a reason."""
        self._stopping = True
        for handle in self.residency.held_handles():
            await handle.end_streams()

    async def close(self) -> None:
        """Finish snapshots under way, then forget every handle (the store is closed by its
        owner)."""
        await self.residency.close()
        await self._listener.stop()


def _tenant_id(tenant: Tenant | None) -> str:
    return (tenant or current_tenant()).id
