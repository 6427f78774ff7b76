"""The PostgreSQL :class:`EventStore`: one database shared by every replica.

Writes: each append is one transaction that locks its session row (``SELECT ... FOR UPDATE``),
checks that the batch continues the log at the row's revision, checks and applies the bracket
lease the batch carries (``store.leases``), inserts the rows, moves the revision and queues a
``NOTIFY``. The row lock is what makes seqs gapless and unique across replicas (a sequence would
leave gaps on rollback) and ``expected_last_seq`` / the compaction lock atomic: whatever a replica
decided from the revision it saw holds only if nobody appended since, and the lock proves it.
Nothing is acknowledged before COMMIT returns.

Reads: single statements on pooled connections (autocommit), each seeing committed rows only.

Every connection runs with a statement timeout, a lock timeout and an idle-in-transaction
timeout; the pool is bounded and a call that cannot get a connection in time fails. Those bound
what the server does; a database that stops answering altogether (a partition, a host that is
gone) answers nothing, so every operation is also bounded here, by the pool timeout plus the
statement timeout and by what is left of the call's deadline (``compactd.deadlines``): past it
the operation is abandoned (its connection is closed and replaced in the background). Any database
failure surfaces as ``StoreUnavailable`` (gRPC UNAVAILABLE); the pool replaces broken
connections, so calls recover once the database answers again. Nothing was written, except
that an append abandoned while its COMMIT was in flight may have landed: a retry with the same
event ids finds it (``AppendEvents`` dedup), and every replica's fold catches up from the log.

Change notifications: a dedicated connection ``LISTEN``s on ``compactd_events``; each append's
``NOTIFY`` carries this store's origin token and the session id, so a replica learns of other
replicas' appends (a wake-up only: it catches up by seq).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import psycopg
import psycopg.conninfo
import psycopg_pool
from psycopg.rows import TupleRow

from compactd import deadlines, errors
from compactd.reasons import Reason
from compactd.store import base, postgres_schema
from compactd.store.base import DEFAULT_TENANT_ID, SessionKey
from compactd.store.candidates import Candidate, CandidateClaim
from compactd.store.leases import Lease, LeaseAction, LeaseOp, apply
from compactd.v1 import events_pb2

log = logging.getLogger(__name__)

CHANNEL: Final = "compactd_events"
_SESSION_COLUMNS = (
    "session_id, create_time, policy_json, revision, tenant, update_time, parent_id, fork_at_seq"
)

Conn = psycopg.AsyncConnection[TupleRow]

# Taken from a call's remaining time, so its answer reaches the caller before the deadline.
_ANSWER_MARGIN_S: Final = 0.1

T = TypeVar("T")
P = ParamSpec("P")


def _bounded(
    action: str,
) -> Callable[
    [Callable[Concatenate[PostgresEventStore, P], Coroutine[Any, Any, T]]],
    Callable[Concatenate[PostgresEventStore, P], Coroutine[Any, Any, T]],
]:
    """Bound a store method by ``PostgresEventStore.budget_s`` (``_within_budget``)."""

    def wrap(
        method: Callable[Concatenate[PostgresEventStore, P], Coroutine[Any, Any, T]],
    ) -> Callable[Concatenate[PostgresEventStore, P], Coroutine[Any, Any, T]]:
        @functools.wraps(method)
        async def bounded(store: PostgresEventStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
            return await store._within_budget(action, method(store, *args, **kwargs))

        return bounded

    return wrap


def _abandon(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and let it end alone, its outcome retrieved (nobody waits for it)."""
    task.cancel()
    task.add_done_callback(lambda done: None if done.cancelled() else done.exception())


#: Events ``read_seqs`` fetches per query (a restore asks for a whole surface's).
SEQS_PER_READ: Final = 4096


