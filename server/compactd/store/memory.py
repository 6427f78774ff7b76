"""An in-memory :class:`EventStore` with the same semantics as the durable ones.

A first-class fake for fast tests and for running the service without a disk. It keeps the
serialized bytes (so callers that mutate their messages later cannot change the log) and applies
each batch under one lock, all checks first, so a failing batch leaves nothing. "Durable" here
means "visible to every later call on this instance".
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from compactd.store import base
from compactd.store.base import DEFAULT_TENANT_ID
from compactd.store.candidates import ProcessCandidates
from compactd.store.leases import Lease, LeaseOp, ProcessLeases
from compactd.v1 import events_pb2

_Key = tuple[str, str]  # (tenant, session id)


@dataclass
class _Session:
    record: base.SessionRecord
    rows: list[base.EventRow] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    snapshot: tuple[int, bytes] | None = None


class MemoryEventStore(base.EventStore):
    """Keeps every session log in process memory.

    Args:
        clock: Source of session creation times.
        read_chunk: Events a read yields between giving the event loop a turn.
    """

    def __init__(self, *, clock: base.Clock = base.utc_now, read_chunk: int = 256) -> None:
        self._clock = clock
        self._read_chunk = read_chunk
        self._sessions: dict[_Key, _Session] = {}
        self._lock = threading.Lock()
        self._open = False
        self._stats = base.StoreStats()
        self._leases = ProcessLeases(clock)
        self._candidate_table = ProcessCandidates(clock)

    async def open(self) -> None:
        self._open = True

    async def close(self) -> None:
        self._open = False

    @property
    def stats(self) -> base.StoreStats:
        return self._stats

    async def create_session(
        self,
        session_id: str,
        policy_json: str | None,
        *,
        tenant: str = DEFAULT_TENANT_ID,
        parent: str = "",
        fork_at_seq: int | None = None,
    ) -> base.SessionRecord:
        self._check_open()
        with self._lock:
            if (tenant, session_id) in self._sessions:
                raise base.session_exists(session_id)
            now = self._clock()
            record = base.SessionRecord(
                session_id, now, policy_json, 0, tenant, now, parent, fork_at_seq
            )
            self._sessions[tenant, session_id] = _Session(record)
            self._count(commits=1)
        return record

    async def get_session(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> base.SessionRecord | None:
        self._check_open()
        with self._lock:
            session = self._sessions.get((tenant, session_id))
            return None if session is None else session.record

    async def list_sessions(
        self,
        *,
        after: str = "",
        limit: int = 100,
        tenant: str = DEFAULT_TENANT_ID,
        parent: str | None = None,
    ) -> list[base.SessionRecord]:
        self._check_open()
        base.check_limit(limit)
        with self._lock:
            ids = sorted(
                i
                for (t, i), s in self._sessions.items()
                if t == tenant and i > after and parent in (None, s.record.parent_session_id)
            )
            return [self._sessions[tenant, i].record for i in ids[:limit]]

    async def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID) -> bool:
        self._check_open()
        with self._lock:
            gone = self._sessions.pop((tenant, session_id), None)
            self._leases.forget((tenant, session_id))
            self._candidates.forget((tenant, session_id))
            if gone is not None:
                self._count(commits=1)
            return gone is not None

    async def usage(
        self, *, tenant: str | None = None, session_id: str | None = None
    ) -> dict[str, base.StoreUsage]:
        self._check_open()
        found: dict[str, base.StoreUsage] = {}
        with self._lock:
            for (owner, sid), session in self._sessions.items():
                if (tenant is not None and owner != tenant) or (
                    session_id is not None and sid != session_id
                ):
                    continue
                held = found.get(owner, base.StoreUsage())
                size = sum(len(row.data) for row in session.rows)
                found[owner] = base.StoreUsage(held.sessions + 1, held.bytes + size)
        return found

    async def append(
        self,
        session_id: str,
        events: Sequence[events_pb2.SessionEvent],
        *,
        tenant: str = DEFAULT_TENANT_ID,
        lease: LeaseOp | None = None,
        rows: Sequence[base.EventRow] | None = None,
    ) -> int:
        self._check_open()
        rows = base.encode_batch(events) if rows is None else list(rows)
        with self._lock:
            try:
                session = self._session(tenant, session_id)
                self._check_continues(session, rows)
                self._leases.apply((tenant, session_id), lease)  # last: nothing below can fail
            except Exception:
                self._count(batches=1, failed_batches=1)
                raise
            for row in rows:
                session.rows.append(row)
                if row.event_id is not None:
                    session.ids[row.event_id] = row.seq
            session.record = dataclasses.replace(
                session.record,
                revision=len(session.rows),
                update_time=self._clock() if rows else session.record.update_time,
            )
            self._count(commits=1, batches=1, events=len(rows))
            return len(session.rows)

    async def read(
        self,
        session_id: str,
        from_seq: int = 0,
        to_seq: int | None = None,
        *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> AsyncIterator[events_pb2.SessionEvent]:
        self._check_open()
        base.check_read_range(from_seq, to_seq)
        with self._lock:
            rows = self._session(tenant, session_id).rows
            end = len(rows) if to_seq is None else min(to_seq, len(rows))
        for start in range(from_seq, end, self._read_chunk):
            # Rows are only ever appended, so indexes below `end` are stable without the lock.
            for row in rows[start : min(start + self._read_chunk, end)]:
                yield base.decode_event(row.data)
            await asyncio.sleep(0)

    async def read_seqs(
        self, session_id: str, seqs: Sequence[int], *, tenant: str = DEFAULT_TENANT_ID
    ) -> list[events_pb2.SessionEvent]:
        self._check_open()
        with self._lock:
            rows = self._session(tenant, session_id).rows
            wanted = sorted({s for s in seqs if 0 <= s < len(rows)})
            return [base.decode_event(rows[s].data) for s in wanted]

    async def read_stored(
        self, session_id: str, seqs: Sequence[int], *, tenant: str = DEFAULT_TENANT_ID
    ) -> dict[int, bytes]:
        self._check_open()
        with self._lock:
            rows = self._session(tenant, session_id).rows
            return {s: rows[s].data for s in sorted(set(seqs)) if 0 <= s < len(rows)}

    async def find_event_ids(
        self, session_id: str, event_ids: Sequence[str], *, tenant: str = DEFAULT_TENANT_ID
    ) -> dict[str, int]:
        self._check_open()
        with self._lock:
            ids = self._session(tenant, session_id).ids
            return {i: ids[i] for i in event_ids if i in ids}

    async def get_lease(self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID) -> Lease | None:
        self._check_open()
        return self._leases.get((tenant, session_id))

    async def renew_lease(
        self,
        session_id: str,
        owner: str,
        token: str,
        ttl_s: float,
        *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:
        self._check_open()
        return self._leases.renew((tenant, session_id), owner, token, ttl_s)

    async def put_snapshot(
        self, session_id: str, revision: int, data: bytes, *, tenant: str = DEFAULT_TENANT_ID
    ) -> None:
        self._check_open()
        with self._lock:
            self._session(tenant, session_id).snapshot = (revision, bytes(data))

    async def get_snapshot(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> tuple[int, bytes] | None:
        self._check_open()
        with self._lock:
            session = self._sessions.get((tenant, session_id))
            return None if session is None else session.snapshot

    def _session(self, tenant: str, session_id: str) -> _Session:
        session = self._sessions.get((tenant, session_id))
        if session is None:
            raise base.session_not_found(session_id)
        return session

    def _check_continues(self, session: _Session, rows: Sequence[base.EventRow]) -> None:
        session_id = session.record.session_id
        if rows and rows[0].seq != len(session.rows):
            raise base.seq_conflict(session_id, rows[0].seq, len(session.rows))
        taken = [r.event_id for r in rows if r.event_id is not None and r.event_id in session.ids]
        if taken:
            raise base.duplicate_event_ids(session_id, taken)

    def _check_open(self) -> None:
        if not self._open:
            raise base.store_closed()

    def _count(self, **increments: int) -> None:
        self._stats = self._stats.plus(**increments)