class PostgresEventStore(base.EventStore):
    """Keeps session logs in one PostgreSQL database that many replicas share.

    Args:
        url: A libpq URL (``postgresql://user@host:port/db``).
        pool_min: Connections kept open.
        pool_max: Most connections at once (per replica: size the database's
            ``max_connections`` for all replicas).
        statement_timeout_ms: Longest a statement may run (also the lock timeout).
        connect_timeout_s: Longest ``open`` and a call wait for a connection.
        read_chunk: Events fetched per round trip while streaming a read.
        migrate: Apply pending migrations at ``open`` (``serve --migrate``); otherwise an older
            schema is refused.
        clock: Source of session creation times.
    """

    def __init__(
        self,
        url: str,
        *,
        pool_min: int = 1,
        pool_max: int = 8,
        statement_timeout_ms: int = 5000,
        connect_timeout_s: float = 5.0,
        read_chunk: int = 256,
        migrate: bool = False,
        clock: base.Clock = base.utc_now,
    ) -> None:
        self._url = url
        self._pool_min = pool_min
        self._pool_max = pool_max
        self._statement_timeout_ms = statement_timeout_ms
        self._connect_timeout_s = connect_timeout_s
        self._read_chunk = read_chunk
        self._migrate = migrate
        self._clock = clock
        self._pool: psycopg_pool.AsyncConnectionPool[Conn] | None = None
        self._lifecycle = asyncio.Lock()
        self._stats = base.StoreStats()
        # Tags this store's NOTIFYs so its own appends do not wake itself.
        self.origin = uuid.uuid4().hex[:12]
        self.schema_version = 0

    @property
    def shared(self) -> bool:
        return True

    @property
    def stats(self) -> base.StoreStats:
        return self._stats

    def _options(self) -> str:
        """libpq ``options``: the URL's own (a search path, say), then our timeouts."""
        ms = int(self._statement_timeout_ms)
        ours = (
            f"-c statement_timeout={ms} -c lock_timeout={ms} "
            f"-c idle_in_transaction_session_timeout={max(ms * 4, 10_000)}"
        )
        given = psycopg.conninfo.conninfo_to_dict(self._url).get("options")
        return f"{given} {ours}" if given else ours

    async def open(self) -> None:
        """Connect the pool and check (or create, or migrate) the schema.

        Raises:
            StartupError: The database cannot be reached (``STORE_UNAVAILABLE``) or its schema
                is older (``SCHEMA_TOO_OLD``) or newer (``SCHEMA_TOO_NEW``) than this server's.
        """
        async with self._lifecycle:
            if self._pool is not None:
                return
            pool: psycopg_pool.AsyncConnectionPool[Conn] = psycopg_pool.AsyncConnectionPool(
                self._url,
                min_size=self._pool_min,
                max_size=self._pool_max,
                timeout=self._connect_timeout_s,
                kwargs={
                    "autocommit": True,
                    "options": self._options(),
                    "connect_timeout": max(math.ceil(self._connect_timeout_s), 1),
                },
                check=psycopg_pool.AsyncConnectionPool.check_connection,
                open=False,
                name="compactd",
            )
            try:
                await pool.open(wait=True, timeout=self._connect_timeout_s)
                async with pool.connection() as conn:
                    self.schema_version = await postgres_schema.check(conn, apply=self._migrate)
            except (psycopg.Error, psycopg_pool.PoolTimeout) as error:
                await pool.close()
                raise errors.StartupError(
                    f"cannot open the PostgreSQL store {_redacted(self._url)}: {error}",
                    reason=Reason.STORE_UNAVAILABLE,
                ) from None
            except BaseException:
                await pool.close()
                raise
            self._pool = pool

    async def close(self) -> None:
        async with self._lifecycle:
            pool, self._pool = self._pool, None
            if pool is not None:
                await pool.close()

    # --- sessions -------------------------------------------------------------------------------

    @_bounded("create a session")
    async def create_session(
        self,
        session_id: str,
        policy_json: str | None,
        *,
        tenant: str = DEFAULT_TENANT_ID,
        parent: str = "",
        fork_at_seq: int | None = None,
    ) -> base.SessionRecord:
        now = self._clock()
        record = base.SessionRecord(
            session_id, now, policy_json, 0, tenant, now, parent, fork_at_seq
        )
        with _db_errors("create a session"):
            async with self._connection() as conn:
                try:
                    await conn.execute(
                        "INSERT INTO sessions (tenant, session_id, create_time, update_time,"
                        " policy_json, revision, parent_id, fork_at_seq)"
                        " VALUES (%s, %s, %s, %s, %s, 0, %s, %s)",
                        (tenant, session_id, now, now, policy_json, parent or None, fork_at_seq),
                    )
                except psycopg.errors.UniqueViolation:
                    raise base.session_exists(session_id) from None
        self._stats = self._stats.plus(commits=1)
        return record

    @_bounded("read a session")
    async def get_session(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> base.SessionRecord | None:
        with _db_errors("read a session"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE {_WHERE_KEY}",
                    (tenant, session_id),
                )
                row = await cursor.fetchone()
        return None if row is None else _record(row)

    @_bounded("list sessions")
    async def list_sessions(
        self,
        *,
        after: str = "",
        limit: int = 100,
        tenant: str = DEFAULT_TENANT_ID,
        parent: str | None = None,
    ) -> list[base.SessionRecord]:
        base.check_limit(limit)
        with _db_errors("list sessions"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE tenant = %s"
                    " AND session_id > %s AND (%s::text IS NULL OR parent_id = %s)"
                    " ORDER BY session_id LIMIT %s",
                    (tenant, after, parent, parent, limit),
                )
                rows = await cursor.fetchall()
        return [_record(row) for row in rows]

    @_bounded("delete a session")
    async def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID) -> bool:
        # One statement: the events and the snapshot go with the row (ON DELETE CASCADE), and
        # an append racing it either lands first (and is deleted) or finds no session.
        with _db_errors("delete a session"):
            async with self._connection() as conn, conn.transaction():
                cursor = await conn.execute(
                    f"DELETE FROM sessions WHERE {_WHERE_KEY}", (tenant, session_id)
                )
                deleted = cursor.rowcount > 0
                await self._notify(conn, tenant, session_id)
        self._stats = self._stats.plus(commits=1)
        return deleted

    # --- appends --------------------------------------------------------------------------------

    @_bounded("append")
    async def append(
        self,
        session_id: str,
        events: Sequence[events_pb2.SessionEvent],
        *,
        tenant: str = DEFAULT_TENANT_ID,
        lease: LeaseOp | None = None,
        rows: Sequence[base.EventRow] | None = None,
    ) -> int:
        rows = base.encode_batch(events) if rows is None else list(rows)
        key = SessionKey(tenant, session_id)
        queued = time.perf_counter()
        try:
            with _db_errors("append"):
                async with self._connection() as conn:
                    started = time.perf_counter()
                    # Pipeline mode: BEGIN rides with the row lock's SELECT, and the inserts,
                    # the revision, the NOTIFY and COMMIT go in one round trip.
                    async with conn.pipeline(), conn.transaction():
                        revision = await self._append_locked(conn, key, rows, lease)
                    committed = time.perf_counter()
        except Exception:
            self._stats = self._stats.plus(batches=1, failed_batches=1)
            raise
        self._stats = self._stats.plus(
            commits=1, batches=1, events=len(rows),
            commit_seconds=committed - started, queued_seconds=started - queued,
        )  # fmt: skip
        return revision

    async def _append_locked(
        self, conn: Conn, key: SessionKey, rows: list[base.EventRow], lease: LeaseOp | None
    ) -> int:
        """The append transaction's body: every check under the session's row lock."""
        session_id = key.session_id
        cursor = await conn.execute(
            "SELECT revision, lease_owner, lease_token, lease_expires, clock_timestamp()"
            f" FROM sessions WHERE {_WHERE_KEY} FOR UPDATE",
            key,
        )
        row = await cursor.fetchone()
        if row is None:
            raise base.session_not_found(session_id)
        revision, now = int(row[0]), row[4]
        if rows and rows[0].seq != revision:
            raise base.seq_conflict(session_id, rows[0].seq, revision)
        ids = [r.event_id for r in rows if r.event_id is not None]
        if ids:
            # Race-free: every insert into this session holds the row lock we hold.
            taken = await _select_event_ids(conn, key, ids)
            if taken:
                raise base.duplicate_event_ids(session_id, list(taken))
        if lease is not None:
            await _apply_lease(conn, key, _lease_of(row, now), lease, now)
        if not rows:
            return revision
        async with conn.cursor() as insert:
            await insert.executemany(
                "INSERT INTO events (tenant, session_id, seq, event_id, type, data)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                [(*key, r.seq, r.event_id, r.type, r.data) for r in rows],
            )
        new_revision = revision + len(rows)
        await conn.execute(
            f"UPDATE sessions SET revision = %s, update_time = %s WHERE {_WHERE_KEY}",
            (new_revision, self._clock(), *key),
        )
        await self._notify(conn, *key)
        return new_revision

    async def _notify(self, conn: Conn, tenant: str, session_id: str) -> None:
        # Delivered at COMMIT, never for a rolled-back transaction.
        payload = json.dumps([self.origin, tenant, session_id])
        await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))

    # --- reads ----------------------------------------------------------------------------------

    async def read(
        self,
        session_id: str,
        from_seq: int = 0,
        to_seq: int | None = None,
        *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> AsyncIterator[events_pb2.SessionEvent]:
        base.check_read_range(from_seq, to_seq)
        record = await self.get_session(session_id, tenant=tenant)
        if record is None:
            raise base.session_not_found(session_id)
        end = record.revision if to_seq is None else min(to_seq, record.revision)
        key = SessionKey(tenant, session_id)
        for start in range(from_seq, end, self._read_chunk):
            stop = min(start + self._read_chunk, end)
            for event in await self._select_range(key, start, stop):
                yield event

    @_bounded("read events")
    async def _select_range(
        self, key: SessionKey, start: int, stop: int
    ) -> list[events_pb2.SessionEvent]:
        with _db_errors("read events"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    f"SELECT data FROM events WHERE {_WHERE_KEY} AND seq >= %s AND seq < %s"
                    " ORDER BY seq",
                    (*key, start, stop),
                )
                rows = await cursor.fetchall()
        return [base.decode_event(row[0]) for row in rows]

    @_bounded("read events")
    async def read_seqs(
        self, session_id: str, seqs: Sequence[int], *, tenant: str = DEFAULT_TENANT_ID
    ) -> list[events_pb2.SessionEvent]:
        wanted = sorted({s for s in seqs if s >= 0})
        key = SessionKey(tenant, session_id)
        found: list[events_pb2.SessionEvent] = []
        with _db_errors("read events"):
            async with self._connection() as conn:
                await _require_session(conn, key)
                # A restore reads a whole surface (tens of thousands of events at
                # max_surface_bytes): fetched a bounded share at a time, parsed in a worker
                # thread, so that neither holds the event loop for long.
                for start in range(0, len(wanted), SEQS_PER_READ):
                    cursor = await conn.execute(
                        f"SELECT data FROM events WHERE {_WHERE_KEY} AND seq = ANY(%s)"
                        " ORDER BY seq",
                        (*key, wanted[start : start + SEQS_PER_READ]),
                    )
                    found += await asyncio.to_thread(_decoded, await cursor.fetchall())
        return found

    @_bounded("read event ids")
    async def find_event_ids(
        self, session_id: str, event_ids: Sequence[str], *, tenant: str = DEFAULT_TENANT_ID
    ) -> dict[str, int]:
        wanted = sorted({i for i in event_ids if i})
        key = SessionKey(tenant, session_id)
        with _db_errors("read event ids"):
            async with self._connection() as conn:
                await _require_session(conn, key)
                return await _select_event_ids(conn, key, wanted)

    @_bounded("count usage")
    async def usage(
        self, *, tenant: str | None = None, session_id: str | None = None
    ) -> dict[str, base.StoreUsage]:
        with _db_errors("count usage"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    "SELECT s.tenant, count(*), coalesce(sum(e.bytes), 0) FROM sessions s"
                    " LEFT JOIN (SELECT tenant, session_id, sum(octet_length(data)) AS bytes"
                    " FROM events GROUP BY tenant, session_id) e USING (tenant, session_id)"
                    " WHERE (%(tenant)s::text IS NULL OR s.tenant = %(tenant)s)"
                    " AND (%(session)s::text IS NULL OR s.session_id = %(session)s)"
                    " GROUP BY s.tenant",
                    {"tenant": tenant, "session": session_id},
                )
                rows = await cursor.fetchall()
        return {str(t): base.StoreUsage(int(n), int(b)) for t, n, b in rows}

    # --- the shared append rate (issue 15) ------------------------------------------------------

    @_bounded("take an append token")
    async def take_append_token(self, tenant: str, rate: float, burst: float) -> float | None:
        # One statement under the tenant's row lock: refill by the database's clock since the
        # last take, take a token if one is there, and say whether it did.
        with _db_errors("take an append token"):
            async with self._connection() as conn:
                params = {"tenant": tenant, "rate": float(rate), "burst": float(burst)}
                cursor = await conn.execute(_TAKE_TOKEN, params)
                row = await cursor.fetchone()
        assert row is not None  # an upsert always answers its row
        taken, tokens = bool(row[0]), float(row[1])
        return 0.0 if taken else (1.0 - tokens) / rate

    # --- fold snapshots (issue 11) ---------------------------------------------------------------

    @_bounded("write a snapshot")
    async def put_snapshot(
        self, session_id: str, revision: int, data: bytes, *, tenant: str = DEFAULT_TENANT_ID
    ) -> None:
        # One statement: atomic. Replicas may race to snapshot a session; the newest revision
        # wins, so a slow writer never replaces a newer snapshot with an older one.
        key = SessionKey(tenant, session_id)
        with _db_errors("write a snapshot"):
            async with self._connection() as conn:
                await _require_session(conn, key)
                await conn.execute(
                    "INSERT INTO snapshots (tenant, session_id, revision, data)"
                    " VALUES (%s, %s, %s, %s) ON CONFLICT (tenant, session_id) DO UPDATE"
                    " SET revision = EXCLUDED.revision, data = EXCLUDED.data"
                    " WHERE snapshots.revision <= EXCLUDED.revision",
                    (*key, revision, data),
                )

    @_bounded("read a snapshot")
    async def get_snapshot(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> tuple[int, bytes] | None:
        with _db_errors("read a snapshot"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    f"SELECT revision, data FROM snapshots WHERE {_WHERE_KEY}",
                    (tenant, session_id),
                )
                row = await cursor.fetchone()
        return None if row is None else (int(row[0]), bytes(row[1]))

    # --- prepared-ahead candidates (issue 35) -----------------------------------------------

    @_bounded("read a candidate")
    async def get_candidate(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> Candidate | None:
        with _db_errors("read a candidate"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    f"SELECT {_CANDIDATE_COLUMNS}, clock_timestamp() FROM candidates"
                    f" WHERE {_WHERE_KEY}",
                    (tenant, session_id),
                )
                row = await cursor.fetchone()
        return None if row is None else _candidate_of(row)

    @_bounded("claim a candidate")
    async def claim_candidate(
        self, session_id: str, claim: CandidateClaim, ttl_s: float, *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:  # fmt: skip
        # One statement: a candidate may be claimed over only once it is abandoned (its summary
        # not ready and its lease lapsed by the database's clock): ``candidates.may_claim``.
        with _db_errors("claim a candidate"):
            async with self._connection() as conn:
                await _require_session(conn, SessionKey(tenant, session_id))
                cursor = await conn.execute(
                    "INSERT INTO candidates AS c (tenant, session_id, candidate_id, owner, digest,"
                    " start_seq, end_seq, started, expires) VALUES (%s, %s, %s, %s, %s, %s, %s,"
                    " clock_timestamp(), clock_timestamp() + make_interval(secs => %s))"
                    " ON CONFLICT (tenant, session_id) DO UPDATE SET"
                    " candidate_id = EXCLUDED.candidate_id, owner = EXCLUDED.owner,"
                    " digest = EXCLUDED.digest, start_seq = EXCLUDED.start_seq,"
                    " end_seq = EXCLUDED.end_seq, started = EXCLUDED.started,"
                    " expires = EXCLUDED.expires, summary = NULL, ready = NULL"
                    " WHERE c.summary IS NULL AND c.expires <= clock_timestamp()",
                    (tenant, session_id, claim.candidate_id, claim.owner, claim.digest,
                     claim.start_seq, claim.end_seq, ttl_s),
                )  # fmt: skip
                return cursor.rowcount == 1

    @_bounded("renew a candidate")
    async def renew_candidate(
        self, session_id: str, candidate_id: str, owner: str, ttl_s: float, *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:  # fmt: skip
        with _db_errors("renew a candidate"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    "UPDATE candidates SET expires = clock_timestamp() + make_interval("
                    f"secs => %s) WHERE {_WHERE_KEY} AND candidate_id = %s AND owner = %s",
                    (ttl_s, tenant, session_id, candidate_id, owner),
                )
                return cursor.rowcount == 1

    @_bounded("store a candidate's summary")
    async def finish_candidate(
        self, session_id: str, candidate_id: str, owner: str, summary: bytes, *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:  # fmt: skip
        with _db_errors("store a candidate's summary"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    "UPDATE candidates SET summary = %s, ready = clock_timestamp()"
                    f" WHERE {_WHERE_KEY} AND candidate_id = %s AND owner = %s",
                    (summary, tenant, session_id, candidate_id, owner),
                )
                return cursor.rowcount == 1

    @_bounded("drop a candidate")
    async def drop_candidate(
        self, session_id: str, candidate_id: str, *, tenant: str = DEFAULT_TENANT_ID
    ) -> bool:
        with _db_errors("drop a candidate"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    f"DELETE FROM candidates WHERE {_WHERE_KEY} AND candidate_id = %s",
                    (tenant, session_id, candidate_id),
                )
                return cursor.rowcount == 1

    # --- leases and notifications ---------------------------------------------------------------

    @_bounded("read a lease")
    async def get_lease(self, session_id: str, *, tenant: str = DEFAULT_TENANT_ID) -> Lease | None:
        with _db_errors("read a lease"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    "SELECT revision, lease_owner, lease_token, lease_expires, clock_timestamp()"
                    f" FROM sessions WHERE {_WHERE_KEY}",
                    (tenant, session_id),
                )
                row = await cursor.fetchone()
        return None if row is None else _lease_of(row, row[4])

    @_bounded("renew a lease")
    async def renew_lease(
        self,
        session_id: str,
        owner: str,
        token: str,
        ttl_s: float,
        *,
        tenant: str = DEFAULT_TENANT_ID,
    ) -> bool:
        with _db_errors("renew a lease"):
            async with self._connection() as conn:
                cursor = await conn.execute(
                    "UPDATE sessions SET lease_expires = clock_timestamp() + make_interval("
                    f"secs => %s) WHERE {_WHERE_KEY} AND lease_owner = %s AND lease_token = %s",
                    (ttl_s, tenant, session_id, owner, token),
                )
                return cursor.rowcount == 1

    async def changes(self) -> AsyncIterator[tuple[str, str]]:
        """(tenant, session id) of sessions other replicas appended to or deleted;
        ``("", "")`` after each (re)connect (catch up on everything: notifications sent while
        disconnected are lost)."""
        backoff = 0.2
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True, connect_timeout=max(int(self._connect_timeout_s), 1)
                )
            except psycopg.Error as error:
                log.warning("cannot LISTEN for changes (retrying): %s", error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.2
            try:
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    yield "", ""
                    async for note in conn.notifies():
                        origin, tenant, session_id = json.loads(note.payload)
                        if origin != self.origin:
                            yield tenant, session_id
            except psycopg.Error as error:
                log.warning("the change listener lost its connection (reconnecting): %s", error)

    # --- helpers --------------------------------------------------------------------------------

    def budget_s(self) -> float:
        """The longest one operation may take: the pool timeout plus the statement timeout, or
        what is left of the call's deadline (less a margin to answer in) when that is less."""
        budget = self._connect_timeout_s + self._statement_timeout_ms / 1000
        left = deadlines.remaining()
        if left is not None:
            budget = min(budget, left - min(_ANSWER_MARGIN_S, left / 10))
        return max(budget, 0.0)

    async def _within_budget(self, action: str, operation: Coroutine[Any, Any, T]) -> T:
        """``operation``'s result, or ``StoreUnavailable`` once it outlasts ``budget_s``.

        It runs as a task that is cancelled and left to end alone on timeout (or when the caller
        goes away): psycopg answers a cancellation by asking the server to cancel the query,
        and waits seconds for that when the server does not answer."""
        budget = self.budget_s()
        task = asyncio.ensure_future(operation)
        try:
            done, _ = await asyncio.wait([task], timeout=budget)
        except asyncio.CancelledError:
            _abandon(task)
            raise
        if done:
            return task.result()
        _abandon(task)
        raise errors.StoreUnavailable(
            f"event store: cannot {action}: the database did not answer within {budget:.2f} s"
        )

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Conn]:
        pool = self._pool
        if pool is None:
            raise base.store_closed()
        async with pool.connection() as conn:
            yield conn


_WHERE_KEY = "tenant = %s AND session_id = %s"

# The bucket's tokens now: what it held plus the refill since its last take, at most a burst.
# statement_timestamp() is one instant per statement; a take that waited for the row lock may
# read an ``updated`` later than it, hence GREATEST.
_REFILLED = (
    "LEAST(%(burst)s, b.tokens + %(rate)s * GREATEST(0, EXTRACT(EPOCH FROM"
    " statement_timestamp() - b.updated)::float8))"
)
_TAKE_TOKEN = (
    "INSERT INTO append_buckets AS b (tenant, tokens, updated, taken)"
    " VALUES (%(tenant)s, %(burst)s - 1, statement_timestamp(), true)"
    " ON CONFLICT (tenant) DO UPDATE SET"
    f" tokens = {_REFILLED} - CASE WHEN {_REFILLED} >= 1 THEN 1 ELSE 0 END,"
    " updated = GREATEST(b.updated, statement_timestamp()),"
    f" taken = {_REFILLED} >= 1"
    " RETURNING taken, tokens"
)


async def _apply_lease(
    conn: Conn, key: SessionKey, current: Lease | None, op: LeaseOp, now: datetime
) -> None:
    after = apply(key.session_id, current, op, now)
    if after is None:
        await conn.execute(
            "UPDATE sessions SET lease_owner = NULL, lease_token = NULL, lease_expires = NULL"
            f" WHERE {_WHERE_KEY}",
            key,
        )
        return
    await conn.execute(
        "UPDATE sessions SET lease_owner = %s, lease_token = %s, lease_expires = %s"
        f" WHERE {_WHERE_KEY}",
        (after.owner, after.token, after.expires, *key),
    )


_CANDIDATE_COLUMNS = (
    "candidate_id, owner, digest, start_seq, end_seq, started, expires, summary, ready"
)


def _candidate_of(row: tuple[Any, ...]) -> Candidate:
    candidate_id, owner, digest, start, end, started, expires, summary, ready, now = row
    claim = CandidateClaim(str(candidate_id), str(owner), str(digest), int(start), int(end))
    return Candidate(
        claim, started, expires, (expires - now).total_seconds(),
        None if summary is None else bytes(summary), ready,
    )  # fmt: skip


def _lease_of(row: tuple[Any, ...], now: datetime) -> Lease | None:
    _, owner, token, expires, *_ = row
    if owner is None or token is None or expires is None:
        return None
    return Lease(str(owner), str(token), expires, (expires - now).total_seconds())


async def _require_session(conn: Conn, key: SessionKey) -> None:
    cursor = await conn.execute(f"SELECT 1 FROM sessions WHERE {_WHERE_KEY}", key)
    if await cursor.fetchone() is None:
        raise base.session_not_found(key.session_id)


async def _select_event_ids(conn: Conn, key: SessionKey, event_ids: list[str]) -> dict[str, int]:
    if not event_ids:
        return {}
    cursor = await conn.execute(
        f"SELECT event_id, seq FROM events WHERE {_WHERE_KEY} AND event_id = ANY(%s)",
        (*key, event_ids),
    )
    return {str(row[0]): int(row[1]) for row in await cursor.fetchall()}


def _record(row: tuple[Any, ...]) -> base.SessionRecord:
    session_id, create_time, policy_json, revision, tenant, update_time, parent, fork = row
    return base.SessionRecord(
        str(session_id),
        create_time.astimezone(UTC),
        policy_json,
        int(revision),
        str(tenant),
        update_time.astimezone(UTC),
        str(parent or ""),
        None if fork is None else int(fork),
    )


@contextlib.contextmanager
def _db_errors(action: str) -> Iterator[None]:
    """Maps every database failure to ``StoreUnavailable``; domain errors pass through."""
    try:
        yield
    except psycopg_pool.PoolTimeout as error:
        raise errors.StoreUnavailable(
            f"event store: cannot {action}: no database connection within the timeout ({error})"
        ) from None
    except psycopg.Error as error:
        raise errors.StoreUnavailable(
            f"event store: cannot {action}: {type(error).__name__}: {error}".rstrip(": ")
        ) from None


def _redacted(url: str) -> str:
    """The URL without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{host}"


__all__ = ["CHANNEL", "LeaseAction", "PostgresEventStore"]


def _decoded(rows: Sequence[TupleRow]) -> list[events_pb2.SessionEvent]:
    """The events of ``rows`` (their ``data`` first): a worker thread's."""
    return [base.decode_event(row[0]) for row in rows]
